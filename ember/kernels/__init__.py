"""Native kernels, built on first use with torch.utils.cpp_extension.

``quant_matmul()`` returns the compiled extension (``quant_matmul.cpp``: quantized
weight matmuls; with ``paged_attention.h`` and ``fused_decoder.h``: attention over
the paged KV pool and the fused decoder stack) or ``None`` when it cannot be built
on this machine; ``available()`` says which. A failed build logs one warning and is
not retried in this process, so everything that has a pure-PyTorch path keeps
working.

The build needs a C++ compiler and ``ninja``. It is compiled with
``-O3 -march=native`` (falling back to no ``-march`` flag if that fails) into
``$EMBER_KERNEL_CACHE/<key>/<name>`` (default ``~/.cache/ember/kernels/<key>/<name>``;
it does not follow ``EMBER_HOME``, which only moves models, so every home shares one
build), where ``key`` covers the torch version, the CPU's instruction-set flags and
the source hash, so a home directory shared between different machines never loads
a build for the wrong CPU. The first build takes a minute; later processes just load
it.

Locking. torch's ``load`` takes a ``FileBaton`` on every call, even when the build is
up to date: a ``lock`` file created with O_EXCL in the build directory, held while
ninja checks the build and removed when done. A process killed there (SIGTERM or
SIGKILL during startup) leaves the file behind, and every later ``load`` waits for
it forever, silently, at 0% CPU. So ember calls ``load`` only to build, never to load
a finished build, and its own lock is one that dies with its process:

- ``<key>/<name>/ember-build.json`` (``BUILD_MARKER``) is written atomically (temp
  file + ``os.replace``) after a build was imported successfully. It records the
  module name, the compiler and linker flags, and the library's file name, size and
  sha256. A process whose flags match a marker, and whose library still matches it,
  imports the library directly and takes no lock at all.
- Without a valid marker (first use, or a build killed half way), the process takes
  ``<key>/build.flock`` (``build_lock_path()``) with ``fcntl.flock``: an OS lock that
  the kernel releases when its holder exits however it dies, so a killed builder
  never blocks the next one. A process that has to wait for it logs one warning
  naming the lock file and the holder's pid. Holding it, the process looks for a
  marker again (the holder may just have built), removes torch's stale ``lock``
  baton if a killed process left one (no ember builder can be inside it: they all
  hold ``build.flock`` first), runs ``load`` and writes the marker.

``EMBER_NO_KERNELS=1`` disables the native kernels (to exercise fallbacks).
``EMBER_KERNEL_ISA=avx2`` (or ``avx2vnni``: AVX2 with 256-bit VNNI, as Intel's client
cores without AVX-512 have; or ``scalar``) builds for that instruction set instead of
``-march=native``: to measure here what an AVX2-only machine (or none) would run.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import platform
import shutil
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from ember import filelock

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("quant_matmul.cpp")
# the headers it includes (paged attention, the fused decoder): part of the build key
_HEADERS = ("quant_lanes.h", "quant_layouts.h", "quant_kernels.h", "packed_linear.h",
            "activations.h", "paged_attention.h", "row_ops.h", "lora_delta.h",
            "routed_experts.h", "delta_net.h", "fused_decoder.h")
# -fopenmp: at::parallel_for is inlined from ATen's headers and only runs threads
# when compiled with OpenMP; at run time the extension shares torch's libgomp
# (same soname, already loaded), so it uses torch's thread pool and thread count.
_BASE_FLAGS = ["-O3", "-ffp-contract=off", "-DNDEBUG", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]
# Tried in order: the first that builds (or was built) is used.
_VARIANTS = (("ember_quant_matmul", ["-march=native"]), ("ember_quant_matmul_generic", []))
_ISA_VARIANTS = {"avx2": ("ember_quant_matmul_avx2", ["-mavx2", "-mfma", "-mf16c"]),
                 "avx2vnni": ("ember_quant_matmul_avx2vnni",
                              ["-mavx2", "-mfma", "-mf16c", "-mavxvnni"]),
                 "scalar": ("ember_quant_matmul_scalar", [])}
# what a CPU must have (as /proc/cpuinfo names it) to run each of those builds
ISA_CPU_FLAGS = {"avx2": ("avx2", "fma", "f16c"), "avx2vnni": ("avx2", "fma", "f16c", "avx_vnni"),
                 "scalar": ()}


def cpu_flags() -> set[str] | None:
    """This CPU's instruction-set flags from /proc/cpuinfo; None where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def missing_cpu_flags(isa: str) -> list[str]:
    """The flags an ``EMBER_KERNEL_ISA`` build needs that this CPU lacks (none where
    /proc/cpuinfo cannot be read)."""
    have = cpu_flags()
    return [f for f in ISA_CPU_FLAGS[isa] if have is not None and f not in have]


