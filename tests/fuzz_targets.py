"""Fuzz targets for every reader of files ember may be handed: the GGUF reader with the
model loader behind it (configuration, tokenizer, chat template, weights), the LoRA
adapter readers (GGUF, and PEFT's safetensors), the KV disk tier's block reader, and
chat templates taken from model files.

Each target takes bytes and must end in one of two ways: it loads, or it raises one of
ember's named errors. Anything else — another exception, a hang past the target's
deadline — is a finding. ``tests/test_fuzz_files.py`` runs them for a bounded number of
structure-aware mutations of the seeds in every test run; ``scripts/fuzz.py`` runs them
under atheris (libFuzzer) for as long as it is given.
"""

from __future__ import annotations

import json
import signal
import struct
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import gguf
import numpy as np

from ember.errors import EmberError

SEED_VOCAB = 300  # 256 byte tokens, a few merges, specials
DEADLINE_S = 10  # past this, one input is a hang


class Hang(BaseException):
    """A target ran past its deadline (a finding; not an Exception, so that no
    ``except Exception`` in the code under test can take it for a refusal)."""


@contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """SIGALRM after ``seconds`` (main thread only), raised as :class:`Hang`."""
    def ring(signum: int, frame: object) -> None:
        raise Hang(f"no answer within {seconds} s")

    previous = signal.signal(signal.SIGALRM, ring)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: each byte a printable character."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def write_seed_model(path: Path, arch: str = "llama", seed: int = 0) -> Path:
    """A small, complete llama model (GPT-2 byte-level vocabulary of SEED_VOCAB tokens,
    one layer of 32, f32 and Q8_0 weights, a chat template): every part of the loader
    reads something of it, in milliseconds."""
    rng = np.random.default_rng(seed)
    hidden, ffn, heads = 32, 64, 4
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_block_count(1)
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    tokens = _byte_tokens()
    merges = ["Ġ t", "h e", "Ġt he", "i n", "a n", "e r", "o n", "Ġ a"]
    tokens += [m.replace(" ", "") for m in merges]
    tokens += ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    tokens += [f"<extra_{i}>" for i in range(SEED_VOCAB - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if t.startswith("<") else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(SEED_VOCAB - len(tokens) + tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                        "{{ m['content'] }}<|im_end|>\n{% endfor %}"
                        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

    def f32(name: str, *shape: int) -> None:
        w.add_tensor(name, rng.normal(0, 0.1, shape).astype(np.float32))

    def q8(name: str, out_f: int, in_f: int) -> None:
        data = rng.normal(0, 0.1, (out_f, in_f)).astype(np.float32)
        w.add_tensor(name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                     raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    f32("token_embd.weight", SEED_VOCAB, hidden)
    f32("output_norm.weight", hidden)
    f32("blk.0.attn_norm.weight", hidden)
    f32("blk.0.ffn_norm.weight", hidden)
    for name, out_f in (("attn_q", hidden), ("attn_k", hidden), ("attn_v", hidden),
                        ("attn_output", hidden), ("ffn_gate", ffn), ("ffn_up", ffn)):
        q8(f"blk.0.{name}.weight", out_f, hidden)
    q8("blk.0.ffn_down.weight", hidden, ffn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_seed_lora(path: Path, rank: int = 4, seed: int = 0) -> Path:
    """A GGUF LoRA adapter (llama.cpp's layout) for :func:`write_seed_model`'s model."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", 8.0)
    for name in ("attn_q", "attn_v"):
        w.add_tensor(f"blk.0.{name}.weight.lora_a",
                     rng.normal(0, 0.1, (rank, 32)).astype(np.float32))
        w.add_tensor(f"blk.0.{name}.weight.lora_b",
                     rng.normal(0, 0.1, (32, rank)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_seed_peft(directory: Path, rank: int = 4, seed: int = 0) -> Path:
    """The same adapter as PEFT writes it: adapter_config.json and safetensors."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps(
        {"r": rank, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
         "peft_type": "LORA"}))
    tensors = {}
    for name in ("q_proj", "v_proj"):
        prefix = f"base_model.model.model.layers.0.self_attn.{name}"
        tensors[f"{prefix}.lora_A.weight"] = rng.normal(0, 0.1, (rank, 32)).astype(np.float32)
        tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, 0.1, (32, rank)).astype(np.float32)
    (directory / "adapter_model.safetensors").write_bytes(_safetensors(tensors))
    return directory


def _safetensors(tensors: dict[str, np.ndarray]) -> bytes:
    header, offset, blobs = {}, 0, []
    for name, array in tensors.items():
        raw = array.tobytes()
        header[name] = {"dtype": "F32", "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + b"".join(blobs)


# ------------------------------------------------------------------ the targets
class Targets:
    """The targets, with a scratch directory and the seed model's configuration."""

    def __init__(self, scratch: Path) -> None:
        from ember.models.architectures import model_config
        from ember.models.gguf import GGUFFile

        self.scratch = scratch
        self.model = write_seed_model(scratch / "seed-model.gguf")
        with GGUFFile(self.model) as f:
            self.cfg = model_config(f)

    def seeds(self) -> dict[str, list[bytes]]:
        lora = write_seed_lora(self.scratch / "seed-lora.gguf")
        peft = write_seed_peft(self.scratch / "seed-peft")
        return {"gguf_model": [self.model.read_bytes()],
                "lora_gguf": [lora.read_bytes()],
                "lora_peft": [(peft / "adapter_model.safetensors").read_bytes()],
                "kv_block": [self._seed_block()],
                "chat_template": [b"{% for m in messages %}{{ m['role'] }}: "
                                  b"{{ m['content'] }}\n{% endfor %}"]}

    def all(self) -> dict[str, Callable[[bytes], None]]:
        return {"gguf_model": self.gguf_model, "lora_gguf": self.lora_gguf,
                "lora_peft": self.lora_peft, "kv_block": self.kv_block,
                "chat_template": self.chat_template}

    def _file(self, name: str, data: bytes) -> Path:
        path = self.scratch / name
        path.write_bytes(data)
        return path

    def gguf_model(self, data: bytes) -> None:
        """The whole load: header, configuration, tokenizer, template, weights; then a
        few tokens encoded and decoded."""
        from ember.models.loader import load_model

        loaded = load_model(str(self._file("model.gguf", data)), "f32")
        ids = loaded.tokenizer.encode("the fuzz <|im_end|>")
        loaded.tokenizer.decode(ids)

    def lora_gguf(self, data: bytes) -> None:
        from ember.models.lora import load_lora

        load_lora(self._file("adapter.gguf", data), "fuzz", self.cfg)

    def lora_peft(self, data: bytes) -> None:
        from ember.models.lora import load_lora

        directory = self.scratch / "peft"
        write_seed_peft(directory)
        (directory / "adapter_model.safetensors").write_bytes(data)
        load_lora(directory, "fuzz", self.cfg)

    def kv_block(self, data: bytes) -> None:
        from ember.kv.disk import CorruptBlock, decode

        try:
            decode(data, bytes(32))
        except CorruptBlock:
            pass

    def chat_template(self, data: bytes) -> None:
        from ember.chat_template import ChatTemplate

        template = ChatTemplate(data.decode("utf-8", errors="replace"), bos_token="<s>",
                                eos_token="</s>")
        template.render([{"role": "user", "content": "hello"}])

    def _seed_block(self) -> bytes:
        from ember.kv.disk import BlockRecord, encode

        return encode(bytes(32), BlockRecord(bytes(range(16)), bytes(16), b"salt",
                                             tuple(range(16)), bytes(64)))


EXPECTED: tuple[type[BaseException], ...] = (EmberError,)


def outcome(target: Callable[[bytes], None], data: bytes, seconds: int = DEADLINE_S) -> str:
    """"ok", "refused" (a named error), or raises the finding."""
    try:
        with deadline(seconds):
            target(data)
    except EXPECTED:
        return "refused"
    return "ok"


def scratch_targets() -> Targets:
    return Targets(Path(tempfile.mkdtemp(prefix="ember-fuzz-")))
