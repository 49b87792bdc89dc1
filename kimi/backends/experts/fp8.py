"""FP8 routed experts (K2-Instruct): humming-kernels' W8A16 indexed GEMMs over float8_e4m3fn weights with their
128 x 128 tile scales (`humming` and `auto`); other backends get the experts dequantised
(reference.dequant_fp8_parts)."""

from __future__ import annotations

import logging

import torch

from kimi.backends.experts.humming import HummingExperts

log = logging.getLogger(__name__)


class HummingFp8Experts(HummingExperts):
    """FP8 block-quantised experts (K2-Instruct: float8_e4m3fn weights, one float32 `weight_scale_inv` per
    block_n x block_k tile, DeepSeek-V3's format) kept in FP8 on the device and run by humming-kernels' indexed
    MoE GEMMs (W8A16: bf16 activations, fp32 accumulation), in the same steps as HummingInt4Experts.

    humming's fp8 schema turns the tile scales into per-row group scales along K (group block_k) in the model dtype, so
    W[n, k] = float(w[n, k]) * bf16(scale_inv[n // block_n, k // block_k]): the scale is rounded to bf16 (relative 2^-9)
    where `kimi.model.quant.dequant_fp8_block` keeps it in float32. The GPU tests bound the output's distance from the
    dequantised reference (RefExperts) by 2e-2 of its max |ref| (measured <= 1.01e-2). Half the bytes of bf16 experts
    (dequantised on load, the `ref` path), and CUDA-graph capturable. Schedules: tuning/humming.json's "fp8" entries,
    else humming's heuristic.

    Args: w13 [E, 2I, D] float8_e4m3fn (gate rows then up rows), w13_scale_inv [E, 2I / block_n, D / block_k]
    float32, w2 [E, D, I] float8_e4m3fn, w2_scale_inv [E, D / block_n, I / block_k] float32, all on the device;
    block (block_n, block_k); dtype: the model dtype (bf16 / fp16). Raises ValueError when 2I, D or I is not a
    multiple of the block edges (the gate / up tiles must not straddle); ImportError without humming.
    """

    weight_kind = "fp8"

    def __init__(
        self,
        w13,
        w13_scale_inv,
        w2,
        w2_scale_inv,
        expert_offset: int,
        num_experts_total: int,
        block: tuple[int, int] = (128, 128),
        dtype: torch.dtype = torch.bfloat16,
    ):
        super().__init__()
        E, two_i, D = w13.shape
        inter = two_i // 2
        bn, bk = block
        if inter % bn or D % bn or D % bk or inter % bk:
            raise ValueError(f"FP8 experts: I {inter} and D {D} must be multiples of the {bn} x {bk} scale tiles")
        for name, t, want in (
            ("w13", w13, (E, 2 * inter, D)),
            ("w2", w2, (E, D, inter)),
            ("w13_scale_inv", w13_scale_inv, (E, 2 * inter // bn, D // bk)),
            ("w2_scale_inv", w2_scale_inv, (E, D // bn, inter // bk)),
        ):
            if tuple(t.shape) != want:
                raise ValueError(f"FP8 experts: {name} is {tuple(t.shape)}, want {want}")
        wcfg = dict(quant_method="fp8", weight_block_size=[bn, bk])
        self._setup(
            wcfg,
            dtype,
            {"weight": w13, "weight_scale_inv": w13_scale_inv.float()},
            {"weight": w2, "weight_scale_inv": w2_scale_inv.float()},
            E,
            D,
            inter,
            w13.device,
            expert_offset,
            num_experts_total,
        )
