"""What the server's preparation makes of a generation request: the parsed body stays as
the client sent it, and how the route reads the replies (the tools in the served model's
call format, the reasoning split) travels beside it in the prepared request."""

from __future__ import annotations

import json
import time
from pathlib import Path

from llamacpp_source import llamacpp_source

from ember.config import EngineConfig
from ember.server import backend
from ember.server import protocol as P
from ember.server.app import Server
from ember.server.config import ServerConfig
from ember.server.routes import CHAT, RESPONSES

TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
QWEN3 = llamacpp_source() / "models" / "templates" / "Qwen-Qwen3-0.6B.jinja"


def _server(tiny_gguf: Path, tiny_loaded, template: str | None) -> Server:
    config = EngineConfig(model=str(tiny_gguf), weights="f32", num_kv_blocks=64,
                          chat_template=template)
    server = Server(ServerConfig(engine=config),
                    start=lambda: backend.local(config, tiny_loaded))
    server.start_loading().join(120)
    assert server.thread is not None, server.load_error
    return server


def _prepared_unchanged(server: Server, route, body: dict):
    raw = json.dumps(body).encode()
    prepared = server._prepare(route, raw, "tenant", time.monotonic())
    for group in prepared.groups:
        server.thread.discard(group.work)
    fresh = P.parse(route.body, body)
    assert prepared.req.model_dump() == fresh.model_dump()
    assert prepared.req.__pydantic_private__ == fresh.__pydantic_private__
    return prepared


def test_the_tool_plan_rides_beside_the_body_in_the_models_format(tiny_gguf, tiny_loaded):
    """A Qwen 3 template takes tools natively (Hermes calls); the plan the replies are
    read with is in that format, the body unchanged; without tools there is no plan."""
    server = _server(tiny_gguf, tiny_loaded, QWEN3.read_text(encoding="utf-8"))
    try:
        assert server.tool_style.native
        body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "weather?"}],
                "tools": [TOOL], "max_tokens": 8}
        prepared = _prepared_unchanged(server, CHAT, body)
        assert prepared.shape.tools is not None
        assert prepared.shape.tools.style == server.tool_style
        assert [t.name for t in prepared.shape.tools.tools] == ["get_weather"]
        assert _prepared_unchanged(server, CHAT, {**body, "tools": None}).shape.tools is None
        # the Responses API tells the tools in a system message, whatever the template
        flat = {"type": "function", **TOOL["function"]}
        responses = _prepared_unchanged(
            server, RESPONSES, {"model": "tiny-llama", "input": "weather?", "tools": [flat]})
        assert responses.shape.tools is not None and not responses.shape.tools.style.native
    finally:
        server.thread.shutdown(timeout=5)
