"""Anthropic's event stream as ember renders it from engine outputs: reasoning first as a
thinking block closed by its signature, a held-back tool call as a tool_use block with one
input_json_delta, and the error event's shape. (tests/e2e/test_anthropic.py drives the
same renderer through the SDK on real models.)"""

from __future__ import annotations

import asyncio
import json

from ember.engine.output import RequestOutput
from ember.sampling.reasoning import ThinkingTags
from ember.server import anthropic as A
from ember.server import render as R
from ember.server import tools
from ember.server.errors import APIError

TAGS = ThinkingTags("<think>", "</think>")


def _outputs(pieces: list[str], finish: str = "stop") -> list[RequestOutput]:
    outs, text = [], ""
    for k, piece in enumerate(pieces):
        text += piece
        last = k == len(pieces) - 1
        outs.append(RequestOutput("r", text, list(range(k + 1)), 12, 4, last,
                                  finish if last else None, delta_text=piece,
                                  delta_token_ids=[k]))
    return outs


def _events(req: A.MessagesRequest, shape: R.Shape, outs: list[RequestOutput]
            ) -> list[tuple[str, dict]]:
    async def stream():
        for out in outs:
            yield 0, out

    async def collect():
        return [e async for e in A.message_events(stream(), req, shape, "msg_1")]

    out = []
    for event in asyncio.run(collect()):
        name, data = event.rstrip("\n").split("\n")
        body = json.loads(data.removeprefix("data: "))
        assert name == f"event: {body['type']}"
        out.append((body["type"], body))
    return out


def _request(**body) -> A.MessagesRequest:
    return A.MessagesRequest.model_validate({
        "model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}],
        **body})


def test_reasoning_streams_as_a_thinking_block_then_the_text():
    events = _events(_request(), R.Shape(None, (TAGS, True)),
                     _outputs(["I think", " hard</think>", "Hello", " there"]))
    kinds = [k for k, _ in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-2:] == ["message_delta", "message_stop"]
    blocks = [b["content_block"]["type"] for k, b in events if k == "content_block_start"]
    assert blocks == ["thinking", "text"]
    deltas = [b["delta"] for k, b in events if k == "content_block_delta"]
    thought = "".join(d.get("thinking", "") for d in deltas)
    assert thought.strip() == "I think hard"
    assert "".join(d.get("text", "") for d in deltas) == "Hello there"
    # the thinking block ends with its signature, before its stop
    sig = next(i for i, (k, b) in enumerate(events)
               if k == "content_block_delta" and b["delta"]["type"] == "signature_delta")
    assert events[sig + 1][0] == "content_block_stop" and events[sig + 1][1]["index"] == 0
    usage = events[-2][1]["usage"]
    assert (usage["input_tokens"], usage["cache_read_input_tokens"]) == (8, 4)
    assert events[0][1]["message"]["usage"]["output_tokens"] == 0
    hidden = _events(_request(thinking={"type": "adaptive", "display": "omitted"}),
                     R.Shape(None, (TAGS, True)),
                     _outputs(["I think", " hard</think>", "Hello", " there"]))
    assert [b["content_block"]["type"] for k, b in hidden if k == "content_block_start"] \
        == ["text"]


def test_a_tool_call_is_held_back_and_sent_as_one_input_json_delta():
    req = _request(tools=[{"name": "f", "input_schema": {
        "type": "object", "properties": {"x": {"type": "integer"}}}}],
        tool_choice={"type": "any"})
    plan = req.tool_plan()
    pieces = ["<tool_call>", '{"name": "f", ', '"arguments": {"x": 3}}', "</tool_call>"]
    events = _events(req, R.Shape(plan, None), _outputs(pieces))
    kinds = [k for k, _ in events]
    assert kinds == ["message_start", "ping", "content_block_start", "content_block_delta",
                     "content_block_stop", "message_delta", "message_stop"]
    start, delta = events[2][1], events[3][1]
    assert start["content_block"]["type"] == "tool_use" and start["content_block"]["name"] == "f"
    assert start["content_block"]["id"].startswith("toolu_")
    assert json.loads(delta["delta"]["partial_json"]) == {"x": 3}
    assert events[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert isinstance(plan, tools.ToolPlan)


def test_the_error_event_has_anthropics_shape():
    event = A.error_event(APIError(400, "tools: broken"))
    assert event == ('event: error\ndata: {"type":"error","error":{"type":'
                     '"invalid_request_error","message":"tools: broken"}}\n\n')
    assert A.error_body(APIError(429, "full"))["error"]["type"] == "rate_limit_error"


def test_a_text_reply_held_back_while_it_might_be_a_call_is_sent_whole():
    req = _request(tools=[{"name": "f", "input_schema": {"type": "object"}}])
    events = _events(req, R.Shape(req.tool_plan(), None),
                     _outputs(["\n", " ", "Hello", " there"]))
    text = "".join(b["delta"].get("text", "") for k, b in events if k == "content_block_delta")
    assert text == "\n Hello there"
    assert events[-2][1]["delta"]["stop_reason"] == "end_turn"
