"""The `triton` experts backend: packed INT4 experts run by kimi's Triton W4A16 fused MoE
(kimi.kernels.triton.moe_w4a16.fused_experts_int4)."""

from __future__ import annotations

import torch
from torch import nn


class TritonInt4Experts(nn.Module):
    """Packed INT4 experts run by `kimi.kernels.triton.moe_w4a16.fused_experts_int4`.

    w13_packed int32 [E, 2I, D/8] (gate rows then up rows), w13_scale [E, 2I, D/32], w2_packed [E, D, I/8],
    w2_scale [E, D, I/32]; num_experts_total: the model's routed experts (tile heuristic).
    """

    graph_safe = True
    w13_packed: torch.Tensor  # the buffers `__init__` registers
    w13_scale: torch.Tensor
    w2_packed: torch.Tensor
    w2_scale: torch.Tensor

    def __init__(self, w13_packed, w13_scale, w2_packed, w2_scale, expert_offset: int, num_experts_total: int):
        super().__init__()
        self.register_buffer("w13_packed", w13_packed)
        self.register_buffer("w13_scale", w13_scale)
        self.register_buffer("w2_packed", w2_packed)
        self.register_buffer("w2_scale", w2_scale)
        self.expert_offset = expert_offset
        self.num_experts_total = num_experts_total

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        from kimi.kernels.triton.moe_w4a16 import fused_experts_int4

        return fused_experts_int4(
            x,
            self.w13_packed,
            self.w13_scale,
            self.w2_packed,
            self.w2_scale,
            topk_weights,
            topk_ids,
            self.expert_offset,
            num_experts_total=self.num_experts_total,
        )
