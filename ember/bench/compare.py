"""``ember bench compare``: ember vs llama.cpp on the same GGUF file, same thread count.

Sides, each fed the same sizes (and, where it takes them, the same token ids):

- ember: ``python -m ember.bench.compare --worker``, one process per weight format
  (so each has its own peak RSS), over a JSON-lines protocol;
- llama.cpp native (``--llama-bench PATH``): llama.cpp's own ``llama-bench`` and
  ``llama-batched-bench`` binaries, one run of each per repetition
  (``ember/bench/llamacpp_native.py`` has the command lines and what they time).
  When present this is the anchor: every ratio printed is a side ÷ this one;
- llama.cpp through its Python binding (``--llama-python``; without
  ``--llama-bench``, also the interpreter running this): ``llamacpp_driver.py``,
  which need not have ember (ember's environment need not have llama_cpp). The
  anchor when the binaries are not given.

Each repetition runs every side once, in an order rotated from one repetition to the
next, after one untimed warm-up run per side. Medians over the repetitions are reported.

Kernel figures (``time.perf_counter`` inside the worker; greedy decoding; ember's
engine built with ``speculation="off"``, so a prompt whose greedy continuation falls
into a loop cannot be sped up by drafting the loop; with it on, that once made ember
look 3.4x as fast as llama.cpp):

1. prefill: the prompt (P tokens) in one chunk/batch, up to and including sampling
   the first token. ember: one request, ``max_tokens=1``, ``max_num_batched_tokens``
   >= P, prefix cache off, timed from ``add_request`` until the engine is idle (=
   time to first token). Binding: one ``llama_decode`` of the P tokens (logits for
   the last) on an emptied KV cache + greedy sampling. Native: llama-bench ``pp<P>``.
   Figure: P / seconds.
2. single-stream decode: after the first token, the remaining ``n - 1`` tokens.
   ember: time from the request's first token until it finishes; binding: ``n - 1``
   iterations of a one-token ``llama_decode`` + greedy sampling; native: llama-bench
   ``tg<n-1>``.
3. aggregate decode at S streams, decode phase only: S requests (distinct prompts)
   are prefilled untimed; the clock starts once *every* stream has its first token
   and stops when all have ``gen`` tokens; figure = tokens generated in that window
   / its length (S * (gen - 1)). Binding: one sequence id per stream, each step one
   ``llama_decode`` of S tokens; native: llama-batched-bench's S_TG with
   ``-ntg gen-1``.
4. weight bytes per decode step, and bytes/s achieved by single-stream decode
   (= bytes per step x tok/s) against a read-bandwidth ceiling measured in this run
   (``measure_bandwidth``: ``torch.sum`` over a 1 GiB float32 tensor with the same
   thread count, 5 passes before the runs and 3 just before and just after each
   side's run; the ceiling is the median of all passes, printed with their min and
   max, and checked against ``torch.amax`` over the same tensor). Beside it, "% of
   read BW around" prices each repetition's decode against the passes around that
   run alone (``fraction_nearby``): a VM's bandwidth drifts between minutes. ember's
   bytes per step are the sizes of the tensors its Linear objects and norm vectors
   hold (the packed codes and scales for q4, 4 B/weight for f32; the embedding table
   is excluded, a step reads one row of it). llama.cpp's (both sides) are the GGUF
   tensor sizes of every tensor a step reads (all but ``token_embd`` unless it
   doubles as the output head). Whether those bytes come from DRAM is measured, not
   read from sysfs (``measure_cache_reach``: the same reduction over 4 MiB, 8 MiB, ...
   tensors; a size is cached while it reads at least ``CACHED_FACTOR`` x the
   ceiling): a VM can report a cache it does not give.
5. peak RSS of each process: the workers' own ``VmHWM`` at exit; the native
   binaries' ``VmHWM`` polled from /proc while they run (``getrusage``'s
   ``ru_maxrss`` would include this launcher's peak on Linux, as it survives fork +
   exec). With native binaries, ember's KV pool holds as many token slots as the
   largest context llama.cpp allocates (llama-batched-bench's); both are reported.

Speculation, in rows of its own (``SPEC_TASKS``): "decode 1 stream, spec on" is the
grounded-QA and code-edit tasks of ``ember bench spec`` (``tasks(1)``, chat template
applied, greedy, their max_tokens), decode phase only, in a separate ember worker
whose engines are built for those tasks alone — one with speculation on, one off, so
the speedup itself shows. Their ratios are against the anchor's plain single-stream
decode. Skipped for a model without a chat template or one written by ``ember bench
synth`` (random weights write noise: nothing to draft from, or a loop that would be).

Figures are printed as a table and written as JSON; nothing here asserts a timing.
"""

from __future__ import annotations

import json
import math
import os
import platform
import selectors
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ember.bench import llamacpp_native as native
from ember.bench.bandwidth import (
    BANDWIDTH_BYTES,
    BRACKET,
    CACHED_FACTOR,
    CHECK_TOLERANCE,
    bandwidth_ceiling,
    cache_note,
    cache_reach_bytes,
    last_level_cache_bytes,
    measure_bandwidth,
    measure_cache_reach,
)
from ember.bench.llamacpp_driver import cpu_seconds  # stdlib-only helpers
from ember.bench.llamacpp_driver import serve as serve_protocol
from ember.bench.throughput import PARAGRAPH
from ember.errors import EmberError
from ember.kv.blocks import blocks_for
from ember.models.footprint import step_weight_bytes as ember_weight_bytes

DRIVER = Path(__file__).with_name("llamacpp_driver.py")
NATIVE = "llama.cpp"  # side names: llama.cpp's binaries, and its Python binding
BINDING = "llama.cpp-py"
SPEC_TASKS = ("qa", "code")  # of ember.bench.spec.tasks: answers that quote their prompt
SYNTH_NAME_MARK = "(random weights)"  # ends general.name in ember.bench.synth's files
HOW_TO_GET_LLAMA = (
    "to compare against llama.cpp, install it with `pip install 'ember[llamacpp]'` "
    "(llama-cpp-python; it builds llama.cpp from source, ~10 min on 2 cores), or pass "
    "--llama-python /path/to/python of an environment where `import llama_cpp` works; "
    "or pass --llama-bench with the directory of llama.cpp's llama-bench binary"
)


