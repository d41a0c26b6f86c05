"""``ember bench constrained``: what a grammar mask costs per token.

1. Mask time: for each grammar, a constrained greedy reply is generated, then the
   grammar is replayed over it, timing ``GrammarProcessor.process`` (bitmask from
   llguidance + applying it to the logits row) at every step: median and p99.
2. End to end: single-stream greedy decode time per output token, constrained vs
   unconstrained, alternating runs, median of the repetitions; the overhead is the
   ratio of the two. (Outputs differ in length, so per-token time is compared.)

Figures are printed and written as JSON; nothing here asserts a timing.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from ember.config import EngineConfig
from ember.engine.engine import LLMEngine
from ember.models.loader import load_model
from ember.sampling.constraints import StructuredOutput
from ember.sampling.params import SamplingParams

GRAMMARS = {
    "json_schema": StructuredOutput.json_schema({
        "type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
        "properties": {"name": {"type": "string", "maxLength": 24},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                "maxItems": 4}}}),
    "json_object": StructuredOutput.json_object(),
    "regex": StructuredOutput.regex(r"[A-Z][a-z]+( [a-z]+){3,12}\."),
}
PROMPT = "Describe a person you admire, briefly."


def _decode_time_per_token(engine: LLMEngine, ids: list[int], params: SamplingParams
                           ) -> tuple[float, list[int]]:
    req = engine.add_request(ids, params)
    while req.first_token_time is None:
        engine.step()
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    n = len(req.output_ids)
    return (time.perf_counter() - start) / max(1, n - 1), req.output_ids


def main(model: str, weights: str, max_tokens: int, reps: int, out: Path | None,
         threads: int | None) -> dict:
    loaded = load_model(model, weights)
    engine = LLMEngine(EngineConfig(model=str(loaded.path), weights=weights, threads=threads,
                                    num_kv_blocks=256), loaded=loaded)
    ids = loaded.encode_chat([{"role": "user", "content": PROMPT}])
    plain = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    _decode_time_per_token(engine, ids, plain)  # warm-up
    print(f"model {loaded.name} ({weights}), {torch.get_num_threads()} threads, greedy, "
          f"single stream")
    print(f"{'grammar':<12} {'mask p50 us':>11} {'mask p99 us':>11} {'tok/s plain':>11} "
          f"{'tok/s constr':>12} {'overhead':>9} {'tokens':>6}")
    rows = {}
    for name, spec in GRAMMARS.items():
        constrained = SamplingParams(temperature=0, max_tokens=max_tokens, structured=spec)
        t_plain, t_con, n_tokens = [], [], 0
        for _ in range(reps):  # alternate so machine noise hits both alike
            t_plain.append(_decode_time_per_token(engine, ids, plain)[0])
            t, toks = _decode_time_per_token(engine, ids, constrained)
            t_con.append(t)
            n_tokens = len(toks)
        mask_us = _mask_times(engine, ids, spec, toks)
        p50, p99 = statistics.median(mask_us), _percentile(mask_us, 99)
        a, b = statistics.median(t_plain), statistics.median(t_con)
        rows[name] = {"mask_us_p50": p50, "mask_us_p99": p99, "plain_tok_s": 1 / a,
                      "constrained_tok_s": 1 / b, "overhead": b / a - 1, "tokens": n_tokens,
                      "output": engine.tokenizer.decode(toks)}
        print(f"{name:<12} {p50:>11.0f} {p99:>11.0f} {1 / a:>11.1f} {1 / b:>12.1f} "
              f"{100 * (b / a - 1):>8.1f}% {n_tokens:>6}")
    result = {"benchmark": "constrained", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "model": loaded.name, "weights": weights, "threads": torch.get_num_threads(),
              "grammars": rows}
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        print(f"wrote {out}")
    return result


def _mask_times(engine: LLMEngine, ids: list[int], spec: StructuredOutput,
                tokens: list[int]) -> list[float]:
    logits = engine.loaded.model.score(ids + tokens)[len(ids) - 1:]
    proc = engine.intake.grammars.processor(spec)
    times = []
    for k, token in enumerate(tokens):
        start = time.perf_counter()
        proc.process(logits[k], ids + tokens[:k])
        times.append(1e6 * (time.perf_counter() - start))
        proc.commit(token)
    return times


def _percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]
