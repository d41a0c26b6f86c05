"""``ember bench compare``: ember vs llama.cpp on the same GGUF file, same thread count.

Both engines run as worker processes of this command, fed the same token ids over a
JSON-lines protocol: ember in ``python -m ember.bench.compare --worker`` (one process
per weight format, so each has its own peak RSS), llama.cpp in
``ember/bench/llamacpp_driver.py`` under ``--llama-python`` (which need not have
ember; ember's environment need not have llama_cpp). Each repetition runs every
side once, in an order rotated from one repetition to the next; after one untimed
warm-up run per side. Medians over the repetitions are reported.

What is timed (``time.perf_counter`` inside the worker; greedy decoding everywhere):

1. prefill: the prompt (P tokens) in one chunk/batch, up to and including sampling
   the first token. ember: one request, ``max_tokens=1``, ``max_num_batched_tokens``
   >= P, prefix cache off, timed from ``add_request`` until the engine is idle (=
   time to first token). llama.cpp: one ``llama_decode`` of the P tokens (logits for
   the last) on an emptied KV cache + greedy sampling. Figure: P / seconds.
2. single-stream decode: after the first token, the remaining ``n - 1`` tokens.
   ember: time from the request's first token until it finishes; llama.cpp:
   ``n - 1`` iterations of a one-token ``llama_decode`` + greedy sampling.
3. aggregate decode at S streams, decode phase only: S requests (distinct prompts)
   are prefilled untimed; the clock starts once *every* stream has its first token
   and stops when all have ``gen`` tokens; figure = tokens generated in that window
   / its length (S * (gen - 1) for llama.cpp; the same for ember, whose prompts all
   fit one prefill step). llama.cpp: one sequence id per stream, each step one
   ``llama_decode`` of S tokens (what llama-batched-bench times as "TG").
4. weight bytes per decode step, and bytes/s achieved by single-stream decode
   (= bytes per step x tok/s) against a bandwidth ceiling measured in this run: a
   ``torch.sum`` over a 1 GiB float32 tensor with the same thread count (bytes read /
   s, best of 5, measured before the runs and after each repetition; the best of
   those is the ceiling). ember's bytes per step are the
   sizes of the tensors its Linear objects and norm vectors hold (the packed codes and
   scales for q4, 4 B/weight for f32; the embedding table is excluded, a step reads
   one row of it). llama.cpp's are the GGUF tensor sizes of every tensor a step reads
   (all but ``token_embd`` unless it doubles as the output head).
5. peak RSS of each worker process (``VmHWM``; ``getrusage``'s ``ru_maxrss`` would
   include this launcher's peak on Linux, as it survives fork + exec).

Figures are printed as a table and written as JSON; nothing here asserts a timing.
"""

from __future__ import annotations

import json
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

from ember.bench.llamacpp_driver import cpu_seconds  # stdlib-only helpers
from ember.bench.llamacpp_driver import serve as serve_protocol
from ember.bench.throughput import PARAGRAPH
from ember.errors import EmberError

DRIVER = Path(__file__).with_name("llamacpp_driver.py")
HOW_TO_GET_LLAMA = (
    "to compare against llama.cpp, install it with `pip install 'ember[llamacpp]'` "
    "(llama-cpp-python; it builds llama.cpp from source, ~10 min on 2 cores), or pass "
    "--llama-python /path/to/python of an environment where `import llama_cpp` works"
)
BANDWIDTH_BYTES = 1 << 30


# ---------------------------------------------------------------- weight bytes
def step_tensor_names(gguf: Any) -> list[str]:
    """GGUF tensors a decode step reads in full: all but the embedding table, which
    is read in full only when it doubles as the output head (tied embeddings)."""
    tied = "output.weight" not in gguf.tensors
    return [n for n in gguf.tensors if n != "token_embd.weight" or tied]


def gguf_step_bytes(gguf: Any) -> int:
    """Weight bytes per decode step for an engine that reads the GGUF tensors as stored."""
    return sum(gguf.tensor(n).nbytes for n in step_tensor_names(gguf))


