"""Oracle outputs kept on disk between runs: what an independent implementation (here
transformers) computed for the same inputs, keyed by everything it depends on, so a
second run reads the oracle's answer instead of rebuilding the oracle model. A miss
computes it as before; nothing of ember's own output is ever stored as an oracle."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ember.models.registry import ember_home


def _path(name: str, key_parts: Sequence[bytes], suffix: str = "") -> Path:
    import transformers

    parts = [*key_parts, transformers.__version__.encode(), torch.__version__.encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:20]
    return ember_home() / "test-oracles" / f"{name}-{key}{suffix}"


def cached_tensor(name: str, key_parts: Sequence[bytes],
                  compute: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``compute()``'s tensor, stored under ``$EMBER_HOME/test-oracles`` by ``name`` and a
    hash of ``key_parts`` plus transformers' and torch's versions (written atomically)."""
    path = _path(name, key_parts, ".pt")
    if path.exists():
        return torch.load(path, weights_only=True)
    value = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    torch.save(value, staging)
    os.replace(staging, path)
    return value


def file_key(path: str | Path) -> bytes:
    """A file's identity for a cache key: its sha256."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.digest()


def cached_dir(name: str, key_parts: Sequence[bytes], build: Callable[[Path], None]) -> Path:
    """A directory ``build(dir)`` fills, kept as :func:`cached_tensor` keeps a tensor:
    built in a staging directory and moved into place whole."""
    path = _path(name, key_parts)
    if (path / "done").exists():
        return path
    staging = path.with_name(f"{path.name}.{os.getpid()}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    build(staging)
    (staging / "done").write_text("")
    shutil.rmtree(path, ignore_errors=True)
    os.replace(staging, path)
    return path
