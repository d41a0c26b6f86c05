"""One process at a time across processes: an exclusive ``flock`` on a file or directory.

The OS drops the lock when its holder exits or is killed, so a crash leaves nothing to
clean up. Used where several processes start at once (test workers, replicas) and
would otherwise build, fetch or unpack the same thing into the same place.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable, Iterator
from pathlib import Path


@contextlib.contextmanager
def exclusive(path: Path, *, on_wait: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold the lock on ``path`` (a directory, or a file created if missing).

    A lock file records its holder's pid while held; a process that has to wait calls
    ``on_wait`` with it before it blocks ("unknown" for a directory, or a file whose
    holder wrote none). The file is never deleted: a process waiting on a deleted
    file's lock would hold a lock nobody else sees.
    """
    is_dir = path.is_dir()
    if not is_dir:
        path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDONLY if is_dir else os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                holder = "" if is_dir else os.pread(fd, 32, 0).decode(errors="replace")
                on_wait(holder.strip() or "unknown")
            fcntl.flock(fd, fcntl.LOCK_EX)
        if is_dir:
            yield
            return
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # releases the lock