def ember_weight_bytes(model: Any) -> int:
    """Weight bytes an ember decode step reads: every layer's linears and norm vectors,
    the final norm and the output head (embedding lookups read one row: excluded)."""
    from ember.models.linear import linear_nbytes

    total = model.output_norm.nbytes + linear_nbytes(model.output)
    for layer in model.layers:
        total += layer.attn_norm.nbytes + layer.ffn_norm.nbytes
        total += sum(linear_nbytes(x) for x in (layer.qkv, layer.o, layer.gate_up, layer.down))
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


def engine_options(spec: dict) -> dict:
    """EngineConfig options that let ``spec`` run as described: one prefill chunk, every
    stream admitted at once, enough KV blocks, prefix cache off."""
    block = 16
    prefill = [len(p) for p in spec.get("prefill", [])]
    d = spec.get("decode") or {}
    batched = spec.get("batched", [])
    need_tokens = max([*prefill, len(d.get("prompt", [])), 1,
                       *(sum(len(p) for p in b["prompts"]) for b in batched)])
    need_blocks = max([-(-(n + 2) // block) for n in prefill]
                      + [-(-(len(d.get("prompt", [])) + int(d.get("n", 0)) + 1) // block)]
                      + [sum(-(-(len(p) + int(b["gen"]) + 1) // block) for p in b["prompts"])
                         for b in batched])
    return {"max_num_seqs": max([1, *(len(b["prompts"]) for b in batched)]),
            "max_num_batched_tokens": need_tokens, "num_kv_blocks": need_blocks + 8,
            "block_size": block, "enable_prefix_caching": False}


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

        return {"weights": self.weights, "load_s": self.loaded.load_seconds,
                "weight_bytes": ember_weight_bytes(self.loaded.model),
                "threads": torch.get_num_threads(), "torch": torch.__version__}

    def run(self, msg: dict) -> dict:
        return ember_run(self.engine, msg)

    def close(self) -> None:
        pass


def worker_main() -> int:
    """The ember worker: the driver's JSON-lines protocol, served by an LLMEngine."""
    return serve_protocol(_EmberBackend)


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


# ---------------------------------------------------------------- measurements
def measure_bandwidth(threads: int, nbytes: int = BANDWIDTH_BYTES, reps: int = 5) -> dict:
    """Read bandwidth: ``torch.sum`` over an ``nbytes`` float32 tensor with ``threads``
    threads, bytes / s of each repetition (GB = 1e9 B); the best is the ceiling."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(nbytes // 4, dtype=torch.float32)
        x.sum()  # fault the pages in, warm the threads
        gbs = []
        for _ in range(reps):
            start = time.perf_counter()
            x.sum()
            gbs.append(x.nbytes / (time.perf_counter() - start) / 1e9)
        del x
    finally:
        torch.set_num_threads(old)
    return {"method": f"torch.sum over {nbytes / 2**30:.2f} GiB float32, {threads} threads",
            "gb_s": gbs, "best_gb_s": max(gbs), "median_gb_s": statistics.median(gbs)}


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


def last_level_cache_bytes() -> int | None:
    """Size of this CPU's largest cache (sysfs), or None where it cannot be read."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = entry.read_text().strip()
        except OSError:
            continue
        unit = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * unit)
    return max(sizes, default=None)


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
         llama_flash_attn: str = "auto", kv_dtype: str = "f32",
         llama_extra_bufts: bool = True) -> dict:
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

    llama = probe_llama(llama_python)
    if not llama["available"]:
        print(f"llama.cpp unavailable: {llama['reason']}\n  {HOW_TO_GET_LLAMA}; "
              "reporting ember's figures only.")
    workers: dict[str, Worker] = {}
    info: dict[str, dict] = {}
    try:
        for w in weights:
            workers[f"ember-{w}"] = Worker(f"ember {w}", [sys.executable, "-m",
                                                         "ember.bench.compare", "--worker"])
        if llama["available"]:
            workers["llama.cpp"] = Worker("llama.cpp", [llama["python"], str(DRIVER)])
        for name, worker in list(workers.items()):
            if name == "llama.cpp":
                msg = {"cmd": "init", "model": str(path), "threads": threads,
                       "prefill_ctx": max([*prefill, decode_prompt + decode_tokens, 1]) + 16,
                       "streams": streams, "stream_ctx": stream_prompt + stream_gen + 16,
                       "flash_attn": llama_flash_attn, "extra_bufts": llama_extra_bufts}
            else:
                msg = {"cmd": "init", "model": str(path), "weights": name[len("ember-"):],
                       "threads": threads,
                       "engine": {**engine_options(spec), "kv_dtype": kv_dtype}}
            try:
                info[name] = worker.call(msg)
            except WorkerError as e:
                if name != "llama.cpp":
                    raise EmberError(str(e)) from None
                llama = {**llama, "available": False, "reason": str(e)}
                print(f"llama.cpp failed to start: {e}; reporting ember's figures only.")
                worker.close()
                del workers[name]
        sides = list(workers)
        runs: dict[str, list[dict]] = {s: [] for s in sides}
        print(f"model {path.name}, {threads} threads, {reps} reps, ember KV {kv_dtype}; "
              f"load average "
              f"{' '.join(map(str, load_start))}; sides: {', '.join(sides)}", flush=True)
        for s in sides:  # warm-up, untimed
            workers[s].call({"cmd": "run", **warmup_spec(spec)})
        for rep in range(reps):
            order = sides[rep % len(sides):] + sides[: rep % len(sides)]
            for s in order:
                load = _load()
                try:
                    reply = workers[s].call({"cmd": "run", **spec})
                except WorkerError as e:
                    if s != "llama.cpp":
                        raise EmberError(str(e)) from None
                    print(f"llama.cpp failed: {e}; reporting ember's figures only.")
                    llama = {**llama, "available": False, "reason": str(e)}
                    sides.remove(s)
                    runs.pop(s)
                    workers.pop(s).kill()
                    continue
                reply.pop("ok", None)
                runs[s].append({"rep": rep, "load_avg_before": load, **reply})
            bandwidth.append(measure_bandwidth(threads, bandwidth_bytes))
            print(f"  rep {rep + 1}/{reps} done ({time.perf_counter() - started:.0f} s, "
                  f"load {' '.join(map(str, _load()))}, read BW "
                  f"{bandwidth[-1]['best_gb_s']:.1f} GB/s)", flush=True)
        for s, worker in workers.items():
            info.setdefault(s, {})["peak_rss_bytes"] = worker.close().get("peak_rss_bytes")
    finally:
        for worker in workers.values():
            worker.kill()
    ceiling = max(b["best_gb_s"] for b in bandwidth)

    results: dict[str, dict] = {}
    for s in sides:
        summary = summarize(runs[s])
        step_bytes = llama_bytes if s == "llama.cpp" else info[s]["weight_bytes"]
        dec = summary["median_tok_s"].get("decode_1")
        achieved = step_bytes * dec / 1e9 if dec else None
        results[s] = {
            **summary, "runs": runs[s], "init": {k: v for k, v in info[s].items()},
            "weight_bytes_per_step": step_bytes,
            "decode_1_weight_gb_s": achieved,
            "decode_1_fraction_of_ceiling": achieved / ceiling if achieved else None,
            "peak_rss_bytes": info[s].get("peak_rss_bytes"),
        }
    ratios: dict[str, dict[str, float]] = {}
    if "llama.cpp" in results:
        ref = results["llama.cpp"]["median_tok_s"]
        for s in sides:
            if s != "llama.cpp":
                ratios[s] = {k: v / ref[k] for k, v in results[s]["median_tok_s"].items()
                             if ref.get(k)}
        for s in sides:
            if s != "llama.cpp" and "decode" in runs[s][0] and runs["llama.cpp"]:
                results[s]["greedy_agreement_tokens"] = agreement(
                    runs[s][0]["decode"]["ids"], runs["llama.cpp"][0]["decode"]["ids"])
    load_end = _load()
    _print_table(results, ratios, sides, ceiling, bandwidth)
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
        "ember_kv_dtype": kv_dtype,
        "method": {
            "prefill": "prompt in one chunk/batch through sampling the first token; tok/s = "
                       "prompt tokens / seconds",
            "decode_1": "one stream, time from first token to last; tok/s = (n-1) / seconds",
            "decode_S": "S streams, decode phase only: from when every stream has its first "
                        "token until all finish; tok/s = tokens in that window / seconds",
            "weight_bytes": "ember: bytes of the tensors held by its Linear objects + norm "
                            "vectors (embedding rows excluded); llama.cpp: GGUF sizes of the "
                            "tensors a step reads (token_embd only when tied as output head)",
            "bandwidth": bandwidth[0]["method"] + ", best of 5, before the runs and after "
                         "each repetition; the ceiling is the best of all",
            "peak_rss": "VmHWM of each worker process from /proc/self/status (getrusage "
                        "ru_maxrss is inherited from the launcher across fork+exec on Linux)",
        },
        "load_avg": {"start": load_start, "end": load_end},
        "bandwidth": bandwidth, "bandwidth_ceiling_gb_s": ceiling,
        "llama": llama, "results": results, "ratios_vs_llama": ratios,
    }
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        print(f"wrote {out}")
    return result


def _print_table(results: dict, ratios: dict, sides: list[str], ceiling: float,
                 bandwidth: list[dict]) -> None:
    keys: list[str] = []
    for s in sides:
        keys += [k for k in results[s]["median_tok_s"] if k not in keys]
    cols: list[tuple[str, str, str | None]] = []  # (header, side, ratio-of side)
    for s in sides:
        cols.append((s, s, None))
        if s in ratios:
            cols.append(("/llama", s, s))

    def label(k: str) -> str:
        kind, n = k.split("_")
        if kind == "prefill":
            return f"prefill {n} tok/s"
        return f"decode {n} stream{'s' if n != '1' else ''} tok/s"

    def row(name: str, cells: list[str]) -> str:
        return f"{name:<24}" + "".join(f"{c:>11}" for c in cells)

    print(row("median of reps", [h for h, _, _ in cols]))
    for k in keys:
        cells = []
        for _, s, r in cols:
            v = ratios[r].get(k) if r else results[s]["median_tok_s"].get(k)
            cells.append("-" if v is None else f"{v:.2f}" if r else f"{v:.1f}")
        print(row(label(k), cells))

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
    extra("peak RSS MB", lambda x: x["peak_rss_bytes"] and x["peak_rss_bytes"] / 1e6, ".0f")
    extra("greedy agree (tokens)", lambda x: x.get("greedy_agreement_tokens"), "d")
    bests = [b["best_gb_s"] for b in bandwidth]
    print(f"read bandwidth ceiling {ceiling:.1f} GB/s ({bandwidth[0]['method']}, best of 5; "
          f"before the runs and after each rep: {', '.join(f'{x:.1f}' for x in bests)})")
    llc = last_level_cache_bytes()
    step = max(results[s]["weight_bytes_per_step"] for s in sides)
    if llc and step <= llc:
        print(f"note: every side's weights per step ({step / 1e6:.0f} MB) fit in this CPU's "
              f"last-level cache ({llc / 2**20:.0f} MiB): decode can exceed the DRAM ceiling "
              "here, and a CPU with a smaller cache will see lower single-stream figures")


if __name__ == "__main__":
    if "--worker" in sys.argv[1:]:
        sys.exit(worker_main())
    print("usage: ember bench compare ...  (this module runs as a worker with --worker)",
          file=sys.stderr)
    sys.exit(2)
