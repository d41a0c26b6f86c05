"""Conversation files (ember.kv.conversation), ``LLM.save_prefix`` / ``load_prefix`` and
``ember chat --conversation`` killed mid-reply, with real files and processes."""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ember.kv import conversation as cv
from ember.kv import disk
from ember.kv.disk import BlockRecord

FP = disk.fingerprint("conversation-test")


def block(i: int) -> BlockRecord:
    key = hashlib.blake2b(f"k{i}".encode(), digest_size=16).digest()
    parent = hashlib.blake2b(f"k{i - 1}".encode(), digest_size=16).digest()
    return BlockRecord(key, parent, b"salt", tuple(range(4 * i, 4 * i + 4)), bytes([i]) * 40)


def two_turns(path: Path) -> tuple[cv.Conversation, cv.Conversation]:
    one = cv.append(path, FP, cv.Conversation(), [{"role": "user", "content": "a"}],
                    [block(0), block(1)])
    two = cv.append(path, FP, one, [{"role": "user", "content": "a"},
                                    {"role": "assistant", "content": "b"}], [block(2)])
    return one, two


def same(a: cv.Conversation, b: cv.Conversation) -> bool:
    return (a.messages, a.records, a.frames, a.size) == (b.messages, b.records, b.frames, b.size)


def test_reads_back_what_was_committed(tmp_path):
    one, two = two_turns(tmp_path / "c")
    assert same(cv.read(tmp_path / "c", FP), two)
    assert two.num_tokens == 12 and len(two.messages) == 2
    assert cv.read(tmp_path / "missing", FP) == cv.Conversation()


def test_every_torn_tail_yields_the_longest_committed_prefix(tmp_path):
    path = tmp_path / "c"
    one, two = two_turns(path)
    data = path.read_bytes()
    for n in range(len(data) + 1):
        path.write_bytes(data[:n])
        got = cv.read(path, FP)
        want = two if n >= two.size else one if n >= one.size else cv.Conversation()
        assert got.messages == want.messages and got.records == want.records, n


def test_every_byte_flip_after_the_header_loses_at_most_that_turn(tmp_path):
    path = tmp_path / "c"
    one, two = two_turns(path)
    data = path.read_bytes()
    for at in range(44, len(data)):
        flipped = bytearray(data)
        flipped[at] ^= 0x10
        path.write_bytes(bytes(flipped))
        got = cv.read(path, FP)
        want = one if at >= one.size else cv.Conversation()
        assert got.messages == want.messages and got.records == want.records, at


def test_appending_after_a_torn_tail_cuts_it_off(tmp_path):
    path = tmp_path / "c"
    one, two = two_turns(path)
    path.write_bytes(path.read_bytes()[:two.size - 5])  # the second turn is torn
    state = cv.read(path, FP)
    assert same(state, one)
    three = cv.append(path, FP, state, [{"role": "user", "content": "c"}], [block(2)])
    assert same(cv.read(path, FP), three)


def test_another_models_file_is_refused_by_name(tmp_path):
    two_turns(tmp_path / "c")
    with pytest.raises(cv.ConversationError, match="another model"):
        cv.read(tmp_path / "c", disk.fingerprint("other"))
    (tmp_path / "junk").write_bytes(b"x" * 100)
    with pytest.raises(cv.ConversationError, match="not an ember conversation"):
        cv.read(tmp_path / "junk", FP)


# ------------------------------------------------------------------ the Python API
def test_save_and_load_prefix_warm_a_new_process_exactly(tiny_gguf, tmp_path):
    from ember import LLM
    from ember.sampling.params import SamplingParams

    prompt = list(range(100, 190))
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    first = LLM(str(tiny_gguf), weights="f32", kv_dtype="f32", num_kv_blocks=64, threads=1)
    saved = first.save_prefix(prompt, tmp_path / "p")
    assert saved == 80  # five full blocks of 16
    ram = first.generate(prompt, greedy)[0]  # a RAM hit: what a warm start must equal
    second = LLM(str(tiny_gguf), weights="f32", kv_dtype="f32", num_kv_blocks=64, threads=1)
    assert second.load_prefix(tmp_path / "p", tenant="b") == []  # another tenant's salt
    assert second.load_prefix(tmp_path / "p") == prompt[:80]
    warm = second.generate(prompt, greedy)[0]
    assert warm.cached_tokens == ram.cached_tokens == 80
    assert warm.token_ids == ram.token_ids and warm.logprobs == ram.logprobs
    other = LLM(str(tiny_gguf), weights="f32", kv_dtype="f16", num_kv_blocks=64, threads=1)
    with pytest.raises(cv.ConversationError):
        other.load_prefix(tmp_path / "p")


# ------------------------------------------------------------------ ember chat
def start_chat(tiny_gguf: Path, path: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "ember.cli", "chat", "--model", str(tiny_gguf), "--weights",
         "f32", "--threads", "1", "--conversation", str(path), "--max-tokens", "600",
         "--temperature", "0", "-v"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        bufsize=1)


def wait_for(stream, text: str, timeout: float = 60.0) -> str:
    deadline, seen = time.monotonic() + timeout, ""
    while text not in seen:
        assert time.monotonic() < deadline, f"no {text!r} in {seen[-2000:]!r}"
        line = stream.readline()
        assert line, f"the chat exited before {text!r}: {seen[-2000:]!r}"
        seen += line
    return seen


@pytest.mark.slow
def test_chat_resumes_warm_after_being_killed_mid_reply(tiny_gguf, tmp_path):
    path = tmp_path / "chat.emb"
    chat = start_chat(tiny_gguf, path)
    try:
        chat.stdin.write("Hello there, tell me a long story.\n")
        chat.stdin.flush()
        wait_for(chat.stderr, "[prompt")  # the first reply is whole (600 tokens or EOS)
        chat.stdin.write("And another one, please.\n")
        chat.stdin.flush()
        time.sleep(0.3)  # mid-reply: 600 tokens take about a second
        chat.send_signal(signal.SIGKILL)
        chat.wait(timeout=30)
        rest = chat.stderr.read()
        assert "[prompt" not in rest and "error" not in rest, rest  # killed mid-reply
    finally:
        chat.kill()
    again = start_chat(tiny_gguf, path)
    try:
        again.stdin.write("What happened next?\n")
        again.stdin.flush()
        err = wait_for(again.stderr, "[prompt")
    finally:
        again.kill()
        again.communicate()
    assert "[resumed 2 messages" in err, err  # the killed turn is not in the file
    cached = int(err.split("[prompt ")[-1].split("(")[1].split(" cached")[0])
    assert cached >= 16, err
