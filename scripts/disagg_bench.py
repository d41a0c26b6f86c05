"""Co-located vs disaggregated serving on this machine, and the simulator checked
against each measured point.

    python scripts/disagg_bench.py --out bench-results/disagg [--workloads mix,docqa]
        [--rates 0.2,0.4,0.6] [--duration 40] [--configs single,replicas,auto,static]

For each configuration it starts ``ember serve`` (one process with all the cores;
``--replicas 2``; ``--replicas 2 --prefill-replicas auto``; ``--replicas 2
--prefill-replicas 1 --disagg always``), runs ``ember bench serve`` on each workload at
each rate, stops the server, then replays every measured step in ``ember bench
simulate`` with the step-cost table of the matching thread count (measured first
with ``ember bench spec-cost``) and prints predicted vs measured goodput. Run it on a
quiet machine: it measures for about (configs × workloads × rates × duration) seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

EMBER = [sys.executable, "-m", "ember.cli"]
CONFIGS = {
    "single": ([], 2, "off"),
    "replicas": (["--replicas", "2"], 1, "off"),
    "auto": (["--replicas", "2", "--prefill-replicas", "auto"], 1, "auto"),
    "static": (["--replicas", "2", "--prefill-replicas", "1", "--disagg", "always"], 1, "1"),
}


def _serve(args: list[str], port: int, log: Path) -> subprocess.Popen:
    # the TPOT objective makes every engine cut prompt chunks to keep streams within it
    cmd = [*EMBER, "serve", "--port", str(port), "--num-kv-blocks", "2048",
           "--slo-tpot", "0.15", *args]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ember serve exited: see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=60).raise_for_status()
                if "--replicas" in args:
                    _wait_replicas(port)
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("ember serve never became healthy")


def _wait_replicas(port: int) -> None:
    for _ in range(240):
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        if "\nember_replicas 2" in text:
            return
        time.sleep(0.5)
    raise RuntimeError("the replicas never came up")


def _metrics(port: int) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
        if line.startswith("ember_disagg_") and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench-results/disagg"))
    ap.add_argument("--workloads", default="mix,docqa")
    ap.add_argument("--rates", default="0.2,0.4,0.6")
    ap.add_argument("--duration", type=float, default=40.0)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--slo", default="ttft=5000,tpot=150")
    ap.add_argument("--port", type=int, default=8765)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tables = {}
    for threads in sorted({CONFIGS[c][1] for c in args.configs.split(",")}):
        tables[threads] = args.out / f"step_costs_{threads}t.json"
        if not tables[threads].exists():
            subprocess.run([*EMBER, "bench", "spec-cost", "--threads", str(threads),
                            "--out", str(tables[threads])], check=True)
    summary = []
    for name in args.configs.split(","):
        extra, threads, prefill = CONFIGS[name]
        proc = _serve(extra, args.port, args.out / f"serve-{name}.log")
        try:
            for workload in args.workloads.split(","):
                result = args.out / f"{name}-{workload}.json"
                subprocess.run([*EMBER, "bench", "serve", "--url",
                                f"http://127.0.0.1:{args.port}", "--workload", workload,
                                "--rates", args.rates, "--duration", str(args.duration),
                                "--slo", args.slo, "--label", name, "--out", str(result),
                                "--tenants", "2"], check=True)
                disagg = _metrics(args.port)
                sim = args.out / f"{name}-{workload}-sim.json"
                subprocess.run([*EMBER, "bench", "simulate", "--costs", str(tables[threads]),
                                "--trace", str(result), "--replicas",
                                "1" if name == "single" else "2", "--prefill-replicas",
                                prefill, "--disagg",
                                "always" if name == "static" else "rule",
                                "--slo", args.slo, "--slo-tpot", "0.15", "--out", str(sim)],
                               check=True)
                for row in json.loads(sim.read_text())["rows"]:
                    summary.append({"config": name, "workload": workload, **{
                        k: row.get(k) for k in ("goodput_rps", "measured_goodput_rps",
                                                "error", "disaggregated")}})
                summary[-1]["disagg_metrics"] = disagg
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
