"""The reference experts backend (`ref`): dequantised weights and `kimi.model.moe.fused_experts_ref`."""

from __future__ import annotations

import torch
from torch import nn

from kimi.model.moe import fused_experts_ref


class RefExperts(nn.Module):
    """Dequantised experts: w13 [E, 2I, D], w2 [E, D, I] (model dtype) -> `fused_experts_ref`."""

    graph_safe = False

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, expert_offset: int):
        super().__init__()
        self.w13 = nn.Parameter(w13, requires_grad=False)
        self.w2 = nn.Parameter(w2, requires_grad=False)
        self.expert_offset = expert_offset

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return fused_experts_ref(x, self.w13, self.w2, topk_weights, topk_ids, self.expert_offset)


def dequant_fp8_parts(parts: dict, block: tuple[int, int], dtype: torch.dtype) -> dict:
    """FP8 parts (`w13_fp8`, `w13_scale_inv`, `w2_fp8`, `w2_scale_inv`) -> dequantised {`w13`, `w2`} in dtype, one
    expert at a time (kimi.model.quant.dequant_fp8_block)."""
    from kimi.model.quant import dequant_fp8_block

    def deq(w, s):
        return torch.stack([dequant_fp8_block(w[e], s[e], block, torch.float32).to(dtype) for e in range(w.shape[0])])

    return {"w13": deq(parts["w13_fp8"], parts["w13_scale_inv"]), "w2": deq(parts["w2_fp8"], parts["w2_scale_inv"])}


def dequant_int4_parts(
    w13_packed: torch.Tensor, w13_scale: torch.Tensor, w2_packed: torch.Tensor, w2_scale: torch.Tensor, dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed INT4 experts ([E, N, K/8] int32 with [E, N, K/32] scales) -> (w13 [E, 2I, D], w2 [E, D, I]) in dtype,
    one expert at a time (kimi.model.quant.dequant_int4, group 32)."""
    from kimi.model.quant import dequant_int4

    def deq(p, s):
        return torch.stack([dequant_int4(p[e], s[e], 32, dtype) for e in range(p.shape[0])])

    return deq(w13_packed, w13_scale), deq(w2_packed, w2_scale)
