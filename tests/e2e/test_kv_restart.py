"""A killed server comes back warm: ``ember serve --kv-cache-dir`` on the real SmolLM2.

The first server answers a conversation, its cached blocks reach the disk tier, and
it is killed with SIGKILL (no shutdown code runs). A second server on the same
directory answers the same conversation from disk: as many ``cached_tokens`` as a
RAM hit had, restores counted in /metrics, the cold reply's tokens and the RAM hit's
logprobs, bit for bit.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import pytest
from e2e_server import KEY_A, EmberServer, start_server

pytestmark = pytest.mark.slow

SYSTEM = ("You are a careful assistant for a city library. " * 12).strip()
MESSAGES = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Which floor has the maps?"}]


def serve(model: Path, log_dir: Path, cache: Path, keys: Path) -> EmberServer:
    # no speculation: its gate learns step costs per process, and a different draft
    # would change the shapes of the work (and so the last bits of the logprobs)
    server = start_server(model, log_dir, "--kv-cache-dir", str(cache), "--api-keys-file",
                          str(keys), "--num-kv-blocks", "256", "--speculation", "off")
    server.wait_ready(api_key=KEY_A)
    return server


def ask(server: EmberServer) -> dict:
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120,
                   headers={"Authorization": f"Bearer {KEY_A}"},
                   json={"model": server.model_id, "messages": MESSAGES, "max_tokens": 12,
                         "temperature": 0, "logprobs": True})
    r.raise_for_status()
    return r.json()


def test_a_killed_server_restarts_warm_from_disk(smollm2_gguf, e2e_log_dir, keys_file,
                                                  tmp_path):
    cache = tmp_path / "kv"
    first = serve(smollm2_gguf, e2e_log_dir, cache, keys_file)
    try:
        cold = ask(first)
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        ram = ask(first)  # a RAM hit: the same shapes of work as a disk hit
        blocks = cold["usage"]["prompt_tokens"] // 16
        deadline = time.monotonic() + 30
        while first.metrics().get("ember_kv_disk_blocks", 0) < blocks:
            assert time.monotonic() < deadline, "the blocks never reached the disk tier"
            time.sleep(0.05)
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(timeout=30)
    finally:
        first.stop()
    second = serve(smollm2_gguf, e2e_log_dir, cache, keys_file)
    try:
        warm = ask(second)
        cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == ram["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
        # bitwise: restored KV is the KV the first server computed
        assert warm["choices"][0]["logprobs"] == ram["choices"][0]["logprobs"]
        m = second.metrics()
        assert m["ember_kv_disk_hits_total"] >= cached // 16
        assert m['ember_kv_disk_decisions_total{decision="restore"}'] >= 1
        assert m["ember_kv_disk_corrupt_total"] == 0
        assert not list(cache.rglob("*.tmp"))
    finally:
        second.stop()
