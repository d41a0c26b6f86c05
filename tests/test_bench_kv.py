"""``ember bench kv`` runs end to end (on the tiny model) and reports what it measured."""

from __future__ import annotations

import json

from ember.bench.kv import main


def test_bench_kv_reports_every_state(tiny_gguf, tmp_path, capsys):
    out = tmp_path / "kv.json"
    main(str(tiny_gguf), "f32", 1, history=80, reps=1, kv_dtypes=["f32", "f16"],
         drop_caches=False, out=out)
    result = json.loads(out.read_text())["results"]
    assert [r["kv_dtype"] for r in result] == ["f32", "f16"]
    for r in result:
        cached = r["cached_tokens"]
        assert cached["cold"] == 0 and cached["ram"] == cached["disk"] == cached["restart"] > 0
        assert r["restored_bytes"] > 0 and r["ratio_to_cold"]["cold"] == 1.0
    f32, f16 = result
    assert f16["restored_bytes"] * 2 == f32["restored_bytes"]
    assert "crossover" in capsys.readouterr().out
