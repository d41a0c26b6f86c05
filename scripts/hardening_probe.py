"""Probe a running OpenAI-compatible server the way issue 9's attacker and crowd did,
and print the figures (before/after comparisons of ``ember serve``).

    python scripts/hardening_probe.py --url http://127.0.0.1:8000 --model smollm2-135m

Each probe is independent; pick them with ``--probes`` (default: all):

- ``burst``: 200 completions written at once; latency of the 429s (median, p99, max)
  and of the accepted requests; start the server with a small ``--max-queue`` to see
  it, and give the prompts ``--burst-prompt-tokens`` to make the engine's steps long.
- ``health``: /health latency (p50, p99, max) polled every 5 ms while a 5 MB prompt is
  sent and refused, and how long the refusal took.
- ``admission``: time to first token of a short request sent while an 8,000-token
  prompt prefills (the long prompt is sent as token ids).
- ``fairprefill``: a 500-message (~7,800-token) chat, and meanwhile a stream of short
  streamed chats one after another; their time to first token (p50, p99, max) and
  how many were answered while the long one ran.
- ``abandon``: a non-streamed request whose client gives up after 1 s; seconds until
  the server is idle again (``ember_requests_running`` back to 0).
- ``slow``: 200 connections that send a header byte every 0.5 s; how many are still
  open after 15 s.

Needs only httpx. Prints one line per figure; writes nothing.
"""

from __future__ import annotations

import argparse
import json
import selectors
import socket
import threading
import time
from typing import Any

import httpx


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def summary(values: list[float]) -> str:
    if not values:
        return "n=0"
    return (f"n={len(values)} p50={pct(values, .5) * 1e3:.1f} ms "
            f"p99={pct(values, .99) * 1e3:.1f} ms max={max(values) * 1e3:.1f} ms")


def metric(url: str, name: str, key: str | None) -> float | None:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    for line in httpx.get(f"{url}/metrics", headers=headers, timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


def probe_burst(url: str, model: str, prompt_tokens: int = 0, n: int = 200) -> None:
    """All connections are opened first, then every request is written at once; each
    latency runs from the moment its own request was written to its status line.
    ``prompt_tokens`` > 0 sends prompts of that many token ids (long engine steps)."""
    host, port = url.split("//", 1)[1].split(":")
    prompt: Any = [100 + i for i in range(prompt_tokens)] if prompt_tokens else "hello"
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 16}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
               b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
               + body)
    socks = [socket.create_connection((host, int(port))) for _ in range(n)]
    sel = selectors.DefaultSelector()
    sent: dict[socket.socket, float] = {}
    for s in socks:
        s.sendall(request)
        sent[s] = time.monotonic()
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    by_status: dict[str, list[float]] = {}
    pending = set(socks)
    while pending:
        for key, _ in sel.select(timeout=600):
            s = key.fileobj
            data = s.recv(65536)
            sel.unregister(s)
            pending.discard(s)
            status = data.split(b" ", 2)[1].decode() if data else "closed"
            by_status.setdefault(status, []).append(time.monotonic() - sent[s])
    for s in socks:
        s.close()
    for status in sorted(by_status):
        print(f"burst: {status}: {summary(by_status[status])}")


