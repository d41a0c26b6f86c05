"""What the HTTP server serves from: a :class:`Backend`, chosen by whoever starts it.

The local backend is one engine on its own thread
(:class:`~ember.engine.thread.EngineThread`); ``ember serve --replicas N`` passes
one whose engines are replicas on Ray Serve (``ember.cluster``). The server knows
only these two protocols, so it never imports the cluster that builds on it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from ember.config import EngineConfig
from ember.engine.engine import LLMEngine
from ember.engine.output import RequestOutput
from ember.engine.thread import EngineThread
from ember.models.loader import LoadedModel
from ember.sampling.params import SamplingParams
from ember.sampling.reasoning import ThinkingTags
from ember.tokenizer import Tokenizer


@dataclass(frozen=True)
class Handle:
    """What the server knows of one prepared choice: its id, its prompt's length and
    its objectives (the same whichever backend prepared it)."""

    request_id: str
    num_prompt: int
    slo_ttft: float | None = None
    slo_tpot: float | None = None


@dataclass(frozen=True)
class PreparedGroup:
    """One prompt's prepared choices: the server reads their ``handles``; the backend
    that prepared them takes ``work`` back whole, to submit or discard it."""

    handles: tuple[Handle, ...]
    work: list[Any]

    @classmethod
    def of(cls, work: list[Any]) -> PreparedGroup:
        """``work`` as a backend's ``prepare`` returned it (engine requests, or a
        replica front's stand-ins): objects with the fields a Handle copies."""
        return cls(tuple(Handle(r.request_id, r.num_prompt, r.slo_ttft, r.slo_tpot)
                         for r in work), work)


class EngineView(Protocol):
    """What the server reads of an engine: the model, and how to prepare a request."""

    config: EngineConfig
    loaded: LoadedModel
    tokenizer: Tokenizer
    thinking_tags: ThinkingTags | None
    max_model_len: int

    def prepare(self, prompt_ids: list[int],
                params: SamplingParams | Sequence[SamplingParams], **options: Any
                ) -> list[Any]: ...

    def load_lora(self, name: str, path: str) -> Any: ...

    def unload_lora(self, name: str) -> None: ...

    def metrics(self) -> dict[str, Any]: ...


class Submission(Protocol):
    """A place in the queue, taken before the request is prepared."""

    @property
    def open(self) -> bool: ...

    def submit(self, group: list[Any], callback: Callable[[RequestOutput], None]
               ) -> list[str]: ...

    def release(self) -> None: ...


class Backend(Protocol):
    engine: EngineView

    @property
    def alive(self) -> bool: ...

    def slot(self, tenant: str | None = None) -> Submission: ...

    def queue_full(self) -> bool: ...

    def quoted(self) -> tuple[Any, dict[tuple[int, str], int]]: ...

    def abort(self, request_id: str) -> None: ...

    def abort_all(self) -> None: ...

    def discard(self, group: Sequence[Any]) -> None: ...

    def metric_lines(self) -> list[str]: ...

    def purge_cache(self, tenant: str) -> dict[str, int]: ...

    def embed(self, inputs: list[list[int]], scores: bool = False) -> Future: ...

    def cancel_embed(self, result: Future) -> None: ...

    def drain(self, timeout: float) -> bool: ...

    def shutdown(self, timeout: float | None = None) -> None: ...


def local(config: EngineConfig, loaded: LoadedModel | None = None) -> Backend:
    """One engine, loaded now (or on ``loaded``, a model already loaded), on its own
    thread."""
    return EngineThread(LLMEngine(config, loaded)).start()
