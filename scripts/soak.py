"""Soak a running ``ember serve`` with mixed requests and print its RSS curve.

    ember serve --kv-cache-bytes 64M &
    python scripts/soak.py --pid $(pgrep -f "ember serve") --requests 5000

Requests cycle through chat, completions, streamed chat, ``n=2``, a JSON schema,
tools, and a client that goes away mid-stream (an abort), four at a time. Every
``--every`` requests it prints the server's RSS (from /proc) and the growth per request
since the first sample after warm-up: a server that keeps nothing per request levels
off (its KV pool, caches and histograms fill, then stop growing).
"""

from __future__ import annotations

import argparse
import itertools
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
TOOL = {"type": "function", "function": {"name": "weather", "description": "Weather in a city",
                                         "parameters": {"type": "object", "properties": {
                                             "city": {"type": "string"}}}}}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def one(url: str, model: str, i: int) -> None:
    text = f"Request {i}: tell me about the number {i * 7919 % 1000}."
    chat = {"model": model, "messages": [{"role": "user", "content": text}],
            "max_tokens": 8}
    kind = i % 7
    with httpx.Client(base_url=url, timeout=120) as c:
        if kind == 0:
            c.post("/v1/chat/completions", json=chat)
        elif kind == 1:
            c.post("/v1/completions", json={"model": model, "prompt": text, "max_tokens": 8})
        elif kind == 2:
            with c.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as r:
                for _ in r.iter_lines():
                    pass
        elif kind == 3:
            c.post("/v1/chat/completions", json={**chat, "n": 2, "temperature": 0.8})
        elif kind == 4:
            c.post("/v1/chat/completions", json={**chat, "max_tokens": 16, "response_format": {
                "type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}})
        elif kind == 5:
            c.post("/v1/chat/completions", json={**chat, "tools": [TOOL]})
        else:  # leaves after the first chunk: the server aborts the request
            with c.stream("POST", "/v1/chat/completions",
                          json={**chat, "max_tokens": 64, "stream": True}) as r:
                next(r.iter_lines(), None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--pid", type=int, required=True, help="the server's process id")
    p.add_argument("--requests", type=int, default=5000)
    p.add_argument("--every", type=int, default=250)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--concurrency", type=int, default=4)
    args = p.parse_args()
    curve = [(0, rss_mb(args.pid))]
    print(f"{0:6d} requests  RSS {curve[0][1]:8.1f} MB", flush=True)
    ids = itertools.count()
    with ThreadPoolExecutor(args.concurrency) as pool:
        for done in range(args.every, args.requests + 1, args.every):
            list(pool.map(lambda _: one(args.url, args.model, next(ids)), range(args.every)))
            curve.append((done, rss_mb(args.pid)))
            base = next(((n, m) for n, m in curve if n >= args.warmup), None)
            slope = ("" if base is None or done == base[0] else
                     f"  {(curve[-1][1] - base[1]) * 1024 / (done - base[0]):6.2f} KB/request "
                     f"since {base[0]}")
            print(f"{done:6d} requests  RSS {curve[-1][1]:8.1f} MB{slope}", flush=True)
    print(json.dumps({"curve": curve}))


if __name__ == "__main__":
    main()
