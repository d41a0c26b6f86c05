"""Native kernels, built on first use with torch.utils.cpp_extension.

``quant_matmul()`` returns the compiled extension (``quant_matmul.cpp``: quantized
weight matmuls) or ``None`` when it cannot be built on this machine; ``available()``
says which. A failed build logs one warning and is not retried in this process, so
everything that has a pure-PyTorch path keeps working.

The build needs a C++ compiler and ``ninja``. It is compiled with
``-O3 -march=native`` (falling back to no ``-march`` flag if that fails) into
``$EMBER_KERNEL_CACHE/<key>`` (default ``~/.cache/ember/kernels/<key>``; it does not
follow ``EMBER_HOME``, which only moves models, so every home shares one build), where
``key`` covers the torch version, the CPU's instruction-set flags and the source
hash, so a home directory shared between different machines never loads a build
for the wrong CPU. The first build takes a minute; later processes just load it.

``EMBER_NO_KERNELS=1`` disables the native kernels (to exercise fallbacks).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("quant_matmul.cpp")
# -fopenmp: at::parallel_for is inlined from ATen's headers and only runs threads
# when compiled with OpenMP; at run time the extension shares torch's libgomp
# (same soname, already loaded), so it uses torch's thread pool and thread count.
_BASE_FLAGS = ["-O3", "-ffp-contract=off", "-DNDEBUG", "-fopenmp"]
_lock = threading.Lock()
_module: ModuleType | None = None
_error: str | None = None
_tried = False


def _cpu_key() -> str:
    """A short hash of the CPU model and instruction-set flags (what -march=native sees)."""
    text = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "model name", "Features")):
                    text += line
                    if line.startswith(("flags", "Features")):
                        break
    except OSError:
        pass
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _build_root() -> Path:
    root = os.environ.get("EMBER_KERNEL_CACHE") or Path.home() / ".cache" / "ember" / "kernels"
    source_hash = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:12]
    key = f"torch{torch.__version__.split('+')[0]}-{_cpu_key()}-{source_hash}"
    return Path(root) / key


def _find_ninja() -> None:
    """Put a pip-installed ninja on PATH (torch runs ``ninja`` from PATH).

    ``.venv/bin/ember`` run without activating the venv does not have ``.venv/bin``
    on PATH, where ``pip install ninja`` puts it.
    """
    if shutil.which("ninja"):
        return
    dirs = [str(Path(sys.executable).parent)]
    try:
        import ninja  # the PyPI package

        dirs.insert(0, ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    for d in dirs:
        if shutil.which("ninja", path=d):
            os.environ["PATH"] = d + os.pathsep + os.environ.get("PATH", "")
            return


def compile_quant_matmul(name: str, flags: list[str], build_dir: Path) -> ModuleType:
    """Compile and import quant_matmul.cpp as module ``name`` with extra ``flags``.

    Used for the default build and by tests to build the other SIMD paths
    (e.g. no ``-march`` for the scalar fallback). Raises on any failure.
    """
    from torch.utils.cpp_extension import load, verify_ninja_availability

    _find_ninja()
    try:
        verify_ninja_availability()
    except RuntimeError:
        raise RuntimeError("ninja is not installed (pip install ninja)") from None
    build_dir.mkdir(parents=True, exist_ok=True)
    return load(name=name, sources=[str(_SOURCE)], extra_cflags=_BASE_FLAGS + flags,
                extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)


def _build() -> ModuleType:
    from torch.utils.cpp_extension import is_ninja_available

    _find_ninja()
    if not is_ninja_available():
        raise RuntimeError("ninja is not installed (pip install ninja)")
    root = _build_root()
    log.info("loading ember native kernels from %s (compiled on first use, ~30 s)", root)
    errors = []
    for name, flags in (("ember_quant_matmul", ["-march=native"]),
                        ("ember_quant_matmul_generic", [])):
        try:
            return compile_quant_matmul(name, flags, root / name)
        except Exception as e:  # no ninja/compiler, compile or link error, import error
            text = str(e).strip()
            errors.append(f"{name} {' '.join(flags) or '(no -march)'}: "
                          f"{text.splitlines()[-1] if text else repr(e)}")
    raise RuntimeError("; ".join(errors))


def quant_matmul() -> ModuleType | None:
    """The compiled quantized-matmul extension, building it on first call; None if unavailable."""
    global _module, _error, _tried
    if _tried:
        return _module
    with _lock:
        if not _tried:
            if os.environ.get("EMBER_NO_KERNELS", "") not in ("", "0"):
                _error = "disabled by EMBER_NO_KERNELS"
            else:
                try:
                    _module = _build()
                except Exception as e:
                    _error = str(e) or repr(e)
                    log.warning("ember native kernels unavailable: %s", _error)
            _tried = True
    return _module


def available() -> bool:
    """Whether the native quantized-matmul kernels can be used (builds them if needed)."""
    return quant_matmul() is not None


def unavailable_reason() -> str | None:
    """Why ``available()`` is False (None when the kernels loaded or were not tried yet)."""
    return _error
