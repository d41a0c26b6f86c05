"""Server configuration read from files: API keys, tenants and their weights."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember.errors import EmberError
from ember.server.config import load_api_keys


def test_keys_file_gives_tenants_and_weights(tmp_path: Path):
    f = tmp_path / "keys.txt"
    f.write_text("# comment\nk1 alpha 3\nk2 alpha\nk3 beta 0.5  # half a share\nk4\n")
    keys, weights = load_api_keys(["k5"], f)
    assert keys["k1"] == keys["k2"] == "alpha" and keys["k3"] == "beta"
    assert keys["k4"].startswith("key-") and keys["k5"].startswith("key-")
    assert weights == {"alpha": 3.0, "beta": 0.5}


@pytest.mark.parametrize("line", ["k1 a 0", "k1 a -2", "k1 a x", "k1 a nan", "k1 a 1 2"])
def test_bad_key_lines_name_the_file_and_line(tmp_path: Path, line: str):
    f = tmp_path / "keys.txt"
    f.write_text(f"ok tenant\n{line}\n")
    with pytest.raises(EmberError, match=r"keys.txt:2"):
        load_api_keys([], f)


@pytest.mark.parametrize("header,token", [
    ("Bearer sk-1", "sk-1"), ("bearer   sk-1", "sk-1"), ("Bearer abc+/~._-==", "abc+/~._-=="),
    ("Bearer sk-1\xa0", None), ("Bearer sk-1\x85", None), ("Bearer \u2003sk-1", None),
    ("Bearer sk-1 x", None), ("Bearer sk=1", None), ("Bearer", None), ("Bearer ", None),
    ("Basic sk-1", None), ("sk-1", None), ("Bearer\tsk-1", None)])
def test_a_bearer_token_is_taken_exactly_as_sent(header: str, token: str | None):
    """RFC 9110 token68 after 'Bearer' and spaces: no Unicode whitespace is stripped,
    so a key followed by NBSP or NEL is not the key."""
    from ember.server.config import bearer_token

    assert bearer_token(header) == token


def test_a_key_no_client_can_send_is_refused_at_start(tmp_path: Path):
    f = tmp_path / "keys.txt"
    f.write_text("good tenant\nbad\u00e9key tenant\n")
    with pytest.raises(EmberError, match=r"keys.txt:2: an API key must be a bearer token"):
        load_api_keys([], f)
    with pytest.raises(EmberError, match=r"--api-key #2"):
        load_api_keys(["fine", "has space"], None)


STARTUP_PROBE = """
import socket, sys
from ember.server.config import ServerConfig
from ember.server.run import run_server

port = int(sys.argv[1])

def start():
    # what a backend that binds ports while it starts (Ray's processes) would meet
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            print("PORT FREE WHILE LOADING", flush=True)
        except OSError:
            print("PORT ALREADY TAKEN", flush=True)
    raise RuntimeError("no backend in this probe")

