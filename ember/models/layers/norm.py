"""RMSNorm: PyTorch's for the float formats (the oracle), one native call for q4.

The choice follows the weight format only because a q4 model has the native kernels
loaded (its linears need them) and already differs from f32 by its int8 activations;
the f32 oracle stays PyTorch from end to end.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ember import kernels

Norm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def native_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    ext = kernels.quant_matmul()
    assert ext is not None, "a q4 model is loaded only where the kernels build"
    return ext.rms_norm(x, weight, eps)


def norm_for(weights: str) -> Norm:
    """The RMSNorm a model of weight format ``weights`` uses."""
    return native_rms_norm if weights == "q4" else rms_norm
