"""The gated MLP of every dense family: down(act(gate) · up), gate and up in one matmul."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ember.models.linear import Linear

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def gated_mlp(gate_up: Linear, down: Linear, activation: Callable[[torch.Tensor], torch.Tensor],
              h: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up(h).chunk(2, dim=-1)
    return down(activation(gate) * up)
