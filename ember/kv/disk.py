"""A crash-safe store of KV blocks on disk: the prefix cache's second tier.

One file per block, named by the block's chain key (``<key hex>.kvb``), in a
directory per model fingerprint. A file is::

    header   magic, format version, fingerprint, chain key, parent key,
             salt length, token count, payload length          (_HEAD)
    salt     the tenant salt the chain was computed under
    tokens   the block's token ids (u32 each)
    payload  the block's K and V bytes, all layers (one contiguous unit)
    checksum blake2b-256 over everything above

A block is served only if every field verifies: magic, version and fingerprint
(model weights hash, weight format, KV dtype, block size, layer/head geometry: see
:func:`fingerprint`), the checksum, and then, by the caller, that the salt, parent
key and tokens are the ones the request would compute. Anything else is a miss; a
file that fails its checksum or cannot be parsed is deleted and counted as corrupt.

Writes are atomic: a temp file is written, optionally fsynced (``fsync``: ``always``
fsyncs each file before its rename and the directory after; ``batch`` fsyncs the
files of a drained batch together before renaming them; ``never`` leaves it to the
page cache), then renamed over the final name. A process killed at any instant
leaves whole blocks or temp files, which the next start deletes. Without fsync a
power loss can leave a renamed file short or zeroed: its checksum fails, so it is
deleted, never served. The index is the directory itself, scanned at startup
(names and sizes only; contents are verified when read), so it is never lost.

Writes happen on a background thread: ``put`` queues the record (bounded in bytes)
and returns; the thread encodes and checksums it. A queued block is already
readable. The directory is
kept under ``capacity`` bytes by deleting least recently used blocks, fairly between
tenants (``scope_of`` a block's salt): from the tenant storing the most bytes first,
so one tenant's flood deletes its own blocks before anyone else's; ``cap`` gives a
tenant a hard limit of its own.

This module does not import torch: payloads are bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import struct
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MAGIC = b"EMBERKV\0"
VERSION = 1
SUFFIX = ".kvb"
FSYNC_POLICIES = ("always", "batch", "never")
_HEAD = struct.Struct("<8sI32s16s16sIIQ")
_SUM = 32


class CorruptBlock(ValueError):
    """Stored bytes that do not parse or fail their checksum."""


def fingerprint(*parts: object) -> bytes:
    """32 bytes naming everything a block's bytes depend on besides its tokens."""
    return hashlib.sha256("\0".join(map(str, parts)).encode()).digest()


@dataclass(frozen=True)
class BlockRecord:
    key: bytes  # the block's chain key
    parent: bytes  # the previous block's chain key (the root key for a first block)
    salt: bytes
    tokens: tuple[int, ...]
    payload: bytes | memoryview


def encode(fp: bytes, rec: BlockRecord) -> bytes:
    head = _HEAD.pack(MAGIC, VERSION, fp, rec.key, rec.parent, len(rec.salt),
                      len(rec.tokens), len(rec.payload))
    body = b"".join((head, rec.salt, struct.pack(f"<{len(rec.tokens)}I", *rec.tokens),
                     rec.payload))
    return body + hashlib.blake2b(body, digest_size=_SUM).digest()


def decode(data: bytes, fp: bytes) -> BlockRecord | None:
    """The record in ``data``; None if it is whole but for another fingerprint or
    format version. Raises :class:`CorruptBlock` if it is torn or altered."""
    if len(data) < _HEAD.size + _SUM:
        raise CorruptBlock(f"{len(data)} bytes is shorter than a header")
    magic, version, got_fp, key, parent, n_salt, n_tokens, n_payload = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise CorruptBlock("bad magic")
    end = _HEAD.size + n_salt + 4 * n_tokens + n_payload
    if end + _SUM != len(data):
        raise CorruptBlock(f"lengths say {end + _SUM} bytes, the file has {len(data)}")
    if hashlib.blake2b(data[:end], digest_size=_SUM).digest() != data[end:]:
        raise CorruptBlock("checksum mismatch")
    if version != VERSION or got_fp != fp:
        return None
    at = _HEAD.size
    salt = data[at:at + n_salt]
    at += n_salt
    tokens = struct.unpack_from(f"<{n_tokens}I", data, at)
    at += 4 * n_tokens
    # the payload is a view of ``data``: restoring copies it once, into the pool
    return BlockRecord(key, parent, bytes(salt), tokens, memoryview(data)[at:end])


@dataclass
class DiskStats:
    hits: int = 0  # blocks read and verified
    misses: int = 0  # lookups of a key the store did not have (or could not serve)
    bytes_read: int = 0
    bytes_written: int = 0
    corrupt: int = 0  # files deleted because they failed to verify
    evicted: int = 0  # files deleted to stay under capacity
    dropped: int = 0  # writes skipped because the write queue was full


