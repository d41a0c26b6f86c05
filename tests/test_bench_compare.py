"""``ember bench compare``: the parts that do not depend on timing.

The llama.cpp driver's protocol and its 'unavailable' answers; llama.cpp's native
binaries' output (captured once from the real binaries: tests/llamacpp_output/), its
mapping onto ember's figures, the ratios against the anchor, the peak-RSS poller;
ember's measurement functions on the tiny model, the speculation rows and their
refusal for synth models, and the weight-bytes bookkeeping. Nothing asserts a speed.
A real llama.cpp run is exercised only when ``EMBER_LLAMA_PYTHON`` names an
interpreter that has llama_cpp, or ``EMBER_LLAMA_BENCH`` the directory of its
llama-bench and llama-batched-bench binaries.
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
from native import require_kernels

from ember import kernels
from ember.bench import bandwidth, compare, synth
from ember.bench import llamacpp_native as native
from ember.bench.synth import Shape
from ember.models.gguf import GGUFFile

HAS_LLAMA_HERE = importlib.util.find_spec("llama_cpp") is not None
LLAMA_PYTHON = os.environ.get("EMBER_LLAMA_PYTHON")
LLAMA_BENCH = os.environ.get("EMBER_LLAMA_BENCH")
OUTPUT = Path(__file__).parent / "llamacpp_output"  # captured from the real binaries
BENCH_JSON = OUTPUT / "llama-bench.json"  # -p 16,32 -n 7
BATCHED_JSONL = OUTPUT / "llama-batched-bench.jsonl"  # -c 76 -npp 16 -ntg 3 -npl 1,2,4
IK_BATCHED = OUTPUT / "ik-llama-batched-bench.txt"  # the same, ik_llama.cpp's, 2>&1


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
    from ember.models.loader import load_model

    require_kernels()
    loaded = load_model(str(tiny_gguf), "q4")
    assert compare.ember_weight_bytes(loaded.model) == compare.gguf_step_bytes(GGUFFile(tiny_gguf))


def test_the_streams_of_a_batched_run_prefill_in_one_step_however_slow_the_model(
        make_tiny_engine, tiny_gguf: Path) -> None:
    """The timed window must be S streams decoding together: a serving-style cap on
    prompt steps would let the first streams decode while the last still prefill."""
    spec = compare.build_spec(_tokens(tiny_gguf), prefill=[], decode_prompt=4,
                              decode_tokens=0, streams=[4], stream_prompt=12, stream_gen=3)
    engine = make_tiny_engine(**compare.engine_options(spec))
    costs = engine.scheduler.costs
    costs.predict = lambda shape: 0.2 * shape.tokens  # a model far slower than 0.5 s
    reqs = [engine.add_request(p, compare._greedy(3)) for p in spec["batched"][0]["prompts"]]
    engine.step()
    assert all(r.first_token_time is not None for r in reqs)
    while engine.has_unfinished():
        engine.step()


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
    b = bandwidth.measure_bandwidth(1, nbytes=1 << 22, reps=3)
    assert len(b["gb_s"]) == 3 and len(b["check_gb_s"]) == 3
    assert b["median_gb_s"] == sorted(b["gb_s"])[1] > 0 and min(b["check_gb_s"]) > 0


def test_each_decode_is_priced_by_the_passes_around_its_own_run() -> None:
    """Reps decoding 2 GB/s beside 2.5 GB/s and 1.6 beside 2.0 are both 80% of what the
    machine read then, whatever the run's overall median ceiling; a run with no passes
    around it (a spec row) does not count."""
    def run(tok_s: float, around: float | None) -> dict:
        r = {"decode": {"tokens": 100, "seconds": 100 / tok_s}}
        return r if around is None else {**r, "read_gb_s_around": around}

    step = 10**8  # bytes per step: 20 tok/s reads 2 GB/s
    runs = [run(20, 2.5), run(16, 2.0), run(30, 3.0), run(5, None)]
    assert compare.fraction_nearby(runs, step) == pytest.approx(0.8)
    assert compare.fraction_nearby([run(5, None)], step) is None


def _run_main(tiny_gguf: Path, out: Path, llama_python: str | None, **kw) -> dict:
    kw.setdefault("spec_rows", False)
    return compare.main(str(tiny_gguf), ["f32"], threads=1, reps=kw.pop("reps", 2), out=out,
                        llama_python=llama_python, prefill=[8], decode_tokens=4, streams=[2],
                        stream_prompt=4, stream_gen=3, decode_prompt=4, command="test",
                        bandwidth_bytes=1 << 22, **kw)


def test_compare_without_llama_reports_ember_only(tiny_gguf: Path, tiny_loaded,
                                                  tmp_path: Path, capsys) -> None:
    result = _run_main(tiny_gguf, tmp_path / "c.json", str(tmp_path / "no-python"),
                       llama_bench=str(tmp_path / "no-llama-bench"))
    printed = capsys.readouterr().out
    assert "pip install 'ember[llamacpp]'" in printed and "--llama-python" in printed
    assert "llama.cpp binaries unavailable: no llama-bench at" in printed
    assert json.loads((tmp_path / "c.json").read_text()) == json.loads(json.dumps(result))
    assert result["llama"]["available"] is False and result["ratios_vs_llama"] == {}
    assert result["llama_native"]["available"] is False and result["anchor"] is None
    ember = result["results"]["ember-f32"]
    assert set(ember["median_tok_s"]) == {"prefill_8", "decode_1", "decode_2"}
    assert len(ember["runs"]) == 2 and ember["peak_rss_bytes"] > 0
    # the record says which kernels ran (an EMBER_KERNEL_ISA run is not a native one)
    assert ember["init"]["kernels"] == kernels.describe()
    assert f"ember-f32 kernels {kernels.describe()}" in printed
    assert ember["weight_bytes_per_step"] == compare.ember_weight_bytes(tiny_loaded.model)
    assert result["cache_reach"]["bytes"] == []  # nothing probed below a 4 MiB ceiling tensor
    # every timed run sits between two ceiling measurements of its own
    assert len(result["bandwidth"]) == 1 + 2 * 2
    assert all(r["read_gb_s_around"] > 0 for r in ember["runs"])
    assert ember["decode_1_fraction_nearby"] == compare.fraction_nearby(
        ember["runs"], ember["weight_bytes_per_step"])


def test_cli_rejects_unknown_weight_format(capsys) -> None:
    from ember.cli import main

    assert main(["bench", "compare", "--weights", "q4,nope"]) == 1
    assert "nope" in capsys.readouterr().err


@pytest.mark.skipif(not LLAMA_PYTHON, reason="set EMBER_LLAMA_PYTHON to an interpreter "
                                             "with llama_cpp to run this")
def test_compare_with_real_llama_cpp(tiny_gguf: Path, tmp_path: Path) -> None:
    result = _run_main(tiny_gguf, tmp_path / "c.json", LLAMA_PYTHON)
    assert result["llama"]["available"] is True, result["llama"]
    assert result["anchor"] == compare.BINDING
    llama = result["results"][compare.BINDING]
    assert set(llama["median_tok_s"]) == {"prefill_8", "decode_1", "decode_2"}
    assert llama["peak_rss_bytes"] > 0
    assert set(result["ratios_vs_llama"]["ember-f32"]) == set(llama["median_tok_s"])
    assert [b["tokens"] for b in llama["runs"][0]["batched"]] == [2 * 2]


# ---------------------------------------------------------------- llama.cpp's binaries
def _bench_tests() -> list[dict]:
    return json.loads(BENCH_JSON.read_text())


def _batched_rows() -> list[dict]:
    return [json.loads(x) for x in BATCHED_JSONL.read_text().splitlines() if x.strip()]


def test_parse_llama_bench_json_from_the_real_binary() -> None:
    parsed = native.parse_bench_json(BENCH_JSON.read_text())
    tests = _bench_tests()
    assert [p["tokens"] for p in parsed["prefill"]] == [16, 32]
    assert parsed["decode"]["tokens"] == 7
    # tokens / seconds is llama-bench's own tok/s (avg_ts) for every test
    rates = [p["tokens"] / p["seconds"] for p in parsed["prefill"]]
    rates.append(parsed["decode"]["tokens"] / parsed["decode"]["seconds"])
    assert rates == pytest.approx([t["avg_ts"] for t in tests], rel=1e-5)
    assert parsed["meta"]["build_commit"] == tests[0]["build_commit"]
    assert parsed["meta"]["type_k"] == "f16" and parsed["meta"]["n_ubatch"] == 512


def test_parse_llama_batched_bench_jsonl_from_the_real_binary() -> None:
    parsed = native.parse_batched_jsonl(BATCHED_JSONL.read_text())
    rows = _batched_rows()
    assert [b["streams"] for b in parsed["batched"]] == [1, 2, 4]
    assert [b["tokens"] for b in parsed["batched"]] == [3, 6, 12]  # S * tg
    # tokens / seconds is its S_TG column (speed_tg)
    assert [b["tokens"] / b["seconds"] for b in parsed["batched"]] == pytest.approx(
        [r["speed_tg"] for r in rows], rel=1e-4)
    assert parsed["n_kv_max"] == rows[0]["n_kv_max"] == 1024


def test_parse_ik_llama_batched_bench_table_from_the_real_binary() -> None:
    """ik_llama.cpp's batched bench prints a markdown table (no JSONL): the same rows."""
    parsed = native.parse_batched_jsonl(IK_BATCHED.read_text())
    assert [b["streams"] for b in parsed["batched"]] == [1, 2, 4]
    assert [b["tokens"] for b in parsed["batched"]] == [3, 6, 12]
    assert [b["speed_tg"] for b in parsed["batched"]] == [125.67, 204.51, 410.24]
    assert [b["seconds"] for b in parsed["batched"]] == [0.024, 0.029, 0.029]
    assert parsed["n_kv_max"] == 256 and parsed["meta"]["n_threads"] == 2


