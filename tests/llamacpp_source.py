"""The parts of llama.cpp's source tree the tests use as oracles, fetched once.

llama.cpp's own tokenizer tests (``models/ggml-vocab-*``), its chat templates
(``models/templates/*.jinja``), its HF → GGUF converter (``convert_hf_to_gguf.py`` with
the ``conversion`` package and the ``gguf-py`` it is written against). They come out
of the llama-cpp-python 0.3.36 sdist (``pip download``, ~75 MB, once) and are cached
under ``$EMBER_HOME/llama.cpp-0.3.36``; ``EMBER_LLAMA_CPP_SOURCE`` may point at a
llama.cpp checkout instead.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from ember import filelock
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
    if all((root / p).exists() for p in _COMPLETE):
        return root
    # pytest-xdist workers collect at once: on a fresh machine each would fetch into the
    # same staging tree, and the second rename fails (or a reader sees a half tree). One
    # fetches while the others wait on an OS lock (dropped if its holder dies), then find
    # the tree whole. (The lock creates its directory, the tree's parent.)
    with filelock.exclusive(root.with_name(root.name + ".lock")):
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
    args = _converter_args(model_dir, out, outtype, extra)
    proc = subprocess.run([sys.executable, str(root / "convert_hf_to_gguf.py"), *args],
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {model_dir}:\n{proc.stderr[-3000:]}")
    return out


def _converter_args(model_dir: Path, out: Path, outtype: str, extra: tuple[str, ...]
                    ) -> list[str]:
    return [str(model_dir), "--outtype", outtype, "--outfile", str(out),
            "--model-name", "tiny-random", *extra]


# A process that imports the converter once (torch, transformers, gguf-py: ~2 s of its
# ~4 s per model) and runs each conversion in a fork of itself: the converter's own
# ``main`` with its own command line, in a fresh copy of that process, so nothing one
# conversion sets (its class attributes, its logging) is seen by the next.
#   {"args": [...], "log": PATH}  -> the fork's pid (its stdout and stderr go to PATH)
#   null                          -> "PID EXITCODE" of the next fork to finish
_CONVERTER = """\
import json, os, runpy, sys, traceback

root = sys.argv[1]
sys.path.insert(0, root)  # the converter's own ``conversion`` package
script = os.path.join(root, "convert_hf_to_gguf.py")
main = runpy.run_path(script, run_name="convert_hf_to_gguf")["main"]  # imports, no run
print("ready", flush=True)
for line in sys.stdin:
    job = json.loads(line)
    if job is None:
        pid, status = os.wait()
        print(pid, os.waitstatus_to_exitcode(status), flush=True)
        continue
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(log, 1)  # stdout is the reply channel
            os.dup2(log, 2)
            sys.argv = [script, *job["args"]]
            main()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    print(pid, flush=True)
"""


class Converter:
    """llama.cpp's ``convert_hf_to_gguf.py``, run as :func:`convert_hf_to_gguf` runs it
    (its gguf-py, offline, the "tiny-random" name) on many checkpoints, a few at a time,
    without importing it again for each. Started at once (its imports overlap the
    caller's work); ``close`` when done."""

    def __init__(self) -> None:
        root = llamacpp_source()
        env = {**os.environ, "PYTHONPATH": str(root / "gguf-py"), "HF_HUB_OFFLINE": "1"}
        self.proc = subprocess.Popen([sys.executable, "-c", _CONVERTER, str(root)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ready = False

    def _ask(self, job: dict | None) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if not self.ready:
            assert self.proc.stdout.readline() == "ready\n", "the converter did not start"
            self.ready = True
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        assert reply, "the converter process died"
        return reply.strip()

    def convert(self, jobs: list[tuple[Path, Path, tuple[str, ...]]], parallel: int = 2
                ) -> list[Path]:
        """Each ``(model_dir, out, extra arguments)`` converted to an f32 GGUF at ``out``,
        ``parallel`` at a time; the paths written, in order."""
        waiting, running, failed = list(jobs), {}, []
        while waiting or running:
            while waiting and len(running) < parallel:
                model_dir, out, extra = waiting.pop(0)
                log = out.with_name(out.name + ".log")
                pid = int(self._ask({"args": _converter_args(model_dir, out, "f32", extra),
                                     "log": str(log)}))
                running[pid] = (model_dir, log)
            pid, code = map(int, self._ask(None).split())
            model_dir, log = running.pop(pid)
            if code != 0:
                failed.append(f"convert_hf_to_gguf.py failed on {model_dir}:\n"
                              f"{log.read_text(errors='replace')[-3000:]}")
        if failed:
            raise RuntimeError("\n".join(failed))
        return [out for _, out, _ in jobs]

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


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