sys.exit(run_server(ServerConfig(), "127.0.0.1", port, graceful_seconds=0.5, start=start))
"""


def test_the_server_takes_its_port_before_the_backend_starts_loading(tmp_path: Path):
    """With ``--replicas`` the backend starts Ray, whose processes bind ports of their
    own; when the server bound its port only after that, one of them could take it
    first and ``ember serve`` died with "address already in use"."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    probe = tmp_path / "probe.py"
    probe.write_text(STARTUP_PROBE)
    proc = subprocess.Popen([sys.executable, str(probe), str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    seen = ""
    try:  # the server's "listening" and the probe's line come from two threads, in any
        while "PORT " not in seen:  # order and even interleaved within a line
            line = proc.stdout.readline()
            if not line:
                break
            seen += line
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert "PORT ALREADY TAKEN" in seen and "PORT FREE" not in seen, seen + proc.stderr.read()


def test_admin_work_runs_off_the_prep_pool_with_a_deadline_on_a_daemon_thread() -> None:
    """A load that never ends: the caller gets a 504 at the deadline; meanwhile the
    pool that tokenizes generation requests is free; the work's thread is a daemon (it
    cannot keep the process alive past SIGTERM); the next admin call waits its turn."""
    import asyncio
    import threading

    from ember.server.app import Server
    from ember.server.config import ServerConfig
    from ember.server.errors import APIError

    server = Server(ServerConfig(admin_timeout=0.2))
    release, seen = threading.Event(), []

    def hung() -> None:
        seen.append(threading.current_thread())
        release.wait(30)

    async def go() -> None:
        with pytest.raises(APIError) as e:
            await server.run_admin(hung)
        assert e.value.status == 504
        # generation's pool answers while the admin work hangs
        assert server.prep_pool.submit(lambda: 7).result(timeout=5) == 7
        second = asyncio.ensure_future(server.run_admin(lambda: "next"))
        await asyncio.sleep(0.05)
        assert not second.done()  # one admin call at a time
        release.set()
        assert await second == "next"

    asyncio.run(go())
    assert seen[0].daemon and seen[0] is not threading.main_thread()


@pytest.mark.parametrize(("lora_dir", "path", "ok"), [
    (None, "adapters/a.gguf", False), (None, "/srv/a.gguf", True),
    ("DIR", "a.gguf", True), ("DIR", "sub/../a.gguf", True), ("DIR", "../a.gguf", False),
    ("DIR", "/etc/passwd", False), ("DIR", "link/passwd", False)])
def test_an_adapter_path_is_absolute_or_under_the_lora_dir(tmp_path: Path, lora_dir, path,
                                                            ok) -> None:
    from ember.server.app import Server
    from ember.server.config import ServerConfig
    from ember.server.errors import APIError

    root = tmp_path / "adapters"
    root.mkdir()
    (root / "link").symlink_to("/etc")  # a symlink out of the directory
    server = Server(ServerConfig(lora_dir=None if lora_dir is None else str(root)))
    if ok:
        assert Path(server.adapters.path(path)).is_absolute()
    else:
        with pytest.raises(APIError) as e:
            server.adapters.path(path)
        assert e.value.status == 400 and e.value.param == "lora_path"


def test_no_response_writes_a_non_finite_number() -> None:
    """Every route's body goes through ``dumps`` (JSON responses and each SSE event):
    NaN and infinities never reach the wire as the bare tokens RFC 8259 forbids."""
    import json
    import math

    from ember.server.render import sse_data as sse
    from ember.server.transport import LOGPROB_FLOOR, JSONBody

    def strict(text: str) -> object:
        def refuse(token: str) -> None:
            raise AssertionError(f"non-JSON number {token} on the wire")
        return json.loads(text, parse_constant=refuse)

    body = {"logprob": float("-inf"), "top": [{"logprob": float("nan")}],
            "nested": ({"x": float("inf")}, 1.5), "ok": -0.25}
    want = {"logprob": LOGPROB_FLOOR, "top": [{"logprob": None}],
            "nested": [{"x": -LOGPROB_FLOOR}, 1.5], "ok": -0.25}
    assert strict(JSONBody(body).body.decode()) == want
    assert strict(sse(body).removeprefix("data: ").strip()) == want
    assert not math.isnan(strict(JSONBody({"a": 1.0}).body.decode())["a"])


def test_several_models_come_from_repeated_models_and_a_directory(tmp_path: Path):
    from ember import cli
    from ember.server.models import merge_metrics, model_name, model_sources

    for name in ("b.gguf", "a-00001-of-00002.gguf", "a-00002-of-00002.gguf", "notes.txt"):
        (tmp_path / name).write_bytes(b"")
    sources = model_sources(["smollm2-135m"], tmp_path)
    assert sources == ["smollm2-135m", str(tmp_path / "a-00001-of-00002.gguf"),
                       str(tmp_path / "b.gguf")]
    assert [model_name(s) for s in sources] == ["smollm2-135m", "a", "b"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no .gguf"):
        model_sources([], tmp_path / "empty")
    with pytest.raises(ValueError, match="not a directory"):
        model_sources([], tmp_path / "b.gguf")

    def config(*args: str):
        return cli.server_config(cli._build_parser().parse_args(["serve", *args]))

    several = config("--models-dir", str(tmp_path), "--models-idle", "30")
    assert several.models == tuple(sources[1:]) and several.models_idle == 30
    assert several.engine.model == sources[1]
    assert config().models == ()  # one model: the single-model server, as before
    for args, match in ((("--models-idle", "5"), "several models"),
                        (("--models-dir", str(tmp_path), "--served-model-name", "x"),
                         "names one model"),
                        (("--models-dir", str(tmp_path), "--models-idle", "0"), "positive"),
                        (("--models-dir", str(tmp_path), "--kv-cache-dir", str(tmp_path)),
                         "disk tier")):
        with pytest.raises(ValueError, match=match):
            config(*args)
    merged = merge_metrics({
        "m1": "# HELP x X.\n# TYPE x counter\nx_total 1\ny{a=\"1\"} 2\n",
        "m2": "# HELP x X.\n# TYPE x counter\nx_total 3\n"})
    assert merged == ['# HELP x X.', '# TYPE x counter', 'x_total{model="m1"} 1',
                      'y{model="m1",a="1"} 2', 'x_total{model="m2"} 3']
