"""``ember bench spec`` and ``ember bench spec-cost``: what speculative decoding buys.

``spec``: five tasks — verbatim copy of a paragraph, grounded question answering over
a supplied document (the answer quotes it), a code edit (return a function with one
change), a free-form story, JSON-schema extraction — each at concurrency 1 and 16,
greedy, the same prompts with speculation on and off, alternating over reps. Speedup
is the median over reps of generated tokens per second on ÷ off (each rep's pair runs
back to back), printed with its range; with it, acceptance and committed tokens per
step per source. With ``--llama-server PATH`` llama.cpp's server runs the same
prompts plain and with each of its n-gram speculation types, and its best speedup
per task is reported beside ember's.

``spec-cost``: the step-cost table (``ember.engine.calibrate``) for this machine.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ember.bench.server_process import ServerProcess, free_port
from ember.bench.traffic import EXTRACTION_SCHEMA
from ember.config import EngineConfig
from ember.engine.engine import LLMEngine
from ember.sampling.constraints import StructuredOutput
from ember.sampling.params import SamplingParams

PARAGRAPHS = [
    "The river runs through the old city, past the market and the library, under seven "
    "stone bridges, and out to the harbor where the fishing boats wait for the morning "
    "tide. In winter the water rises and the lower streets flood; in summer children swim "
    "near the mill and the old men fish from the walls.",
    "Our library opens at nine on weekdays and at ten on Saturdays. Members may borrow up "
    "to six books for three weeks, renew them twice online, and reserve titles that are on "
    "loan. Late returns cost twenty cents a day, capped at five dollars per book.",
    "The mountain trail starts behind the visitor centre, climbs through pine forest to a "
    "wooden bridge, and reaches the summit after four kilometres. Hikers should carry "
    "water, wear sturdy boots, and turn back if the weather changes or the path is icy.",
    "Each spring the council repairs the harbour wall, repaints the lighthouse, and checks "
    "the buoys in the channel. The work takes six weeks, costs about two hundred thousand "
    "euros, and is paid for by the port fees of the fishing fleet and the ferries.",
]
CODE = '''def moving_average(values, window):
    """Average of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    total = 0.0
    result = []
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index >= window - 1:
            result.append(total / window)
    return result
