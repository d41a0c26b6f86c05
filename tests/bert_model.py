"""Random-weight BERT encoders: a transformers ``BertModel`` or ``NomicBertModel`` (the
oracle) written as the GGUF llama.cpp's converter makes of one (its tensor names and
keys, float32; nomic-bert's q, k and v fused into ``attn_qkv`` as the converter fuses
nomic's ``Wqkv``), with the bge WordPiece vocabulary from llama.cpp's vocab test
file."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from ember.models.gguf import GGUFFile

LAYER_TENSORS = {  # transformers' name in encoder.layer.{i} -> llama.cpp's blk.{i}
    "attention.self.query": "attn_q", "attention.self.key": "attn_k",
    "attention.self.value": "attn_v", "attention.output.dense": "attn_output",
    "attention.output.LayerNorm": "attn_output_norm", "intermediate.dense": "ffn_up",
    "output.dense": "ffn_down", "output.LayerNorm": "layer_output_norm"}


NOMIC_LAYER_TENSORS = {  # transformers' name in layers.{i} -> llama.cpp's blk.{i}
    "self_attn.o_proj": "attn_output", "post_attention_layernorm": "attn_output_norm",
    "mlp.up_proj": "ffn_up", "mlp.gate_proj": "ffn_gate", "mlp.down_proj": "ffn_down",
    "post_mlp_layernorm": "layer_output_norm"}
NOMIC_ROPE_BASE = 1000.0


def random_bert(vocab: int, seed: int = 0) -> torch.nn.Module:
    import transformers

    config = transformers.BertConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=128,
                                     max_position_embeddings=512, type_vocab_size=2)
    torch.manual_seed(seed)
    return _randomise(transformers.BertModel(config, add_pooling_layer=False).eval())


def random_nomic_bert(vocab: int, seed: int = 0) -> torch.nn.Module:
    import transformers

    config = transformers.NomicBertConfig(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        head_dim=16, intermediate_size=96, max_position_embeddings=512, type_vocab_size=2,
        rope_parameters={"rope_theta": NOMIC_ROPE_BASE, "rope_type": "default"})
    torch.manual_seed(seed)
    return _randomise(transformers.NomicBertModel(config).eval())


def _randomise(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            else:
                p.normal_(0.0, 0.15)
    return model


def random_rank_head(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """A cross-encoder's head over ``model``'s CLS state: transformers'
    ``RobertaClassificationHead`` (dense, tanh, one relevance output), as bge-reranker
    has it."""
    from transformers.models.roberta.modeling_roberta import RobertaClassificationHead

    config = model.config.__class__(**model.config.to_dict())
    config.num_labels = 1
    torch.manual_seed(seed)
    return _randomise(RobertaClassificationHead(config).eval())


def write_bert(path: Path, model: torch.nn.Module, vocab_file: Path, pooling: int,
               head: torch.nn.Module | None = None) -> Path:
    """``head``: a classification head, written as llama.cpp's converter names
    RoBERTa's (``cls`` the dense layer, ``cls.output`` the projection)."""
    c = model.config
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()
             if not k.endswith("position_ids") and not k.endswith("token_type_ids")}
    names = dict(_EMBEDDINGS, **{"embeddings.position_embeddings.weight":
                                 "position_embd.weight"})
    for i in range(c.num_hidden_layers):
        for theirs, ours in LAYER_TENSORS.items():
            for kind in ("weight", "bias"):
                names[f"encoder.layer.{i}.{theirs}.{kind}"] = f"blk.{i}.{ours}.{kind}"
    tensors = {ours: state[theirs] for theirs, ours in names.items()}
    if head is not None:
        for kind in ("weight", "bias"):
            tensors[f"cls.{kind}"] = getattr(head.dense, kind).detach().numpy()
            tensors[f"cls.output.{kind}"] = getattr(head.out_proj, kind).detach().numpy()
    return _write(path, "bert", c, vocab_file, pooling, tensors)


def write_nomic_bert(path: Path, model: torch.nn.Module, vocab_file: Path, pooling: int
                     ) -> Path:
    c = model.config
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    tensors = {ours: state[theirs] for theirs, ours in _EMBEDDINGS.items()}
    for i in range(c.num_hidden_layers):
        tensors[f"blk.{i}.attn_qkv.weight"] = np.concatenate(
            [state[f"layers.{i}.self_attn.{x}_proj.weight"] for x in "qkv"])
        for theirs, ours in NOMIC_LAYER_TENSORS.items():
            for kind in ("weight", "bias"):
                if f"layers.{i}.{theirs}.{kind}" in state:
                    tensors[f"blk.{i}.{ours}.{kind}"] = state[f"layers.{i}.{theirs}.{kind}"]
    return _write(path, "nomic-bert", c, vocab_file, pooling, tensors,
                  rope_base=NOMIC_ROPE_BASE)


_EMBEDDINGS = {"embeddings.word_embeddings.weight": "token_embd.weight",
               "embeddings.token_type_embeddings.weight": "token_types.weight",
               "embeddings.LayerNorm.weight": "token_embd_norm.weight",
               "embeddings.LayerNorm.bias": "token_embd_norm.bias"}


def _write(path: Path, arch: str, c, vocab_file: Path, pooling: int,
           tensors: dict[str, np.ndarray], rope_base: float | None = None) -> Path:
    md = GGUFFile(vocab_file).metadata
    w = gguf.GGUFWriter(str(path), arch)
    if rope_base is not None:
        w.add_rope_freq_base(rope_base)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_block_count(c.num_hidden_layers)
    w.add_layer_norm_eps(c.layer_norm_eps)
    w.add_causal_attention(False)
    w.add_pooling_type(gguf.PoolingType(pooling))
    w.add_tokenizer_model("bert")
    w.add_tokenizer_pre(md["tokenizer.ggml.pre"])
    w.add_token_list(md["tokenizer.ggml.tokens"])
    w.add_token_types([int(t) for t in md["tokenizer.ggml.token_type"]])
    w.add_token_type_count(c.type_vocab_size)
    for key in ("unknown", "seperator", "padding", "cls", "mask"):
        value = md.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None:
            w.add_uint32(f"tokenizer.ggml.{key}_token_id", int(value))
    for name, array in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(array))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