def test_ik_llama_flags() -> None:
    """The fork's flags: -fa 0|1 and -rtr for repacking (mainline: --repack 0 to stop it)."""
    bins = native.Binaries(Path("llama-bench"), Path("llama-batched-bench"), ik=True)
    sizes = native.Sizes((16,), 7, (2,), 16, 3)
    argv = native.bench_argv(bins, "m.gguf", 2, sizes, "auto", repack=True)
    assert argv[argv.index("-fa") + 1] == "1" and argv[argv.index("-rtr") + 1] == "1"
    argv = native.bench_argv(bins, "m.gguf", 2, sizes, "off", repack=False)
    assert argv[argv.index("-fa") + 1] == "0" and "--repack" not in argv
    assert "-rtr" in native.batched_argv(bins, "m.gguf", 2, sizes, "on", repack=True)
    assert "--no-repack" not in native.batched_argv(bins, "m.gguf", 2, sizes, "on", False)


def test_native_output_maps_onto_embers_keys() -> None:
    """The two binaries' output becomes one run reply that ``summarize`` turns into the
    same keys as ember's: prefill_P, decode_1 (llama-bench tg), decode_S (S_TG), for
    the stream counts asked for only."""
    sizes = native.Sizes((16, 32), 7, (2, 4), 16, 3)
    reply = native.to_reply({native.BENCH: BENCH_JSON.read_text(),
                             native.BATCHED: BATCHED_JSONL.read_text()}, sizes)
    medians = compare.summarize([reply])["median_tok_s"]
    tests, rows = _bench_tests(), _batched_rows()
    assert medians == pytest.approx({
        "prefill_16": tests[0]["avg_ts"], "prefill_32": tests[1]["avg_ts"],
        "decode_1": tests[2]["avg_ts"],  # llama-bench's tg, not batched-bench's 1 stream
        "decode_2": rows[1]["speed_tg"], "decode_4": rows[2]["speed_tg"]}, rel=1e-4)
    assert reply["n_kv_max"] == 1024 and set(reply["meta"]) == {native.BENCH, native.BATCHED}


