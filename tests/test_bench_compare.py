"""``ember bench compare``: the parts that do not depend on timing.

The llama.cpp driver's protocol and its 'unavailable' answers, ember's measurement
functions on the tiny model, and the weight-bytes bookkeeping. Nothing asserts a
speed. A real llama.cpp run is exercised only when ``EMBER_LLAMA_PYTHON`` names an
interpreter that has llama_cpp.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ember.bench import compare
from ember.models.gguf import GGUFFile

HAS_LLAMA_HERE = importlib.util.find_spec("llama_cpp") is not None
LLAMA_PYTHON = os.environ.get("EMBER_LLAMA_PYTHON")


def _tokens(gguf_path: Path) -> list[int]:
    from ember.tokenizer import Tokenizer

    return Tokenizer.from_gguf(GGUFFile(gguf_path)).encode(compare.PARAGRAPH)


# ---------------------------------------------------------------- llama.cpp driver
def test_probe_missing_interpreter(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-python")
    r = compare.probe_llama(missing)
    assert r == {"available": False, "python": missing, "reason": f"no interpreter at {missing}"}


def test_probe_interpreter_that_is_not_python(tmp_path: Path) -> None:
    fake = tmp_path / "fake-python"
    fake.write_text("#!/bin/sh\necho 'this is not json'\necho 'boom' >&2\nexit 3\n")
    fake.chmod(0o755)
    r = compare.probe_llama(str(fake))
    assert r["available"] is False
    assert "exit status 3" in r["reason"] and "boom" in r["reason"]


@pytest.mark.skipif(HAS_LLAMA_HERE, reason="llama_cpp is importable in this interpreter")
def test_probe_interpreter_without_llama_cpp() -> None:
    r = compare.probe_llama(sys.executable)
    assert r["available"] is False
    assert "llama_cpp" in r["reason"]


@pytest.mark.skipif(HAS_LLAMA_HERE, reason="llama_cpp is importable in this interpreter")
def test_driver_protocol_reports_errors_as_json() -> None:
    """Every request gets one JSON line; a failed init is an answer, not a crash."""
    lines = [{"cmd": "run"}, {"cmd": "init", "model": "x.gguf", "threads": 1,
                              "prefill_ctx": 64}, {"cmd": "bogus"}, {"cmd": "exit"}]
    proc = subprocess.run([sys.executable, str(compare.DRIVER)],
                          input="".join(json.dumps(m) + "\n" for m in lines),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    replies = [json.loads(x) for x in proc.stdout.splitlines()]
    assert [r["ok"] for r in replies] == [False, False, False, True]
    assert "before 'init'" in replies[0]["error"]
    assert "llama_cpp" in replies[1]["error"]
    assert "unknown command" in replies[2]["error"]
    assert replies[3]["peak_rss_bytes"] > 0


def test_driver_imports_nothing_from_ember() -> None:
    text = compare.DRIVER.read_text()
    assert "import ember" not in text and "from ember" not in text


# ---------------------------------------------------------------- weight bytes
def test_weight_bytes_f32_is_sum_of_tensor_sizes(tiny_loaded, tiny_gguf: Path) -> None:
    gguf = GGUFFile(tiny_gguf)
    names = compare.step_tensor_names(gguf)
    assert "token_embd.weight" in names  # tied: the embedding table is the output head
    expected = sum(4 * gguf.tensor(n).n_elements for n in names)
    assert tiny_loaded.weights == "f32"
    assert compare.ember_weight_bytes(tiny_loaded.model) == expected


def test_weight_bytes_q4_matches_gguf_for_q8_tensors(tiny_gguf: Path) -> None:
    """The tiny model is Q8_0 (34 B per 32 weights, rows a multiple of 8, f32 norms):
    ember's packed form holds exactly the GGUF bytes."""
    from ember import kernels
    from ember.models.loader import load_model

    if not kernels.available():
        pytest.skip(f"native kernels unavailable: {kernels.unavailable_reason()}")
    loaded = load_model(str(tiny_gguf), "q4")
    assert compare.ember_weight_bytes(loaded.model) == compare.gguf_step_bytes(GGUFFile(tiny_gguf))


def test_step_tensors_exclude_untied_embedding() -> None:
    class Fake:
        tensors = {"token_embd.weight": 0, "output.weight": 0, "blk.0.attn_q.weight": 0}

    assert compare.step_tensor_names(Fake()) == ["output.weight", "blk.0.attn_q.weight"]


