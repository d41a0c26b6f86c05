"""``ember inspect``: the report against gguf-py's reading of the same file, and each
refused part saying why without sinking the rest."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import gguf
import pytest
from llamacpp_source import llamacpp_source

from ember.models.gguf import GGUFFile
from ember.models.inspect import format_report, inspect_gguf


def test_smollm2_report_matches_gguf_py(smollm2_gguf: Path) -> None:
    with GGUFFile(smollm2_gguf) as f:
        report = inspect_gguf(f)
    reader = gguf.GGUFReader(smollm2_gguf)
    counts = Counter(t.tensor_type.name for t in reader.tensors)
    assert {k: v["count"] for k, v in report["tensors"].items()} == dict(counts)
    assert report["tensors"]["Q4_1"]["runs"] == "packed, native kernels"

    def meta(key: str) -> int:
        field = reader.fields[key]
        return int(field.parts[field.data[0]][0])

    layers, kv_heads = meta("llama.block_count"), meta("llama.attention.head_count_kv")
    head_dim = meta("llama.embedding_length") // meta("llama.attention.head_count")
    assert report["kv_bytes_per_token"]["f32"] == 2 * layers * kv_heads * head_dim * 4
    assert report["kv_bytes_per_token"]["f16"] == 2 * layers * kv_heads * head_dim * 2
    assert report["model"]["n_layers"] == layers and report["model"]["options"] == {}
    assert report["tokenizer"]["model"] == "gpt2"
    assert report["tokenizer"]["vocab_size"] == len(reader.fields["tokenizer.ggml.tokens"].data)
    assert report["native"]["fused_stack"] is True
    tpl = report["chat_template"]
    assert tpl["source"] == "gguf" and not tpl["tools"]  # SmolLM2's template takes no tools
    assert "smollm2" in format_report(report).lower() or "SmolLM2" in format_report(report)


def test_a_refused_architecture_still_reports_its_tokenizer(tmp_path: Path) -> None:
    """The bge vocabulary file relabelled as an architecture ember does not run."""
    from hf_gguf import rewrite_gguf

    source = llamacpp_source() / "models" / "ggml-vocab-bert-bge.gguf"
    path = rewrite_gguf(source, tmp_path / "mamba.gguf",
                        add_keys={"general.architecture": "mamba"})
    with GGUFFile(path) as f:
        report = inspect_gguf(f)
    assert "'mamba' is not supported" in report["model"]["refused"]
    assert report["native"]["fused_stack"] is False
    assert report["tokenizer"]["model"] == "bert"
    assert "REFUSED" in format_report(report)


@pytest.mark.slow
def test_cli_prints_json(smollm2_gguf: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "ember.cli", "inspect", str(smollm2_gguf),
                          "--json"], capture_output=True, text=True, check=True).stdout
    report = json.loads(out)
    assert report["architecture"] == "llama" and "Q4_1" in report["tensors"]