def test_native_output_missing_a_figure_is_an_error() -> None:
    outputs = {native.BENCH: BENCH_JSON.read_text(), native.BATCHED: BATCHED_JSONL.read_text()}
    with pytest.raises(native.NativeError, match="npl 8"):
        native.to_reply(outputs, native.Sizes((16,), 7, (2, 8), 16, 3))
    with pytest.raises(native.NativeError, match="pp64"):
        native.to_reply(outputs, native.Sizes((64,), 7, (), 0, 0))
    with pytest.raises(native.NativeError, match="no JSON"):
        native.parse_bench_json("main: error: failed to load model\n")


def test_llama_ctx_is_what_llama_cpp_allocated() -> None:
    """The fixture ran ``-c 76 -npl 1,2,4``: llama.cpp reported n_kv_max 1024 (76 rounds
    to 256, split in 4 sequences of 64, each rounded up to 256)."""
    assert native.llama_ctx(76, 4) == _batched_rows()[0]["n_kv_max"] == 1024
    sizes = native.Sizes((), 0, (1, 2, 4), 16, 3)
    assert sizes.batched_ctx() == 256  # 4 * (16 + 3), rounded up as llama.cpp would
    assert sizes.contexts() == {native.BATCHED: 1024}
    assert native.llama_ctx(1008, 16) == 16 * 256 and native.llama_ctx(600) == 768


