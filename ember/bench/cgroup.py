"""A memory cgroup for one benchmark process: a real limit on its memory, page cache
included, as a machine with that much RAM (or a container with that limit) imposes.

``ulimit`` cannot do this (it caps address space, not resident pages, and ignores the
page cache), and a limit only on the process's anonymous memory would let llama.cpp's
mmap-ed weights sit in a page cache the size of the host. A cgroup charges every page
the processes in it touch, file pages included, and reclaims (or kills) beyond it.

Both hierarchies are handled: cgroup v2 (``memory.max``, ``memory.peak``) where
``/sys/fs/cgroup`` is the unified tree with the memory controller, else v1
(``/sys/fs/cgroup/memory``: ``memory.limit_in_bytes``, ``memory.max_usage_in_bytes``).
Swap is capped at zero where the kernel lets us, so the limit is RAM. A cgroup is made
for one run and removed after it, so its peak is that run's.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ember.errors import EmberError

V2_ROOT = Path("/sys/fs/cgroup")
V1_ROOT = Path("/sys/fs/cgroup/memory")


class CgroupError(EmberError):
    """No memory cgroup can be made here (not root, no controller, read-only tree)."""


class MemoryCgroup:
    """``with MemoryCgroup(limit) as cg: run(argv, preexec_fn=cg.join)``; ``cg.peak()``."""

    def __init__(self, limit_bytes: int, name: str | None = None) -> None:
        if limit_bytes <= 0:
            raise ValueError(f"a memory limit must be positive, got {limit_bytes}")
        self.limit = limit_bytes
        name = name or f"ember-bench-{os.getpid()}-{time.monotonic_ns()}"
        controllers = V2_ROOT / "cgroup.controllers"
        if controllers.is_file() and "memory" in controllers.read_text().split():
            self.v2, self.path = True, V2_ROOT / name
        elif V1_ROOT.is_dir():
            self.v2, self.path = False, V1_ROOT / name
        else:
            raise CgroupError("no memory cgroup controller here (neither cgroup v2's "
                              f"{controllers} nor v1's {V1_ROOT})")
        try:
            self.path.mkdir()
        except OSError as e:
            raise CgroupError(f"cannot make a memory cgroup at {self.path} ({e}): run as "
                              "root, or in a container that delegates its cgroup") from None
        try:
            if self.v2:
                self._write("memory.max", limit_bytes)
                self._write("memory.swap.max", 0, optional=True)
            else:
                self._write("memory.limit_in_bytes", limit_bytes)
                self._write("memory.memsw.limit_in_bytes", limit_bytes, optional=True)
                self._write("memory.swappiness", 0, optional=True)
        except BaseException:
            self.close()
            raise

    def _write(self, name: str, value: int, optional: bool = False) -> None:
        try:
            (self.path / name).write_text(str(value))
        except OSError as e:
            if not optional:
                raise CgroupError(f"cannot set {self.path / name} to {value}: {e}") from None

    def join(self) -> None:
        """Move the calling process into the cgroup (a ``preexec_fn``: runs in the child
        between fork and exec, so everything it execs is charged here)."""
        (self.path / ("cgroup.procs" if self.v2 else "tasks")).write_text(str(os.getpid()))

    def peak(self) -> int | None:
        """The most memory its processes held at once, page cache included."""
        name = "memory.peak" if self.v2 else "memory.max_usage_in_bytes"
        try:
            return int((self.path / name).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def oom_kills(self) -> int:
        """Processes the kernel killed here for memory."""
        name = "memory.events" if self.v2 else "memory.oom_control"
        try:
            for line in (self.path / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def close(self) -> None:
        """Remove the cgroup (its processes must have exited)."""
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:  # a just-exited process may still be leaving it
                time.sleep(0.1)

    def __enter__(self) -> MemoryCgroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
