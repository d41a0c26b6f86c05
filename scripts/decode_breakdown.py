"""Where a q4 decode step goes: the fused stack's stage timers, and an A/B against the
op-by-op path (the same model with the native stack switched off).

    python scripts/decode_breakdown.py --streams 1 --context 562
    python scripts/decode_breakdown.py --streams 16 --context 2000 --kv-dtype f16 --ab
    python scripts/decode_breakdown.py --ab --prefill 512

Model forward only (no engine, sampling or server), 2 threads by default; every figure
is the mean over --steps decode steps after 5 warm-up steps.
"""

from __future__ import annotations

import argparse
import time

import torch

from ember.kv.blocks import KV_DTYPES, BlockAllocator, BlockTable
from ember.models.layers.attention import AttentionBatch, RowSpec
from ember.models.loader import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--context", type=int, default=562)
    ap.add_argument("--kv-dtype", choices=KV_DTYPES, default="f16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--ab", action="store_true", help="also time the op-by-op path")
    ap.add_argument("--prefill", type=int, default=0, metavar="N",
                    help="with --ab: also time one N-token prefill both ways")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, "q4").model
    stack = model.native
    if stack is None:
        raise SystemExit("no fused stack for this model here (q4 kernels unavailable?)")
    bs, ctx, n = 16, args.context, args.streams
    per_row = -(-(ctx + args.steps + 8) // bs)
    kv = model.new_kv_storage(per_row * n, bs, args.kv_dtype)
    kv.pool.zero_()
    alloc, gen = BlockAllocator(per_row * n), torch.Generator().manual_seed(0)
    tables = []
    for _ in range(n):
        table = BlockTable(alloc, bs)
        table.reserve(per_row * bs)
        tables.append(table)
        prompt = torch.randint(0, model.cfg.vocab_size, (ctx,), generator=gen)
        model.forward(prompt, AttentionBatch.build([RowSpec(table.block_ids(ctx), 0, ctx)],
                                                   bs), kv)

    def steps(count: int, first: int) -> float:
        start = time.perf_counter()
        for i in range(count):
            pos = ctx + (first + i) % (args.steps + 5)
            batch = AttentionBatch.build([RowSpec(t.block_ids(pos + 1), pos, 1)
                                          for t in tables], bs)
            model.forward(torch.randint(0, model.cfg.vocab_size, (n,), generator=gen), batch, kv)
        return (time.perf_counter() - start) / count

    steps(5, 0)
    stack.set_profiling(True)
    step = steps(args.steps, 5)
    stages = stack.stage_seconds()
    stack.set_profiling(False)
    calls = stages.pop("calls")
    print(f"{args.model} q4, {n} stream(s), {ctx}-token contexts, KV {args.kv_dtype}, "
          f"{args.threads} threads: step {step * 1e3:.2f} ms = {n / step:.1f} tok/s")
    inside = 0.0
    for name, seconds in sorted(stages.items(), key=lambda kv: -kv[1]):
        inside += seconds / calls
        print(f"  stack  {name:22s} {seconds / calls * 1e3:7.2f} ms  {seconds / calls / step:5.0%}")
    outside = step - inside
    print(f"  outside the stack (embedding, output head, metadata) "
          f"{outside * 1e3:7.2f} ms  {outside / step:5.0%}")
    if args.ab:
        results = {}
        for name, native in (("op-by-op", None), ("fused", stack)) * 2:
            model.native = native
            results[name] = min(results.get(name, 1e9), steps(args.steps // 2, 0))
        model.native = stack
        print(f"A/B decode: op-by-op {n / results['op-by-op']:.1f} tok/s, fused "
              f"{n / results['fused']:.1f} tok/s ({results['op-by-op'] / results['fused']:.2f}x)")
    if args.ab and args.prefill:
        print(prefill_ab(model, args.prefill, args.kv_dtype, gen))


def prefill_ab(model, n: int, kv_dtype: str, gen: torch.Generator) -> str:
    """One n-token prefill, fused vs op-by-op (PyTorch SDPA attention), best of 3 each."""
    bs, stack = 16, model.native
    kv = model.new_kv_storage(-(-n // bs), bs, kv_dtype)
    kv.pool.zero_()
    table = BlockTable(BlockAllocator(-(-n // bs)), bs)
    table.reserve(n)
    batch = AttentionBatch.build([RowSpec(table.block_ids(n), 0, n)], bs)
    prompt = torch.randint(0, model.cfg.vocab_size, (n,), generator=gen)
    best = {}
    for name, native in (("op-by-op", None), ("fused", stack)) * 2:
        model.native = native
        for _ in range(2):
            start = time.perf_counter()
            model.forward(prompt, batch, kv)
            best[name] = min(best.get(name, 1e9), time.perf_counter() - start)
    model.native = stack
    return (f"A/B prefill {n}: op-by-op {n / best['op-by-op']:.1f} tok/s, fused "
            f"{n / best['fused']:.1f} tok/s ({best['op-by-op'] / best['fused']:.2f}x)")


if __name__ == "__main__":
    main()