def test_command_lines_follow_the_sizes(tiny_gguf: Path) -> None:
    spec = compare.build_spec(_tokens(tiny_gguf), prefill=[128, 600], decode_prompt=32,
                              decode_tokens=128, streams=[4, 16], stream_prompt=32,
                              stream_gen=32)
    sizes = native.Sizes.of(spec)
    assert sizes == native.Sizes((128, 600), 127, (4, 16), 32, 31)
    bins = native.Binaries(Path("/x/llama-bench"), Path("/x/llama-batched-bench"))
    bench = native.bench_argv(bins, "m.gguf", 2, sizes)
    assert bench == ["/x/llama-bench", "-m", "m.gguf", "-t", "2", "-p", "128,600", "-n", "127",
                     "-r", "1", "-o", "json", "-fa", "auto", "-ub", "600", "-b", "2048"]
    batched = native.batched_argv(bins, "m.gguf", 2, sizes, flash_attn="off", repack=False)
    assert batched == ["/x/llama-batched-bench", "-m", "m.gguf", "-t", "2", "-c", "1024",
                       "-npp", "32", "-ntg", "31", "-npl", "4,16", "--output-format", "jsonl",
                       "-fa", "off", "--no-repack"]
    assert native.bench_argv(bins, "m.gguf", 2, sizes, repack=False)[-2:] == ["--repack", "0"]
    assert native.batched_argv(native.Binaries(bins.bench, None), "m.gguf", 2, sizes) is None
    # ember's pool is given llama-batched-bench's KV cells (16 sequences of 256)
    kv_tokens = max(sizes.contexts().values())
    assert kv_tokens == 4096
    assert compare.engine_options(spec, kv_tokens)["num_kv_blocks"] * 16 == kv_tokens


def test_locate_binaries(tmp_path: Path) -> None:
    with pytest.raises(native.NativeError, match="no llama-bench at"):
        native.locate(str(tmp_path / "nowhere"))
    with pytest.raises(native.NativeError, match="not an executable llama-bench"):
        native.locate(str(tmp_path))  # a directory without it
    _fake_binaries(tmp_path, batched=False)
    bins = native.locate(str(tmp_path))
    assert bins.bench == (tmp_path / "llama-bench").resolve() and bins.batched is None
    assert bins.version == "version: fake"


def _fake_binaries(where: Path, batched: bool = True) -> Path:
    """Scripts named like llama.cpp's binaries that record their arguments and print the
    captured output of the real ones."""
    for name, fixture in (("llama-bench", BENCH_JSON), ("llama-batched-bench", BATCHED_JSONL)):
        if name == "llama-batched-bench" and not batched:
            continue
        script = where / name
        script.write_text(f'#!/bin/sh\necho "$@" >> "{where / (name + ".argv")}"\n'
                          'if [ "$1" = --version ]; then echo "version: fake" >&2; exit 0; fi\n'
                          f'cat "{fixture}"\n')
        script.chmod(0o755)
    return where


