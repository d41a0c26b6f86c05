"""Gemma 3: the shared decoder with Gemma's differences.

- Five sliding-window layers (window from ``gemma3.attention.sliding_window``, RoPE
  base 10,000) for every global one (the GGUF's ``rope.freq_base``, with its linear
  scaling if any); llama.cpp fixes the same pattern of 6.
- NEOX RoPE; per-head RMSNorm of q and k before it; queries scaled by
  1/sqrt(head_dim) (1/sqrt(hidden/heads) for the 62-layer 27B, as llama.cpp does).
- Norms after each sublayer as well as before; GeGLU (tanh-approximated GELU).
- Embeddings multiplied by sqrt(hidden). RMSNorm weights need no ``1 +``: the GGUF
  converter already added it.
- A chat template (Gemma's turns) for GGUFs that carry none, like the 270M base.
"""

from __future__ import annotations

import math
from typing import Any

from ember.models.config import LayerAttention, ModelConfig
from ember.models.gguf import GGUFFile

SLIDING_PATTERN = 6  # layer i is global when (i + 1) % 6 == 0
LOCAL_ROPE_BASE = 10000.0

# Gemma's turns: a system message opens the first user turn; the assistant is "model".
CHAT_TEMPLATE = """\
{{- bos_token -}}
{%- if messages and messages[0]['role'] == 'system' -%}
  {%- set system = messages[0]['content'] + '\n\n' -%}
  {%- set messages = messages[1:] -%}
{%- else -%}
  {%- set system = '' -%}
{%- endif -%}
{%- for message in messages -%}
  {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
  {{- '<start_of_turn>' + role + '\n' + (system if loop.first else '') -}}
  {{- message['content'] | trim -}}
  {{- '<end_of_turn>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<start_of_turn>model\n' -}}
{%- endif -%}
"""


def configure(gguf: GGUFFile, base: ModelConfig) -> dict[str, Any]:
    arch = base.architecture
    window = int(gguf.require(f"{arch}.attention.sliding_window"))
    layers = tuple(
        LayerAttention(base.rope_base, rope_scale=base.rope_scale)
        if (i + 1) % SLIDING_PATTERN == 0 else LayerAttention(LOCAL_ROPE_BASE, window)
        for i in range(base.n_layers))
    per_head = base.hidden_size // base.n_heads if base.n_layers == 62 else base.head_dim
    return {"rope_neox": True, "layers": layers, "attn_scale": 1.0 / math.sqrt(per_head),
            "embed_scale": math.sqrt(base.hidden_size), "qk_norm": True, "post_norms": True,
            "activation": "gelu_tanh"}
