"""Can one tenant tell, from its own latency, whether another tenant cached a prompt?

    ember serve --api-keys-file keys.txt [--lora NAME=PATH] &
    python scripts/timing_probe.py --victim-key KEY_A --probe-key KEY_B [--model NAME]

The victim tenant sends prompt X (so X is cached for it). The probing tenant then sends,
in random order, X and fresh prompts of the same length, and measures each one's
time to first token. If caches leaked across tenants, X would come back faster; the
AUC of "X faster than a fresh prompt" over all pairs (Mann-Whitney) is 0.5 when the
probe learns nothing, 1.0 when it always can tell. ``--model``: probe through an
adapter (the victim uses the same one).
"""

from __future__ import annotations

import argparse
import random
import time

import httpx


def ttft(url: str, key: str, model: str, prompt: str) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "stream": True}
    t = time.monotonic()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {key}"}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data:"):
                return time.monotonic() - t
    raise RuntimeError("no token")


def auc(faster: list[float], slower: list[float]) -> float:
    """P(a value of ``faster`` < a value of ``slower``), ties counting half."""
    wins = sum((a < b) + 0.5 * (a == b) for a in faster for b in slower)
    return wins / (len(faster) * len(slower))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--victim-key", required=True)
    p.add_argument("--probe-key", required=True)
    p.add_argument("--trials", type=int, default=40)
    p.add_argument("--words", type=int, default=300)
    args = p.parse_args()
    rng = random.Random(0)
    vocab = "river stone market lantern orchard harbor meadow engine garden letter".split()

    def text() -> str:
        return " ".join(rng.choice(vocab) for _ in range(args.words))

    cached, fresh = [], []
    for _ in range(args.trials):
        secret = text()
        ttft(args.url, args.victim_key, args.model, secret)  # now cached for the victim
        tries = [("cached", secret), ("fresh", text())]
        rng.shuffle(tries)
        for kind, prompt in tries:
            (cached if kind == "cached" else fresh).append(
                ttft(args.url, args.probe_key, args.model, prompt))
    print(f"probe TTFT: victim-cached prompts median {sorted(cached)[len(cached) // 2] * 1e3:.1f}"
          f" ms, fresh {sorted(fresh)[len(fresh) // 2] * 1e3:.1f} ms; AUC "
          f"{auc(cached, fresh):.2f} over {args.trials} trials (0.5: nothing learnt)")


if __name__ == "__main__":
    main()