class DiskStore:
    """Blocks on disk under ``root / <fingerprint>``, at most ``capacity`` bytes."""

    def __init__(self, root: str | Path, fp: bytes, capacity: int, fsync: str = "batch",
                 queue_bytes: int = 256 * 1024**2,
                 scope_of: Callable[[bytes], bytes] = lambda salt: b"",
                 cap: Callable[[bytes], int | None] = lambda scope: None) -> None:
        """``scope_of(salt)``: the tenant a block's bytes count against; ``cap(scope)``:
        the most bytes that tenant may store (None: its fair share of ``capacity``)."""
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync must be one of {', '.join(FSYNC_POLICIES)}, got {fsync!r}")
        self.fp = fp
        self.dir = Path(root) / fp.hex()[:32]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.capacity = capacity
        self.fsync = fsync
        self.queue_bytes = queue_bytes
        self.stats = DiskStats()
        self._lock = threading.Lock()
        self._index: dict[bytes, int] = {}  # key -> file size
        self._size = 0
        self.scope_of, self.cap = scope_of, cap
        self._scope: dict[bytes, bytes] = {}  # key -> its tenant scope
        self._by_scope: dict[bytes, OrderedDict[bytes, None]] = {}  # LRU first
        self._scope_bytes: Counter[bytes] = Counter()
        # queued for the writer thread, which encodes them (the checksum is off the
        # caller's thread) and serves reads meanwhile
        self._pending: OrderedDict[bytes, BlockRecord] = OrderedDict()
        self._pending_bytes = 0
        self._wake = threading.Condition(self._lock)
        self._writing = False  # the writer holds a batch it has not indexed yet
        self._closed = False
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="ember-kv-disk",
                                        daemon=True)
        self._writer.start()

    # ------------------------------------------------------------ index
    def _scan(self) -> None:
        files = []
        for entry in os.scandir(self.dir):
            name = entry.name
            if name.endswith(".tmp"):  # a write that never reached its rename
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                continue
            if not name.endswith(SUFFIX):
                continue
            try:
                key = bytes.fromhex(name[:-len(SUFFIX)])
                st = entry.stat()
            except (ValueError, FileNotFoundError):
                continue
            # a file whose header cannot be read is indexed anyway: deleted when read
            salt = self._salt_of(key) or b""
            files.append((st.st_mtime_ns, key, st.st_size, self.scope_of(salt)))
        for _, key, size, scope in sorted(files):
            self._add(key, size, scope)
        for scope in list(self._by_scope):
            self._trim(scope)
        self._shrink()
        log.info("KV disk store %s: %d blocks, %.1f MB", self.dir, len(self._index),
                 self._size / 1e6)

    def _path(self, key: bytes) -> Path:
        return self.dir / (key.hex() + SUFFIX)

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._pending or key in self._index

    def __len__(self) -> int:
        with self._lock:
            return len(self._index.keys() | self._pending.keys())

    @property
    def size_bytes(self) -> int:
        return self._size

    def _add(self, key: bytes, size: int, scope: bytes) -> None:
        """Index a stored file (lock held)."""
        self._index[key] = size
        self._size += size
        self._scope[key] = scope
        self._by_scope.setdefault(scope, OrderedDict())[key] = None
        self._scope_bytes[scope] += size

    def _touch(self, key: bytes) -> None:
        """A stored block was read: the most recently used of its tenant (lock held)."""
        scope = self._scope.get(key)
        if scope is not None:
            self._by_scope[scope].move_to_end(key)

    def _shrink(self) -> None:
        """Delete files until under capacity: the least recently used of the tenant
        storing the most bytes first (lock held)."""
        while self._size > self.capacity and self._index:
            scope = max(self._by_scope, key=lambda s: self._scope_bytes[s])
            self._forget(next(iter(self._by_scope[scope])))
            self.stats.evicted += 1

    def _trim(self, scope: bytes) -> None:
        """Delete a tenant's least recently used files past its own cap (lock held)."""
        cap = self.cap(scope)
        while cap is not None and self._scope_bytes[scope] > cap and scope in self._by_scope:
            self._forget(next(iter(self._by_scope[scope])))
            self.stats.evicted += 1

    def bytes_by_scope(self) -> dict[bytes, int]:
        """Bytes stored per tenant scope."""
        with self._lock:
            return dict(self._scope_bytes)

    def _forget(self, key: bytes) -> None:
        size = self._index.pop(key, None)
        if size is not None:
            self._size -= size
            scope = self._scope.pop(key)
            lru = self._by_scope[scope]
            del lru[key]
            if not lru:
                del self._by_scope[scope]
            self._scope_bytes[scope] -= size
            if not self._scope_bytes[scope]:
                del self._scope_bytes[scope]
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(key))

    # ------------------------------------------------------------ reads
    def get(self, key: bytes) -> BlockRecord | None:
        """The verified record stored under ``key``, or None (counted as a miss)."""
        with self._lock:
            queued = self._pending.get(key)
            known = queued is not None or key in self._index
        if not known:
            self.stats.misses += 1
            return None
        if queued is not None:
            self.stats.hits += 1
            self.stats.bytes_read += len(queued.payload)
            return queued
        try:
            data = self._path(key).read_bytes()
        except FileNotFoundError:
            with self._lock:
                self._forget(key)
            self.stats.misses += 1
            return None
        try:
            rec = decode(data, self.fp)
            if rec is not None and rec.key != key:
                raise CorruptBlock("the file holds another key")
        except CorruptBlock as e:
            log.warning("KV disk block %s is corrupt (%s): deleted", key.hex(), e)
            with self._lock:
                self._forget(key)
            self.stats.corrupt += 1
            self.stats.misses += 1
            return None
        if rec is None:
            self.stats.misses += 1
            return None
        with self._lock:
            self._touch(key)
        self.stats.hits += 1
        self.stats.bytes_read += len(data)
        return rec

    def purge(self, match: Callable[[bytes], bool]) -> tuple[int, int]:
        """Delete every stored block whose salt ``match`` accepts (a tenant's): queued
        ones are dropped, files are read as far as their salt; returns (blocks, bytes)."""
        removed = nbytes = 0
        with self._lock:
            for key, rec in list(self._pending.items()):
                if match(rec.salt):
                    del self._pending[key]
                    self._pending_bytes -= len(rec.payload)
                    removed, nbytes = removed + 1, nbytes + len(rec.payload)
        self.flush()  # what the writer holds lands first, then is looked at like the rest
        with self._lock:
            keys = list(self._index)
        for key in keys:
            salt = self._salt_of(key)
            if salt is not None and match(salt):
                with self._lock:
                    size = self._index.get(key, 0)
                    self._forget(key)
                removed, nbytes = removed + 1, nbytes + size
        return removed, nbytes

    def _salt_of(self, key: bytes) -> bytes | None:
        """The salt in a stored block's header (None: gone, or not a block of ours)."""
        try:
            with open(self._path(key), "rb") as f:
                head = f.read(_HEAD.size)
                if len(head) < _HEAD.size:
                    return None
                magic, _, _, _, _, n_salt, _, _ = _HEAD.unpack(head)
                salt = f.read(n_salt)
        except OSError:  # gone, or unreadable: treated as not ours
            return None
        return salt if magic == MAGIC and len(salt) == n_salt else None

    def discard(self, key: bytes) -> None:
        """Delete a block that verified but does not belong where it was looked up."""
        with self._lock:
            self._pending.pop(key, None)
            self._forget(key)

    # ------------------------------------------------------------ writes
    def put(self, rec: BlockRecord) -> bool:
        """Queue ``rec`` for writing; False if it was dropped (queue full) or stored."""
        size = len(rec.payload)
        with self._lock:
            if rec.key in self._index or rec.key in self._pending:
                return False
            if self._pending_bytes + size > self.queue_bytes or self._closed:
                self.stats.dropped += 1
                return False
            self._pending[rec.key] = rec
            self._pending_bytes += size
            self._wake.notify()
        return True

    def flush(self) -> None:
        """Wait until every queued block is on disk, and the batch being written (which
        may hold blocks a purge took off the queue meanwhile) is indexed."""
        with self._lock:
            while self._pending or self._writing:
                self._wake.wait(0.05)

    def close(self) -> None:
        self.flush()
        with self._lock:
            self._closed = True
            self._wake.notify_all()
        self._writer.join(timeout=5)

    def _write_loop(self) -> None:
        while True:
            with self._lock:
                while not self._pending and not self._closed:
                    self._wake.wait()
                if self._closed and not self._pending:
                    return
                batch = list(self._pending.items())
                self._writing = True
            try:
                self._write(batch)
            except OSError as e:  # a full disk, say: these blocks are simply not stored
                log.warning("KV disk store: writing %d blocks failed: %s", len(batch), e)
            with self._lock:
                for key, rec in batch:
                    if self._pending.pop(key, None) is not None:
                        self._pending_bytes -= len(rec.payload)
                self._writing = False
                self._wake.notify_all()

    def _write(self, batch: Sequence[tuple[bytes, BlockRecord]]) -> None:
        temps = []
        for key, rec in batch:
            data = encode(self.fp, rec)
            tmp = self.dir / f".{key.hex()}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
                if self.fsync == "always":
                    f.flush()
                    os.fsync(f.fileno())
            temps.append((key, tmp, len(data)))
        if self.fsync == "batch":
            for _, tmp, _ in temps:
                fd = os.open(tmp, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        salts = {key: rec.salt for key, rec in batch}
        for key, tmp, size in temps:
            os.replace(tmp, self._path(key))
            with self._lock:
                if key not in self._index:
                    scope = self.scope_of(salts[key])
                    self._add(key, size, scope)
                    self.stats.bytes_written += size
                    self._trim(scope)
                self._shrink()
        if self.fsync != "never":
            fd = os.open(self.dir, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
