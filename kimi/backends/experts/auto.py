"""The `auto` experts backend (the default on CUDA): humming's GEMMs with kimi's CUDA GEMM at decode sizes over one
copy of the INT4 experts (HummingInt4Experts with cuda_decode); without humming-kernels, kimi's CUDA GEMM at every
size."""

from __future__ import annotations

import logging

import torch
from torch import nn

from kimi.backends.experts.cuda_w4a16 import CudaInt4Experts
from kimi.backends.experts.humming import HummingInt4Experts

log = logging.getLogger(__name__)


def make_int4(
    w13_packed: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
    expert_offset: int,
    num_experts_total: int,
    dtype: torch.dtype,
) -> nn.Module:
    """HummingInt4Experts(cuda_decode=True) over packed INT4 experts (kimi.backends.experts.make_experts' parts);
    CudaInt4Experts (with a warning) when humming-kernels is not installed. Raises ValueError when it is not and
    dtype is not bf16 (kimi's CUDA GEMM runs bf16 models only)."""
    args = (w13_packed, w13_scale, w2_packed, w2_scale, expert_offset, num_experts_total)
    try:
        return HummingInt4Experts(*args, cuda_decode=True)
    except ImportError as e:
        if dtype != torch.bfloat16:
            raise ValueError(
                f"MoE backend auto without humming-kernels ({e}) needs kimi's CUDA GEMM, which runs "
                f"bf16 models only, not {dtype}"
            ) from e
        log.warning(
            "MoE backend auto: humming-kernels is not installed (%s); kimi's CUDA GEMM runs every step "
            "(about 2x slower prefill than humming's)",
            e,
        )
        return CudaInt4Experts(*args)
