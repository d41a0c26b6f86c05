"""A LoRA adapter for the real SmolLM2 made with PEFT, in both formats, for the tests.

PEFT's LoRA (rank 4 on all seven projections, A and B random) on transformers' own
SmolLM2 dequantized from the same GGUF; saved as a PEFT directory, converted to a GGUF
adapter by llama.cpp's ``convert_lora_to_gguf.py``, plus a zero adapter (B = 0).
transformers + PEFT's logits on ``IDS`` are the oracle.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from llamacpp_source import convert_lora_to_gguf

IDS = [1, 504, 3458, 282, 4649, 314, 7042, 30, 378, 1183, 314, 7042, 446, 1557, 30, 216]
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_adapters(base_model: torch.nn.Module, root: Path) -> dict[str, Any]:
    """The adapters on a copy of ``base_model`` (transformers' SmolLM2 from the GGUF,
    ``hf_gguf.transformers_from_gguf``), which PEFT changes in place."""
    import copy

    import peft

    hf = copy.deepcopy(base_model)
    # the converter reads the base's config only: as a checkpoint's (a GGUF-loaded one
    # has no architectures and names the GGUF as a quantization)
    base = hf.config.to_dict()
    base.pop("quantization_config", None)
    (root / "base").mkdir(parents=True)
    (root / "base" / "config.json").write_text(json.dumps(
        {**base, "architectures": [type(hf).__name__]}))
    model = peft.get_peft_model(hf, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=MODULES, init_lora_weights=False))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.05)
        oracle = model(torch.tensor([IDS])).logits[0]
    model.save_pretrained(root / "peft")
    gguf = convert_lora_to_gguf(root / "peft", root / "base", root / "adapter.gguf")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.zero_()
    model.save_pretrained(root / "zero")
    return {"peft": root / "peft", "gguf": gguf, "zero": root / "zero", "oracle": oracle}
