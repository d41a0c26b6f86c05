"""GGUF models from the Hugging Face Hub: ``ORG/REPO[:QUANT]`` and ``hf://ORG/REPO/FILE``.

A name like ``bartowski/Qwen3-8B-GGUF:Q4_K_M`` picks the repository's file by its quant
tag the way llama.cpp's ``-hf`` does (``Q4_K_M`` when no tag is given and the repository
has one, else its first GGUF; ``mmproj`` files never), with every part of a split GGUF
(``-00001-of-0000N.gguf``). ``hf://ORG/REPO/PATH.gguf`` (``hf://ORG/REPO@REVISION/...``
for a branch, tag or commit) names one file exactly.

Files go into ``huggingface_hub``'s cache, in its layout (``HF_HUB_CACHE`` /
``HF_HOME``), so they are shared with every other tool that uses it, fetched with its
request headers and URL scheme; ``HF_TOKEN`` and ``HF_ENDPOINT`` (a mirror, or a test
server) are read when a pull starts. An interrupted download, even a killed process,
resumes where it stopped. A file is used only once its size and sha256 equal
what the Hub publishes for it (LFS metadata); the digest is then remembered, so later
starts do not read it again. Offline (``HF_HUB_OFFLINE=1``, or the Hub unreachable), a
name resolves to what the cache already holds.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from ember.errors import ChecksumError, ModelFetchError, UnknownModelError

log = logging.getLogger("ember.hub")

DEFAULT_TAG = "Q4_K_M"
_REPO = r"[A-Za-z0-9][\w.-]*/[\w.-]+"
_NAME = re.compile(rf"(?P<repo>{_REPO})(?::(?P<tag>[\w.-]+))?")
_URL = re.compile(rf"hf://(?P<repo>{_REPO})(?:@(?P<revision>[^/]+))?/(?P<file>.+\.gguf)")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
# the quant tags a file name may carry, to list what a repository has
_QUANT = re.compile(r"(?<![A-Za-z0-9])(I?Q\d(?:_[A-Z0-9]+)*|T?Q\d_\d|F16|BF16|F32|MXFP4(?:_MOE)?)"
                    r"(?![A-Za-z0-9])", re.IGNORECASE)


@dataclass(frozen=True)
class HubRef:
    """A model named on the Hub."""

    repo: str
    revision: str | None = None  # None: the default branch
    tag: str | None = None  # a quant tag to pick the file by
    filename: str | None = None  # or the file itself

    def __str__(self) -> str:
        if self.filename:
            at = f"@{self.revision}" if self.revision else ""
            return f"hf://{self.repo}{at}/{self.filename}"
        return self.repo + (f":{self.tag}" if self.tag else "")


def parse(name: str) -> HubRef | None:
    """The Hub reference ``name`` is, or None (a path, an alias). ``ORG/REPO`` names a
    repository only when it is not an existing file and does not end in ``.gguf``."""
    m = _URL.fullmatch(name)
    if m:
        return HubRef(m["repo"], m["revision"], None, m["file"])
    if name.endswith(".gguf") or name.startswith((".", "/", "~")) or Path(name).exists():
        return None
    m = _NAME.fullmatch(name)
    return HubRef(m["repo"], None, m["tag"]) if m else None


# ---------------------------------------------------------------------- picking files
def quant_tags(files: list[str]) -> list[str]:
    """The quant tags of a repository's GGUF files, as llama.cpp's ``-hf`` names them."""
    tags = {m.group(1).upper() for f in files if f.endswith(".gguf") and "mmproj" not in f
            for m in [_QUANT.search(Path(f).name)] if m}
    return sorted(tags)


def pick(files: list[str], ref: HubRef) -> list[str]:
    """The files ``ref`` names among a repository's: one GGUF, or every part of a split
    one, in order. A missing tag is an error that lists the tags present."""
    if ref.filename:
        if ref.filename not in files:
            raise UnknownModelError(f"{ref.repo} has no file {ref.filename!r}")
        return _parts(files, ref.filename)
    ggufs = sorted(f for f in files if f.endswith(".gguf") and "mmproj" not in Path(f).name)
    if not ggufs:
        raise UnknownModelError(f"{ref.repo} has no GGUF file")
    tag = ref.tag or DEFAULT_TAG
    bounded = re.compile(rf"(?<![A-Za-z0-9]){re.escape(tag)}(?![A-Za-z0-9])", re.IGNORECASE)
    tagged = [f for f in ggufs if bounded.search(f)]
    if not tagged and ref.tag is None:
        tagged = ggufs  # no Q4_K_M: the first file, as llama.cpp does
    if not tagged:
        have = ", ".join(quant_tags(files)) or "none recognised"
        raise UnknownModelError(f"{ref.repo} has no {tag} file; its quants: {have}")
    firsts = [f for f in tagged if not _SPLIT.search(f) or _SPLIT.search(f).group(1) == "00001"]
    return _parts(files, firsts[0])


def _parts(files: list[str], first: str) -> list[str]:
    m = _SPLIT.search(first)
    if m is None:
        return [first]
    count, stem = int(m.group(2)), first[:m.start()]
    parts = [f"{stem}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    missing = [p for p in parts if p not in files]
    if missing:
        raise UnknownModelError(f"split model {first!r} lacks {', '.join(missing)}")
    return parts


# ---------------------------------------------------------------------- the Hub
def _hub() -> Any:
    import huggingface_hub
    import huggingface_hub.utils  # noqa: F401  (a submodule the package does not load)

    return huggingface_hub


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT") or "https://huggingface.co"


def cache_dir() -> Path:
    """huggingface_hub's cache, as its environment variables say now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class _Remote:
    commit: str
    files: dict[str, tuple[int | None, str | None]]  # name -> (size, LFS sha256)