def _variants() -> tuple[tuple[str, list[str]], ...]:
    isa = os.environ.get("EMBER_KERNEL_ISA", "native")
    if isa == "native":
        return _VARIANTS
    if isa not in _ISA_VARIANTS:
        raise RuntimeError(f"EMBER_KERNEL_ISA={isa!r}: choose native, "
                           f"{', '.join(_ISA_VARIANTS)}")
    missing = missing_cpu_flags(isa)
    if missing:  # its instructions would kill the process (SIGILL) at the first matmul
        raise RuntimeError(f"EMBER_KERNEL_ISA={isa}: this CPU lacks {', '.join(missing)}")
    return (_ISA_VARIANTS[isa],)
BUILD_MARKER = "ember-build.json"
BUILD_LOCK = "build.flock"
_TORCH_BATON = "lock"  # torch.utils.file_baton.FileBaton's file in the build directory
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
    digest = hashlib.sha256(_SOURCE.read_bytes())
    for name in _HEADERS:
        digest.update(_SOURCE.with_name(name).read_bytes())
    source_hash = digest.hexdigest()[:12]
    key = f"torch{torch.__version__.split('+')[0]}-{_cpu_key()}-{source_hash}"
    return Path(root) / key


def build_lock_path() -> Path:
    """The ``flock`` file that serialises builds of this machine's kernels."""
    return _build_root() / BUILD_LOCK


