"""Architecture hyper-parameters, read from GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass

from ember.errors import UnsupportedModelError
from ember.models.gguf import GGUFFile

SUPPORTED_ARCHITECTURES = ("llama",)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    n_layers: int
    hidden_size: int
    ffn_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_dim: int  # leading dims of each head that RoPE rotates (llama.cpp's n_rot)
    rope_base: float
    norm_eps: float
    vocab_size: int
    context_length: int
    tied_embeddings: bool

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> ModelConfig:
        arch = gguf.architecture
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"{gguf.path.name}: architecture {arch!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )

        def key(name: str) -> object:
            return gguf.require(f"{arch}.{name}")

        hidden = int(key("embedding_length"))
        n_heads = int(key("attention.head_count"))
        head_dim = int(gguf.get(f"{arch}.attention.key_length", hidden // n_heads))
        vocab = gguf.get(f"{arch}.vocab_size")
        if vocab is None:
            vocab = gguf.tensor("token_embd.weight").shape[0]
        return cls(
            architecture=arch,
            n_layers=int(key("block_count")),
            hidden_size=hidden,
            ffn_size=int(key("feed_forward_length")),
            n_heads=n_heads,
            n_kv_heads=int(gguf.get(f"{arch}.attention.head_count_kv", n_heads)),
            head_dim=head_dim,
            rope_dim=int(gguf.get(f"{arch}.rope.dimension_count", head_dim)),
            rope_base=float(gguf.get(f"{arch}.rope.freq_base", 10000.0)),
            norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            vocab_size=int(vocab),
            context_length=int(gguf.get(f"{arch}.context_length", 2048)),
            tied_embeddings="output.weight" not in gguf.tensors,
        )
