"""Throughput of `ember serve` with tracing and the request log off and on, side by side.

    python scripts/trace_overhead.py [--model smollm2-135m] [--rounds 3]

Each round starts a server with everything off, then one with
``--otlp-traces-endpoint`` (to a receiver in this script that decodes nothing) and
``--request-log`` (the order alternates between rounds), and runs the same load
through each: ``--clients`` streams at once, ``--requests`` chat completions of
``--max-tokens`` tokens (sampled, seeded). It prints, per run, tok/s and the server
process's CPU seconds per 1,000 tokens (steadier than tok/s between server starts),
then the medians and on/off. Whole-server figures vary by several percent between
server starts, more than the effect; ``--micro`` therefore also measures, in this
process, the CPU time tracing and the request log add per request (building the spans,
the exporter's thread encoding and sending them, the log line), to set against a
request's CPU time.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx


class _Sink(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def _serve(model: str, port: int, extra: list[str]) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "ember.cli", "serve", "--model", model,
                             "--port", str(port), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the server did not start")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its threads (Linux /proc)."""
    import os

    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _load(port: int, model: str, args: argparse.Namespace, pid: int) -> tuple[float, float]:
    url = f"http://127.0.0.1:{port}/v1/chat/completions"

    def one(i: int) -> int:
        r = httpx.post(url, timeout=300, json={
            "model": model, "max_tokens": args.max_tokens, "temperature": 0.8, "seed": i,
            "messages": [{"role": "user", "content": f"Tell story number {i} about a fox."}]})
        return r.json()["usage"]["completion_tokens"]

    with ThreadPoolExecutor(args.clients) as pool:
        list(pool.map(one, range(args.clients)))  # warm
        start, cpu = time.perf_counter(), _cpu_seconds(pid)
        tokens = sum(pool.map(one, range(args.requests)))
        wall, cpu = time.perf_counter() - start, _cpu_seconds(pid) - cpu
    return tokens / wall, 1000 * cpu / tokens


def micro(endpoint: str, n: int = 2000, chunks: int = 2) -> float:
    """CPU seconds that tracing + the request log add per request (all threads)."""
    from ember.engine.output import RequestOutput
    from ember.engine.request import Timeline
    from ember.server.telemetry import RequestRecord, Telemetry

    with tempfile.TemporaryDirectory() as tmp:
        telemetry = Telemetry(endpoint, request_log=f"{tmp}/log.jsonl")
        now = time.monotonic()
        timeline = Timeline(chunks=[(now + i * .05, now + i * .05 + .04, 512 * i, 512)
                                    for i in range(chunks)], decode_steps=95,
                            arrival_time=now, admitted_time=now + .001,
                            first_token_time=now + .1, finished_time=now + 1.0)
        out = RequestOutput("req-1", "x" * 400, list(range(96)), 1024, 0, True, "length",
                            timeline=timeline)
        record = RequestRecord("/v1/chat/completions", "tenant-a", now, {}, now + .001,
                               "smollm2-135m", None, {"max_tokens": 96, "temperature": 0.8})
        start = time.process_time()
        for _ in range(n):
            telemetry.finished(record, [out], 200, None, now + 1.01)
        telemetry.close()  # waits for the exporter to send everything
        return (time.process_time() - start) / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--micro", action="store_true",
                   help="only the in-process cost per request")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--port", type=int, default=8190)
    args = p.parse_args()
    sink = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{sink.server_address[1]}/v1/traces"
    if args.micro:
        per = micro(endpoint)
        print(f"tracing + request log: {per * 1e6:.0f} µs of CPU per request (a request "
              f"with 2 prefill chunks and 96 output tokens: 9 spans and a log line)")
        return
    figures: dict[str, list[float]] = {"off": [], "on": []}
    cpu: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
                extra = [] if mode == "off" else [
                    "--otlp-traces-endpoint", endpoint, "--request-log", f"{tmp}/log.jsonl"]
                proc = _serve(args.model, args.port, extra)
                try:
                    rate, per_k = _load(args.port, args.model, args, proc.pid)
                finally:
                    proc.terminate()
                    proc.wait(30)
                figures[mode].append(rate)
                cpu[mode].append(per_k)
                print(f"round {r + 1} tracing {mode}: {rate:.1f} tok/s, "
                      f"{per_k:.3f} CPU s per 1k tokens", flush=True)
    off, on = statistics.median(figures["off"]), statistics.median(figures["on"])
    c_off, c_on = statistics.median(cpu["off"]), statistics.median(cpu["on"])
    print(f"median tok/s: off {off:.1f}, on {on:.1f}; on/off {on / off:.3f}")
    print(f"median CPU s per 1k tokens: off {c_off:.3f}, on {c_on:.3f}; "
          f"on/off {c_on / c_off:.3f}")


if __name__ == "__main__":
    main()