'''
STORIES = ["a lighthouse keeper", "a lost robot", "a baker in a small town", "two rival chess "
           "players", "a cat who learns to swim", "an old map", "the last train of the night",
           "a garden on a roof"]


@dataclass
class Task:
    name: str
    messages: list[list[dict[str, str]]]  # one conversation per concurrent request
    max_tokens: int
    structured: StructuredOutput | None = None


def tasks(n: int) -> list[Task]:
    """The five tasks, with ``n`` variants of each (for ``n`` concurrent requests)."""
    def user(text: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": text}]

    pick = [PARAGRAPHS[i % len(PARAGRAPHS)] for i in range(n)]
    when = ["in winter", "on Saturdays", "at the bridge", "each spring"]
    rename = [("total", "running"), ("result", "averages"), ("index", "i"), ("value", "x")]
    return [
        Task("copy", [user(f"Copy the following text exactly, word for word:\n\n{p}")
                      for p in pick], 96),
        Task("qa", [user(f"{p}\n\nQuote the sentence of the text above that answers: what "
                         f"happens {when[i % 4]}?") for i, p in enumerate(pick)], 64),
        Task("code", [user(f"Here is a Python function:\n\n{CODE}\nReturn the whole function "
                           f"with one change: rename `{rename[i % 4][0]}` to "
                           f"`{rename[i % 4][1]}`.") for i in range(n)], 128),
        Task("story", [user(f"Write a short story about {STORIES[i % len(STORIES)]}.")
                       for i in range(n)], 96),
        Task("json", [user(f"{p}\n\nThe author is Ada Lindqvist from Bergen, writing in 1998. "
                           "Extract name, city and year.") for p in pick], 48,
             StructuredOutput.json_schema(EXTRACTION_SCHEMA)),
    ]


def run_ember(engine: LLMEngine, task: Task) -> dict[str, Any]:
    """Generated tokens per second for the task's prompts, all at once, the mean time from
    their start to each one's last token (``mean_latency_s``), plus spec stats."""
    params = SamplingParams(temperature=0, max_tokens=task.max_tokens,
                            structured=task.structured)
    prompts = [engine.loaded.encode_chat(m) for m in task.messages]
    start = time.perf_counter()
    reqs = [engine.add_request(p, params) for p in prompts]
    steps = engine.stats["steps"]
    done: dict[int, float] = {}  # request index -> seconds from the start to its last token
    while engine.has_unfinished():
        engine.step()
        now = time.perf_counter() - start
        for i, r in enumerate(reqs):
            if r.is_finished and i not in done:
                done[i] = now
    seconds = time.perf_counter() - start
    tokens = sum(r.num_output for r in reqs)
    out = {"tok_s": tokens / seconds, "tokens": tokens, "steps": engine.stats["steps"] - steps,
           # a request refused at admission finished before any step: it counts as the run
           "mean_latency_s": statistics.fmean(done.get(i, seconds) for i in range(len(reqs))),
           "texts": [engine.tokenizer.decode(r.output_ids) for r in reqs]}
    specs = [r.speculator.stats for r in reqs if r.speculator is not None]
    if specs:
        sources: dict[str, list[int]] = {}
        for s in specs:
            for name, (d, a) in s.by_source.items():
                sources.setdefault(name, [0, 0])
                sources[name][0] += d
                sources[name][1] += a
        accepted = sum(s.accepted for s in specs)
        # every forward pass a request takes part in commits one token beyond the drafts
        # it accepted there, so its passes number its tokens less its accepted drafts
        out.update(drafted=sum(s.drafted for s in specs), accepted=accepted,
                   tokens_per_step=tokens / max(1, tokens - accepted), sources=sources)
    return out


def main_spec(model: str, weights: str, threads: int | None, concurrency: list[int],
              reps: int, out: Path, llama_server: str | None, skip_ember: bool = False
              ) -> dict[str, Any]:
    base = dict(model=model, weights=weights, threads=threads, num_kv_blocks=2048)
    on = LLMEngine(EngineConfig(**base))
    off = LLMEngine(EngineConfig(**base, speculation="off"), loaded=on.loaded)
    results: dict[str, Any] = {"ember": {}, "llama.cpp": {}}
    for n in ([] if skip_ember else concurrency):
        for task in tasks(n):
            runs = {"on": [], "off": []}
            for rep in range(reps):
                order = [("on", on), ("off", off)] if rep % 2 == 0 else [("off", off), ("on", on)]
                for label, engine in order:
                    runs[label].append(run_ember(engine, task))
            results["ember"][f"{task.name}@{n}"] = row = _ember_row(runs)
            print(_ember_line(task.name, n, row), flush=True)
    if llama_server:
        results["llama.cpp"] = run_llama(llama_server, on.loaded.path, threads or 2,
                                         concurrency, reps)
    results["about"] = {"machine": platform.processor() or platform.machine(),
                        "model": on.loaded.name, "weights": on.loaded.weights}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"\nwrote {out}")
    return results


def _ember_row(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians of the on and off runs, and the speedup as the median of each rep's
    on ÷ off: a pair runs back to back, so the machine's drift between reps (on a busy
    VM, 10-30% over a minute) cancels within it; ``speedup_range`` shows what is left."""
    pairs = [a["tok_s"] / b["tok_s"] for a, b in zip(runs["on"], runs["off"], strict=True)]
    # the mean request's time to its last token, off ÷ on: in a batch that all starts
    # together the slowest stream sets tok_s, while drafts that finish some streams
    # early shorten their own requests
    latency = [b["mean_latency_s"] / a["mean_latency_s"]
               for a, b in zip(runs["on"], runs["off"], strict=True)]
    best_on = max(runs["on"], key=lambda r: r["tok_s"])
    return {"on_tok_s": statistics.median(r["tok_s"] for r in runs["on"]),
            "off_tok_s": statistics.median(r["tok_s"] for r in runs["off"]),
            "speedup": statistics.median(pairs), "speedup_range": [min(pairs), max(pairs)],
            "latency_speedup": statistics.median(latency),
            "latency_speedup_range": [min(latency), max(latency)],
            "same_output": runs["on"][0]["texts"] == runs["off"][0]["texts"],
            **{k: best_on.get(k) for k in ("drafted", "accepted", "tokens_per_step", "sources")}}


def _ember_line(name: str, n: int, row: dict[str, Any]) -> str:
    acc = (f"{row['accepted']}/{row['drafted']} accepted, {row['tokens_per_step']:.2f} tok/step"
           if row.get("drafted") is not None else "")
    return (f"ember {name:<6} c={n:<3} on {row['on_tok_s']:7.1f} tok/s  off "
            f"{row['off_tok_s']:7.1f}  speedup {row['speedup']:.2f}x "
            f"({row['speedup_range'][0]:.2f}-{row['speedup_range'][1]:.2f})  mean request "
            f"{row['latency_speedup']:.2f}x ({row['latency_speedup_range'][0]:.2f}-"
            f"{row['latency_speedup_range'][1]:.2f})  {acc}"
            f"{'' if row['same_output'] else '  (OUTPUT DIFFERS)'}")


LLAMA_SPEC = {  # llama-server's n-gram speculation types, and a short-lookup variant
    "ngram-simple": ["--spec-type", "ngram-simple"],
    "ngram-simple-3": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                       "--spec-ngram-simple-size-m", "16"],
    "ngram-map-k": ["--spec-type", "ngram-map-k"],
    "ngram-mod": ["--spec-type", "ngram-mod"],
    "ngram-cache": ["--spec-type", "ngram-cache"],
}


def run_llama(binary: str, gguf: Path, threads: int, concurrency: list[int], reps: int
              ) -> dict[str, Any]:
    """The same tasks against llama-server, plain and with each n-gram type."""
    configs = {"plain": [], **LLAMA_SPEC}
    tok_s: dict[str, dict[str, float]] = {}
    for label, extra in configs.items():
        with LlamaServer(binary, gguf, threads, max(concurrency), extra) as url:
            for n in concurrency:
                for task in tasks(n):
                    rates = [_llama_task(url, task) for _ in range(reps)]
                    tok_s.setdefault(f"{task.name}@{n}", {})[label] = statistics.median(rates)
    out = {}
    for key, by_config in tok_s.items():
        best = max(LLAMA_SPEC, key=lambda c: by_config.get(c, 0.0))
        out[key] = {"plain_tok_s": by_config["plain"], "best": best,
                    "best_tok_s": by_config[best], "speedup": by_config[best] / by_config["plain"],
                    "all": by_config}
        print(f"llama.cpp {key:<10} plain {by_config['plain']:7.1f} tok/s  best {best} "
              f"{by_config[best]:7.1f}  speedup {out[key]['speedup']:.2f}x", flush=True)
    return out


class LlamaServer(ServerProcess):
    """A llama-server process on a free port for the duration of a ``with``; a context
    of ``context`` tokens (default 2,048 per slot)."""

    def __init__(self, binary: str, gguf: Path, threads: int, slots: int, extra: list[str],
                 context: int | None = None) -> None:
        from ember.bench.llamacpp_native import binary_env

        port = free_port()
        super().__init__([binary, "-m", str(gguf), "--host", "127.0.0.1", "--port",
                          str(port), "-t", str(threads), "--parallel", str(slots),
                          "-c", str(context or 2048 * slots), *extra],
                         port, binary_env(Path(binary)))


def _llama_task(url: str, task: Task) -> float:
    import httpx

    def one(messages: list[dict[str, str]]) -> int:
        body: dict[str, Any] = {"messages": messages, "max_tokens": task.max_tokens,
                                "temperature": 0}
        if task.structured is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "x", "schema": json.loads(task.structured.source)}}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    start = time.perf_counter()
    with ThreadPoolExecutor(len(task.messages)) as pool:
        tokens = sum(pool.map(one, task.messages))
    return tokens / (time.perf_counter() - start)


def main_cost(model: str, weights: str, threads: int | None, out: Path) -> None:
    from ember.engine.calibrate import FULL_GRID, describe, fit, measure, sample_shape, write_table

    engine = LLMEngine(EngineConfig(model=model, weights=weights, threads=threads,
                                    speculation="off", num_kv_blocks=2048))
    samples = measure(engine, **FULL_GRID)
    coef = fit(samples)
    plain = {s["rows"]: s["seconds"] for s in samples if s["tokens"] == s["rows"]}
    print(f"{'rows':>5} {'extra':>6} {'split':>5} {'ms':>8} {'× plain':>8} {'model ms':>9}")
    from ember.engine.costs import StepCostModel

    model_ = StepCostModel(coef, learn=False)
    for s in samples:
        split = int(s.get("split", False))
        ratio = s["seconds"] / plain.get(s["rows"], s["seconds"])
        predicted = model_.predict(sample_shape(s))
        print(f"{s['rows']:>5} {s['tokens'] - s['rows']:>6} {'yes' if split else '':>5} "
              f"{s['seconds'] * 1000:8.2f} {ratio:8.2f} {predicted * 1000:9.2f}")
    write_table(out, samples, describe(engine))
    print(f"coefficients: {coef}\nwrote {out}")
