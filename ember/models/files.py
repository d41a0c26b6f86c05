"""Where ember keeps its files (``$EMBER_HOME``, by default ``~/.cache/ember``), and
the sha256 of model files, read once per version of a file."""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

_CHUNK = 1 << 20


def ember_home() -> Path:
    return Path(os.environ.get("EMBER_HOME") or Path.home() / ".cache" / "ember")


REMEMBERED_DIGESTS = 256  # kept in $EMBER_HOME/sha256/; the oldest go beyond it


def sha256_of(path: Path, remember: bool = False) -> str:
    """The file's sha256, hashed once per version of the file (path, device, inode, size,
    modification and change times: a write, even one that puts the mtime back, changes
    the ctime) per process. ``remember``: also keep it in ``$EMBER_HOME/sha256/`` for
    later processes, so a restart does not read a model again to fingerprint it (a 142
    GB model takes minutes, and under a memory limit pushes the page cache around); not
    for verifying a download, where the bytes themselves must be read."""
    st = Path(path).stat()
    version = (str(Path(path).resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
               st.st_ctime_ns)
    if not remember:
        return _sha256_of(*version)
    known = ember_home() / "sha256" / hashlib.sha256(
        "\0".join(map(str, version)).encode()).hexdigest()
    try:
        cached = known.read_text().strip()
        if len(cached) == 64 and all(c in "0123456789abcdef" for c in cached):
            return cached
    except OSError:
        pass
    digest = _sha256_of(*version)
    try:  # a cache: written whole or not at all, and failing to write it is no error
        known.parent.mkdir(parents=True, exist_ok=True)
        tmp = known.with_name(f"{known.name}.{os.getpid()}.tmp")
        tmp.write_text(digest)
        os.replace(tmp, known)
        entries = sorted(known.parent.iterdir(), key=lambda p: p.stat().st_mtime_ns)
        for old in entries[:-REMEMBERED_DIGESTS]:
            old.unlink(missing_ok=True)
    except OSError:
        pass
    return digest


@functools.lru_cache(maxsize=64)
def _sha256_of(path: str, dev: int, ino: int, size: int, mtime_ns: int, ctime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()
