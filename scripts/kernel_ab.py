"""A/B of the native kernels against another git revision's, in one process.

Builds ``ember/kernels/quant_matmul.cpp`` (with its headers) as it is at ``--base``
into a module of its own, loads the model once, gives each build its own fused
decoder stack over the same layers, and times them alternately: decode steps of
``--rows`` rows at a 160-token context, or one ``--prefill``-token prompt. Alternating
in one process is what makes a few-percent difference visible on a machine whose
bandwidth drifts by tens of percent between runs.

    python scripts/kernel_ab.py --model ~/.cache/ember/synth/llama-1b-Q4_K_M.gguf --base HEAD~1
    python scripts/kernel_ab.py --model FILE --base 28cfce5 --rows 16
    python scripts/kernel_ab.py --model FILE --base HEAD~1 --prefill 512
    EMBER_KERNEL_ISA=avx2 python scripts/kernel_ab.py --model FILE --base HEAD~1

Both builds get the flags this tree's kernels were built with (``-march=native``, or
those of ``EMBER_KERNEL_ISA``: an AVX2 machine's kernels measured on this one).

Prints each build's median milliseconds per forward and the median of the paired
ratios (this tree ÷ base); the layers only (no embedding, output head or sampling).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from ember import kernels
from ember.kv.blocks import BlockAllocator, BlockTable
from ember.models.decoder import native_decoder
from ember.models.layers.attention import AttentionBatch, RowSpec
from ember.models.loader import load_model

REPO = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True,
                          text=True).stdout


def build_revision(rev: str, into: Path) -> object:
    """The kernels as they are at git revision ``rev`` (every C++ source and header
    there), compiled as their own module."""
    src = into / "src"
    src.mkdir(parents=True)
    for path in _git("ls-tree", "--name-only", f"{rev}:ember/kernels").split():
        if path.endswith((".h", ".cpp")):
            (src / path).write_text(_git("show", f"{rev}:ember/kernels/{path}"))
    return load(name="ember_kernel_ab_base", sources=[str(src / "quant_matmul.cpp")],
                extra_cflags=[*kernels._BASE_FLAGS, *(kernels.loaded_flags() or [])],
                extra_ldflags=[*kernels._LDFLAGS], build_directory=str(into), verbose=False)


def batch(model, rows: int, prefill: int):
    """A KV pool and the step's metadata: `rows` decode rows at 160 tokens, or a prompt."""
    blocks = (prefill or 161 * rows) // 16 + rows + 8
    kv = model.new_kv_storage(blocks, 16, torch.float16)
    alloc = BlockAllocator(blocks)
    specs = []
    for _ in range(1 if prefill else rows):
        table = BlockTable(alloc, 16)
        table.reserve(prefill or 161)
        specs.append(RowSpec(table.block_ids(prefill or 161), 0 if prefill else 160,
                             prefill or 1))
    kv.zero_blocks(alloc.take_unzeroed())
    return kv, AttentionBatch.build(specs, 16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--base", required=True, help="git revision to compare against")
    ap.add_argument("--rows", type=int, default=1, help="decode rows per step")
    ap.add_argument("--prefill", type=int, default=0, metavar="N",
                    help="time one N-token prompt instead of decode steps")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=0,
                    help="forwards per timing (default: 32 rows' worth, at least 4; 2 for prefill)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, "q4").model
    if kernels.quant_matmul() is None:
        raise SystemExit(f"the kernels do not build here: {kernels.unavailable_reason()}")
    with tempfile.TemporaryDirectory() as tmp:
        builds = {"base": build_revision(args.base, Path(tmp)), "this": kernels.quant_matmul()}
        stacks = {k: native_decoder(model.cfg, model.layers, ext=e) for k, e in builds.items()}
        kv, b = batch(model, args.rows, args.prefill)
        x = torch.randn(b.positions.numel(), model.cfg.hidden_size)
        ropes = [torch.view_as_real(r.rotation(b.positions)).contiguous()
                 for r in model.ropes.values()]
        calls = args.calls or (2 if args.prefill else max(4, 32 // args.rows))
        ms: dict[str, list[float]] = {k: [] for k in stacks}
        for _ in range(args.reps):
            for name, stack in stacks.items():
                def step(stack=stack) -> None:
                    stack.forward(x.clone(), kv.pool, ropes, b.slot_mapping, b.tables,
                                  b.token_rows, b.positions)
                step()
                start = time.perf_counter()
                for _ in range(calls):
                    step()
                ms[name].append((time.perf_counter() - start) / calls * 1e3)
    ratio = statistics.median(t / s for t, s in zip(ms["this"], ms["base"], strict=True))
    shape = f"{args.prefill}-token prompt" if args.prefill else f"{args.rows} row(s)"
    print(f"{Path(args.model).name}, {shape}, {args.threads} threads, {args.reps} alternations: "
          f"base ({args.base}) {statistics.median(ms['base']):.2f} ms, this tree "
          f"{statistics.median(ms['this']):.2f} ms; this / base {ratio:.3f}")


if __name__ == "__main__":
    main()
