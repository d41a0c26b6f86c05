"""The front's and the replicas' messages as checked bytes (ember.cluster.wire): each
kind comes back as it was sent, and anything else — corrupt, truncated, another
kind, another version, a pickle, a body whose fields have the wrong types — is a
WireError, never an object."""

from __future__ import annotations

import pickle
import struct
import zlib

import msgspec
import pytest

from ember.cluster import wire
from ember.cluster.protocol import GroupSpec, Handoff, PurgeSpec, Verdict
from ember.engine.intake import SLO
from ember.engine.output import RequestOutput
from ember.engine.request import Timeline
from ember.sampling.constraints import StructuredOutput
from ember.sampling.params import SamplingParams
from ember.sampling.sampler import TokenLogprobs
from ember.spec.speculator import SpecStats

SPEC = GroupSpec("g", [1, 2, 3], [SamplingParams(max_tokens=3, temperature=0.0, stop=["\n"],
                                                 structured=StructuredOutput.regex("a+"))],
                 "tenant", priority=2, slo=SLO(ttft=2.0, tpot=0.1), waited=0.25,
                 references=("ref",), keys=[b"\x01" * 8, b"\x02" * 8], avoid=("r0",),
                 lora=("one", "/adapters/one.gguf", b"\x00\xff"), replica="r1")
OUTPUT = RequestOutput("g", "ab", [5, 6], 3, 0, True, "length", delta_text="b",
                       delta_token_ids=[6], logprobs=[TokenLogprobs(5, -0.5, [(5, -0.5)])],
                       spec=SpecStats(drafted=4, accepted=3, by_source={"ngram": [4, 3]}),
                       timeline=Timeline(chunks=[(1.0, 1.5, 0, 3)], decode_steps=2))


def _framed(body: bytes, kind: int, version: int = wire.VERSION) -> bytes:
    """A message with a well-formed header around ``body`` (a valid checksum)."""
    return struct.pack("<4sHHII", wire.MAGIC, version, kind, len(body), zlib.crc32(body)) + body


@pytest.mark.parametrize("message", [
    SPEC, PurgeSpec("tenant", "r2"), Verdict("r1", "queue is full", "queue_full"),
    Verdict("r2", imported={"tokens": 32, "error": ""}), OUTPUT,
], ids=lambda m: type(m).__name__)
def test_each_kind_comes_back_as_it_was_sent(message) -> None:
    assert wire.unpack(wire.pack(message), type(message)) == message


def test_a_handoffs_blocks_travel_beside_its_message() -> None:
    """The blocks are a Ray object reference in a cluster: never in the bytes."""
    blocks = object()  # stands for the reference: the codec must not touch it
    spec = GroupSpec("g", [1], [SamplingParams()], "t",
                     handoff=Handoff(blocks, 32, 6000, "r1", first=1))
    message, beside = wire.call_args(spec)
    # nested: Ray would fetch a reference passed as an argument itself before the call
    assert beside == [blocks] and spec.handoff.blocks is blocks  # the sender's unchanged
    got = wire.received_spec(message, beside)
    assert got.handoff == spec.handoff
    item = wire.stream_item(spec.handoff)
    assert isinstance(item, tuple) and item[1] is blocks
    assert wire.read_item(item) == spec.handoff


def test_a_damaged_message_is_refused_by_name() -> None:
    data = wire.pack(SPEC)
    flipped = bytearray(data)
    flipped[-3] ^= 0x10
    for bad, why in [(bytes(flipped), "checksum"), (data[:-1], "header says"),
                     (data[:10], "shorter than its header"), (b"XXXX" + data[4:], "magic"),
                     (_framed(data[16:], 0, version=9), "version 9")]:
        with pytest.raises(wire.WireError, match=why):
            wire.unpack(bad, GroupSpec)


def test_a_message_of_another_kind_is_refused() -> None:
    with pytest.raises(wire.WireError, match="got a Verdict, expected GroupSpec"):
        wire.unpack(wire.pack(Verdict("r1")), GroupSpec)
    with pytest.raises(wire.WireError, match="kind 77"):
        wire.unpack(_framed(b"\x90", 77), GroupSpec)


class _Boom:
    def __reduce__(self):
        return (exec, ("import sys; sys.modules['ember'].BOOM = True",))


def test_a_pickle_is_never_run() -> None:
    import ember

    payload = pickle.dumps(_Boom())
    for data in (payload, _framed(payload, 0)):
        with pytest.raises(wire.WireError):
            wire.unpack(data, GroupSpec)
    assert not hasattr(ember, "BOOM")


@pytest.mark.parametrize("fields,why", [
    ({"request_id": "g", "prompt_ids": ["x"], "params": [{}], "tenant": "t"}, "prompt_ids"),
    ({"request_id": "g", "prompt_ids": [1], "params": [{"temperature": -1}], "tenant": "t"},
     "temperature"),
    ({"request_id": "g", "prompt_ids": [1], "params": [{}]}, "tenant"),
])
def test_a_body_whose_fields_are_wrong_is_refused(fields, why) -> None:
    """A well-framed body (valid checksum) that is not a valid GroupSpec: every field's
    type is checked, and the dataclasses' own validation runs."""
    body = msgspec.msgpack.encode(fields)
    with pytest.raises(wire.WireError, match=why):
        wire.unpack(_framed(body, wire.KINDS.index(GroupSpec)), GroupSpec)


def test_only_the_protocols_messages_are_packed() -> None:
    with pytest.raises(TypeError, match="dict is not a wire message"):
        wire.pack({"request_id": "g"})