def test_compare_anchored_on_native_binaries(tiny_gguf: Path, tmp_path: Path, capsys) -> None:
    """With --llama-bench, llama.cpp's binaries are a side of their own (here stand-ins
    printing the real binaries' output): run once per repetition with the sizes asked
    for, their command lines recorded, every ratio against them, ember's KV pool as
    large as their largest context."""
    (tmp_path / "bin").mkdir()
    bins = _fake_binaries(tmp_path / "bin")
    result = compare.main(str(tiny_gguf), ["f32"], threads=1, reps=2, out=tmp_path / "c.json",
                          llama_python=None, prefill=[16, 32], decode_tokens=8,
                          streams=[2, 4], stream_prompt=16, stream_gen=4, decode_prompt=4,
                          command="test", bandwidth_bytes=1 << 22, llama_bench=str(bins),
                          spec_rows=False)
    printed = capsys.readouterr().out
    assert result["anchor"] == compare.NATIVE and result["llama"]["available"] is False
    assert "ratio columns (/llama.cpp)" in printed and "llama-bench, llama-batched-bench" in printed
    tests, rows = _bench_tests(), _batched_rows()
    llama = result["results"][compare.NATIVE]
    assert llama["median_tok_s"] == pytest.approx({
        "prefill_16": tests[0]["avg_ts"], "prefill_32": tests[1]["avg_ts"],
        "decode_1": tests[2]["avg_ts"], "decode_2": rows[1]["speed_tg"],
        "decode_4": rows[2]["speed_tg"]}, rel=1e-4)
    ember = result["results"]["ember-f32"]["median_tok_s"]
    assert result["ratios_vs_llama"] == {"ember-f32": pytest.approx(
        {k: v / llama["median_tok_s"][k] for k, v in ember.items()})}
    # --version, then a warm-up and 2 repetitions: one process per binary each time
    argv = {n: (bins / f"{n}.argv").read_text().splitlines()
            for n in ("llama-bench", "llama-batched-bench")}
    assert argv["llama-bench"] == ["--version"] + 3 * [
        f"-m {tiny_gguf} -t 1 -p 16,32 -n 7 -r 1 -o json -fa auto"]
    batched = (f"-m {tiny_gguf} -t 1 -c 256 -npp 16 -ntg {{}} -npl 2,4 --output-format jsonl "
               "-fa auto")
    assert argv["llama-batched-bench"] == [batched.format(2), batched.format(3),
                                           batched.format(3)]  # the warm-up is shorter
    assert result["llama_native"]["commands"]["llama-bench"].endswith(argv["llama-bench"][2])
    assert len(llama["runs"]) == 2 and llama["peak_rss_bytes"] > 0
    procs = llama["runs"][0]["processes"]
    assert procs["llama-bench"]["command"] == result["llama_native"]["commands"]["llama-bench"]
    assert procs["llama-batched-bench"]["meta"]["n_kv_max"] == 1024
    # ember's KV pool holds llama-batched-bench's 4 x 256 cells
    kv = result["kv_context"]
    assert kv["ember_pool_tokens"] == {"ember-f32": 1024}
    assert kv["llama.cpp"]["predicted"]["llama-batched-bench"] == 1024
    assert kv["llama.cpp"]["llama-batched-bench n_kv_max"] == [1024]


def test_a_failing_native_binary_is_left_out(tiny_gguf: Path, tmp_path: Path,
                                             capsys) -> None:
    bins = _fake_binaries(tmp_path)
    (bins / "llama-batched-bench").write_text(
        "#!/bin/sh\necho 'main: error: failed to create the llama_context' >&2\nexit 1\n")
    result = _run_main(tiny_gguf, tmp_path / "c.json", None, llama_bench=str(bins), reps=1)
    printed = capsys.readouterr().out
    assert "llama.cpp failed" in printed and "failed to create the llama_context" in printed
    assert result["llama_native"]["available"] is False
    assert "exited with 1" in result["llama_native"]["reason"]
    assert result["anchor"] is None and set(result["results"]) == {"ember-f32"}


