"""Server configuration read from files: API keys, tenants and their weights."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember.errors import EmberError
from ember.server.app import load_api_keys


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
    from ember.server.app import bearer_token

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
from ember.server.app import ServerConfig, run_server

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