def _find_ninja() -> None:
    """Put the pip-installed ninja first on PATH (torch runs ``ninja`` from PATH).

    Always the same ninja, whatever PATH the caller has: ninja versions keep
    incompatible build logs (1.11 writes v5, 1.13 v7), and a log written by another
    version makes ninja recompile a kernel that is up to date (~30 s). Also,
    ``.venv/bin/ember`` run without activating the venv lacks ``.venv/bin`` on PATH.
    """
    dirs = [str(Path(sys.executable).parent)]
    try:
        import ninja  # the PyPI package, a dependency

        dirs.insert(0, ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    found = shutil.which("ninja")
    for d in dirs:
        ours = shutil.which("ninja", path=d)
        if ours:
            if found is None or os.path.realpath(found) != os.path.realpath(ours):
                os.environ["PATH"] = d + os.pathsep + os.environ.get("PATH", "")
            return


def _require_ninja() -> None:
    from torch.utils.cpp_extension import is_ninja_available

    _find_ninja()
    if not is_ninja_available():
        raise RuntimeError("ninja is not installed (pip install ninja)")


# ------------------------------------------------------------------ the build marker


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _marker_for(name: str, flags: list[str], library: Path) -> dict[str, object]:
    """What a marker records; a later process loads the library only if all of it matches."""
    return {"module": name, "cflags": _BASE_FLAGS + flags, "ldflags": _LDFLAGS,
            "library": library.name, "size": library.stat().st_size,
            "sha256": _sha256(library)}


def _built_library(name: str, flags: list[str], build_dir: Path) -> Path | None:
    """The library a valid marker in ``build_dir`` vouches for, else None."""
    try:
        marker = json.loads((build_dir / BUILD_MARKER).read_text())
        library = build_dir / marker["library"]
        if marker == _marker_for(name, flags, library):
            return library
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no marker (never built, or a build killed half way), or no library
    return None


def _write_marker(name: str, flags: list[str], build_dir: Path, module: ModuleType) -> None:
    # Atomic, so a process killed here leaves the old state (no marker), never half
    # a marker. The temp name is fixed: only the build-lock holder writes it.
    library = Path(module.__file__ or "")
    tmp = build_dir / (BUILD_MARKER + ".tmp")
    with open(tmp, "w") as f:
        json.dump(_marker_for(name, flags, library), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, build_dir / BUILD_MARKER)


def _import_library(name: str, library: Path) -> ModuleType:
    """Import a built extension as torch's ``load`` does, without its lock."""
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_built(name: str, flags: list[str], build_dir: Path) -> ModuleType | None:
    """The already built extension, imported without any lock; None if it is not built."""
    library = _built_library(name, flags, build_dir)
    if library is None:
        return None
    try:
        return _import_library(name, library)
    except Exception as e:  # e.g. a library the loader rejects: rebuild it
        log.debug("cannot import %s (%s); rebuilding", library, e)
        return None


# ------------------------------------------------------------------ building


@contextlib.contextmanager
def _build_lock(path: Path) -> Iterator[None]:
    """Hold the build lock ``path``, saying so if another builder holds it."""

    def waiting(holder: str) -> None:
        log.warning("another ember process (pid %s) is compiling the native kernels; "
                    "waiting for it to finish (build lock: %s)", holder, path)

    with filelock.exclusive(path, on_wait=waiting):
        yield


def _remove_stale_baton(build_dir: Path) -> None:
    # Called holding the build lock, so no ember builder is inside torch's baton:
    # a baton file here was left by a killed process and would make load() wait forever.
    baton = build_dir / _TORCH_BATON
    with contextlib.suppress(FileNotFoundError):
        baton.unlink()
        log.info("removed a stale torch build lock left by a killed process: %s", baton)


def _torch_build(name: str, flags: list[str], build_dir: Path) -> ModuleType:
    """Build (or relink) and import with torch's ``load``; the caller holds the build lock."""
    from torch.utils.cpp_extension import load

    build_dir.mkdir(parents=True, exist_ok=True)
    # Until the new build is imported, no marker may vouch for a library being rewritten.
    (build_dir / BUILD_MARKER).unlink(missing_ok=True)
    _remove_stale_baton(build_dir)
    # fresh lists: load() appends torch's own flags to them in place
    module = load(name=name, sources=[str(_SOURCE)], extra_cflags=[*_BASE_FLAGS, *flags],
                  extra_ldflags=[*_LDFLAGS], build_directory=str(build_dir), verbose=False)
    _write_marker(name, flags, build_dir, module)
    return module


def compile_quant_matmul(name: str, flags: list[str], build_dir: Path) -> ModuleType:
    """Compile and import quant_matmul.cpp as module ``name`` with extra ``flags``.

    Loads a completed earlier build without locking; otherwise builds it holding the
    build lock of ``build_dir``'s parent (the build root). Used for the default build
    and by tests to build the other SIMD paths (e.g. no ``-march`` for the scalar
    fallback). Raises on any failure.
    """
    module = _load_built(name, flags, build_dir)
    if module is not None:
        return module
    _require_ninja()
    with _build_lock(build_dir.parent / BUILD_LOCK):
        # the process we waited for may have just built it
        module = _load_built(name, flags, build_dir)
        return module if module is not None else _torch_build(name, flags, build_dir)


def _build() -> ModuleType:
    root = _build_root()
    variants = _variants()
    for name, flags in variants:  # a generic build exists only if the native one failed
        module = _load_built(name, flags, root / name)
        if module is not None:
            return module
    _require_ninja()
    log.info("compiling ember native kernels into %s (first use, ~30 s)", root)
    errors = []
    for name, flags in variants:
        try:
            return compile_quant_matmul(name, flags, root / name)
        except Exception as e:  # no compiler, compile or link error, import error
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


def loaded_flags() -> list[str] | None:
    """The compiler flags of the kernels this process loaded (building them if needed);
    None if there are none."""
    module = quant_matmul()
    if module is None:
        return None
    return dict((*_VARIANTS, *_ISA_VARIANTS.values()))[module.__name__]


def describe() -> str:
    """Which kernels this process runs, for benchmark records (builds them if needed):
    the SIMD path and the build it came from (``avx512vnni, -march=native``; ``avx2,
    EMBER_KERNEL_ISA=avx2``), or why there are none."""
    module = quant_matmul()
    if module is None:
        return f"none ({unavailable_reason()})"
    isa = {name: key for key, (name, _) in _ISA_VARIANTS.items()}.get(module.__name__)
    chosen = f"EMBER_KERNEL_ISA={isa}" if isa else " ".join(loaded_flags() or ["no -march"])
    return f"{module.simd()}, {chosen}"


def available() -> bool:
    """Whether the native quantized-matmul kernels can be used (builds them if needed)."""
    return quant_matmul() is not None


def unavailable_reason() -> str | None:
    """Why ``available()`` is False (None when the kernels loaded or were not tried yet)."""
    return _error