# ---------------------------------------------------------------- weight bytes
def step_tensor_names(gguf: Any) -> list[str]:
    """GGUF tensors a decode step reads in full: all but the embedding table, which
    is read in full only when it doubles as the output head (tied embeddings)."""
    tied = "output.weight" not in gguf.tensors
    return [n for n in gguf.tensors if n != "token_embd.weight" or tied]


def gguf_step_bytes(gguf: Any) -> int:
    """Weight bytes per one-token decode step for an engine that reads the GGUF tensors
    as stored: of a stack of routed experts ([E, out, in]), the k a token routes to."""
    used = gguf.get(f"{gguf.architecture}.expert_used_count", 0)
    total = 0
    for n in step_tensor_names(gguf):
        info = gguf.tensor(n)
        routed = used and n.endswith("_exps.weight") and len(info.shape) == 3
        total += info.nbytes * used // info.shape[0] if routed else info.nbytes
    return total


# ---------------------------------------------------------------- ember side
def _greedy(max_tokens: int) -> Any:
    from ember.sampling.params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def ember_prefill(engine: Any, prompt: list[int]) -> float:
    """Seconds from add_request to the first (only) token of one request."""
    params = _greedy(1)
    start = time.perf_counter()
    engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def ember_decode(engine: Any, prompt: list[int], n: int) -> tuple[float, list[int]]:
    """Seconds from the first token to the last of one ``n``-token request, and its ids."""
    req = engine.add_request(prompt, _greedy(n))
    while req.first_token_time is None:
        engine.step()
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start, req.output_ids


def ember_batched(engine: Any, prompts: list[list[int]], gen: int) -> tuple[float, int]:
    """Decode phase of len(prompts) concurrent requests: (seconds, tokens) counted from
    the moment every request has its first token until all have ``gen``."""
    reqs = [engine.add_request(p, _greedy(gen)) for p in prompts]
    while any(r.first_token_time is None for r in reqs):
        engine.step()
    before = sum(r.num_output for r in reqs)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start, sum(r.num_output for r in reqs) - before


def ember_run(engine: Any, spec: dict) -> dict:
    """One repetition of ``spec`` (the driver's ``run`` message) on an ember engine."""
    out: dict = {"prefill": [], "batched": []}
    wall0, cpu0 = time.perf_counter(), cpu_seconds()
    for prompt in spec.get("prefill", []):
        out["prefill"].append({"tokens": len(prompt), "seconds": ember_prefill(engine, prompt)})
    if spec.get("decode"):
        d = spec["decode"]
        secs, ids = ember_decode(engine, d["prompt"], int(d["n"]))
        out["decode"] = {"tokens": len(ids) - 1, "seconds": secs, "ids": ids}
    for b in spec.get("batched", []):
        secs, toks = ember_batched(engine, b["prompts"], int(b["gen"]))
        out["batched"].append({"streams": len(b["prompts"]), "tokens": toks, "seconds": secs})
    out["wall_s"] = time.perf_counter() - wall0
    out["cpu_s"] = cpu_seconds() - cpu0
    return out


def engine_options(spec: dict, kv_tokens: int = 0) -> dict:
    """EngineConfig options that let ``spec`` run as described: one prefill chunk, every
    stream admitted at once, enough KV blocks (at least ``kv_tokens`` slots: llama.cpp's
    context, where one is matched), prefix cache off, speculation off. No step-time
    cap on prompt chunks: the serving default (0.5 s) split a 3B model's 2,048 prompt
    tokens of 16 streams over 20 steps, so streams started decoding up to 19 steps
    apart and the timed window ended with a shrinking batch — a figure a third below
    the 16-stream rate it claims to be."""
    block = 16
    prefill = [len(p) for p in spec.get("prefill", [])]
    d = spec.get("decode") or {}
    batched = spec.get("batched", [])
    need_tokens = max([*prefill, len(d.get("prompt", [])), 1,
                       *(sum(len(p) for p in b["prompts"]) for b in batched)])
    need_blocks = max([blocks_for(n + 2, block) for n in prefill]
                      + [blocks_for(len(d.get("prompt", [])) + int(d.get("n", 0)) + 1, block)]
                      + [sum(blocks_for(len(p) + int(b["gen"]) + 1, block) for p in b["prompts"])
                         for b in batched])
    return {"max_num_seqs": max([1, *(len(b["prompts"]) for b in batched)]),
            "max_num_batched_tokens": need_tokens,
            "num_kv_blocks": max(need_blocks + 8, blocks_for(kv_tokens, block)),
            "block_size": block, "enable_prefix_caching": False, "speculation": "off",
            "max_prefill_step_seconds": math.inf}


class _EmberBackend:
    """ember's side of the worker protocol (see ``llamacpp_driver.serve``)."""

    def __init__(self, msg: dict) -> None:
        from ember.config import EngineConfig
        from ember.engine.engine import LLMEngine
        from ember.models.loader import load_model

        self.weights = msg["weights"]
        self.loaded = load_model(msg["model"], self.weights)
        self.engine = LLMEngine(EngineConfig(model=str(self.loaded.path), weights=self.weights,
                                             threads=msg["threads"], **msg["engine"]),
                                loaded=self.loaded)

    def info(self) -> dict:
        import torch

        from ember import kernels

        config = self.engine.config
        return {"weights": self.weights, "load_s": self.loaded.load_seconds,
                "weight_bytes": ember_weight_bytes(self.loaded.model),
                "threads": torch.get_num_threads(), "torch": torch.__version__,
                "speculation": config.speculation, "kv_dtype": config.kv_dtype,
                "kv_pool_tokens": self.engine.kv.num_blocks * config.block_size,
                "kernels": kernels.describe()}

    def run(self, msg: dict) -> dict:
        return ember_run(self.engine, msg)

    def close(self) -> None:
        pass


