"""The noise floor of `ember eval`'s q4 rows: how far its figures move when nothing
but the last bit of q4's arithmetic changes, next to what each KV dtype does.

    python scripts/eval_noise.py --model smollm2-135m --nudges 13

q4 quantizes every layer's activations to int8, so any rounding upstream (a narrower
KV dtype, a different summation order) becomes a different rounding of the next
layer's inputs. Here q4 with f32 KV has its input embeddings nudged by about one
float32 ulp (x * (1 + s * 2^-23), s in {-1, 0, 1} at random per element, one seed per
nudge) — far below f16's rounding (2^-11) — and is scored as `ember eval` scores it,
against f32 weights with f32 KV. A KV dtype whose q4 row lies within the nudges'
spread adds no drift beyond noise (docs/quantization.md).
"""

from __future__ import annotations

import argparse

import torch

from ember.eval import TEXT, _Acc, windows
from ember.kv.dtypes import KV_DTYPES
from ember.models.loader import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--nudges", type=int, default=13)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ref_model, q4 = load_model(args.model, "f32"), load_model(args.model, "q4")
    ids = ref_model.encode_prompt(TEXT.read_text())
    embed = q4.model.embed

    def nudged(seed: int):
        def lookup(tokens: torch.Tensor) -> torch.Tensor:
            x = embed(tokens)
            g = torch.Generator().manual_seed(seed * 100003 + int(tokens[0]) * 31 + len(tokens))
            return x * (1 + torch.randint(-1, 2, x.shape, generator=g).float() * 2.0**-23)
        return lookup

    runs = [(f"{d} KV", d, None) for d in KV_DTYPES]
    runs += [(f"f32 KV, nudge {s}", "f32", s) for s in range(1, args.nudges + 1)]
    acc = {label: _Acc() for label, _, _ in runs}
    for chunk in windows(ids, 512):
        ref = ref_model.model.score(chunk)[:-1].float()
        targets = torch.tensor(chunk[1:])
        for label, kv, seed in runs:
            q4.model.embed = embed if seed is None else nudged(seed)
            acc[label].add(q4.model.score(chunk, kv_dtype=kv)[:-1].float(), ref, targets)
    q4.model.embed = embed
    print(f"{args.model}: q4 vs f32 weights + f32 KV, {acc[runs[0][0]].n} positions")
    for label, a in acc.items():
        print(f"  q4 + {label:<18} KL {a.kl / a.n:.5f}  top-1 {a.agree / a.n:.1%}  "
              f"max drift {a.drift:.3f}")


if __name__ == "__main__":
    main()
