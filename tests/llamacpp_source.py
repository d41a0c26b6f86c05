"""The parts of llama.cpp's source tree the tests use as oracles, fetched once.

llama.cpp's own tokenizer tests (``models/ggml-vocab-*``), its chat templates
(``models/templates/*.jinja``), its HF → GGUF converter (``convert_hf_to_gguf.py`` with
the ``conversion`` package and the ``gguf-py`` it is written against). They come out
of the llama-cpp-python 0.3.36 sdist (``pip download``, ~75 MB, once) and are cached
under ``$EMBER_HOME/llama.cpp-0.3.36``; ``EMBER_LLAMA_CPP_SOURCE`` may point at a
llama.cpp checkout instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from ember.models.registry import ember_home

SDIST_VERSION = "0.3.36"
_PREFIX = "vendor/llama.cpp/"
# What is extracted (paths under llama.cpp's root); a tree missing any is fetched again.
_WANTED = ("models/ggml-vocab-", "models/templates/", "convert_hf_to_gguf.py", "conversion/",
           "gguf-py/gguf/", "convert_lora_to_gguf.py")
_COMPLETE = ("models/ggml-vocab-llama-bpe.gguf.out", "models/templates/llama-cpp-deepseek-r1.jinja",
             "convert_hf_to_gguf.py", "conversion/base.py", "gguf-py/gguf/constants.py",
             "convert_lora_to_gguf.py")


def _extract(dest: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--no-binary", ":all:", f"llama-cpp-python=={SDIST_VERSION}",
                        "-d", tmp], check=True)
        [sdist] = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        staging = dest.with_name(dest.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                _, _, inner = member.name.partition(_PREFIX)
                if not member.isfile() or not inner.startswith(_WANTED):
                    continue
                out = staging / inner
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(tar.extractfile(member).read())  # type: ignore[union-attr]
        staging.rename(dest)  # whole or absent: a killed download leaves no half tree


def llamacpp_source() -> Path:
    """llama.cpp's source root (the parts listed above)."""
    given = os.environ.get("EMBER_LLAMA_CPP_SOURCE")
    if given:
        return Path(given)
    root = ember_home() / f"llama.cpp-{SDIST_VERSION}"
    if not all((root / p).exists() for p in _COMPLETE):
        shutil.rmtree(root, ignore_errors=True)
        _extract(root)
    return root


def convert_hf_to_gguf(model_dir: Path, out: Path, outtype: str = "f32",
                       extra: tuple[str, ...] = ()) -> Path:
    """Run llama.cpp's converter on a transformers checkpoint, with the gguf-py it ships.
    The file is named "tiny-random": llama.cpp keys token attributes on the model's
    name (a "phi3" name wants Phi-3's own special tokens in the vocabulary)."""
    root = llamacpp_source()
    env = {**os.environ, "PYTHONPATH": str(root / "gguf-py"), "HF_HUB_OFFLINE": "1"}
    args = [str(model_dir), "--outtype", outtype, "--outfile", str(out),
            "--model-name", "tiny-random", *extra]
    proc = subprocess.run([sys.executable, str(root / "convert_hf_to_gguf.py"), *args],
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {model_dir}:\n{proc.stderr[-3000:]}")
    return out


def convert_lora_to_gguf(adapter_dir: Path, base_dir: Path, out: Path) -> Path:
    """Run llama.cpp's LoRA converter on a PEFT adapter directory (``base_dir``: the base
    model's config.json), writing an f32 GGUF adapter."""
    root = llamacpp_source()
    env = {**os.environ, "PYTHONPATH": str(root / "gguf-py"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(root / "convert_lora_to_gguf.py"),
                           str(adapter_dir), "--base", str(base_dir), "--outtype", "f32",
                           "--outfile", str(out)], env=env, capture_output=True, text=True,
                          cwd=root)
    if proc.returncode != 0:
        raise RuntimeError(f"convert_lora_to_gguf.py failed on {adapter_dir}:\n"
                           f"{proc.stderr[-3000:]}")
    return out
