"""What travels between the front and the replicas: plain dataclasses, sent as checked
bytes by :mod:`ember.cluster.wire`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ember.engine.intake import SLO
from ember.sampling.params import SamplingParams

DEPLOYMENT = "EmberReplica"
APP = "ember"


@dataclass
class GroupSpec:
    """One prompt's n choices, as the front prepared them for a replica's
    ``engine.prepare`` (which validates them again, so a replica's answer is the same
    as a single-process server's)."""

    request_id: str  # choice j > 0 gets f"{request_id}-{j}", as engine.prepare names them
    prompt_ids: list[int]
    params: list[SamplingParams]
    tenant: str
    priority: int = 0
    slo: SLO | None = None
    weight: float = 1.0
    waited: float = 0.0  # seconds since the request arrived at the front (TTFT counts from then)
    references: tuple[str, ...] = ()
    keys: list[bytes] = field(default_factory=list)  # prefix-cache chain keys, for routing
    avoid: tuple[str, ...] = ()  # replicas that refused or died on it: route elsewhere
    # the LoRA adapter it runs with: (name, path, identity) as the front loaded it; the
    # replica loads the same file on demand and refuses it if its identity changed
    lora: tuple[str, str, bytes] | None = None
    # disaggregation (ember.cluster.disagg): ``prefill`` asks the replica only to compute
    # the prompt's KV and hand it over; ``handoff`` is that KV, for the replica that
    # decodes; ``replica`` names the replica the front chose (routers send it there
    # unless it refused or died on the spec); ``handoff_from``: the first block a prefill
    # hands over (the decoding replica holds the ones before it in its prefix cache)
    prefill: bool = False
    handoff: Handoff | None = None
    replica: str = ""
    handoff_from: int = 0

    @property
    def request_ids(self) -> list[str]:
        return [self.request_id] + [f"{self.request_id}-{j}" for j in range(1, len(self.params))]


@dataclass
class Handoff:
    """A prompt's KV, prefilled on one replica for another: the prompt's full blocks
    except its last token's, each encoded in the disk tier's checksummed block format
    (:func:`ember.kv.disk.encode`: fingerprint, salt, parent key, tokens, checksum).
    ``blocks`` is a Ray object reference to the list of encoded blocks (it travels
    through Ray's object store straight to the decoding replica), or the list itself
    outside Ray."""

    blocks: Any
    tokens: int  # prompt tokens the chain covers, from the prompt's start
    nbytes: int
    source: str  # the replica that prefilled
    engine_seconds: float = 0.0  # the prefill's time in its replica's engine, queue included
    export_seconds: float = 0.0  # copying, encoding and publishing the blocks
    error: str = ""  # why there are no blocks (the prefill failed): the decoder recomputes
    first: int = 0  # the chain's block that blocks[0] is (the decoder had those before)


@dataclass(frozen=True)
class PurgeSpec:
    """Forget one tenant's cached prefixes on the replica named (the router sends it
    there and nowhere else: the front purges every replica in turn)."""

    tenant: str
    replica: str


@dataclass
class Verdict:
    """A replica's first answer to a group: accepted, or the error ``prepare`` raised."""

    replica: str  # the replica's unique id
    error: str | None = None  # None: accepted
    kind: str = ""  # "invalid" (param names the culprit), "queue_full" or "stopped"
    param: str = ""
    # what the replica made of the spec's handoff: tokens taken, bytes, seconds to fetch,
    # verify and load them, and why it took fewer than handed over (it recomputes those)
    imported: dict[str, Any] | None = None
