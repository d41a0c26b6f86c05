"""Conversation files: a chat's messages and its KV blocks, reopened warm by a new process.

Used by ``ember chat --conversation FILE`` and ``LLM.save_prefix`` / ``load_prefix``.
The file is append-only::

    header   MAGIC, format version, fingerprint (the disk tier's: model weights hash
             and format, KV dtype, block size, geometry)
    frames   kind (1 byte: B block, M messages, C commit), body length (u64), body,
             blake2b-128 over kind, length and body

A ``B`` body is a record in the disk tier's encoding (with its own checksum): a KV
block, or for a hybrid model the recurrent-state snapshot taken after a block (each
turn appends the newest; an import takes the furthest its blocks reach),
an ``M`` body the whole message list as JSON, and a ``C`` body the number of frames
written before it — the record count, written last. A reader keeps what the last
commit whose count matches vouches for: a torn or altered tail (a process killed
mid-write, a byte flipped) yields the longest consistent prefix, never a partial
turn. A file written for another model, weight format, KV dtype or block size is
refused with :class:`ConversationError`.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ember.errors import EmberError
from ember.kv import disk
from ember.kv.disk import BlockRecord
from ember.kv.tier import blocks_of

MAGIC = b"EMBERCV\0"
VERSION = 1
_HEADER = struct.Struct("<8sI32s")
_FRAME = struct.Struct("<cQ")
_SUM = 16


class ConversationError(EmberError):
    """A conversation file that cannot be used (another model's, or not one at all)."""


@dataclass
class Conversation:
    messages: list[dict[str, Any]] = field(default_factory=list)
    records: list[BlockRecord] = field(default_factory=list)  # KV blocks, state snapshots
    frames: int = 0  # frames up to and including the last commit
    size: int = 0  # bytes of the file that the last commit vouches for

    @property
    def num_tokens(self) -> int:
        return sum(len(rec.tokens) for rec in blocks_of(self.records))


def _frame(kind: bytes, body: bytes) -> bytes:
    head = _FRAME.pack(kind, len(body))
    return head + body + hashlib.blake2b(head + body, digest_size=_SUM).digest()


def read(path: str | Path, fp: bytes) -> Conversation:
    """The committed state of the file at ``path`` (empty if it does not exist)."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return Conversation()
    if len(data) < _HEADER.size:
        return Conversation()  # killed before its header was whole: nothing committed
    magic, version, got_fp = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ConversationError(f"{path} is not an ember conversation file")
    if version != VERSION:
        raise ConversationError(f"{path} has format version {version}; this ember reads "
                                f"{VERSION}")
    if got_fp != fp:
        raise ConversationError(
            f"{path} was written for another model, weight format, KV dtype or block size "
            "(its fingerprint differs); start a new conversation file")
    committed = Conversation(size=_HEADER.size)
    messages: list[dict[str, Any]] = []
    records: list[BlockRecord] = []
    at, frames = _HEADER.size, 0
    while at + _FRAME.size + _SUM <= len(data):
        kind, n = _FRAME.unpack_from(data, at)
        end = at + _FRAME.size + n
        if end + _SUM > len(data) or hashlib.blake2b(
                data[at:end], digest_size=_SUM).digest() != data[end:end + _SUM]:
            break  # a torn or altered frame: nothing after it is trusted
        body = data[at + _FRAME.size:end]
        at = end + _SUM
        try:
            if kind == b"C":
                if struct.unpack("<Q", body)[0] != frames:
                    break
                committed = Conversation(list(messages), list(records), frames + 1, at)
            elif kind == b"M":
                messages = json.loads(body)
            elif kind == b"B":
                rec = disk.decode(body, fp)
                if rec is None:
                    break
                records.append(rec)
            else:
                break
        except (ValueError, struct.error, disk.CorruptBlock):
            break
        frames += 1
    return committed


def append(path: str | Path, fp: bytes, prior: Conversation,
           messages: list[dict[str, Any]] | None, records: Sequence[BlockRecord]
           ) -> Conversation:
    """Append ``records`` and (if given) the whole ``messages`` list, then a commit.

    ``prior`` is the file's committed state (from :func:`read` or the last append); a
    torn tail after it is cut off first. Returns the new committed state.
    """
    path = Path(path)
    frames = [_frame(b"B", disk.encode(fp, rec)) for rec in records]
    if messages is not None:
        frames.append(_frame(b"M", json.dumps(messages).encode()))
    count = prior.frames + len(frames)
    frames.append(_frame(b"C", struct.pack("<Q", count)))
    with open(path, "r+b" if path.exists() else "wb") as f:
        f.truncate(prior.size)  # drop a torn tail (or a torn header: size 0)
        f.seek(prior.size)
        if prior.size == 0:
            f.write(_HEADER.pack(MAGIC, VERSION, fp))
        for frame in frames:
            f.write(frame)
        f.flush()
        os.fsync(f.fileno())
        size = f.tell()
    return Conversation(list(messages if messages is not None else prior.messages),
                        [*prior.records, *records], count + 1, size)


def save_turn(path: str | Path, fp: bytes, prior: Conversation, messages: list[dict[str, Any]],
              records: Sequence[BlockRecord]) -> Conversation:
    """Append a chat turn: the messages and what of ``records`` (the export of the whole
    history so far) the file lacks — new blocks and, for a hybrid model, the state after
    the last of them. A history that no longer starts with the file's blocks (rewritten)
    starts the file over."""
    chain = [rec.key for rec in blocks_of(records)]
    have = [rec.key for rec in blocks_of(prior.records)]
    if chain[:len(have)] != have:
        prior = Conversation()
    kept = {rec.key for rec in prior.records}
    return append(path, fp, prior, messages, [rec for rec in records if rec.key not in kept])
