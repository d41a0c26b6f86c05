"""What the front and the replicas send each other, as checked bytes.

Ray carries a call's arguments and a stream's items by pickling them, and unpickling
runs whatever code the bytes name. ember hands Ray only bytes for its own messages:
each is msgpack of one of the protocol's dataclasses behind a header (magic, format
version, which message, body length, CRC-32 of the body), and is decoded into the
type the receiver expects and nothing else, every field's type checked (msgspec), so
a corrupt, truncated, foreign or mismatched message is a :class:`WireError` naming
what is wrong, never an object of another type. A KV handoff's blocks are not in its
message: they travel beside it (a Ray object reference to the disk tier's
checksummed blocks, fetched replica to replica), and are verified block by block
when taken (``EmberReplica._import``).

What this does not change: Ray's own channels between its processes pickle, so the
trust boundary is who can reach them (docs/scaling.md, "What Ray pickles").
"""

from __future__ import annotations

import functools
import struct
import zlib
from collections.abc import AsyncIterator
from dataclasses import fields, replace
from typing import Any, TypeVar

import msgspec

from ember.cluster.protocol import GroupSpec, Handoff, PurgeSpec, Verdict
from ember.engine.output import RequestOutput
from ember.errors import EmberError

MAGIC = b"EMBW"
VERSION = 1
# the message kinds, by their number in the header (append only: the number is the wire's)
KINDS: tuple[type, ...] = (GroupSpec, PurgeSpec, Verdict, RequestOutput, Handoff)
_HEADER = struct.Struct("<4sHHII")  # magic, version, kind, body length, crc32(body)

T = TypeVar("T")

_encoder = msgspec.msgpack.Encoder()
_decoders = {kind: msgspec.msgpack.Decoder(kind) for kind in KINDS}


class WireError(EmberError):
    """A message that is not one this side can read (corrupt, truncated, another
    version or another kind than expected)."""


def pack(message: Any) -> bytes:
    """``message`` (one of :data:`KINDS`) as header + msgpack body."""
    try:
        kind = KINDS.index(type(message))
    except ValueError:
        raise TypeError(f"{type(message).__name__} is not a wire message") from None
    try:
        body = _encoder.encode(message)
    except OverflowError:  # msgpack's integers are 64-bit
        raise WireError(f"a number in the {type(message).__name__} is out of the 64-bit "
                        "range") from None
    return _HEADER.pack(MAGIC, VERSION, kind, len(body), zlib.crc32(body)) + body


def unpack(data: Any, *expected: type[T]) -> T:
    """The message in ``data``, which must be one of the ``expected`` kinds."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise WireError(f"expected a message's bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) < _HEADER.size:
        raise WireError(f"message of {len(data)} bytes is shorter than its header")
    magic, version, kind, length, crc = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise WireError("not an ember message (bad magic)")
    if version != VERSION:
        raise WireError(f"message format version {version}, this side reads {VERSION}")
    if kind >= len(KINDS) or KINDS[kind] not in expected:
        name = KINDS[kind].__name__ if kind < len(KINDS) else f"kind {kind}"
        raise WireError(f"got a {name}, expected "
                        + " or ".join(t.__name__ for t in expected))
    body = data[_HEADER.size:]
    if len(body) != length:
        raise WireError(f"body of {len(body)} bytes, header says {length}")
    if zlib.crc32(body) != crc:
        raise WireError("checksum mismatch")
    try:
        return _decoders[KINDS[kind]].decode(body)
    except (msgspec.DecodeError, ValueError, TypeError) as e:
        raise WireError(f"malformed {KINDS[kind].__name__}: {e}") from None


@functools.lru_cache(maxsize=16)  # a spec can hold a long prompt: keep few
def peek(data: bytes) -> GroupSpec | PurgeSpec | None:
    """The spec a routed call carries, for the router (which sees each several times);
    None when ``data`` is not one."""
    try:
        return unpack(data, GroupSpec, PurgeSpec)
    except WireError:
        return None


# ---------------------------------------------------------------- a call and its stream
def call_args(spec: GroupSpec) -> tuple[bytes, list[Any] | None]:
    """The arguments of ``EmberReplica.generate`` for ``spec``: its message, and the
    blocks of its handoff (if any) beside it, in a list: Ray fetches an object
    reference passed as an argument itself before the call, and the replica fetches
    the blocks when it takes them (with a deadline, recomputing the prompt if they are
    lost)."""
    if spec.handoff is None:
        return pack(spec), None
    blocks = [spec.handoff.blocks]
    return pack(replace(spec, handoff=replace(spec.handoff, blocks=None))), blocks


def out_of_range(spec: GroupSpec) -> str | None:
    """The first sampling parameter of ``spec`` whose integer msgpack cannot carry (the
    API bounds none of seed, top_k, max_tokens above), for a 400 naming it."""
    for params in spec.params:
        for f in fields(params):
            value = getattr(params, f.name)
            values = value if isinstance(value, list) else [value]
            if any(isinstance(v, int) and not -(1 << 63) <= v < (1 << 64) for v in values):
                return f.name
    return None


def received_spec(message: bytes, blocks: list[Any] | None) -> GroupSpec:
    """The replica's side of :func:`call_args`."""
    spec = unpack(message, GroupSpec)
    if spec.handoff is not None:
        spec.handoff.blocks = blocks[0] if blocks else None
    return spec


def stream_item(message: Verdict | RequestOutput | Handoff) -> bytes | tuple[bytes, Any]:
    """An item of a replica's stream: the message; a handoff's blocks beside it."""
    if isinstance(message, Handoff):
        return pack(replace(message, blocks=None)), message.blocks
    return pack(message)


def read_item(item: Any) -> Verdict | RequestOutput | Handoff:
    """The front's side of :func:`stream_item`."""
    if isinstance(item, tuple) and len(item) == 2:
        handoff = unpack(item[0], Handoff)
        handoff.blocks = item[1]
        return handoff
    return unpack(item, Verdict, RequestOutput)


class ReplicaStream:
    """A replica's stream as the front reads it: each item decoded."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def __aiter__(self) -> AsyncIterator[Verdict | RequestOutput | Handoff]:
        return self

    async def __anext__(self) -> Verdict | RequestOutput | Handoff:
        return read_item(await self._stream.__anext__())

    def cancel(self) -> None:
        self._stream.cancel()
