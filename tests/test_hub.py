"""``ember pull ORG/REPO[:QUANT]`` and ``hf://`` names through ``huggingface_hub``,
against a local server with the Hub's HTTP surface (tests/hub_server.py; nothing here
reaches the internet): the file picked by quant tag as llama.cpp's ``-hf`` picks it,
split parts, sizes and sha256 checked before use, clear errors (missing repo or quant,
gated repo, no network), the cache used offline, a Hub name working wherever a model is
named, and a download killed with SIGKILL resuming where it stopped."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hub_server import HubServer

from ember.errors import ChecksumError, ModelFetchError, UnknownModelError
from ember.models import hub
from ember.models import registry as R
from ember.models.hub import HubRef

FILES = ["tiny-Q4_K_M.gguf", "tiny-Q8_0.gguf", "tiny-IQ4_XS.gguf", "mmproj-tiny-f16.gguf",
         "README.md"]


# ---------------------------------------------------------------------- names and picking
@pytest.mark.parametrize("name,ref", [
    ("bartowski/Qwen3-8B-GGUF", HubRef("bartowski/Qwen3-8B-GGUF")),
    ("bartowski/Qwen3-8B-GGUF:Q8_0", HubRef("bartowski/Qwen3-8B-GGUF", tag="Q8_0")),
    ("hf://org/repo/sub/dir/m-Q4_0.gguf", HubRef("org/repo", filename="sub/dir/m-Q4_0.gguf")),
    ("hf://org/repo@v1.0/m.gguf", HubRef("org/repo", "v1.0", filename="m.gguf")),
    ("smollm2-135m", None), ("models/x.gguf", None), ("./org/repo", None), ("/abs/x", None),
])
def test_hub_names_are_told_from_paths_and_aliases(name, ref):
    assert hub.parse(name) == ref


def test_a_file_is_picked_by_its_quant_tag_as_llama_cpp_does():
    files = FILES + ["big/big-Q4_K_M-00002-of-00002.gguf", "big/big-Q4_K_M-00001-of-00002.gguf"]
    assert hub.pick(FILES, HubRef("o/r")) == ["tiny-Q4_K_M.gguf"]  # the default tag
    assert hub.pick(FILES, HubRef("o/r", tag="q8_0")) == ["tiny-Q8_0.gguf"]
    assert hub.pick(FILES, HubRef("o/r", tag="IQ4_XS")) == ["tiny-IQ4_XS.gguf"]
    assert hub.pick(["a-F16.gguf", "mmproj-a-f16.gguf", "a-Q8_0.gguf"], HubRef("o/r")) \
        == ["a-F16.gguf"]  # no Q4_K_M: the first GGUF, never an mmproj
    assert hub.pick(files[5:], HubRef("o/r")) == ["big/big-Q4_K_M-00001-of-00002.gguf",
                                                  "big/big-Q4_K_M-00002-of-00002.gguf"]
    with pytest.raises(UnknownModelError, match=r"no Q5_K_M file; its quants: IQ4_XS, "
                                                r"Q4_K_M, Q8_0"):
        hub.pick(FILES, HubRef("o/r", tag="Q5_K_M"))
    with pytest.raises(UnknownModelError, match="lacks"):
        hub.pick(["m-00001-of-00003.gguf", "m-00002-of-00003.gguf"], HubRef("o/r"))


# ---------------------------------------------------------------------- the local Hub
@pytest.fixture(scope="module")
def server(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("hub-files")
    variants = {}
    for name in FILES:  # distinct bytes per file: a wrong pick cannot pass
        data = tiny_gguf.read_bytes() if name == "tiny-Q4_K_M.gguf" else (
            tiny_gguf.read_bytes() + name.encode())
        (root / name).write_bytes(data)
        variants[name] = root / name
    s = HubServer()
    s.add("org/tiny-GGUF", variants)
    s.add("org/split-GGUF", {f"m-Q4_K_M-0000{i}-of-00002.gguf": variants[FILES[i]]
                             for i in (1, 2)})
    s.add("org/gated-GGUF", {"g-Q4_K_M.gguf": variants[FILES[0]]})
    s.gated.add("org/gated-GGUF")
    yield s
    s.close()


@pytest.fixture
def env(server: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh Hub cache pointed at the local server; returns the cache."""
    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("EMBER_HOME", str(tmp_path / "ember"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    server.rate, server.tamper = None, {}
    return cache


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_pull_puts_the_picked_file_in_the_hub_cache_verified(env, server):
    path = R.pull("org/tiny-GGUF")
    assert path.name == "tiny-Q4_K_M.gguf" and env in path.parents
    assert _sha(path) == _sha(server.repos["org/tiny-GGUF"]["tiny-Q4_K_M.gguf"])
    q8 = R.ensure_model("org/tiny-GGUF:Q8_0")
    assert q8.name == "tiny-Q8_0.gguf"
    assert R.ensure_model("hf://org/tiny-GGUF/tiny-Q8_0.gguf") == q8
    served = len(server.ranges)
    assert R.pull("org/tiny-GGUF") == path and len(server.ranges) == served  # cached
    assert R.resolve_model("org/tiny-GGUF:Q8_0") == q8  # no network needed
    split = R.pull("org/split-GGUF")
    assert split.name == "m-Q4_K_M-00001-of-00002.gguf"
    assert split.with_name("m-Q4_K_M-00002-of-00002.gguf").is_file()
    listed = {m.name: m.size for m in R.list_models()}
    assert listed["hf://org/tiny-GGUF/tiny-Q4_K_M.gguf"] == path.stat().st_size
    assert listed["hf://org/split-GGUF/m-Q4_K_M-00001-of-00002.gguf"] == (
        split.stat().st_size + split.with_name("m-Q4_K_M-00002-of-00002.gguf").stat().st_size)


def test_errors_say_what_is_wrong(env, server, monkeypatch):
    with pytest.raises(UnknownModelError, match="org/nope: no such model repository"):
        R.pull("org/nope")
    with pytest.raises(UnknownModelError, match="its quants: IQ4_XS, Q4_K_M, Q8_0"):
        R.pull("org/tiny-GGUF:Q2_K")
    with pytest.raises(ModelFetchError, match="gated.*HF_TOKEN"):
        R.pull("org/gated-GGUF")
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    assert R.pull("org/gated-GGUF").name == "g-Q4_K_M.gguf"


def test_a_file_whose_bytes_are_not_the_hubs_is_removed_not_used(env, server):
    name = "tiny-Q8_0.gguf"
    good = server.repos["org/tiny-GGUF"][name].read_bytes()
    server.tamper[name] = good[:-1] + bytes([good[-1] ^ 1])  # same size, one bit off
    with pytest.raises(ChecksumError, match="sha256"):
        R.pull(f"org/tiny-GGUF:{name[5:9]}")
    assert not [p for p in env.rglob(name) if p.exists()]
    server.tamper = {}
    assert _sha(R.pull("org/tiny-GGUF:Q8_0")) == hashlib.sha256(good).hexdigest()


def test_offline_a_hub_name_is_what_the_cache_holds(env, server, monkeypatch):
    path = R.pull("org/tiny-GGUF")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert R.ensure_model("org/tiny-GGUF") == path
    with pytest.raises(UnknownModelError, match="not in the cache"):
        R.ensure_model("org/tiny-GGUF:Q8_0")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    assert R.ensure_model("org/tiny-GGUF") == path
    with pytest.raises(ModelFetchError, match="cannot reach the Hub"):
        R.ensure_model("org/tiny-GGUF:Q8_0")


def test_a_hub_name_works_where_a_model_is_named(env, server, tiny_gguf):
    from ember import LLM, SamplingParams

    llm = LLM("org/tiny-GGUF", threads=1, num_kv_blocks=32)
    ref = LLM(str(tiny_gguf), threads=1, num_kv_blocks=32)
    params = SamplingParams(temperature=0, max_tokens=4)
    assert llm.generate(["hello"], params)[0].token_ids == \
        ref.generate(["hello"], params)[0].token_ids


@pytest.mark.slow
def test_a_download_killed_midway_resumes_and_verifies(env, server, tmp_path):
    """A real ``ember pull`` process, SIGKILLed once a quarter of the file has arrived;
    the next pull asks the Hub for the rest only (a ranged GET) and the file verifies."""
    name = "tiny-Q8_0.gguf"
    size = server.repos["org/tiny-GGUF"][name].stat().st_size
    server.rate = size / 6  # about six seconds for the whole file
    proc = subprocess.Popen([sys.executable, "-m", "ember.cli", "pull", "org/tiny-GGUF:Q8_0"],
                            env=os.environ.copy(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            partial = [p for p in env.rglob("*.incomplete") if p.stat().st_size > size // 4]
            if partial:
                break
            assert proc.poll() is None, "the pull ended before it could be killed"
            time.sleep(0.05)
        else:
            raise AssertionError("the download never got a quarter of the way")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not [p for p in env.rglob(name) if p.exists()]  # nothing that looks complete
    server.rate = None
    path = R.pull("org/tiny-GGUF:Q8_0")
    starts = [start for f, start in server.ranges if f == name]
    assert starts[0] == 0 and starts[-1] > size // 4, starts  # resumed, not restarted
    assert _sha(path) == _sha(server.repos["org/tiny-GGUF"][name])
    shutil.rmtree(env)


@pytest.mark.slow
def test_the_cli_pulls_a_hub_name_on_first_use_and_lists_it(env, server, tiny_gguf):
    def ember(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ember.cli", *args], env=os.environ.copy(),
                              capture_output=True, text=True, timeout=120)

    args = ["generate", "--raw", "--temperature", "0", "--max-tokens", "4", "--threads", "1"]
    hub_run = ember(*args, "--model", "org/tiny-GGUF", "Once upon")
    assert hub_run.returncode == 0, hub_run.stderr
    local = ember(*args, "--model", str(tiny_gguf), "Once upon")
    assert hub_run.stdout == local.stdout
    listed = ember("models")
    assert "hf://org/tiny-GGUF/tiny-Q4_K_M.gguf" in listed.stdout, listed.stdout
    pulled = ember("pull", "org/split-GGUF")
    assert pulled.returncode == 0 and "2 parts, sha256 verified" in pulled.stdout, pulled