def _remote(ref: HubRef) -> _Remote:
    """The repository's files, sizes and LFS digests at ``ref``'s revision (the Hub's
    model-info API itself, not ``HfApi.model_info``: huggingface_hub reads
    ``HF_HUB_OFFLINE`` once, when imported; ember decides per pull)."""
    import httpx

    url = f"{endpoint()}/api/models/{ref.repo}"
    if ref.revision:
        url += f"/revision/{quote(ref.revision, safe='')}"
    r = httpx.get(url, params={"blobs": "true"}, headers=_headers(), follow_redirects=True,
                  timeout=30.0)
    _check(r, ref)
    info = r.json()
    return _Remote(info["sha"], {s["rfilename"]: (s.get("size"), (s.get("lfs") or {}).get(
        "sha256")) for s in info.get("siblings") or []})


def _headers() -> dict[str, str]:
    return _hub().utils.build_hf_headers(token=os.environ.get("HF_TOKEN") or None)


def _check(r: Any, ref: HubRef, name: str | None = None) -> None:
    """The Hub's refusal as ember's error, by its ``X-Error-Code`` (what huggingface_hub
    reads too)."""
    if r.status_code < 400:
        return
    code = r.headers.get("X-Error-Code")
    if code == "GatedRepo":
        raise ModelFetchError(f"{ref.repo} is gated: accept its terms at {endpoint()}/"
                              f"{ref.repo} and set HF_TOKEN to a token of that account")
    if code == "RepoNotFound" or (r.status_code == 404 and code is None and name is None):
        raise UnknownModelError(f"{ref.repo}: no such model repository at {endpoint()} (a "
                                "private one needs HF_TOKEN)")
    if code == "RevisionNotFound":
        raise UnknownModelError(f"{ref.repo} has no revision {ref.revision!r}")
    if code == "EntryNotFound":
        raise UnknownModelError(f"{ref.repo} has no file {name!r}")
    raise ModelFetchError(f"{endpoint()} answered {r.status_code} for {ref}"
                          + (f" ({name})" if name else ""))


def _unreachable(e: BaseException) -> bool:
    """Whether ``e`` says the Hub could not be reached (not that it answered an error)."""
    import httpx

    return isinstance(e, httpx.TransportError | OSError)


def pull(ref: HubRef, *, force: bool = False) -> Path:
    """Download (or find in the cache) what ``ref`` names, verified; the first part's
    path. Offline or with the Hub unreachable, what the cache holds."""
    if _offline():
        return cached(ref)
    try:
        remote = _remote(ref)
    except (ModelFetchError, UnknownModelError):
        raise
    except Exception as e:
        if not _unreachable(e):
            raise
        log.warning("cannot reach %s (%s): looking in the cache", endpoint(), e)
        try:
            return cached(ref)
        except UnknownModelError:
            raise ModelFetchError(f"cannot reach the Hub at {endpoint()} ({type(e).__name__})"
                                  f" and {ref} is not in the cache ({cache_dir()})") from None
    names = pick(sorted(remote.files), ref)
    paths = [_download(ref, remote, name, force) for name in names]
    return paths[0]


