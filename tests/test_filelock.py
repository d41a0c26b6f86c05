"""ember.filelock: a second process waits while the first holds the lock, learns the
holder's pid, and gets the lock once the holder is killed (the OS drops it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ember import filelock

HOLD = """
import sys, time
from pathlib import Path
from ember import filelock
with filelock.exclusive(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(600)
"""


def _holder(path: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    with proc.stdout:
        assert proc.stdout.readline() == "held\n"
    return proc


@pytest.mark.parametrize("kind", ["file", "directory"])
def test_a_waiter_blocks_until_the_killed_holder_lets_go(tmp_path: Path, kind: str) -> None:
    path = tmp_path / ("build.flock" if kind == "file" else "models")
    if kind == "directory":
        path.mkdir()
    holder = _holder(path)
    seen: list[str] = []
    waiting, got = threading.Event(), threading.Event()

    def on_wait(holder_pid: str) -> None:
        seen.append(holder_pid)
        waiting.set()

    def wait_for_lock() -> None:
        with filelock.exclusive(path, on_wait=on_wait):
            got.set()

    # a daemon: if the lock were never released, the test fails instead of hanging pytest
    waiter = threading.Thread(target=wait_for_lock, daemon=True)
    try:
        waiter.start()
        assert waiting.wait(30), "neither waited nor was told who holds the lock"
        assert not got.is_set(), "took a lock another process holds"
        assert seen == [str(holder.pid) if kind == "file" else "unknown"]
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    assert got.wait(30), "the lock of a killed holder was not released"
    waiter.join()


def test_a_body_that_raises_still_releases_the_lock(tmp_path: Path) -> None:
    path = tmp_path / "build.flock"
    with pytest.raises(KeyError), filelock.exclusive(path):
        raise KeyError("the build failed")
    assert path.read_text() == ""
    with filelock.exclusive(path, on_wait=lambda _: pytest.fail("still held")):
        pass


def test_the_lock_file_names_only_its_current_holder(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "build.flock"  # the parent is created
    with filelock.exclusive(path, on_wait=lambda _: pytest.fail("nobody held it")):
        assert path.read_text() == str(os.getpid())
    assert path.read_text() == ""  # released: no stale pid for the next waiter
    with filelock.exclusive(path, on_wait=lambda _: pytest.fail("still held")):
        pass
