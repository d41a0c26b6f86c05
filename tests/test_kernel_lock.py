"""A killed start never blocks a later one: the native kernel's build lock (ember/kernels).

torch's ``load`` takes a ``lock`` file on every call, even for a kernel that is
already built; a process killed inside it used to leave the file behind, and every
later start then hung forever. These tests start real processes against a private
copy of this machine's built kernel cache (so nothing recompiles) and kill them.

The loaders are forks of one helper process that has imported torch: a fresh Python
spends 1.5-2 s importing torch, which takes no lock, before a ~150 ms kernel load in
which torch's lock used to be held for ~10 ms. Forks put every kill inside the kernel
load and make a trial cost ~0.1 s instead of ~3 s, so there are enough trials to hit
a window that short (50 kills of fresh processes at random instants missed it).
"""

from __future__ import annotations

import fcntl
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from native import require_kernels

from ember import kernels

TRIALS = 80
BUILDS_IF_RECOMPILING = 3  # build-path trials where ninja recompiles every time (~30 s each)
START_TIMEOUT = 60.0  # s for a loader to load a built kernel; a blocked start never does
# Reads commands on stdin, one reply line each on stdout:
#   start                  -> PID of a new loader (a fork that imports ember.kernels,
#                             loads the kernel and exits 0)
#   kill PID SIGNUM DELAY  -> its exit code after SIGNUM sent DELAY s after it started
#                             (0: it had finished)
#   wait PID TIMEOUT       -> "EXITCODE SECONDS-SINCE-START", or "running" after TIMEOUT s
_LOADERS = """\
import os, sys, time, torch

started = {}


def load():
    os.dup2(2, 1)  # stdout is the reply channel
    import ember.kernels as k
    os._exit(0 if k.quant_matmul() is not None else 3)


def reap(pid, timeout):
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return f"{os.waitstatus_to_exitcode(status)} {time.monotonic() - started.pop(pid)}"
        if time.monotonic() >= deadline:
            return "running"
        time.sleep(0.001)


print("ready", flush=True)
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "start":
        t = time.monotonic()
        pid = os.fork()
        if pid == 0:
            load()
        started[pid] = t
        reply = str(pid)
    elif cmd == "kill":
        pid, signum, delay = int(args[0]), int(args[1]), float(args[2])
        time.sleep(max(0.0, started[pid] + delay - time.monotonic()))
        os.kill(pid, signum)  # a finished loader is a zombie until reaped: no effect
        reply = reap(pid, START_TIMEOUT).split()[0]
    else:
        reply = reap(int(args[0]), float(args[1]))
    print(reply, flush=True)
for pid in started:  # stdin closed: the test is over
    os.kill(pid, 9)
""".replace("START_TIMEOUT", repr(START_TIMEOUT))
# Holds the build lock as a builder does, says "locked", and sleeps until killed.
_HOLDER = """\
import time, ember.kernels as k
with k._build_lock(k.build_lock_path()):
    print("locked", flush=True)
    time.sleep(600)
"""


