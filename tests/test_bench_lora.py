"""``ember bench lora`` runs end to end (on the tiny model) and reports what it measured;
its random adapters are valid adapters of the rank asked for, and they change tokens."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ember.bench.lora import main, write_random_adapter
from ember.models.loader import load_model
from ember.models.lora import TARGETS, load_lora


def test_random_adapters_fit_the_model_at_their_rank(tiny_gguf, tmp_path) -> None:
    cfg = load_model(str(tiny_gguf), "f32").config
    adapter = load_lora(write_random_adapter(cfg, 3, 0, tmp_path / "a.gguf"), "a", cfg)
    assert adapter.rank == 3 and len(adapter.deltas) == cfg.n_layers * len(TARGETS)


def test_bench_lora_reports_both_runs(tiny_gguf, tmp_path, capsys) -> None:
    out = tmp_path / "lora.json"
    main(str(tiny_gguf), "f32", 1, streams=2, rank=2, prompt_len=6, gen=3, reps=1, out=out)
    result = json.loads(out.read_text())
    assert result["base_median"] > 0 and result["lora_median"] > 0
    assert result["ratio"] == result["lora_median"] / result["base_median"]
    assert result["adapter_bytes"] > 0
    assert "adapters (r=2" in capsys.readouterr().out


LLAMA_BIN = os.environ.get("EMBER_LLAMA_BENCH")  # the directory of llama.cpp's binaries


@pytest.mark.skipif(not LLAMA_BIN, reason="set EMBER_LLAMA_BENCH to the directory of "
                    "llama-server to run this")
def test_bench_lora_runs_llama_server_with_the_same_adapters(tiny_gguf, tmp_path) -> None:
    out = tmp_path / "lora.json"
    main(str(tiny_gguf), "f32", 1, streams=2, rank=2, prompt_len=6, gen=3, reps=1, out=out,
         llama_server=str(Path(str(LLAMA_BIN)) / "llama-server"))
    theirs = json.loads(out.read_text())["llama_server"]
    assert theirs["base_median"] > 0 and theirs["lora_median"] > 0
