"""Measure what a step costs on this machine: the table the step-cost model starts from.

A synthetic batch of decoding requests (prompts already computed) is stepped with
every row verifying ``d`` extra query tokens, for a grid of batch sizes and ``d``
(and with only a quarter of the rows verifying, which prices the separate attention
call that verify rows beside decode rows take);
each sample is the wall time of the forward pass plus sampling every logits row —
what a speculative step adds over a plain one. The samples are fitted to the
:class:`~ember.engine.costs.StepCostModel` line. ``ember bench spec-cost`` writes the
full grid to a JSON file (ember ships one, ``step_costs.json``, measured on its CI
machine); ``EngineConfig(calibrate_costs=True)`` (``ember serve --spec-calibrate``)
runs a short grid at startup instead.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from ember.engine.costs import NUM_FEATURES, Coefficients, StepShape, fit_at_best_knee
from ember.engine.request import Request
from ember.engine.runner import ModelRunner, ScheduledRow
from ember.kv.manager import KVCacheManager
from ember.models.loader import LoadedModel
from ember.sampling.params import SamplingParams
from ember.sampling.sampler import SampleRow, sample_rows


class LLMEngine(Protocol):
    """What calibration drives: an engine's requests, steps, KV and runner (the
    engine calls it while it is being built, so it asks for no more than this)."""

    loaded: LoadedModel
    kv: KVCacheManager
    runner: ModelRunner

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Request: ...

    def step(self) -> list[Any]: ...

    def abort(self, request_id: str) -> None: ...

FULL_GRID = {"rows": (1, 2, 4, 8, 16, 32), "extra": (0, 1, 2, 4, 8, 16),
             "chunks": ((0, 64), (0, 256), (512, 64), (512, 256)), "contexts": (96, 640)}
QUICK_GRID = {"rows": (1, 4, 16), "extra": (0, 4, 16), "chunks": ((0, 128), (384, 128)),
              "contexts": (96, 512)}


def measure(engine: LLMEngine, rows: tuple[int, ...], extra: tuple[int, ...],
            chunks: tuple[tuple[int, int], ...] = (), contexts: tuple[int, ...] = (96,),
            reps: int = 3, seed: int = 0) -> list[dict[str, Any]]:
    """Samples ``{"tokens", "rows", "attended", "seconds"}`` (each the best of ``reps``):
    decode batches of each size verifying each number of extra tokens, at each context
    length (attention's share), and prompt chunks ``(start, length)`` alone."""
    samples = []
    for i, context in enumerate(contexts):
        samples += _measure(engine, rows, extra, chunks if i == 0 else (), context, reps,
                            seed + i)
    return samples


def _measure(engine: LLMEngine, rows: tuple[int, ...], extra: tuple[int, ...],
             chunks: tuple[tuple[int, int], ...], context: int, reps: int, seed: int
             ) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    vocab = engine.loaded.config.vocab_size
    params = SamplingParams(temperature=0.7, max_tokens=2048, ignore_eos=True,
                            speculation=False)
    reqs = [engine.add_request([rng.randrange(100, vocab) for _ in range(context)], params)
            for _ in range(max(rows))]
    long = max((s + n for s, n in chunks), default=0)
    try:
        while any(r.num_output == 0 for r in reqs):  # prefill them all
            engine.step()
        samples = [_time_step(engine, reqs[:n], d, n, reps, rng, vocab)
                   for n in rows for d in extra]
        samples += [_time_step(engine, reqs[:n], d, max(1, n // 4), reps, rng, vocab)
                    for n in rows if n > 1 for d in extra if d]
        if chunks:
            prompt = engine.add_request([rng.randrange(100, vocab) for _ in range(long + 1)],
                                        params)
            reqs.append(prompt)
            engine.kv.reserve(prompt, long)
            samples += [_time_chunk(engine, prompt, start, n, reps) for start, n in chunks]
        return samples
    finally:
        for r in reqs:
            engine.abort(r.request_id)
        engine.step()


def _time_chunk(engine: LLMEngine, req: Any, start: int, n: int, reps: int
                ) -> dict[str, Any]:
    """A prompt chunk of ``n`` tokens after ``start`` computed ones (timing only: the
    earlier positions hold whatever is there)."""
    best = float("inf")
    for _ in range(reps):
        start_time = time.perf_counter()
        engine.runner.execute([ScheduledRow(req, n, start=start)])
        best = min(best, time.perf_counter() - start_time)
    return {"tokens": n, "rows": 1, "attended": n * (start + n), "logits": 0, "drafts": 0,
            "seconds": best}


def _time_step(engine: LLMEngine, reqs: list, d: int, drafting: int, reps: int,
               rng: random.Random, vocab: int) -> dict[str, Any]:
    """A step of ``reqs`` decoding, the first ``drafting`` of them verifying ``d`` more."""
    best = float("inf")
    drafts = [d if i < drafting else 0 for i in range(len(reqs))]
    for _ in range(reps):
        rows = []
        for req, k in zip(reqs, drafts, strict=True):
            engine.kv.reserve(req, req.kv_len + 1 + k)
            rows.append(ScheduledRow(req, 1, [rng.randrange(100, vocab) for _ in range(k)]))
        samplers = [r.request.sampler for r in rows for _ in range(1 + len(r.draft))]
        start = time.perf_counter()
        logits = engine.runner.execute(rows)
        sample_rows([SampleRow(s, logits[k], None, (), 0) for k, s in enumerate(samplers)])
        best = min(best, time.perf_counter() - start)
    shape = StepShape(0, 0, 0)
    for req, k in zip(reqs, drafts, strict=True):
        shape = shape.plus(1 + k, req.kv_len + 1 + k, drafts=k)
    return {"tokens": shape.tokens, "rows": shape.rows, "attended": shape.attended,
            "split": shape.split, "logits": shape.logits, "drafts": shape.drafts,
            "seconds": best}


def sample_shape(s: dict[str, Any]) -> StepShape:
    """A measured sample as the step it timed (samples without "logits" or "drafts"
    predate them: every token of a decode or verify step had logits, and all but one
    per row were drafts)."""
    split = bool(s.get("split", False))
    return StepShape(s["tokens"], s["rows"], s["attended"], decode_rows=int(split),
                     verify_rows=int(split), logits=s.get("logits", s["tokens"]),
                     drafts=s.get("drafts", s["tokens"] - s["rows"]))


def fit(samples: list[dict[str, Any]]) -> Coefficients:
    """Coefficients of the step-time model minimising the *relative* error (a lone 12 ms
    step matters as much as a 1 s one), non-negative (by dropping a column that would
    go negative and refitting), at the compute knee of :data:`KNEES` that fits best."""
    y = np.array([s["seconds"] for s in samples])
    x = np.array([sample_shape(s).features(0.0) for s in samples])
    return fit_at_best_knee(x, y, _nonnegative_relative_lstsq)


def _nonnegative_relative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    w = 1.0 / y[:, None]
    scale = np.maximum(np.abs(x).max(axis=0), 1e-12)
    keep = list(range(NUM_FEATURES))
    while True:
        coef, *_ = np.linalg.lstsq((x * w / scale)[:, keep], (y * w[:, 0]), rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            break
        keep.pop(int(np.argmin(coef)))
    full = np.zeros(NUM_FEATURES)
    full[keep] = np.clip(coef, 0.0, None)
    return full / scale


def write_table(path: Path, samples: list[dict[str, Any]], about: dict[str, Any]) -> None:
    coef = fit(samples)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"about": about, "coefficients": coef.__dict__,
                                "samples": samples}, indent=1))


DEFAULT_TABLE = Path(__file__).with_name("step_costs.json")


def describe(engine: LLMEngine) -> dict[str, Any]:
    """What a table is valid for: the model, its weight format, the thread count."""
    return {"model": engine.loaded.name, "weights": engine.loaded.weights,
            "threads": torch.get_num_threads()}


def read_table(path: Path, engine: LLMEngine) -> Coefficients | None:
    """The coefficients of a table written by :func:`write_table` for this engine's model,
    weights and threads (None if unreadable or measured for something else)."""
    try:
        table = json.loads(path.read_text())
        if {k: table["about"].get(k) for k in ("model", "weights", "threads")} != describe(
                engine):
            return None
        return Coefficients(**table["coefficients"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def initial_costs(engine: LLMEngine, calibrate: bool) -> Coefficients | None:
    """The coefficients an engine starts from: measured now, or the shipped table."""
    if calibrate:
        return fit(measure(engine, **QUICK_GRID, reps=2))
    return read_table(DEFAULT_TABLE, engine)