class Loaders:
    """Starts, kills and waits for loader processes (through ``_LOADERS``)."""

    def __init__(self, cwd: Path) -> None:
        self.err = cwd / "loaders.err"  # the loaders' stderr, readable while they run
        with open(self.err, "w") as f:
            self.proc = subprocess.Popen([sys.executable, "-c", _LOADERS], cwd=cwd, text=True,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=f)
        assert self._reply() == "ready"

    def _reply(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the loader helper died:\n{self.stderr()}"
        return line.strip()

    def _ask(self, *words: object) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(" ".join(map(str, words)) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def start(self) -> int:
        return int(self._ask("start"))

    def kill(self, pid: int, sig: int = signal.SIGKILL, delay: float = 0.0) -> bool:
        """Send ``sig`` ``delay`` s after ``pid`` started; whether it stopped it loading."""
        return int(self._ask("kill", pid, int(sig), delay)) != 0

    def wait(self, pid: int, timeout: float) -> tuple[int, float] | None:
        """Exit code and seconds since its start, or None if it still runs after ``timeout``."""
        reply = self._ask("wait", pid, timeout)
        if reply == "running":
            return None
        code, seconds = reply.split()
        return int(code), float(seconds)

    def stderr(self) -> str:
        return self.err.read_text()

    def close(self) -> None:
        self.proc.communicate(timeout=30)  # closes stdin: it kills the loaders left and exits


@pytest.fixture
def loaders(tmp_path: Path, cache: Path) -> Iterator[Loaders]:
    """Loaders for this test's kernel cache (``cache`` sets it before they start)."""
    helper = Loaders(tmp_path)
    yield helper
    helper.close()


def build_dirs(root: Path) -> list[Path]:
    return [d for d in root.iterdir() if d.is_dir()]


def forget_builds(root: Path) -> None:
    """Delete the markers, so the next loader takes the build path (ninja finds it up to date)."""
    for d in build_dirs(root):
        (d / kernels.BUILD_MARKER).unlink(missing_ok=True)


def listing(root: Path) -> str:
    return "\n".join(f"  {p.relative_to(root)} ({p.stat().st_size} B)"
                     for p in sorted(root.rglob("*")) if p.is_file())


def assert_starts(loaders: Loaders, pid: int, root: Path, context: str) -> float:
    """Wait for loader ``pid`` to load the kernel; the seconds that took."""
    result = loaders.wait(pid, START_TIMEOUT)
    if result is None:
        loaders.kill(pid)
        pytest.fail(f"{context}: the start blocked ({START_TIMEOUT:.0f} s without loading the "
                    f"kernel). Files in {root}:\n{listing(root)}\nstderr:\n{loaders.stderr()}")
    code, seconds = result
    assert code == 0, f"{context}: loader failed (exit code {code}):\n{loaders.stderr()}"
    return seconds


def ninja_says_stale(build_dir: Path) -> str | None:
    """Why ninja would rebuild ``build_dir`` (a dry run with ``-d explain``); None if clean.

    Whether an unchanged copy of a build is up to date is ninja's call, made from file
    times and its logs; on one CI machine it rebuilt every copy. These tests need no
    recompile to be fast, but their property (no start ever blocks) holds either way.
    """
    kernels._find_ninja()  # the ninja ember builds with
    out = subprocess.run(["ninja", "-C", str(build_dir), "-n", "-d", "explain"],
                         capture_output=True, text=True, timeout=60)
    text = (out.stdout + out.stderr).strip()
    return None if out.returncode == 0 and "no work to do" in text else text


def wait_for_stderr(loaders: Loaders, pid: int, text: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while text not in loaders.stderr():
        assert loaders.wait(pid, 0.05) is None, f"loader exited instead:\n{loaders.stderr()}"
        assert time.monotonic() < deadline, f"no {text!r} on stderr:\n{loaders.stderr()}"
    return loaders.stderr()


def built_elsewhere(build_dir: Path) -> bool:
    """Whether ``build_dir`` was built from another checkout or virtual environment.

    The cache is keyed by source contents, CPU and torch version, so two checkouts of
    one commit share a build; but its build.ninja names the source file and torch's
    headers by absolute path, and torch rewrites it from this process's paths before
    running ninja, which then sees a changed command and recompiles. A start with the
    build marker never runs ninja, so this costs only the tests that drop the marker.
    """
    from torch.utils.cpp_extension import include_paths

    text = (build_dir / "build.ninja").read_text()
    return str(kernels._SOURCE) not in text or include_paths()[0] not in text


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of this machine's kernel build, built first if needed (~1 minute)."""
    require_kernels()
    root = kernels._build_root()
    copy = tmp_path_factory.mktemp("kernels")
    module = kernels.quant_matmul()
    assert module is not None and module.__file__ is not None
    name = Path(module.__file__).parent.name  # the build loaders make (not test variants)
    # without the lock files: a stale torch baton there would be the old bug's leftover
    shutil.copytree(root / name, copy / root.name / name,
                    ignore=shutil.ignore_patterns("lock", kernels.BUILD_LOCK, "*.tmp"))
    # rebuild the copy once, from here, where ninja would recompile it on every build path
    # (built from another checkout, or sources checked out again since: ~45 s each time)
    if built_elsewhere(copy / root.name / name) or ninja_says_stale(copy / root.name / name):
        (copy / root.name / name / kernels.BUILD_MARKER).unlink()
        subprocess.run([sys.executable, "-c", "import ember.kernels as k; "
                        "assert k.quant_matmul() is not None, k.unavailable_reason()"],
                       env={**os.environ, "EMBER_KERNEL_CACHE": str(copy)}, check=True,
                       timeout=600)
    return copy


@pytest.fixture
def cache(built_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's own copy of the built cache, used by it and its processes; its build root."""
    shutil.copytree(built_cache, tmp_path / "kernels")
    monkeypatch.setenv("EMBER_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.delenv("EMBER_NO_KERNELS", raising=False)
    return kernels._build_root()


@pytest.mark.slow
def test_killing_loaders_at_random_instants_never_blocks_the_next_start(
        cache: Path, loaders: Loaders) -> None:
    """SIGKILL/SIGTERM a loader at a random instant of its load, then start another."""
    seed = int(os.environ.get("EMBER_TEST_SEED") or random.randrange(2**32))
    print(f"seed {seed} (EMBER_TEST_SEED={seed} repeats these kill instants)")
    rng = random.Random(seed)
    stale = ninja_says_stale(cache / "ember_quant_matmul")
    window = {}  # seconds a clean load takes, with and without a build marker
    for build in (True, False):
        if build:
            forget_builds(cache)
        window[build] = assert_starts(loaders, loaders.start(), cache, "a clean load")
    print(f"a load takes {window[False] * 1e3:.1f} ms, {window[True] * 1e3:.1f} ms "
          "through the build path")
    builds = TRIALS  # at most this many trials take the build path
    if window[True] >= 10.0:
        # each of ~40 build trials would cost a compile (~30 s)
        assert stale, (f"the build path took {window[True]:.1f} s, though ninja found the "
                       f"copy up to date: ember rebuilt a built kernel\n{listing(cache)}")
        print(f"ninja rebuilds even an unchanged copy here ({window[True]:.0f} s), so only "
              f"{BUILDS_IF_RECOMPILING} trials build:\n{stale}")
        builds = BUILDS_IF_RECOMPILING
    killed = 0
    for trial in range(TRIALS):
        build = builds > 0 and rng.random() < 0.5
        builds -= build
        sig = rng.choice((signal.SIGKILL, signal.SIGTERM))
        delay = rng.uniform(0.0, window[build])
        if build:
            forget_builds(cache)
        killed += loaders.kill(loaders.start(), sig, delay)
        context = (f"seed {seed}, trial {trial}: after {sig.name} {delay * 1e3:.1f} ms "
                   f"into a {'build' if build else 'load'}")
        assert_starts(loaders, loaders.start(), cache, context)
    print(f"{killed}/{TRIALS} loaders were killed before they loaded the kernel")


@pytest.mark.slow
def test_a_stale_torch_baton_does_not_block_loading_or_building(
        cache: Path, loaders: Loaders) -> None:
    """The ``lock`` file a killed torch ``load`` leaves blocks neither a load nor a build."""
    for d in build_dirs(cache):
        (d / "lock").touch()
    objects = {p: p.stat().st_mtime_ns for p in cache.rglob("*.o")}
    stale = ninja_says_stale(cache / "ember_quant_matmul")
    assert_starts(loaders, loaders.start(), cache, "load with stale torch lock files")
    forget_builds(cache)
    seconds = assert_starts(loaders, loaders.start(), cache, "build with stale torch lock files")
    print(f"the build path took {seconds:.2f} s")
    rebuilt = [d for d in build_dirs(cache) if (d / kernels.BUILD_MARKER).is_file()]
    assert rebuilt, f"no build marker written:\n{listing(cache)}"
    assert not any((d / "lock").exists() for d in rebuilt), listing(cache)
    # where ninja finds the copied build up to date, losing a marker costs no recompile
    if stale:
        print(f"not checked that nothing recompiled: ninja rebuilds an unchanged copy:\n{stale}")
    else:
        assert {p: p.stat().st_mtime_ns for p in cache.rglob("*.o")} == objects


@pytest.mark.slow
def test_a_second_builder_waits_for_the_first_and_says_so(
        cache: Path, loaders: Loaders) -> None:
    lock_path = kernels.build_lock_path()
    forget_builds(cache)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, str(os.getpid()).encode())  # as a builder does, for the message
        pid = loaders.start()
        stderr = wait_for_stderr(loaders, pid, "waiting")
        assert str(lock_path) in stderr and f"pid {os.getpid()}" in stderr, stderr
        assert loaders.wait(pid, 0.5) is None, f"did not wait for the lock:\n{stderr}"
    finally:
        os.close(fd)
    assert_starts(loaders, pid, cache, "after the lock was released")
    assert loaders.stderr().count("waiting") == 1, loaders.stderr()


@pytest.mark.slow
def test_a_killed_builder_does_not_block_the_next_start(
        cache: Path, loaders: Loaders, tmp_path: Path) -> None:
    """A loader waiting for a builder goes on when that builder is killed."""
    forget_builds(cache)
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER], cwd=tmp_path, text=True,
                              stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        for d in build_dirs(cache):  # as if it had been killed inside torch's load, too
            (d / "lock").touch()
        pid = loaders.start()
        wait_for_stderr(loaders, pid, "waiting")
        holder.kill()
        holder.wait()
        assert_starts(loaders, pid, cache, "after the builder holding the lock was killed")
    finally:
        holder.kill()
        holder.communicate()