# ---------------------------------------------------------------- spec rows
def spec_refusal(gguf: Any) -> str | None:
    """Why the speculation rows would mislead for this model file, or None.

    A synth model (``ember bench synth``: random weights) writes noise: drafts copied
    from the prompt are rejected, and if greedy decoding falls into a loop, drafts
    of the loop are accepted — either way the figure says nothing about real text.
    A model without a chat template cannot be given the tasks as ``ember bench spec``
    gives them.
    """
    from ember.models.architectures import ARCHITECTURES

    name = str(gguf.metadata.get("general.name", ""))
    if name.startswith("synth ") and name.endswith(SYNTH_NAME_MARK):
        return (f"{name!r} is an `ember bench synth` model: random weights write noise, so "
                "speculation on it measures nothing real")
    family = ARCHITECTURES.get(str(gguf.metadata.get("general.architecture")))
    if "tokenizer.chat_template" not in gguf.metadata and (
            family is None or family.chat_template is None):
        return "the model has no chat template (the spec tasks are chat prompts)"
    return None


def loops(ids: list[int], min_len: int = 16) -> bool:
    """Whether the second half of a greedy output is one short cycle repeated (a period
    of at most a quarter of that half): the output speculation accelerates trivially."""
    tail = ids[len(ids) // 2:]
    if len(tail) < min_len:
        return False
    return any(all(tail[i] == tail[i - p] for i in range(p, len(tail)))
               for p in range(1, len(tail) // 4 + 1))


def spec_decode(engine: Any, prompt: list[int], max_tokens: int) -> dict:
    """One greedy request, decode phase only: seconds from its first token to its last,
    the tokens after the first, its ids, and what speculation drafted and accepted."""
    from ember.sampling.params import SamplingParams

    req = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
    while req.first_token_time is None and engine.has_unfinished():
        engine.step()
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    stats = req.speculator.stats if req.speculator is not None else None
    return {"tokens": req.num_output - 1, "seconds": time.perf_counter() - start,
            "ids": req.output_ids, "drafted": stats.drafted if stats else 0,
            "accepted": stats.accepted if stats else 0}


class _EmberSpecBackend:
    """The speculation rows: ``SPEC_TASKS`` of ``ember bench spec`` at one stream, on
    two engines over one loaded model — speculation on (the engine default, gated) and
    off — and nothing else (the kernel figures come from an engine that cannot
    speculate). Order alternates with the repetition; ``max_tokens`` caps a warm-up."""

    def __init__(self, msg: dict) -> None:
        from ember.bench.spec import tasks
        from ember.config import EngineConfig
        from ember.engine.engine import LLMEngine
        from ember.models.loader import load_model

        self.weights = msg["weights"]
        self.loaded = load_model(msg["model"], self.weights)
        self.tasks = {t.name: t for t in tasks(1) if t.name in msg["tasks"]}
        self.prompts = {n: self.loaded.encode_chat(t.messages[0]) for n, t in self.tasks.items()}
        need = max(len(p) + t.max_tokens for p, t in zip(self.prompts.values(),
                                                           self.tasks.values(), strict=True))
        base = dict(model=str(self.loaded.path), weights=self.weights, threads=msg["threads"],
                    max_num_seqs=1, max_num_batched_tokens=max(512, need),
                    num_kv_blocks=blocks_for(need, 16) + 8, block_size=16,
                    enable_prefix_caching=False, kv_dtype=msg.get("kv_dtype", "f16"))
        self.engines = {"on": LLMEngine(EngineConfig(**base), loaded=self.loaded),
                        "off": LLMEngine(EngineConfig(**base, speculation="off"),
                                         loaded=self.loaded)}

    def info(self) -> dict:
        return {"weights": self.weights, "role": "spec",
                "speculation": {k: e.config.speculation for k, e in self.engines.items()},
                "tasks": {n: {"prompt_tokens": len(self.prompts[n]), "max_tokens": t.max_tokens}
                          for n, t in self.tasks.items()}}

    def run(self, msg: dict) -> dict:
        order = ["on", "off"] if int(msg.get("rep", 0)) % 2 == 0 else ["off", "on"]
        wall0, cpu0 = time.perf_counter(), cpu_seconds()
        out: dict = {"spec": []}
        for name, task in self.tasks.items():
            row: dict = {"task": name, "prompt_tokens": len(self.prompts[name])}
            for label in order:
                row[label] = spec_decode(self.engines[label], self.prompts[name],
                                         min(task.max_tokens, msg.get("max_tokens") or
                                             task.max_tokens))
            out["spec"].append(row)
        out["wall_s"] = time.perf_counter() - wall0
        out["cpu_s"] = cpu_seconds() - cpu0
        return out

    def close(self) -> None:
        pass


def _backend(msg: dict) -> Any:
    return _EmberSpecBackend(msg) if msg.get("role") == "spec" else _EmberBackend(msg)


def worker_main() -> int:
    """The ember worker: the driver's JSON-lines protocol, served by an LLMEngine
    (``"role": "spec"`` in ``init``: the speculation rows' two engines)."""
    return serve_protocol(_backend)


# ---------------------------------------------------------------- worker processes
class WorkerError(RuntimeError):
    pass


class Worker:
    """A JSON-lines worker process (ember's or the llama.cpp driver); stderr to a file."""

    def __init__(self, name: str, argv: list[str]) -> None:
        self.name = name
        self.stderr = tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, text=True, bufsize=1)

    def stderr_tail(self, lines: int = 5) -> str:
        self.stderr.flush()
        self.stderr.seek(0)
        tail = [ln for ln in self.stderr.read().splitlines() if ln.strip()][-lines:]
        return " | ".join(tail)

    def call(self, msg: dict, timeout: float = 900) -> dict:
        assert self.proc.stdin and self.proc.stdout
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise WorkerError(f"{self.name} worker is gone ({e}); stderr: "
                              f"{self.stderr_tail()}") from None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                self.kill()
                raise WorkerError(f"{self.name} worker gave no answer in {timeout:.0f} s")
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=10)
            raise WorkerError(f"{self.name} worker exited (status {self.proc.returncode}); "
                              f"stderr: {self.stderr_tail()}")
        try:
            reply = json.loads(line)
        except json.JSONDecodeError:
            raise WorkerError(f"{self.name} worker answered {line[:200]!r}, not JSON") from None
        if not reply.get("ok"):
            raise WorkerError(f"{self.name}: {reply.get('error', 'failed')}")
        return reply

    def run(self, msg: dict) -> dict:
        """One repetition (the ``run`` message without its ``cmd``); the reply sans ``ok``."""
        reply = self.call({"cmd": "run", **msg})
        reply.pop("ok", None)
        return reply

    def close(self) -> dict:
        try:
            reply = self.call({"cmd": "exit"}, timeout=60)
            self.proc.wait(timeout=30)
            return reply
        except (WorkerError, subprocess.TimeoutExpired):
            self.kill()
            return {}
        finally:
            self.stderr.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def probe_llama(python: str | None) -> dict:
    """Whether ``python`` (default: this interpreter) can run the llama.cpp driver.

    Returns ``{"available": True, "python": ..., "llama_cpp_version": ...}`` or
    ``{"available": False, "python": ..., "reason": ...}``; never raises.
    """
    python = python or sys.executable
    try:
        proc = subprocess.run([python, str(DRIVER), "--probe"], capture_output=True, text=True,
                              timeout=120, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return {"available": False, "python": python, "reason": f"no interpreter at {python}"}
    except (PermissionError, OSError) as e:
        return {"available": False, "python": python, "reason": f"cannot run {python}: {e}"}
    except subprocess.TimeoutExpired:
        return {"available": False, "python": python,
                "reason": f"{python} did not answer the probe within 120 s"}
    lines = proc.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        answer = None
    if proc.returncode != 0 or not isinstance(answer, dict) or "available" not in answer:
        err = " | ".join(proc.stderr.strip().splitlines()[-3:])
        return {"available": False, "python": python,
                "reason": f"{python} could not run the llama.cpp driver (exit status "
                          f"{proc.returncode}{'; ' + err if err else ''})"}
    if not answer["available"]:
        return {"available": False, "python": python,
                "reason": f"{python}: {answer.get('error', 'llama_cpp unavailable')}"}
    return {"available": True, "python": python,
            "llama_cpp_version": answer.get("llama_cpp_version")}


def build_spec(tokens: list[int], prefill: list[int], decode_prompt: int, decode_tokens: int,
               streams: list[int], stream_prompt: int, stream_gen: int) -> dict:
    """The token ids both engines are fed (the ``run`` message)."""
    need = max([*prefill, decode_prompt, stream_prompt, 1])
    base = (tokens * (need // max(1, len(tokens)) + 1))[:need]
    spec: dict = {"prefill": [base[:n] for n in prefill], "batched": []}
    if decode_tokens > 0:
        spec["decode"] = {"prompt": base[:decode_prompt], "n": decode_tokens}
    for s in streams:
        # distinct first tokens, so no two streams are the same sequence
        spec["batched"].append({"prompts": [[100 + i] + base[: stream_prompt - 1]
                                            for i in range(s)], "gen": stream_gen})
    return spec


def warmup_spec(spec: dict) -> dict:
    """Every shape once, short: first-call allocations and kernel choices happen here."""
    out = {"prefill": spec["prefill"],
           "batched": [{"prompts": b["prompts"], "gen": min(3, b["gen"])}
                       for b in spec["batched"]]}
    if spec.get("decode"):
        out["decode"] = {"prompt": spec["decode"]["prompt"], "n": min(8, spec["decode"]["n"])}
    return out


def fraction_nearby(runs: list[dict], step_bytes: int) -> float | None:
    """Median over repetitions of single-stream decode's read rate (bytes per step x
    tok/s) over the ceiling measured just before and just after that run. A VM's read
    bandwidth moves by a third from minute to minute (23.6-32.1 GB/s in one run on the
    Xeon): a pass minutes away can be from a faster phase than the decode it prices."""
    fractions = [step_bytes * r["decode"]["tokens"] / r["decode"]["seconds"] / 1e9
                 / r["read_gb_s_around"] for r in runs
                 if "decode" in r and r.get("read_gb_s_around")]
    return statistics.median(fractions) if fractions else None


def summarize(runs: list[dict]) -> dict:
    """Per-repetition figures (tok/s) and their medians from a side's run replies."""
    per: dict[str, list[float]] = {}
    for r in runs:
        for p in r["prefill"]:
            per.setdefault(f"prefill_{p['tokens']}", []).append(p["tokens"] / p["seconds"])
        if "decode" in r:
            d = r["decode"]
            per.setdefault("decode_1", []).append(d["tokens"] / d["seconds"])
        for b in r["batched"]:
            per.setdefault(f"decode_{b['streams']}", []).append(b["tokens"] / b["seconds"])
    return {"per_rep_tok_s": per, "median_tok_s": {k: statistics.median(v) for k, v in per.items()}}


def summarize_spec(runs: list[dict]) -> dict:
    """The speculation rows from the spec worker's run replies: per task, tok/s of the
    decode phase with speculation on and off (per repetition and median), the speedup
    (median on / median off), whether both wrote the same tokens (they must: greedy
    speculation is lossless), and whether the output loops (``loops``)."""
    per: dict[str, list[float]] = {}
    tasks: dict[str, dict] = {}
    for r in runs:
        for row in r["spec"]:
            name = row["task"]
            for label in ("on", "off"):
                x = row[label]
                if x["tokens"] > 0 and x["seconds"] > 0:
                    per.setdefault(f"spec_{label}_{name}", []).append(x["tokens"] / x["seconds"])
            t = tasks.setdefault(name, {"prompt_tokens": row["prompt_tokens"],
                                        "tokens": row["on"]["tokens"], "same_output": True,
                                        "looping": False, "drafted": 0, "accepted": 0})
            t["same_output"] &= row["on"]["ids"] == row["off"]["ids"]
            t["looping"] |= loops(row["on"]["ids"])
            t["drafted"] += row["on"]["drafted"]
            t["accepted"] += row["on"]["accepted"]
    medians = {k: statistics.median(v) for k, v in per.items()}
    for name, t in tasks.items():
        on, off = medians.get(f"spec_on_{name}"), medians.get(f"spec_off_{name}")
        t["speedup"] = on / off if on and off else None
    return {"per_rep_tok_s": per, "median_tok_s": medians, "tasks": tasks}


def anchor_of(sides: list[str]) -> str | None:
    """The side every ratio is against: llama.cpp's binaries, else its binding."""
    return next((s for s in (NATIVE, BINDING) if s in sides), None)


def ratios_against(medians: dict[str, dict[str, float]], anchor: str | None
                   ) -> dict[str, dict[str, float]]:
    """Each side's median tok/s ÷ the anchor's for the same figure; a speculation row
    (``spec_*``) ÷ the anchor's plain single-stream decode (``decode_1``)."""
    if anchor is None or anchor not in medians:
        return {}
    ref = medians[anchor]
    out: dict[str, dict[str, float]] = {}
    for side, figures in medians.items():
        if side == anchor:
            continue
        out[side] = {}
        for key, value in figures.items():
            base = ref.get("decode_1" if key.startswith("spec_") else key)
            if base:
                out[side][key] = value / base
    return out


def agreement(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two greedy continuations."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _machine() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(),
            "cpu_count": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as f:
            info["mem_total"] = f.readline().split(":", 1)[1].strip()
    except OSError:
        pass
    info["llc_bytes"] = last_level_cache_bytes()
    return info


def _load() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


# ---------------------------------------------------------------- main
def main(model: str, weights: list[str], threads: int | None, reps: int, out: Path | None,
         llama_python: str | None, prefill: list[int], decode_tokens: int, streams: list[int],
         stream_prompt: int, stream_gen: int, decode_prompt: int = 32,
         command: str | None = None, bandwidth_bytes: int = BANDWIDTH_BYTES,
         llama_flash_attn: str = "auto", kv_dtype: str = "f16",
         llama_extra_bufts: bool = True, llama_bench: str | None = None,
         spec_rows: bool = True) -> dict:
    """Run the comparison (module docstring), print the table, write ``out`` as JSON.

    ``llama_bench``: llama.cpp's binaries (the anchor). ``llama_python``: an interpreter
    with the binding; when ``llama_bench`` is given the binding runs only if this is
    too, else it defaults to this interpreter. ``spec_rows``: measure the speculation
    rows (where the model allows: ``spec_refusal``)."""
    from ember.models.gguf import GGUFFile
    from ember.models.loader import physical_cores
    from ember.models.registry import ensure_model
    from ember.tokenizer import Tokenizer

    started = time.perf_counter()
    load_start = _load()
    threads = threads or physical_cores()
    path = ensure_model(model)
    gguf = GGUFFile(path)
    tokens = Tokenizer.from_gguf(gguf).encode(PARAGRAPH * 4)
    llama_bytes = gguf_step_bytes(gguf)
    spec = build_spec(tokens, prefill, decode_prompt, decode_tokens, streams, stream_prompt,
                      stream_gen)
    bandwidth = [measure_bandwidth(threads, bandwidth_bytes)]
    reach = measure_cache_reach(threads, bandwidth_bytes)

    sides: dict[str, Any] = {}  # name -> Worker | NativeSide, in rotation order
    info: dict[str, dict] = {}
    llama_native: dict = {"available": False, "reason": "not asked for (--llama-bench)"}
    contexts: dict[str, int] = {}
    binaries: native.NativeSide | None = None
    if llama_bench:
        try:
            binaries = native.NativeSide(native.locate(llama_bench), str(path), threads,
                                         llama_flash_attn, llama_extra_bufts)
        except native.NativeError as e:
            llama_native = {"available": False, "reason": str(e)}
            print(f"llama.cpp binaries unavailable: {e}; leaving them out.")
        else:
            contexts = native.Sizes.of(spec).contexts()
            llama_native = {"available": True, **binaries.info(), "contexts": contexts,
                            "commands": {k: shlex.join(v)
                                         for k, v in binaries.argvs(spec).items()}}
            if streams and binaries.bins.batched is None:
                print(f"note: no {native.BATCHED} beside {binaries.bins.bench}: no native "
                      "multi-stream figures")
    if llama_python is not None or not llama_bench:
        llama = probe_llama(llama_python)
        if not llama["available"]:
            print(f"llama.cpp's Python binding unavailable: {llama['reason']}\n  "
                  f"{HOW_TO_GET_LLAMA}; leaving it out.")
    else:
        llama = {"available": False, "reason": "not asked for (--llama-python)"}
    refusal = spec_refusal(gguf) if spec_rows else "not asked for (--no-spec)"
    kv_tokens = max(contexts.values(), default=0)
    spec_of: dict[str, str] = {}  # spec worker -> the ember side its rows belong to

    def start_ember(name: str, weights: str, msg: dict) -> None:
        sides[name] = Worker(name, [sys.executable, "-m", "ember.bench.compare", "--worker"])
        try:
            info[name] = sides[name].call({"cmd": "init", "model": str(path),
                                           "weights": weights, "threads": threads, **msg})
        except WorkerError as e:
            raise EmberError(str(e)) from None

    try:
        for w in weights:
            start_ember(f"ember-{w}", w, {"engine": {**engine_options(spec, kv_tokens),
                                                     "kv_dtype": kv_dtype}})
            if refusal is None:
                spec_of[f"ember-{w} spec"] = f"ember-{w}"
                start_ember(f"ember-{w} spec", w, {"role": "spec", "kv_dtype": kv_dtype,
                                                   "tasks": list(SPEC_TASKS)})
        if binaries is not None:
            sides[NATIVE] = binaries
            info[NATIVE] = binaries.info()
        if llama["available"]:
            sides[BINDING] = Worker(BINDING, [llama["python"], str(DRIVER)])
            try:
                info[BINDING] = sides[BINDING].call(
                    {"cmd": "init", "model": str(path), "threads": threads,
                     "prefill_ctx": max([*prefill, decode_prompt + decode_tokens, 1]) + 16,
                     "streams": streams, "stream_ctx": stream_prompt + stream_gen + 16,
                     "flash_attn": llama_flash_attn, "extra_bufts": llama_extra_bufts})
            except WorkerError as e:
                llama = {**llama, "available": False, "reason": str(e)}
                print(f"llama.cpp's Python binding failed to start: {e}; leaving it out.")
                sides.pop(BINDING).close()

        runs = _measure(sides, info, spec_of, spec, reps, threads, bandwidth_bytes, bandwidth,
                        started, f"model {path.name}, {threads} threads, {reps} reps, ember KV "
                        f"{kv_dtype}; load average {' '.join(map(str, load_start))}")
        for s, x in sides.items():
            info.setdefault(s, {}).update(x.close())
    finally:
        for x in sides.values():
            x.kill()
    if NATIVE not in sides and llama_native["available"]:
        llama_native = {**llama_native, "available": False, "reason": info[NATIVE]["failed"]}
    if BINDING not in sides and llama["available"]:
        llama = {**llama, "available": False, "reason": info[BINDING]["failed"]}
    ceiling = bandwidth_ceiling(bandwidth)
    reach["cached_bytes"] = cache_reach_bytes(reach, ceiling["gb_s"])

    columns = [s for s in sides if s not in spec_of]
    results = _results(columns, sides, runs, info, spec_of, llama_bytes, ceiling, refusal)
    anchor = anchor_of(columns)
    ratios = ratios_against({s: results[s]["median_tok_s"] for s in columns}, anchor)
    if BINDING in results and runs[BINDING] and "decode" in runs[BINDING][0]:
        for s in columns:
            if s.startswith("ember-") and "decode" in runs[s][0]:
                results[s]["greedy_agreement_tokens"] = agreement(
                    runs[s][0]["decode"]["ids"], runs[BINDING][0]["decode"]["ids"])
    kv_context = {"ember_pool_tokens": {s: info[s].get("kv_pool_tokens") for s in columns
                                        if s.startswith("ember-")},
                  "ember_kv_dtype": kv_dtype}
    if NATIVE in results:
        kv_context["llama.cpp"] = {"predicted": contexts, "type_k": _native_meta(
            runs[NATIVE], native.BENCH, "type_k"), "llama-batched-bench n_kv_max": sorted(
            {r["n_kv_max"] for r in runs[NATIVE] if "n_kv_max" in r})}
    if BINDING in results:
        kv_context["llama.cpp-py"] = info[BINDING].get("contexts")
    load_end = _load()
    _print_table(results, ratios, columns, anchor, ceiling, reach, refusal)
    _print_context(kv_context, results)
    print(f"load average: start {' '.join(map(str, load_start))}, "
          f"end {' '.join(map(str, load_end))}; {time.perf_counter() - started:.0f} s total")
    result = {
        "benchmark": "compare",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": command or " ".join(shlex.quote(a) for a in sys.argv),
        "machine": _machine(),
        "model": str(path), "threads": threads, "reps": reps,
        "sizes": {"prefill": prefill, "decode_prompt": decode_prompt,
                  "decode_tokens": decode_tokens, "streams": streams,
                  "stream_prompt": stream_prompt, "stream_gen": stream_gen},
        "ember_kv_dtype": kv_dtype, "kv_context": kv_context,
        "method": _method(ceiling),
        "load_avg": {"start": load_start, "end": load_end},
        "bandwidth": bandwidth, "bandwidth_ceiling": ceiling,
        "bandwidth_ceiling_gb_s": ceiling["gb_s"], "cache_reach": reach,
        "llama": llama, "llama_native": llama_native, "anchor": anchor,
        "results": results, "ratios_vs_llama": ratios,
    }
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        print(f"wrote {out}")
    return result


def _measure(sides: dict, info: dict, spec_of: dict[str, str], spec: dict, reps: int,
             threads: int, bandwidth_bytes: int, bandwidth: list[dict], started: float,
             header: str) -> dict[str, list[dict]]:
    """Every side's runs: one untimed warm-up each, then ``reps`` rounds in a rotating
    order, each kernel side's run between two short bandwidth measurements (appended to
    ``bandwidth``)."""

    def message(name: str, rep: int, warm: bool = False) -> dict:
        if name in spec_of:
            return {"rep": rep, "max_tokens": 8 if warm else None}
        return warmup_spec(spec) if warm else spec

    runs: dict[str, list[dict]] = {s: [] for s in sides}
    print(f"{header}; sides: "
          f"{', '.join(s for s in sides if s not in spec_of)}"
          + (f"; speculation rows: {', '.join(spec_of)}" if spec_of else "")
          + "".join(f"; {s} kernels {info[s]['kernels']}" for s in sides
                    if s not in spec_of and "kernels" in info.get(s, {}))
          + (f"; {NATIVE} is {info[NATIVE]['version']}" if "version" in info.get(NATIVE, {})
             else ""), flush=True)
    for s in list(sides):  # warm-up, untimed
        _run_side(sides, runs, info, s, message(s, 0, warm=True), None)
    for rep in range(reps):
        order = list(sides)
        order = order[rep % len(order):] + order[: rep % len(order)]
        for s in order:
            if s not in sides:
                continue
            bracket = s not in spec_of  # a kernel side's run sits between two ceilings
            if bracket:
                bandwidth.append(measure_bandwidth(threads, bandwidth_bytes, BRACKET))
            _run_side(sides, runs, info, s, message(s, rep), rep)
            if bracket:
                bandwidth.append(measure_bandwidth(threads, bandwidth_bytes, BRACKET))
                if runs.get(s) and runs[s][-1]["rep"] == rep:  # see fraction_nearby
                    runs[s][-1]["read_gb_s_around"] = statistics.fmean(
                        b["median_gb_s"] for b in bandwidth[-2:])
        print(f"  rep {rep + 1}/{reps} done ({time.perf_counter() - started:.0f} s, "
              f"load {' '.join(map(str, _load()))}, read BW "
              f"{bandwidth[-1]['median_gb_s']:.1f} GB/s)", flush=True)
    return runs


def _results(columns: list[str], sides: dict, runs: dict[str, list[dict]], info: dict,
             spec_of: dict[str, str], llama_bytes: int, ceiling: dict,
             refusal: str | None) -> dict[str, dict]:
    """Each column's medians, weight read rate against the ceiling and memory, with an
    ember side's speculation rows folded in."""
    results: dict[str, dict] = {}
    for s in columns:
        summary = summarize(runs[s])
        step_bytes = llama_bytes if s in (NATIVE, BINDING) else info[s]["weight_bytes"]
        dec = summary["median_tok_s"].get("decode_1")
        achieved = step_bytes * dec / 1e9 if dec else None
        results[s] = {
            **summary, "runs": runs[s], "init": info[s],
            "weight_bytes_per_step": step_bytes,
            "decode_1_weight_gb_s": achieved,
            "decode_1_fraction_of_ceiling": achieved / ceiling["gb_s"] if achieved else None,
            "decode_1_fraction_nearby": fraction_nearby(runs[s], step_bytes),
            "peak_rss_bytes": info[s].get("peak_rss_bytes"),
        }
        if s.startswith("ember-"):
            worker = next((k for k, v in spec_of.items() if v == s), None)
            if worker in sides:
                rows = summarize_spec(runs[worker])
                results[s]["per_rep_tok_s"].update(rows.pop("per_rep_tok_s"))
                results[s]["median_tok_s"].update(rows.pop("median_tok_s"))
                results[s]["spec"] = {**rows, "runs": runs[worker], "init": info[worker],
                                      "peak_rss_bytes": info[worker].get("peak_rss_bytes")}
            else:
                results[s]["spec"] = {"skipped": refusal}
    return results


def _method(ceiling: dict) -> dict[str, str]:
    """How each figure was measured, for the JSON."""
    return {
        "speculation": "kernel figures (prefill, decode_1, decode_S): ember's engine has "
                       "speculation off; spec_on_<task>/spec_off_<task>: the tasks "
                       f"{', '.join(SPEC_TASKS)} of `ember bench spec` (tasks(1), chat "
                       "template, greedy, their max_tokens), decode phase, on two engines "
                       "of their own (speculation on / off); ratios against the anchor's "
                       "decode_1",
        "prefill": "prompt in one chunk/batch through sampling the first token; tok/s = "
                   "prompt tokens / seconds (native: llama-bench pp<P>)",
        "decode_1": "one stream, time from first token to last; tok/s = (n-1) / seconds "
                    "(native: llama-bench tg<n-1>)",
        "decode_S": "S streams, decode phase only: from when every stream has its first "
                    "token until all finish; tok/s = tokens in that window / seconds "
                    "(native: llama-batched-bench S_TG with -ntg gen-1)",
        "weight_bytes": "ember: bytes of the tensors held by its Linear objects + norm "
                        "vectors (embedding rows excluded); llama.cpp: GGUF sizes of the "
                        "tensors a step reads (token_embd only when tied as output head)",
        "bandwidth": f"{ceiling['method']}, 5 passes before the runs and {BRACKET} "
                     "just before and just after each side's run; the ceiling is the "
                     "median of all passes (min/max beside it); check: torch.amax over "
                     "the same tensor; 'around': each rep's decode over the mean of "
                     "the passes just before and after its run, median over reps",
        "peak_rss": "VmHWM: the workers' own from /proc/self/status at exit; the native "
                    "binaries' polled from /proc/PID/status every 10 ms while they run "
                    "(getrusage ru_maxrss is inherited from the launcher across "
                    "fork+exec on Linux)",
    }


def _run_side(sides: dict, runs: dict, info: dict, name: str, msg: dict,
              rep: int | None) -> None:
    """One run of side ``name`` (``rep`` None: the warm-up, not kept). A llama.cpp side
    that fails is dropped with a note; an ember side that fails ends the benchmark."""
    load = _load()
    try:
        reply = sides[name].run(msg)
    except (WorkerError, native.NativeError) as e:
        if name not in (NATIVE, BINDING):
            raise EmberError(str(e)) from None
        print(f"{name} failed: {e}; leaving it out.")
        info.setdefault(name, {})["failed"] = str(e)
        sides.pop(name).kill()
        runs.pop(name)
        return
    if rep is not None:
        runs[name].append({"rep": rep, "load_avg_before": load, **reply})


def _native_meta(runs: list[dict], binary: str, key: str) -> Any:
    for r in runs:
        meta = r.get("processes", {}).get(binary, {}).get("meta") or {}
        if key in meta:
            return meta[key]
    return None


def _label(key: str) -> str:
    parts = key.split("_")
    if parts[0] == "spec":
        return f"decode 1, spec {parts[1]}: {'_'.join(parts[2:])}"
    if parts[0] == "prefill":
        return f"prefill {parts[1]} tok/s"
    n = parts[1]
    return f"decode {n} stream{'s' if n != '1' else ''} tok/s"


def _print_table(results: dict, ratios: dict, columns: list[str], anchor: str | None,
                 ceiling: dict, reach: dict, refusal: str | None) -> None:
    keys: list[str] = []
    for s in columns:
        keys += [k for k in results[s]["median_tok_s"] if k not in keys]
    kernel = [k for k in keys if not k.startswith("spec_")]
    spec_keys = [f"spec_{x}_{t}" for t in SPEC_TASKS for x in ("on", "off")
                 if f"spec_{x}_{t}" in keys]
    cols: list[tuple[str, str, str | None]] = []  # (header, side, ratio-of side)
    for s in columns:
        cols.append((s, s, None))
        if s in ratios:
            cols.append((f"/{anchor}", s, s))

    def row(name: str, cells: list[str]) -> str:
        return f"{name:<28}" + "".join(f"{c:>13}" for c in cells)

    if anchor:
        what = ("llama.cpp's own binaries (llama-bench, llama-batched-bench)" if anchor == NATIVE
                else "llama.cpp through its Python binding")
        print(f"ratio columns (/{anchor}): the side to their left ÷ {what}; speculation rows "
              f"÷ its plain single-stream decode")
    print("kernel figures: speculation off on every side")
    print(row("median of reps", [h for h, _, _ in cols]))

    def figure(k: str) -> None:
        cells = []
        for _, s, r in cols:
            v = ratios[r].get(k) if r else results[s]["median_tok_s"].get(k)
            cells.append("-" if v is None else f"{v:.2f}" if r else f"{v:.1f}")
        print(row(_label(k), cells))

    for k in kernel:
        figure(k)

    def extra(name: str, fn: Any, fmt: str) -> None:
        cells = []
        for _, s, r in cols:
            v = None if r else fn(results[s])
            cells.append("" if r else "-" if v is None else format(v, fmt))
        print(row(name, cells))

    extra("weight MB / step", lambda x: x["weight_bytes_per_step"] / 1e6, ".1f")
    extra("weight GB/s (1 stream)", lambda x: x["decode_1_weight_gb_s"], ".2f")
    extra("% of read BW ceiling", lambda x: x["decode_1_fraction_of_ceiling"] and
          100 * x["decode_1_fraction_of_ceiling"], ".0f")
    extra("% of read BW around", lambda x: x["decode_1_fraction_nearby"] and
          100 * x["decode_1_fraction_nearby"], ".0f")
    extra("peak RSS MB", lambda x: x["peak_rss_bytes"] and x["peak_rss_bytes"] / 1e6, ".0f")
    if any("greedy_agreement_tokens" in results[s] for s in columns):
        extra(f"greedy agree w/ {BINDING}", lambda x: x.get("greedy_agreement_tokens"), "d")
    if refusal:
        print(f"decode 1 stream, spec on: not measured: {refusal}")
    elif spec_keys:
        print("decode 1 stream on real text (speculation on, then off; tok/s of the decode "
              "phase):")
        for k in spec_keys:
            figure(k)
        for s in columns:
            for task, t in results[s].get("spec", {}).get("tasks", {}).items():
                speedup = f"{t['speedup']:.2f}x" if t["speedup"] else "-"
                flags = ("" if t["same_output"] else "  OUTPUT DIFFERS (on vs off)") + (
                    "  OUTPUT LOOPS: not a real-text figure" if t["looping"] else "")
                print(f"  {s} {task}: speedup {speedup}, {t['accepted']}/{t['drafted']} "
                      f"drafted tokens accepted, {t['tokens']} tokens after a "
                      f"{t['prompt_tokens']}-token prompt{flags}")
    line = (f"read bandwidth ceiling {ceiling['gb_s']:.1f} GB/s: median of {ceiling['passes']} "
            f"passes of {ceiling['method']} before the runs and around each side's run (min "
            f"{ceiling['min_gb_s']:.1f}, max {ceiling['max_gb_s']:.1f})")
    if "check_gb_s" in ceiling:
        line += (f"; check, torch.amax: {ceiling['check_gb_s']:.1f} GB/s"
                 + ("" if ceiling["check_agrees"] else
                    f" — the two differ by more than {CHECK_TOLERANCE:.0%}: a noisy machine?"))
    print(line)
    llc = last_level_cache_bytes()
    if reach["bytes"]:
        curve = ", ".join(f"{b / 2**20:.0f} MiB {g:.0f}"
                          for b, g in zip(reach["bytes"], reach["gb_s"], strict=True))
        print(f"read bandwidth by tensor size (GB/s): {curve}; cached (over "
              f"{CACHED_FACTOR:g}x the ceiling) up to {reach['cached_bytes'] / 2**20:.0f} MiB"
              + (f"; sysfs reports a {llc / 2**20:.0f} MiB last-level cache" if llc else ""))
    step = max(results[s]["weight_bytes_per_step"] for s in columns)
    note = cache_note(step, llc, reach["cached_bytes"])
    if note:
        print(note)


def _print_context(kv: dict, results: dict) -> None:
    """The KV sizes each side ran with, and where the native peak RSS comes from."""
    pools = ", ".join(f"{s} {n}" for s, n in kv["ember_pool_tokens"].items())
    line = f"KV token slots: ember pool ({kv['ember_kv_dtype']}) {pools}"
    if "llama.cpp" in kv:
        c = kv["llama.cpp"]
        line += (f"; llama.cpp ({c['type_k'] or 'f16'}) per test "
                 + ", ".join(f"{k} {v}" for k, v in c["predicted"].items()))
        reported = c["llama-batched-bench n_kv_max"]
        predicted = c["predicted"].get(native.BATCHED)
        if reported and predicted is not None and reported != [predicted]:
            line += f" (llama-batched-bench reported n_kv_max {reported})"
    if kv.get("llama.cpp-py"):
        line += "; llama.cpp-py " + ", ".join(f"{k} {v['n_ctx']}"
                                              for k, v in kv["llama.cpp-py"].items())
    print(line)
    if NATIVE in results:
        procs: dict[str, list[dict]] = {}
        for r in results[NATIVE]["runs"]:
            for name, p in r.get("processes", {}).items():
                procs.setdefault(name, []).append(p)
        parts = []
        for name, ps in procs.items():
            peak = max(p["peak_rss_bytes"] or 0 for p in ps)
            ru = max(p["ru_maxrss_bytes"] for p in ps)
            parts.append(f"{name} {peak / 1e6:.0f} MB (wait4 ru_maxrss {ru / 1e6:.0f} MB)")
        launcher = max(p["launcher_hwm_bytes"] or 0 for ps in procs.values() for p in ps)
        print(f"llama.cpp peak RSS, VmHWM polled every {native.POLL_S * 1000:.0f} ms: "
              f"{', '.join(parts)}; ru_maxrss includes this launcher's own peak "
              f"({launcher / 1e6:.0f} MB), carried across fork + exec")
        for name, ps in procs.items():
            print(f"  {name}: {ps[0]['command']}")


if __name__ == "__main__":
    if "--worker" in sys.argv[1:]:
        sys.exit(worker_main())
    print("usage: ember bench compare ...  (this module runs as a worker with --worker)",
          file=sys.stderr)
    sys.exit(2)