# ---------------------------------------------------------------- ember side
def test_ember_measurements_on_tiny_model(make_tiny_engine, tiny_gguf: Path) -> None:
    spec = compare.build_spec(_tokens(tiny_gguf), prefill=[8, 20], decode_prompt=4,
                              decode_tokens=6, streams=[2, 3], stream_prompt=5, stream_gen=4)
    opts = compare.engine_options(spec)
    assert opts["max_num_batched_tokens"] >= 20 and opts["max_num_seqs"] == 3
    engine = make_tiny_engine(**opts)
    r = compare.ember_run(engine, spec)
    assert [p["tokens"] for p in r["prefill"]] == [8, 20]
    assert r["decode"]["tokens"] == 5 and len(r["decode"]["ids"]) == 6
    assert [(b["streams"], b["tokens"]) for b in r["batched"]] == [(2, 6), (3, 9)]
    assert all(x["seconds"] > 0 for x in [*r["prefill"], r["decode"], *r["batched"]])
    assert not engine.has_unfinished() and engine.kv.num_used == 0
    s = compare.summarize([r, compare.ember_run(engine, spec)])
    assert set(s["median_tok_s"]) == {"prefill_8", "prefill_20", "decode_1", "decode_2",
                                      "decode_3"}
    assert all(len(v) == 2 for v in s["per_rep_tok_s"].values())
    assert all(math.isfinite(v) and v > 0 for v in s["median_tok_s"].values())


def test_agreement_is_common_prefix() -> None:
    assert compare.agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert compare.agreement([1, 2], [1, 2, 3]) == 2


def test_bandwidth_measurement_is_well_formed() -> None:
    b = compare.measure_bandwidth(1, nbytes=1 << 22, reps=3)
    assert len(b["gb_s"]) == 3 and b["best_gb_s"] == max(b["gb_s"]) > 0


def _run_main(tiny_gguf: Path, out: Path, llama_python: str) -> dict:
    return compare.main(str(tiny_gguf), ["f32"], threads=1, reps=2, out=out,
                        llama_python=llama_python, prefill=[8], decode_tokens=4, streams=[2],
                        stream_prompt=4, stream_gen=3, decode_prompt=4, command="test",
                        bandwidth_bytes=1 << 22)


def test_compare_without_llama_reports_ember_only(tiny_gguf: Path, tiny_loaded,
                                                  tmp_path: Path, capsys) -> None:
    result = _run_main(tiny_gguf, tmp_path / "c.json", str(tmp_path / "no-python"))
    printed = capsys.readouterr().out
    assert "pip install 'ember[llamacpp]'" in printed and "--llama-python" in printed
    assert json.loads((tmp_path / "c.json").read_text()) == json.loads(json.dumps(result))
    assert result["llama"]["available"] is False and result["ratios_vs_llama"] == {}
    ember = result["results"]["ember-f32"]
    assert set(ember["median_tok_s"]) == {"prefill_8", "decode_1", "decode_2"}
    assert len(ember["runs"]) == 2 and ember["peak_rss_bytes"] > 0
    assert ember["weight_bytes_per_step"] == compare.ember_weight_bytes(tiny_loaded.model)


def test_cli_rejects_unknown_weight_format(capsys) -> None:
    from ember.cli import main

    assert main(["bench", "compare", "--weights", "q4,nope"]) == 1
    assert "nope" in capsys.readouterr().err


@pytest.mark.skipif(not LLAMA_PYTHON, reason="set EMBER_LLAMA_PYTHON to an interpreter "
                                             "with llama_cpp to run this")
def test_compare_with_real_llama_cpp(tiny_gguf: Path, tmp_path: Path) -> None:
    result = _run_main(tiny_gguf, tmp_path / "c.json", LLAMA_PYTHON)
    assert result["llama"]["available"] is True, result["llama"]
    llama = result["results"]["llama.cpp"]
    assert set(llama["median_tok_s"]) == {"prefill_8", "decode_1", "decode_2"}
    assert llama["peak_rss_bytes"] > 0
    assert set(result["ratios_vs_llama"]["ember-f32"]) == set(llama["median_tok_s"])
    assert [b["tokens"] for b in llama["runs"][0]["batched"]] == [2 * 2]