def _download(ref: HubRef, remote: _Remote, name: str, force: bool) -> Path:
    """``name`` in the Hub cache's layout (``blobs/<sha256>``, ``snapshots/<commit>/name``
    linking to it, ``refs/<branch>``), verified. Not ``hf_hub_download``: since 2.x it
    downloads into a file of its own process, so a killed pull would start over; here the
    ``.incomplete`` blob is the download's, and the next pull asks only for the rest."""
    from ember import filelock

    size, sha256 = remote.files[name]
    repo_dir = cache_dir() / ("models--" + ref.repo.replace("/", "--"))
    link = repo_dir / "snapshots" / remote.commit / name
    blob = repo_dir / "blobs" / (sha256 or f"{remote.commit}.{name.replace('/', '.')}")
    blob.parent.mkdir(parents=True, exist_ok=True)
    with filelock.exclusive(repo_dir / ".ember-pull.lock"):
        if force or not blob.is_file() or not _verified(blob, size, sha256):
            _fetch(ref, remote, name, blob, size)
            if not _verified(blob, size, sha256):
                got = blob.stat().st_size
                blob.unlink()
                raise ChecksumError(f"{ref.repo}/{name}: the download ({got} bytes) is not "
                                    f"what the Hub publishes ({size} bytes, sha256 "
                                    f"{sha256}); removed, pull again")
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.exists():
            link.unlink(missing_ok=True)  # a dangling link
            link.symlink_to(os.path.relpath(blob, link.parent))
        branch = repo_dir / "refs" / (ref.revision or "main")
        if ref.revision != remote.commit:
            branch.parent.mkdir(parents=True, exist_ok=True)
            branch.write_text(remote.commit)
    return link


def _verified(blob: Path, size: int | None, sha256: str | None) -> bool:
    """Size and sha256 as the Hub publishes them (the digest read once, then remembered
    for this version of the file)."""
    from ember.models.files import sha256_of

    if size is not None and blob.stat().st_size != size:
        return False
    return sha256 is None or sha256_of(blob, remember=True) == sha256


def _fetch(ref: HubRef, remote: _Remote, name: str, blob: Path, size: int | None) -> None:
    """Download ``name`` into ``blob``, resuming its ``.incomplete`` file, with a progress
    bar (bytes and rate) on stderr."""
    import httpx
    from tqdm.auto import tqdm

    hub = _hub()
    partial = blob.with_name(blob.name + ".incomplete")
    have = partial.stat().st_size if partial.is_file() else 0
    if size is not None and have > size:
        partial.unlink()
        have = 0
    url = hub.hf_hub_url(ref.repo, name, revision=remote.commit, endpoint=endpoint())
    headers = _headers()
    if have:
        headers["Range"] = f"bytes={have}-"
    with httpx.stream("GET", url, headers=headers, follow_redirects=True,
                      timeout=httpx.Timeout(30.0, read=120.0)) as r:
        if r.status_code == 416 and size is not None and have == size:
            os.replace(partial, blob)  # it was all there
            return
        _check(r, ref, name)
        if r.status_code == 200:
            have = 0  # the server sent the whole file: start over
        with open(partial, "ab" if have else "wb") as f, tqdm(
                total=size, initial=have, unit="B", unit_scale=True, unit_divisor=1024,
                desc=Path(name).name, disable=None) as bar:
            for chunk in r.iter_bytes(1 << 20):
                f.write(chunk)
                bar.update(len(chunk))
    os.replace(partial, blob)


def cached(ref: HubRef) -> Path:
    """What ``ref`` names in the local cache (no network): the snapshot of its revision
    (the default branch's last pulled commit when none is given)."""
    root = cache_dir() / ("models--" + ref.repo.replace("/", "--"))
    revision = ref.revision or "main"
    refs = root / "refs" / revision
    commit = refs.read_text().strip() if refs.is_file() else revision
    snapshot = root / "snapshots" / commit
    if not snapshot.is_dir():
        raise UnknownModelError(f"{ref} is not in the cache ({cache_dir()}); pull it online "
                                "first")
    files = sorted(str(p.relative_to(snapshot)) for p in snapshot.rglob("*.gguf"))
    try:
        names = pick(files, ref)
    except UnknownModelError:
        held = ", ".join(files) or "no GGUF file"
        raise UnknownModelError(f"{ref} is not in the cache ({cache_dir()} holds {held} of "
                                f"{ref.repo}); pull it online first") from None
    return snapshot / names[0]


@dataclass(frozen=True)
class CachedModel:
    name: str  # hf://ORG/REPO/FILE
    path: Path
    size: int  # bytes, every part of a split model


def list_cached() -> list[CachedModel]:
    """The GGUF files in the Hub cache (first parts of split ones), newest snapshot each."""
    out: list[CachedModel] = []
    for root in sorted(cache_dir().glob("models--*--*")):
        repo = root.name.removeprefix("models--").replace("--", "/", 1)
        snapshots = sorted((root / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime)
        if not snapshots:
            continue
        snapshot = snapshots[-1]
        for path in sorted(snapshot.rglob("*.gguf")):
            name = str(path.relative_to(snapshot))
            m = _SPLIT.search(name)
            if m and m.group(1) != "00001":
                continue
            parts = [snapshot / p for p in (_parts_present(snapshot, name) if m else [name])]
            size = sum(p.stat().st_size for p in parts if p.exists())
            out.append(CachedModel(f"hf://{repo}/{name}", path, size))
    return out


def _parts_present(snapshot: Path, first: str) -> list[str]:
    m = _SPLIT.search(first)
    assert m is not None
    stem, count = first[:m.start()], int(m.group(2))
    return [f"{stem}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
