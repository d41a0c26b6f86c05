"""``ember bench simulate``: the discrete-event cluster model against queueing theory and
against hand-computed timelines."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from ember.bench.goodput import Objectives
from ember.bench.simulate import (
    Cluster,
    SimRequest,
    Simulation,
    md1_wait,
    requests_of_trace,
    synthetic,
)
from ember.engine.costs import Coefficients, StepCostModel, StepShape

# a step costs 10 ms plus 0.1 ms per token: nothing depends on context or rows
FLAT = Coefficients(base=0.010, per_token=0.0001, per_row=0.0, per_attended=0.0,
                    verify_call=0.0, per_logit=0.0, per_excess=0.0, per_draft=0.0, knee=1)


def _service(prompt: int, output: int) -> float:
    """One request alone: one prefill step, then a step per further token."""
    model = StepCostModel(FLAT, learn=False)
    prefill = model.predict(StepShape(prompt, 1, 0, logits=1))
    return prefill + (output - 1) * model.predict(StepShape(1, 1, 0, decode_rows=1, logits=1))


def test_one_request_takes_its_steps_and_nothing_else() -> None:
    sim = Simulation(Cluster(costs=FLAT), [SimRequest(1.0, 64, 4)])
    sim.run()
    (r,) = sim.requests
    assert r.ttft == pytest.approx(0.010 + 64e-4)
    assert r.end - r.arrival == pytest.approx(_service(64, 4))


@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_one_at_a_time_with_poisson_arrivals_is_an_md1_queue(rho: float) -> None:
    """max_num_seqs=1: requests are served one after another in a fixed time D, so the
    mean wait before service is the Pollaczek–Khinchine ρD / 2(1-ρ)."""
    service = _service(64, 4)
    rate = rho / service
    sim = Simulation(Cluster(costs=FLAT, max_num_seqs=1), synthetic(rate, 20_000, 64, 4))
    sim.run()
    waits = [r.started - r.arrival for r in sim.requests]
    assert statistics.fmean(waits) == pytest.approx(md1_wait(rate, service), rel=0.06)


def test_a_handed_over_prompt_waits_for_its_transfer_and_decodes_elsewhere() -> None:
    """Static disaggregation on 2 replicas: prefill (minus the last block's tail) on the
    prefill replica, then coordination and transfer, then the tail and the first token
    on the other."""
    c = Cluster(replicas=2, costs=FLAT, prefill_replicas=1, policy="always",
                bandwidth_bps=1e9, coordination_s=0.003, kv_bytes_per_token=10_000)
    sim = Simulation(c, [SimRequest(0.0, 101, 3)])
    out = sim.run()
    (r,) = sim.requests
    handed = 96  # the full blocks before the last token
    expected = ((0.010 + handed * 1e-4) + 0.003 + handed * 10_000 / 1e9
                + (0.010 + (101 - handed) * 1e-4))
    assert r.prefill_on == 0 and r.replica == 1 and out["disaggregated"] == 1
    assert r.ttft == pytest.approx(expected)


def test_more_replicas_more_goodput_and_the_rule_never_loses_to_colocation() -> None:
    slo = Objectives(ttft=2.0, tpot=0.1)
    reqs = synthetic(90.0, 1200, 256, 32, seed=1)  # one replica serves ~29 per second

    def goodput(**kw) -> float:
        fresh = [SimRequest(r.arrival, r.prompt, r.output) for r in reqs]
        return Simulation(Cluster(costs=FLAT, kv_bytes_per_token=20_000, **kw), fresh,
                          slo).run()["goodput_rps"]

    one, four = goodput(replicas=1), goodput(replicas=4)
    assert four > 2 * one
    assert goodput(replicas=4, prefill_replicas="auto") >= 0.98 * four


def test_a_bench_serve_trace_replays_its_completed_requests(tmp_path: Path) -> None:
    rec = {"sent": 0.5, "status": "ok", "prompt_tokens": 120, "output_tokens": 7,
           "cached_tokens": 64, "kind": "chat"}
    steps = [{"records": [rec, {**rec, "status": "rejected", "prompt_tokens": 0}],
              "goodput_rps": 1.0}]
    path = tmp_path / "serve.json"
    path.write_text(json.dumps({"steps": steps}))
    ((r,),) = requests_of_trace(path)
    assert (r.arrival, r.prompt, r.output, r.cached, r.kind) == (0.5, 120, 7, 64, "chat")


def test_the_command_prints_and_writes_each_point(tmp_path: Path) -> None:
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"coefficients": FLAT.__dict__}))
    out = tmp_path / "sim.json"
    run = subprocess.run(
        [sys.executable, "-m", "ember.cli", "bench", "simulate", "--costs", str(costs),
         "--prompt-tokens", "500", "--rates", "2,4", "--requests", "50", "--replicas", "1,2",
         "--prefill-replicas", "off,auto", "--out", str(out)],
        capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 8 and all(r["requests"] == 50 for r in rows)
    assert "goodput" in run.stdout
