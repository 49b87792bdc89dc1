"""RMSNorm, the plain PyTorch reference (docs/model-format.md, Math; DeepSeek-V3 reference `RMSNorm`)."""

from __future__ import annotations

import torch

# The DeepSeek-V3 reference builds q_a_layernorm and kv_a_layernorm with this eps, whatever
# config.rms_norm_eps says (docs/model-format.md, Math).
LATENT_NORM_EPS = 1e-6


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * (x * rsqrt(mean(x^2) + eps))` over the last dim, computed in float32, cast back to x.dtype.

    x: [..., D] any floating dtype; weight: [D]. Returns [..., D] in x.dtype.
    Math: docs/model-format.md, Math (RMSNorm in fp32).
    """
    xf = x.float()  # [..., D]
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)  # [..., D]
    return (weight.float() * xf).to(x.dtype)
