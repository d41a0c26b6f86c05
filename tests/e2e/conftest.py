"""End-to-end fixtures: real ``ember serve`` servers on free local ports.

The shared servers here run in this process (``serve_in_process``: the options
``ember serve`` parses, its app and uvicorn on a thread, on a model the session has
loaded already); tests talk to them over HTTP only. A server whose process is under
test (a signal, a kill, Ray, its own log) is a separate ``python -m ember.cli serve``
(``start_server``), started by the test module that needs it. Servers are shared per
session.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_server import KEY_A, KEY_B, EmberServer, serve_in_process, served_weights


@pytest.fixture(scope="session")
def e2e_log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("e2e-logs")


@pytest.fixture(scope="session")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text(f"# test keys\n{KEY_A} tenant-a\n{KEY_B} tenant-b\n")
    return path


def _serve(model: Path, log_dir: Path, *args: str, api_key: str | None = None,
           weights: str = "f32", loaded=None) -> Iterator[EmberServer]:
    server = serve_in_process(model, log_dir, *args, weights=weights, loaded=loaded)
    try:
        server.wait_ready(api_key=api_key)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def smol_server(smollm2_gguf: Path, e2e_log_dir: Path, keys_file: Path, smollm2_served_llm
                ) -> Iterator[EmberServer]:
    """The real SmolLM2-135M behind two API keys (tenants A and B), in the default
    weight format (``served_weights``), on the model ``smol_reference`` loaded."""
    yield from _serve(smollm2_gguf, e2e_log_dir, "--api-keys-file", str(keys_file),
                      "--num-kv-blocks", "512", api_key=KEY_A, weights=served_weights(),
                      loaded=smollm2_served_llm.engine.loaded)


@pytest.fixture(scope="session")
def smol_reference(smollm2_served_llm):
    """An in-process ``ember.LLM`` in ``smol_server``'s weight format: the oracle for
    what that server answers (teacher-forced logprobs, greedy continuations)."""
    assert smollm2_served_llm.engine.config.weights == served_weights()
    return smollm2_served_llm


@pytest.fixture(scope="session")
def tiny_mech_server(tiny_gguf: Path, e2e_log_dir: Path, tiny_loaded) -> Iterator[EmberServer]:
    """Tiny model, one sequence at a time, a one-slot queue, no prefix cache: every
    block a request holds must come back when it ends."""
    yield from _serve(tiny_gguf, e2e_log_dir, "--max-num-seqs", "1", "--max-queue", "1",
                      "--no-prefix-caching", "--num-kv-blocks", "256", loaded=tiny_loaded)


# a template that thinks: the assistant turn opens with <think>
THINKING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n"
            "{% endif %}")


@pytest.fixture(scope="module")
def thinking_server(tiny_gguf: Path, e2e_log_dir: Path, tmp_path_factory: pytest.TempPathFactory,
                    tiny_loaded) -> Iterator[EmberServer]:
    """Tiny model served with THINKING as its chat template (reasoning split and budgets,
    in each API's shape)."""
    template = tmp_path_factory.mktemp("tpl") / "thinking.jinja"
    template.write_text(THINKING)
    yield from _serve(tiny_gguf, e2e_log_dir, "--chat-template", str(template),
                      "--num-kv-blocks", "128", loaded=tiny_loaded)


@pytest.fixture(scope="session")
def tiny_small_server(tiny_gguf: Path, e2e_log_dir: Path, tiny_loaded
                      ) -> Iterator[EmberServer]:
    """Tiny model with a 64-token context window: error paths and fuzzing."""
    yield from _serve(tiny_gguf, e2e_log_dir, "--max-model-len", "64", "--num-kv-blocks", "128",
                      loaded=tiny_loaded)


KEY_Q = "sk-tenant-q-5555555555"  # a tenant allowed nothing in the queue: every request 429s


@pytest.fixture(scope="session")
def otlp_receiver():
    """A real OTLP/HTTP trace receiver on loopback (tests/e2e/test_telemetry.py)."""
    from test_telemetry import Receiver

    receiver = Receiver()
    yield receiver
    receiver.server.shutdown()


@pytest.fixture(scope="session")
def observed_server(smollm2_gguf: Path, e2e_log_dir: Path, keys_file: Path, otlp_receiver,
                    tmp_path_factory: pytest.TempPathFactory, smollm2_served_llm
                    ) -> Iterator[tuple[EmberServer, Path]]:
    """The real SmolLM2 behind tenants A, B and Q (Q may queue nothing: 429), with the
    chat page, traces sent to ``otlp_receiver`` and a request log (its path is the
    second item): shared by the chat page's and the telemetry tests."""
    root = tmp_path_factory.mktemp("observed")
    keys, limits, log = root / "keys.txt", root / "limits.txt", root / "requests.jsonl"
    keys.write_text(keys_file.read_text() + f"{KEY_Q} tenant-q\n")
    limits.write_text("tenant-q max_queued=0\n")
    for server in _serve(smollm2_gguf, e2e_log_dir, "--api-keys-file", str(keys),
                         "--tenant-limits", str(limits), "--num-kv-blocks", "512",
                         "--otlp-traces-endpoint", otlp_receiver.url, "--request-log", str(log),
                         api_key=KEY_A, weights=served_weights(),
                         loaded=smollm2_served_llm.engine.loaded):
        yield server, log
