"""Where speculation's time goes at N streams: each step of one `ember bench spec` task,
speculation on and off, by kind (plain decode, or with drafts to verify; a step that gave
any request its first token ran a prompt and is left out), with the tokens it committed
per millisecond and the cost model's prediction beside its measured time.

    python scripts/spec_steps.py --task copy --concurrency 16 --reps 5
    python scripts/spec_steps.py --task code --warm copy,qa   # the gate after other tasks

On and off are fresh engines over one model, alternating back to back as `ember bench
spec` runs them. Per rep and side it prints the forward-pass total, each kind's step
count, mean rows, mean query tokens, committed tokens per ms and the mean of predicted
and measured milliseconds, then the whole run: steps, tok/s and the mean request's
latency (see docs/speculation.md).
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from ember.bench.spec import run_ember, tasks
from ember.config import EngineConfig
from ember.engine.engine import LLMEngine


class StepLog:
    """Wraps an engine's ``step`` and its cost model's ``observe``: per step, the shape,
    the measured and predicted seconds, and the tokens the step committed."""

    def __init__(self, engine: LLMEngine) -> None:
        self.runs: list[list[tuple[Any, float, float, int]]] = []
        self._requests: list[Any] = []
        self._seen: dict[str, Any] = {}
        costs, add, step = engine.scheduler.costs, engine.add_request, engine.step
        observe = costs.observe

        def add_request(*args: Any, **kwargs: Any) -> Any:
            request = add(*args, **kwargs)
            self._requests.append(request)
            return request

        def observed(shape: Any, seconds: float) -> None:
            self._seen.update(shape=shape, seconds=seconds, predicted=costs.predict(shape))
            observe(shape, seconds)

        def logged_step() -> Any:
            before = self._committed()
            waiting = [r for r in self._requests if r.num_output == 0]
            self._seen.clear()
            out = step()
            # a step that gave any request its first token ran (part of) a prompt
            prompt = any(r.num_output for r in waiting)
            if "shape" in self._seen and not prompt:
                self.runs[-1].append((self._seen["shape"], self._seen["seconds"],
                                      self._seen["predicted"], self._committed() - before))
            return out

        engine.add_request, costs.observe, engine.step = add_request, observed, logged_step

    def _committed(self) -> int:
        return sum(r.num_output for r in self._requests)

    def start_run(self) -> None:
        self.runs.append([])
        self._requests.clear()


def describe(steps: list[tuple[Any, float, float, int]]) -> str:
    """One line: the forward-pass total of the run's steps after its prompts, then its
    plain decode steps and the steps with drafts to verify."""
    kinds = {"decode": [s for s in steps if not s[0].drafts],
             "verify": [s for s in steps if s[0].drafts]}
    line = f"forward {sum(s[1] for s in steps) * 1e3:.0f} ms"
    for name, group in kinds.items():
        if not group:
            continue
        ms = sum(s[1] for s in group) * 1e3
        rows = statistics.fmean(s[0].rows for s in group)
        line += (f" | {name} {len(group)} steps, rows {rows:.1f},"
                 f" tokens {statistics.fmean(s[0].tokens for s in group):.1f},"
                 f" {sum(s[3] for s in group) / ms:.2f} committed/ms,"
                 f" measured {ms / len(group):.2f} ms, predicted "
                 f"{statistics.fmean(s[2] for s in group) * 1e3:.2f} ms")
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = [t.name for t in tasks(1)]
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--weights", default="auto", help="as `ember bench spec --weights`")
    ap.add_argument("--task", default="copy", choices=names)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warm", default="", help="comma-separated tasks each engine runs first")
    args = ap.parse_args()
    warm = [w for w in args.warm.split(",") if w]
    if unknown := set(warm) - set(names):
        ap.error(f"--warm: no task {', '.join(sorted(unknown))} (choose from {', '.join(names)})")
    base = dict(model=args.model, weights=args.weights, threads=args.threads,
                num_kv_blocks=2048)
    on = LLMEngine(EngineConfig(**base))
    off = LLMEngine(EngineConfig(**base, speculation="off"), loaded=on.loaded)
    by_name = {t.name: t for t in tasks(args.concurrency)}
    for name in warm:
        for engine in (on, off):
            run_ember(engine, by_name[name])
    logs = {"on": StepLog(on), "off": StepLog(off)}
    for rep in range(args.reps):
        order = [("on", on), ("off", off)] if rep % 2 == 0 else [("off", off), ("on", on)]
        for label, engine in order:
            logs[label].start_run()
            out = run_ember(engine, by_name[args.task])
            print(f"rep {rep} {label:3}: {out['steps']} steps, {out['tok_s']:.0f} tok/s, mean "
                  f"request {out['mean_latency_s'] * 1e3:.0f} ms, drafted "
                  f"{out.get('drafted', 0)}, accepted {out.get('accepted', 0)}; "
                  f"{describe(logs[label].runs[-1])}", flush=True)


if __name__ == "__main__":
    main()
