"""A random-weight BERT encoder: a transformers ``BertModel`` (the oracle) written as the
GGUF llama.cpp's converter makes of one (its tensor names and keys, float32), with the
bge WordPiece vocabulary from llama.cpp's vocab test file."""

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


def random_bert(vocab: int, seed: int = 0) -> torch.nn.Module:
    import transformers

    config = transformers.BertConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=128,
                                     max_position_embeddings=512, type_vocab_size=2)
    torch.manual_seed(seed)
    model = transformers.BertModel(config, add_pooling_layer=False).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            else:
                p.normal_(0.0, 0.15)
    return model


def write_bert(path: Path, model: torch.nn.Module, vocab_file: Path, pooling: int) -> Path:
    c = model.config
    src = GGUFFile(vocab_file)
    md = src.metadata
    w = gguf.GGUFWriter(str(path), "bert")
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
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()
             if not k.endswith("position_ids") and not k.endswith("token_type_ids")}
    names = {"embeddings.word_embeddings.weight": "token_embd.weight",
             "embeddings.position_embeddings.weight": "position_embd.weight",
             "embeddings.token_type_embeddings.weight": "token_types.weight",
             "embeddings.LayerNorm.weight": "token_embd_norm.weight",
             "embeddings.LayerNorm.bias": "token_embd_norm.bias"}
    for i in range(c.num_hidden_layers):
        for theirs, ours in LAYER_TENSORS.items():
            for kind in ("weight", "bias"):
                names[f"encoder.layer.{i}.{theirs}.{kind}"] = f"blk.{i}.{ours}.{kind}"
    for theirs, ours in names.items():
        w.add_tensor(ours, np.ascontiguousarray(state[theirs]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
