"""End-to-end fixtures: real ``ember serve`` processes on free local ports.

Each server is a separate process started with ``python -m ember.cli serve``; tests
talk to it over HTTP only. Servers are shared per session (a server that a test
must kill, as the graceful-shutdown test does, is started by that test itself).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_server import KEY_A, KEY_B, EmberServer, served_weights, start_server


@pytest.fixture(scope="session")
def e2e_log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("e2e-logs")


@pytest.fixture(scope="session")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text(f"# test keys\n{KEY_A} tenant-a\n{KEY_B} tenant-b\n")
    return path


def _serve(model: Path, log_dir: Path, *args: str, api_key: str | None = None,
           weights: str = "f32") -> Iterator[EmberServer]:
    server = start_server(model, log_dir, *args, weights=weights)
    try:
        server.wait_ready(api_key=api_key)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def smol_server(smollm2_gguf: Path, e2e_log_dir: Path, keys_file: Path
                ) -> Iterator[EmberServer]:
    """The real SmolLM2-135M behind two API keys (tenants A and B), in the default
    weight format (``served_weights``)."""
    yield from _serve(smollm2_gguf, e2e_log_dir, "--api-keys-file", str(keys_file),
                      "--num-kv-blocks", "512", api_key=KEY_A, weights=served_weights())


@pytest.fixture(scope="session")
def smol_reference(smollm2_served_llm):
    """An in-process ``ember.LLM`` in ``smol_server``'s weight format: the oracle for
    what that server answers (teacher-forced logprobs, greedy continuations)."""
    assert smollm2_served_llm.engine.config.weights == served_weights()
    return smollm2_served_llm


@pytest.fixture(scope="session")
def tiny_mech_server(tiny_gguf: Path, e2e_log_dir: Path) -> Iterator[EmberServer]:
    """Tiny model, one sequence at a time, a one-slot queue, no prefix cache: every
    block a request holds must come back when it ends."""
    yield from _serve(tiny_gguf, e2e_log_dir, "--max-num-seqs", "1", "--max-queue", "1",
                      "--no-prefix-caching", "--num-kv-blocks", "256")


@pytest.fixture(scope="session")
def tiny_small_server(tiny_gguf: Path, e2e_log_dir: Path) -> Iterator[EmberServer]:
    """Tiny model with a 64-token context window: error paths and fuzzing."""
    yield from _serve(tiny_gguf, e2e_log_dir, "--max-model-len", "64", "--num-kv-blocks", "128")


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
                    tmp_path_factory: pytest.TempPathFactory
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
                         api_key=KEY_A, weights=served_weights()):
        yield server, log