@pytest.mark.skipif(not LLAMA_BENCH, reason="set EMBER_LLAMA_BENCH to the directory of "
                                            "llama-bench and llama-batched-bench to run this")
def test_compare_with_real_llama_cpp_binaries(tiny_gguf: Path, tmp_path: Path) -> None:
    result = _run_main(tiny_gguf, tmp_path / "c.json", None, llama_bench=LLAMA_BENCH)
    assert result["llama_native"]["available"] is True, result["llama_native"]
    assert result["anchor"] == compare.NATIVE
    llama = result["results"][compare.NATIVE]
    assert set(llama["median_tok_s"]) == {"prefill_8", "decode_1", "decode_2"}
    assert set(result["ratios_vs_llama"]["ember-f32"]) == set(llama["median_tok_s"])
    for name in ("llama-bench", "llama-batched-bench"):
        proc = llama["runs"][0]["processes"][name]
        assert proc["returncode"] == 0 and proc["peak_rss_bytes"] > 0
    assert result["kv_context"]["llama.cpp"]["llama-batched-bench n_kv_max"] == [
        result["kv_context"]["ember_pool_tokens"]["ember-f32"]]


# ---------------------------------------------------------------- peak RSS
MiB = 1 << 20


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux's /proc")
def test_peak_rss_poller_measures_the_child_not_the_launcher() -> None:
    """A child that writes 64 MiB, frees it and lives on peaks 64 MiB above one that does
    not (the high-water mark keeps a peak shorter than a poll); the launcher's 256 MiB,
    which wait4's ru_maxrss carries into the child, is not counted."""
    held = bytes(range(256)) * (256 * MiB // 256)  # this process's high-water mark
    alloc = "import time; b = bytes(range(256)) * ({n} // 256); del b; time.sleep(0.3)"
    # polls 0.25 s apart: the 64 MiB live for a fraction of that, between two polls
    base = native.run_with_peak_rss([sys.executable, "-c", alloc.format(n=256)], poll_s=0.25)
    grown = native.run_with_peak_rss([sys.executable, "-c", alloc.format(n=64 * MiB)],
                                     poll_s=0.25)
    assert base.returncode == grown.returncode == 0
    assert grown.peak_rss_bytes - base.peak_rss_bytes == pytest.approx(64 * MiB, abs=6 * MiB)
    assert grown.peak_rss_bytes < 200 * MiB
    assert grown.launcher_hwm_bytes >= len(held)
    assert grown.ru_maxrss_bytes >= len(held)  # the reason ru_maxrss is not the figure
    del held


def test_peak_rss_poller_reports_exit_status_and_output() -> None:
    run = native.run_with_peak_rss([sys.executable, "-c",
                                    "import sys; print('out'); print('err', file=sys.stderr); "
                                    "sys.exit(3)"])
    assert (run.returncode, run.stdout, run.stderr) == (3, "out\n", "err\n")
    assert run.wall_s > 0 and run.record()["returncode"] == 3


# ---------------------------------------------------------------- ratios, bandwidth
def test_ratios_are_against_the_native_anchor() -> None:
    medians = {"ember-q4": {"prefill_128": 300.0, "decode_1": 30.0, "decode_4": 80.0,
                            "spec_on_qa": 60.0, "spec_off_qa": 31.0},
               compare.BINDING: {"prefill_128": 110.0, "decode_1": 18.0, "decode_4": 50.0},
               compare.NATIVE: {"prefill_128": 100.0, "decode_1": 20.0, "decode_4": 40.0}}
    assert compare.anchor_of(list(medians)) == compare.NATIVE
    assert compare.anchor_of(["ember-q4", compare.BINDING]) == compare.BINDING
    assert compare.anchor_of(["ember-q4"]) is None
    ratios = compare.ratios_against(medians, compare.NATIVE)
    assert ratios == {
        "ember-q4": {"prefill_128": 3.0, "decode_1": 1.5, "decode_4": 2.0,
                     "spec_on_qa": 3.0, "spec_off_qa": 1.55},  # spec rows ÷ plain decode_1
        compare.BINDING: {"prefill_128": 1.1, "decode_1": 0.9, "decode_4": 1.25}}
    assert compare.ratios_against(medians, None) == {}
    without = {k: v for k, v in medians.items() if k != compare.NATIVE}
    assert compare.ratios_against(without, compare.BINDING)["ember-q4"]["decode_4"] == 1.6


def test_bandwidth_ceiling_is_the_median_of_every_pass() -> None:
    """One outlier pass (79.9 GB/s among 46-50) moves neither the ceiling nor the check."""
    m = [{"method": "m", "gb_s": [47.0, 48.0, 79.9, 46.0, 49.0], "check_gb_s": [44.0] * 5},
         {"method": "m", "gb_s": [50.0, 47.0, 48.0, 46.0, 49.0], "check_gb_s": [45.0] * 5}]
    c = bandwidth.bandwidth_ceiling(m)
    assert (c["gb_s"], c["min_gb_s"], c["max_gb_s"], c["passes"]) == (48.0, 46.0, 79.9, 10)
    assert c["check_gb_s"] == 44.5 and c["check_agrees"] is True
    m[1]["check_gb_s"] = m[0]["check_gb_s"] = [20.0] * 5
    assert bandwidth.bandwidth_ceiling(m)["check_agrees"] is False


MiB = 1 << 20
# torch.sum by tensor size on a 2-core Xeon VM whose sysfs reports a 480 MiB L3
XEON_REACH = {"bytes": [n * MiB for n in (4, 16, 32, 64, 128, 256, 400, 1024)],
              "gb_s": [104.8, 50.9, 51.5, 52.5, 24.7, 23.5, 23.9, 26.6]}


def test_the_cache_probe_reads_each_size_below_the_ceilings_tensor() -> None:
    r = bandwidth.measure_cache_reach(1, 16 * MiB, read_bytes=8 * MiB)
    assert r["bytes"] == [4 * MiB, 8 * MiB] and min(r["gb_s"]) > 0


def test_the_cache_decode_sees_is_where_reads_fall_to_the_dram_rate() -> None:
    assert bandwidth.cache_reach_bytes(XEON_REACH, 25.1) == 64 * MiB
    bounced = {**XEON_REACH, "gb_s": [104.8, 50.9, 30.0, 52.5, 24.7, 80.0, 23.9, 26.6]}
    assert bandwidth.cache_reach_bytes(bounced, 25.1) == 16 * MiB  # the first fall counts
    assert bandwidth.cache_reach_bytes(XEON_REACH, 80.0) == 0
    assert bandwidth.cache_reach_bytes({"bytes": [], "gb_s": []}, 25.1) == 0


def test_the_cache_note_trusts_the_measured_cache_over_sysfs() -> None:
    sysfs = 480 * MiB
    fits = bandwidth.cache_note(30_000_000, sysfs, 64 * MiB)
    assert fits and "can exceed the DRAM ceiling" in fits and "64 MiB" in fits
    # SmolLM2 (98 MB) inside sysfs's 480 MiB but past the measured 64: a DRAM-bound figure
    dram = bandwidth.cache_note(98_000_000, sysfs, 64 * MiB)
    assert dram and "480 MiB" in dram and "from DRAM" in dram and "exceed" not in dram
    assert "at no probed size" in bandwidth.cache_note(98_000_000, sysfs, 0)
    assert bandwidth.cache_note(740_000_000, sysfs, 64 * MiB) is None
    assert bandwidth.cache_note(740_000_000, None, 0) is None


# ---------------------------------------------------------------- speculation rows
def test_kernel_figures_have_speculation_off(tiny_gguf: Path, tmp_path: Path) -> None:
    spec = compare.build_spec(_tokens(tiny_gguf), [8], 4, 4, [2], 4, 3)
    assert compare.engine_options(spec)["speculation"] == "off"
    result = _run_main(tiny_gguf, tmp_path / "c.json", str(tmp_path / "no-python"), reps=1)
    assert result["results"]["ember-f32"]["init"]["speculation"] == "off"


def test_loops_detects_a_greedy_cycle_only() -> None:
    assert compare.loops([7, 8] * 5 + [1, 2, 3] * 20)
    assert compare.loops(list(range(40)) + [5] * 40)
    assert not compare.loops(list(range(80)))
    assert not compare.loops([1, 2, 3] * 4)  # too short to say
    text = [1, 2, 3, 4, 9, 1, 2, 3, 4, 10, 11, 12, 1, 2, 3, 4, 13, 14, 15, 16] * 2
    assert not compare.loops(text)  # repeats, but no cycle


TINY_SYNTH = Shape("tiny-synth", "llama", hidden=64, n_layers=2, n_heads=4, n_kv_heads=2,
                   head_dim=16, ffn=128, vocab=49152, tied=True, rope_base=1e4, context=2048,
                   norm_eps=1e-5)


def test_spec_refusal_names_the_reason(tiny_gguf: Path) -> None:
    class Fake:
        def __init__(self, metadata: dict) -> None:
            self.metadata = metadata

    synth_name = synth.model_metadata(synth.SHAPES["llama-1b"], "Q4_K_M")
    assert "ember bench synth" in compare.spec_refusal(Fake(
        {**synth_name, "tokenizer.chat_template": "{{ x }}"}))
    assert "no chat template" in compare.spec_refusal(Fake({"general.architecture": "llama"}))
    assert compare.spec_refusal(Fake({"general.architecture": "gemma3"})) is None  # built in
    assert compare.spec_refusal(GGUFFile(tiny_gguf)) is None  # SmolLM2's template


def test_spec_rows_refused_for_a_synth_model(smollm2_file: GGUFFile, tmp_path: Path,
                                             capsys) -> None:
    path = tmp_path / "tiny-synth-Q8_0.gguf"
    synth.write_synth(path, TINY_SYNTH, "Q8_0", smollm2_file)
    gguf = GGUFFile(path)
    assert "tokenizer.chat_template" in gguf.metadata  # so the template alone cannot tell
    reason = compare.spec_refusal(gguf)
    assert reason and "random weights" in reason
    result = _run_main(path, tmp_path / "c.json", str(tmp_path / "no-python"), reps=1,
                       spec_rows=True)
    ember = result["results"]["ember-f32"]
    assert ember["spec"] == {"skipped": reason}
    assert not [k for k in ember["median_tok_s"] if k.startswith("spec_")]
    assert f"spec on: not measured: {reason}" in capsys.readouterr().out


@pytest.mark.slow
def test_spec_rows_on_a_model_with_a_chat_template(tiny_gguf: Path, tmp_path: Path) -> None:
    """The qa and code tasks, speculation on and off, in a worker of their own: the rows
    carry tok/s both ways and the same tokens both ways (greedy speculation is lossless)."""
    result = _run_main(tiny_gguf, tmp_path / "c.json", str(tmp_path / "no-python"), reps=1,
                       spec_rows=True)
    ember = result["results"]["ember-f32"]
    assert {"spec_on_qa", "spec_off_qa", "spec_on_code", "spec_off_code"} <= set(
        ember["median_tok_s"])
    assert ember["init"]["speculation"] == "off"
    assert ember["spec"]["init"]["speculation"] == {"on": "auto", "off": "off"}
    assert set(ember["spec"]["tasks"]) == {"qa", "code"}
    for task in ember["spec"]["tasks"].values():
        assert task["same_output"] is True and task["tokens"] > 0
    [run] = ember["spec"]["runs"]
    assert [r["task"] for r in run["spec"]] == ["qa", "code"]


def test_cli_passes_the_llama_cpp_sides_and_spec_choice(monkeypatch) -> None:
    from ember.cli import main

    seen = {}
    monkeypatch.setattr(compare, "main", lambda *a, **kw: seen.update(kw, args=a))
    assert main(["bench", "compare", "--weights", "f32", "--llama-bench", "/opt/llama/bin",
                 "--no-spec", "--llama-extra-bufts", "off"]) == 0
    assert seen["llama_bench"] == "/opt/llama/bin" and seen["spec_rows"] is False
    assert seen["llama_extra_bufts"] is False and seen["args"][5] is None  # llama_python
    assert main(["bench", "compare", "--weights", "f32"]) == 0
    assert seen["llama_bench"] is None and seen["spec_rows"] is True
