"""The `cuda` experts backend: kimi's CUDA W4A16 indexed GEMM (kimi.kernels.cuda.moe_w4a16) at every step size,
and the forward the `auto` backend runs at decode sizes (`cuda_experts_forward`)."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from kimi.errors import BackendUnavailableError

log = logging.getLogger(__name__)


# Backend "auto": the largest step, in expected local pairs (T * top_k * E_local / E_total), that runs kimi's CUDA
# GEMM; larger ones run humming's (the crossover of the two: docs/performance.md).
AUTO_CUDA_MAX_PAIRS = 512


def expected_local_pairs(T: int, k: int, E: int, num_experts_total: int) -> int:
    """The (token, expert) pairs a step of T tokens at top-k routes to E local experts of num_experts_total, in
    expectation under uniform routing (at least 1): what the expert GEMMs' schedules are picked by."""
    return max(1, T * k * E // max(num_experts_total, E))


class CudaInt4Experts(nn.Module):
    """Packed INT4 experts run by kimi's CUDA indexed GEMM (kimi.kernels.cuda.moe_w4a16), weights repacked at load.

    Same arguments as TritonInt4Experts (the packed tensors are consumed). Steps per call: align in 16-row blocks
    (kimi.kernels.triton.fused.moe_align_fused) -> gate_up GEMM over the local pairs' rows, its epilogue writing
    silu(gate) * up (gate_up rows stored in `kimi.kernels.cuda.moe_w4a16.glu_interleave`'s order; `glu` False: the plain
    GEMM and the silu_mul_rows kernel, for A/B runs) -> down GEMM -> the Triton combine (routing weights applied once).
    bf16 activations only. Raises ValueError for shapes the kernel cannot take (N % 64, K % 64), RuntimeError on a GPU
    that is not sm_90 (Hopper: the kernel is built for sm_90a), and what `kimi.kernels.cuda.moe_w4a16.load_extension`
    raises when it cannot be built; all of them here, at model load (so kimi.backends.experts.make_experts_or_ref can
    fall back to the reference).
    """

    graph_safe = True
    expert_major_ok = True  # forward(..., expert_major=True): see kimi.model.moe.run_experts
    w13: torch.Tensor  # the buffers `__init__` registers
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor

    def __init__(self, w13_packed, w13_scale, w2_packed, w2_scale, expert_offset: int, num_experts_total: int):
        super().__init__()
        from kimi.kernels.cuda import moe_w4a16 as mc

        E, two_i, d8 = w13_packed.shape
        self.E, self.D, self.inter = E, d8 * 8, two_i // 2
        dev = w13_packed.device
        if dev.type != "cuda" or torch.cuda.get_device_capability(dev)[0] != 9:
            raise BackendUnavailableError(f"MoE backend cuda needs an sm_90 (Hopper) GPU; got {dev}")
        mc.config_for(two_i, self.D), mc.config_for(self.D, self.inter)  # ValueError when no configuration runs one
        # launch configurations: config_for's per step size, or these where set (benchmarks)
        self.config13: tuple[int, int, int] | None = None
        self.config2: tuple[int, int, int] | None = None
        self.glu = True
        # the GEMMs' launch variants (cuda_experts_forward; the measured-faster defaults, benchmarks A/B the others)
        self.pdl_mode, self.early_weights, self.zero_pads = "early", True, True
        self.glu_group = mc.GLU_GROUP  # w13's rows in glu_interleave's order (config_for above: I % 32 == 0)
        w13, s13 = mc.repack(*mc.glu_interleave(w13_packed, w13_scale))
        w2, s2 = mc.repack(w2_packed, w2_scale)
        self.register_buffer("w13", w13)
        self.register_buffer("w13_scale", s13)
        self.register_buffer("w2", w2)
        self.register_buffer("w2_scale", s2)
        self.expert_offset = expert_offset
        self.num_experts_total = num_experts_total
        mc.load_extension()  # built (or loaded from its cache) at model load, not in the first step

    def forward(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        expert_major: bool = False,
        max_pairs: int | None = None,
        expected_pairs: int | None = None,
    ) -> torch.Tensor:
        """x [T, D], topk_weights [T, k], topk_ids [T, k] -> [T, D] (`cuda_experts_forward`; the keywords as
        kimi.model.moe.DispatchResult)."""
        T, k = topk_ids.shape
        m_local = expected_pairs or expected_local_pairs(T, k, self.E, self.num_experts_total)
        return cuda_experts_forward(
            x,
            topk_weights,
            topk_ids,
            self.E,
            self.expert_offset,
            self.inter,
            self.w13,
            self.w13_scale,
            self.w2,
            self.w2_scale,
            m_local,
            self.config13,
            self.config2,
            self.glu_group,
            self.glu,
            expert_major=expert_major,
            max_pairs=max_pairs,
            pdl_mode=self.pdl_mode,
            early_weights=self.early_weights,
            zero_pads=self.zero_pads,
        )


def cuda_experts_forward(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    E: int,
    expert_offset: int,
    inter: int,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    m_local: int,
    config13: tuple[int, int, int] | None = None,
    config2: tuple[int, int, int] | None = None,
    glu_group: int = 0,
    fuse_glu: bool = True,
    expert_major: bool = False,
    max_pairs: int | None = None,
    pdl_mode: str = "early",
    early_weights: bool = True,
    zero_pads: bool = True,
) -> torch.Tensor:
    """The routed experts through kimi's CUDA GEMM (kimi.kernels.cuda.moe_w4a16.indexed_gemm): align in 16-row blocks
    (kimi.kernels.triton.fused.moe_align_fused) -> gate_up over the local pairs' rows -> silu(gate) * up on those rows
    -> down -> the Triton combine. x [T, D] bf16, topk_weights [T, k], topk_ids [T, k] global ids; w13 / s13 ([E, D/16,
    4I] int32, [E, D/32, 2I] bf16) and w2 / s2 ([E, I/16, 2D], [E, I/32, D]) in the kernel's layout; m_local: the step's
    expected local pairs, which picks the launch configurations (kimi.kernels.cuda.moe_w4a16.config_for) unless config13
    / config2 are given. glu_group: 0, or the group of `kimi.kernels.cuda.moe_w4a16.glu_interleave` that w13's rows are
    stored in; with GLU_GROUP and fuse_glu the gate_up GEMM's epilogue writes SiLU(gate) * up (no SiLU kernel). Returns
    [T, D] (rows without a local pair are 0). expert_major / max_pairs: as kimi.model.moe.DispatchResult (with
    expert_major and k == 1 the down GEMM's output is returned: weights not applied, rows without a local expert unset;
    max_pairs bounds the local pairs, sizing the align and the GEMM grids). pdl_mode / zero_pads: both GEMMs'
    (kimi.kernels.cuda.moe_w4a16.indexed_gemm); early_weights: the down GEMM's (its align is two kernels
    back). CUDA graphs keep the values of their capture."""
    from kimi.kernels.cuda import moe_w4a16 as mc
    from kimi.kernels.triton.fused import moe_align_fused, silu_mul_rows
    from kimi.kernels.triton.moe_w4a16 import combine_into

    T, k = topk_ids.shape
    D = x.shape[-1]
    if T == 0 or max_pairs == 0:  # no local pair: nothing to compute (unset rows / zeros, as below)
        return torch.empty_like(x) if T == 0 or (expert_major and k == 1) else torch.zeros_like(x)
    sorted_ids, block_expert, num_padded, _ = moe_align_fused(topk_ids, E, expert_offset, 16, max_pairs)
    P = T * k
    config13 = config13 or mc.config_for(2 * inter, D, m_local)
    config2 = config2 or mc.config_for(D, inter, m_local)
    kw: dict[str, Any] = {"zero_pads": zero_pads, "pdl_mode": pdl_mode}  # both GEMMs' launch variants
    if fuse_glu and glu_group == mc.GLU_GROUP:  # SiLU(gate) * up from the gate_up GEMM's epilogue
        act = torch.empty((P, inter), dtype=x.dtype, device=x.device)  # rows = pair ids (local ones written)
        mc.indexed_gemm(
            x.contiguous(), w13, s13, sorted_ids, block_expert, num_padded, k, act, config13, glu=True, **kw
        )
    else:
        y1 = torch.empty((P, 2 * inter), dtype=x.dtype, device=x.device)  # rows = pair ids (local ones written)
        mc.indexed_gemm(x.contiguous(), w13, s13, sorted_ids, block_expert, num_padded, k, y1, config13, **kw)
        act = silu_mul_rows(y1, sorted_ids, num_padded, inter, interleave=glu_group)  # [P, I], listed rows only
    y2 = torch.empty((P, D), dtype=x.dtype, device=x.device)
    # the align is two kernels back (gate_up, or gate_up + silu_mul_rows, each waiting before it releases): the down
    # GEMM may start loading its weights before it waits
    mc.indexed_gemm(
        act, w2, s2, sorted_ids, block_expert, num_padded, 1, y2, config2, early_weights=early_weights, **kw
    )
    if expert_major and k == 1:  # rows = pairs, weights applied by the combine, unset rows never read
        return y2
    out = torch.empty_like(x)  # [T, D]; combine writes every element
    combine_into(y2, topk_weights, topk_ids, expert_offset, E, out)
    return out
