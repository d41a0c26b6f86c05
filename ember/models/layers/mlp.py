"""The gated MLP of every dense family: down(glu(gate, up)), gate and up in one matmul,
and the gated linear units the families use (routed experts use them too)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ember.models.linear import Linear

GLU = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# OpenAI's SwiGLU (gpt-oss): constants of the model, not of the file (llama.cpp fixes
# them too)
SWIGLU_OAI_ALPHA = 1.702
SWIGLU_OAI_LIMIT = 7.0


def _swiglu_oai(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gpt-oss: the gate clamped above and up clamped both ways at 7, the gate's sigmoid
    sharpened by 1.702, up offset by one."""
    gate = gate.clamp(max=SWIGLU_OAI_LIMIT)
    up = up.clamp(min=-SWIGLU_OAI_LIMIT, max=SWIGLU_OAI_LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_OAI_ALPHA))


# activation name (ModelConfig.activation) -> glu(gate, up)
GLUS: dict[str, GLU] = {
    "silu": lambda gate, up: F.silu(gate) * up,
    "gelu_tanh": lambda gate, up: F.gelu(gate, approximate="tanh") * up,
    "swiglu_oai": _swiglu_oai,
}


def gated_mlp(gate_up: Linear, down: Linear, glu: GLU, h: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up(h).chunk(2, dim=-1)
    return down(glu(gate, up))
