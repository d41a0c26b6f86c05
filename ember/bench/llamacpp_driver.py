"""llama.cpp side of ``ember bench compare``, run as a separate process.

This script imports only the standard library and ``llama_cpp`` (llama-cpp-python),
never ember, so it can run under any interpreter that has llama.cpp while ember's own
environment stays free of it. It uses llama.cpp's low-level C API (the calls
llama-bench and llama-batched-bench make), not the high-level ``Llama`` class.

Protocol: ``python llamacpp_driver.py --probe`` prints one JSON object saying whether
``llama_cpp`` imports. Without ``--probe`` it serves JSON lines: one request object per
stdin line, one reply object per stdout line, every reply with ``"ok"``:

- ``{"cmd": "init", "model": PATH, "threads": T, "prefill_ctx": N, "streams": [4, 16],
  "stream_ctx": M}``: load the model and one context per measurement kind;
- ``{"cmd": "run", "prefill": [[ids]...], "decode": {"prompt": [ids], "n": 128},
  "batched": [{"prompts": [[ids]...], "gen": 32}]}``: one repetition (format below);
- ``{"cmd": "exit"}``: free everything, reply with the peak RSS and exit.

What is timed (``time.perf_counter``):

- prefill: one ``llama_decode`` of the whole prompt as one batch (logits for the last
  token only) on an emptied KV cache, plus greedy sampling of that token;
- decode: after the prompt and the first token, ``n - 1`` iterations of
  ``llama_decode`` of one token + greedy sampling (the first token is excluded);
- batched: S streams with their own prompts (sequence ids 0..S-1) are prefilled
  untimed and sample their first token; then ``gen - 1`` steps, each one
  ``llama_decode`` of S tokens (one per sequence) + greedy sampling of S tokens.
  Tokens counted: S * (gen - 1), i.e. only tokens produced after every stream has
  its first one.

C-level writes to stdout are redirected to stderr so the protocol stays clean.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from typing import Any

_proto = sys.stdout  # replaced in serve() by a private duplicate of fd 1


def _reply(obj: dict) -> None:
    _proto.write(json.dumps(obj) + "\n")
    _proto.flush()


def peak_rss_bytes() -> int:
    """This process's peak RSS: ``VmHWM`` where /proc has it, else ``ru_maxrss``.

    On Linux ``getrusage``'s ``ru_maxrss`` survives fork + exec, so a worker would
    report its launcher's peak if that was larger; ``VmHWM`` starts afresh at exec.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def probe() -> dict:
    try:
        import llama_cpp
    except Exception as e:  # ImportError, or a broken native library
        return {"available": False, "error": f"import llama_cpp failed: {type(e).__name__}: {e}",
                "python": sys.executable}
    return {"available": True, "llama_cpp_version": getattr(llama_cpp, "__version__", "?"),
            "python": sys.executable}