def probe_health(url: str, model: str) -> None:
    latencies: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=120) as c:
            while not stop.is_set():
                t = time.monotonic()
                c.get(f"{url}/health")
                latencies.append(time.monotonic() - t)
                time.sleep(0.005)

    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.5)
    big = "lorem ipsum " * (5_000_000 // 12)
    t = time.monotonic()
    r = httpx.post(f"{url}/v1/chat/completions", timeout=600, json={
        "model": model, "messages": [{"role": "user", "content": big}], "max_tokens": 4})
    refused = time.monotonic() - t
    time.sleep(0.5)
    stop.set()
    poller.join()
    print(f"health: 5 MB prompt answered {r.status_code} in {refused:.2f} s; "
          f"/health during it: {summary(latencies)}")


def probe_admission(url: str, model: str, long_tokens: int = 8000) -> None:
    done: dict[str, float] = {}

    def long_request() -> None:
        t = time.monotonic()
        httpx.post(f"{url}/v1/completions", timeout=1200, json={
            "model": model, "prompt": [100 + i % 30000 for i in range(long_tokens)],
            "max_tokens": 1})
        done["long"] = time.monotonic() - t

    th = threading.Thread(target=long_request)
    th.start()
    time.sleep(1.0)
    t = time.monotonic()
    httpx.post(f"{url}/v1/completions", timeout=1200, json={
        "model": model, "prompt": "Hello", "max_tokens": 1})
    short = time.monotonic() - t
    th.join()
    print(f"admission: short request (1 token) took {short:.2f} s while an "
          f"{long_tokens}-token prompt prefilled (which took {done['long']:.2f} s)")


def probe_fairprefill(url: str, model: str, turns: int = 250) -> None:
    messages: list[dict[str, str]] = []
    for i in range(turns):
        messages += [{"role": "user", "content": f"Message number {i} about the weather"},
                     {"role": "assistant", "content": f"Reply {i}: it is sunny"}]
    messages.append({"role": "user", "content": "Summarize."})
    done: dict[str, Any] = {}

    def long_chat() -> None:
        t = time.monotonic()
        r = httpx.post(f"{url}/v1/chat/completions", timeout=1200, json={
            "model": model, "messages": messages, "max_tokens": 4})
        done["long"] = (r.status_code, time.monotonic() - t, r.json().get("usage"))

    th = threading.Thread(target=long_chat)
    th.start()
    time.sleep(1.0)
    ttfts = []
    while th.is_alive():
        t = time.monotonic()
        with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=1200, json={
                "model": model, "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 2, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and '"content"' in line:
                    ttfts.append(time.monotonic() - t)
                    break
        time.sleep(0.2)
    th.join()
    status, seconds, usage = done["long"]
    print(f"fairprefill: long chat {status} in {seconds:.1f} s "
          f"({(usage or {}).get('prompt_tokens')} prompt tokens); short chats' TTFT "
          f"{summary(ttfts)}")


def probe_abandon(url: str, model: str, key: str | None) -> None:
    try:
        httpx.post(f"{url}/v1/chat/completions", timeout=1.0, json={
            "model": model, "messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": 4000, "ignore_eos": True})
    except httpx.TimeoutException:
        pass
    left = time.monotonic()
    while metric(url, "ember_requests_running", key) not in (0.0, None):
        if time.monotonic() - left > 300:
            break
        time.sleep(0.02)
    print(f"abandon: server idle {time.monotonic() - left:.2f} s after the client left")


def probe_slow(url: str, n: int = 200, seconds: float = 15.0) -> None:
    host, port = url.split("//", 1)[1].split(":")
    socks = []
    for _ in range(n):
        s = socket.create_connection((host, int(port)))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        s.setblocking(False)
        socks.append(s)
    deadline = time.monotonic() + seconds
    open_ = set(range(n))
    while time.monotonic() < deadline:
        for i in list(open_):
            try:
                socks[i].sendall(b"X")
                if socks[i].recv(1024) == b"":
                    open_.discard(i)
            except BlockingIOError:
                pass
            except OSError:
                open_.discard(i)
        time.sleep(0.5)
    for s in socks:
        s.close()
    print(f"slow: {len(open_)} of {n} slow-header connections still open after {seconds:g} s")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--metrics-key", default=None)
    p.add_argument("--probes", default="burst,health,admission,fairprefill,abandon,slow")
    p.add_argument("--burst-prompt-tokens", type=int, default=0,
                   help="burst prompts of this many token ids (default: the text 'hello')")
    args = p.parse_args(argv)
    probes: dict[str, Any] = {
        "burst": lambda: probe_burst(args.url, args.model, args.burst_prompt_tokens),
        "health": lambda: probe_health(args.url, args.model),
        "admission": lambda: probe_admission(args.url, args.model),
        "fairprefill": lambda: probe_fairprefill(args.url, args.model),
        "abandon": lambda: probe_abandon(args.url, args.model, args.metrics_key),
        "slow": lambda: probe_slow(args.url),
    }
    for name in args.probes.split(","):
        probes[name.strip()]()


if __name__ == "__main__":
    main()