class Driver:
    def __init__(self, msg: dict) -> None:
        import llama_cpp as L

        self.L = L
        L.llama_backend_init()
        start = time.perf_counter()
        mparams = L.llama_model_default_params()
        mparams.n_gpu_layers = 0
        # llama.cpp's extra CPU buffer types (repacked weights, AMX). Off where they
        # crash: on a VM that reports AMX but does not grant its tile state, ggml's AMX
        # matmul segfaults (seen in ggml_backend_amx_mul_mat, llama-cpp-python 0.3.36).
        self.extra_bufts = bool(msg.get("extra_bufts", True))
        if hasattr(mparams, "use_extra_bufts"):
            mparams.use_extra_bufts = self.extra_bufts
        self.model = L.llama_model_load_from_file(msg["model"].encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {msg['model']}")
        self.threads = int(msg["threads"])
        # llama.cpp's own default is "auto" (-1); 0 = off, 1 = on
        self.flash_attn = {"auto": -1, "off": 0, "on": 1}[msg.get("flash_attn", "auto")]
        self.batch_cap = 512
        # prefill + single-stream decode: one sequence, the whole prompt in one ubatch
        n = int(msg["prefill_ctx"])
        self.single = self._context(n_ctx=n, n_seq=1, n_batch=max(n, self.batch_cap))
        # one context per stream count, one KV sequence per stream
        self.multi = {}
        stream_ctx = int(msg.get("stream_ctx", 0))
        for s in msg.get("streams", []):
            self.multi[int(s)] = self._context(n_ctx=int(s) * stream_ctx, n_seq=int(s),
                                               n_batch=max(self.batch_cap, stream_ctx))
        self.sampler = L.llama_sampler_init_greedy()
        self.load_s = time.perf_counter() - start
        self.batches: dict[int, object] = {}

    def _context(self, n_ctx: int, n_seq: int, n_batch: int):
        L = self.L
        p = L.llama_context_default_params()
        p.n_ctx = n_ctx
        p.n_batch = n_batch
        p.n_ubatch = n_batch
        p.n_seq_max = n_seq
        p.n_threads = self.threads
        p.n_threads_batch = self.threads
        p.no_perf = True
        p.flash_attn_type = self.flash_attn
        ctx = L.llama_init_from_model(self.model, p)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not create a context (n_ctx={n_ctx}, "
                               f"n_seq_max={n_seq})")
        return ctx

    def info(self) -> dict:
        L = self.L
        ctxs = {"single": self.single, **{f"streams_{s}": c for s, c in self.multi.items()}}
        return {
            "llama_cpp_version": getattr(L, "__version__", "?"),
            "model_size_bytes": int(L.llama_model_size(self.model)),
            "n_params": int(L.llama_model_n_params(self.model)),
            "load_s": self.load_s,
            "contexts": {k: {"n_ctx": int(L.llama_n_ctx(c)), "n_batch": int(L.llama_n_batch(c)),
                             "n_ubatch": int(L.llama_n_ubatch(c)),
                             "n_seq_max": int(L.llama_n_seq_max(c))} for k, c in ctxs.items()},
            "threads": self.threads,
            "flash_attn": {-1: "auto", 0: "off", 1: "on"}[self.flash_attn],
            "extra_bufts": self.extra_bufts,
            "system_info": L.llama_print_system_info().decode(errors="replace"),
        }

    def _batch(self, n: int):
        if n not in self.batches:
            self.batches[n] = self.L.llama_batch_init(n, 0, 1)
        return self.batches[n]

    def _decode(self, ctx, items: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, pos, seq_id, wants_logits) items."""
        b = self._batch(len(items))
        for i, (tok, pos, seq, out) in enumerate(items):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = 1 if out else 0
        b.n_tokens = len(items)
        rc = self.L.llama_decode(ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} for a batch of {len(items)}")
        self.L.llama_synchronize(ctx)

    def _clear(self, ctx) -> None:
        self.L.llama_memory_clear(self.L.llama_get_memory(ctx), True)

    def _sample(self, ctx, idx: int) -> int:
        return int(self.L.llama_sampler_sample(self.sampler, ctx, idx))

    def prefill(self, prompt: list[int]) -> float:
        ctx = self.single
        self._clear(ctx)
        n = len(prompt)
        items = [(t, p, 0, p == n - 1) for p, t in enumerate(prompt)]
        start = time.perf_counter()
        self._decode(ctx, items)
        self._sample(ctx, -1)
        return time.perf_counter() - start

    def decode(self, prompt: list[int], n: int) -> tuple[float, list[int]]:
        ctx = self.single
        self._clear(ctx)
        m = len(prompt)
        self._decode(ctx, [(t, p, 0, p == m - 1) for p, t in enumerate(prompt)])
        ids = [self._sample(ctx, -1)]
        start = time.perf_counter()
        for i in range(n - 1):
            self._decode(ctx, [(ids[-1], m + i, 0, True)])
            ids.append(self._sample(ctx, -1))
        return time.perf_counter() - start, ids

    def batched(self, prompts: list[list[int]], gen: int) -> tuple[float, int]:
        s = len(prompts)
        ctx = self.multi[s]
        self._clear(ctx)
        last = [0] * s
        # untimed prefill: whole prompts packed into batches of at most batch_cap tokens
        group: list[int] = []
        for seq in range(s + 1):
            full = sum(len(prompts[q]) for q in group)
            if seq == s or (group and full + len(prompts[seq]) > self.batch_cap):
                items, outs = [], []
                for q in group:
                    p = prompts[q]
                    items += [(t, pos, q, pos == len(p) - 1) for pos, t in enumerate(p)]
                    outs.append((q, len(items) - 1))
                self._decode(ctx, items)
                for q, idx in outs:
                    last[q] = self._sample(ctx, idx)
                group = []
            if seq < s:
                group.append(seq)
        start = time.perf_counter()
        for step in range(gen - 1):
            self._decode(ctx, [(last[q], len(prompts[q]) + step, q, True) for q in range(s)])
            last = [self._sample(ctx, q) for q in range(s)]
        return time.perf_counter() - start, s * (gen - 1)

    def run(self, msg: dict) -> dict:
        out: dict = {"prefill": [], "batched": []}
        wall0, cpu0 = time.perf_counter(), cpu_seconds()
        for prompt in msg.get("prefill", []):
            out["prefill"].append({"tokens": len(prompt), "seconds": self.prefill(prompt)})
        if msg.get("decode"):
            d = msg["decode"]
            secs, ids = self.decode(d["prompt"], int(d["n"]))
            out["decode"] = {"tokens": len(ids) - 1, "seconds": secs, "ids": ids}
        for b in msg.get("batched", []):
            secs, toks = self.batched(b["prompts"], int(b["gen"]))
            out["batched"].append({"streams": len(b["prompts"]), "tokens": toks, "seconds": secs})
        out["wall_s"] = time.perf_counter() - wall0
        out["cpu_s"] = cpu_seconds() - cpu0
        return out

    def close(self) -> None:
        L = self.L
        for b in self.batches.values():
            L.llama_batch_free(b)
        L.llama_sampler_free(self.sampler)
        for ctx in [self.single, *self.multi.values()]:
            L.llama_free(ctx)
        L.llama_model_free(self.model)


def serve(make_backend: Any = None) -> int:
    """Serve the JSON-lines protocol: ``init`` builds a backend from the message
    (default: this llama.cpp ``Driver``; ember's worker passes its own), ``run``
    calls ``backend.run(msg)``, ``exit`` closes it and reports peak RSS."""
    global _proto
    make_backend = make_backend or Driver
    # The protocol gets a private copy of stdout; fd 1 itself goes to stderr, so
    # anything the C library prints cannot corrupt the JSON lines.
    sys.stdout.flush()
    _proto = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    driver = None
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            msg = json.loads(line)
            cmd = msg.get("cmd")
            if cmd == "init":
                driver = make_backend(msg)
                _reply({"ok": True, **driver.info()})
            elif cmd == "run":
                if driver is None:
                    raise RuntimeError("'run' before 'init'")
                _reply({"ok": True, **driver.run(msg)})
            elif cmd == "exit":
                if driver is not None:
                    driver.close()
                _reply({"ok": True, "peak_rss_bytes": peak_rss_bytes()})
                return 0
            else:
                raise ValueError(f"unknown command {cmd!r}")
        except Exception as e:
            _reply({"ok": False, "error": f"{type(e).__name__}: {e}"})
    return 0


def main(argv: list[str]) -> int:
    if "--probe" in argv:
        print(json.dumps(probe()))
        return 0
    return serve()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
