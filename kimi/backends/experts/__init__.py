"""Routed-expert backends (`ExpertsBackend`) and their registry: the same function as
`kimi.model.moe.fused_experts_ref`, over the experts this rank owns, with the INT4 weights kept PACKED (and FP8 weights
kept in FP8) on the device.

- `HummingInt4Experts` (`humming`, and `auto`, the default on CUDA): humming-kernels' indexed W4A16 MoE GEMM
  (humming 0.1.20, API read from its wheel: `humming.layer.HummingLayer` loaded from compressed-tensors `weight_packed`
  / `weight_scale` / `weight_shape`, `transform()`ed once into humming's layout, then called with moe_align's sorted
  pair ids). Steps: align (kimi.kernels.triton.moe_w4a16.moe_align, pure torch, graph-capturable) -> gate_up GEMM per
  (token, slot) pair -> silu(gate) * up (on CUDA: kimi.kernels.triton.fused.silu_mul_rows over the local pairs' rows
  only; align: kimi.kernels.triton.fused.moe_align_fused) -> down GEMM -> our Triton combine (routing weights applied
  once). With `cuda_decode` (backend `auto`), steps of up to AUTO_CUDA_MAX_PAIRS expected local pairs run kimi's CUDA
  GEMM instead (kimi/kernels/cuda/csrc/moe_w4a16.cu, which reads humming's layout: one copy of the experts serves both),
  larger steps (prefill) humming's: the faster of the two at each size (docs/performance.md). The gate_up rows are
  stored interleaved (kimi.kernels.cuda.moe_w4a16.glu_interleave), so kimi's gate_up GEMM writes silu(gate) * up from
  its epilogue and silu_mul_rows reads humming's output in that order.
- `HummingFp8Experts` (humming backend, FP8 checkpoints: K2-Instruct): the same steps over humming's W8A16 indexed
  GEMMs, the float8_e4m3fn weights with their 128 x 128 tile scales loaded through humming's fp8 schema.
- `CudaInt4Experts` (`cuda`): kimi's CUDA W4A16 indexed GEMM at every size (kimi/kernels/cuda/csrc/moe_w4a16.cu via
  kimi.kernels.cuda.moe_w4a16; weights repacked once at load by kimi.kernels.cuda.moe_w4a16.repack, no humming needed),
  in the same steps as humming's (align in 16-row blocks). Faster than humming at decode sizes, about 2x slower at
  prefill sizes (it streams an expert's weights once per 16-row block; docs/performance.md). bf16 models only.
- `TritonInt4Experts`: kimi's Triton W4A16 fused MoE (`fused_experts_int4`).
- `RefExperts`: dequantised weights (bf16) and `fused_experts_ref` (not capturable in a CUDA graph: it reads
  expert counts on the host). Used for `--moe-backend ref`, and for FP8 experts under the backends without an FP8
  kernel (triton, cuda) or shapes humming's FP8 path does not take (dequantised to bf16 on load).

Contract (`ExpertsBackend`), every backend: an nn.Module built from one layer's stacked local expert weights
(`make_experts`: the weights layout each takes) with `forward(x [T, D] bf16, topk_weights [T, k] f32, topk_ids
[T, k] int64 global ids) -> [T, D]`; pairs whose expert is not in [expert_offset, expert_offset + E_local)
contribute nothing; rows with no local pair are 0. `graph_safe`: whether a CUDA graph may capture its forward (it
reads nothing on the host). Optional `expert_major_ok`: forward also takes expert-major inputs
(kimi.model.moe.run_experts). Optional `kernel_variants(max_tokens, top_k)`: step sizes, one per JIT-compiled kernel
variant forward picks for steps of 1..max_tokens tokens (humming's schedules), which the start-up warm-up runs
(kimi.worker.warmup).

Modules: reference (`ref`), triton_w4a16 (`triton`), cuda_w4a16 (`cuda`), humming (`humming`; `auto` is humming
with kimi's CUDA GEMM at decode sizes, auto.py), fp8 (FP8 experts on humming).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from kimi.backends.experts import auto
from kimi.backends.experts.cuda_w4a16 import CudaInt4Experts
from kimi.backends.experts.fp8 import HummingFp8Experts
from kimi.backends.experts.humming import HummingInt4Experts
from kimi.backends.experts.reference import RefExperts, dequant_fp8_parts, dequant_int4_parts
from kimi.backends.experts.triton_w4a16 import TritonInt4Experts
from kimi.config import MOE_BACKENDS as BACKENDS

__all__ = ["BACKENDS", "INT4_BACKENDS", "ExpertsBackend", "make_experts", "make_experts_or_ref"]

log = logging.getLogger(__name__)


class ExpertsBackend(Protocol):
    """What a MoE layer calls (the contract in the module docstring)."""

    graph_safe: bool

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor: ...


def _cuda(*args, dtype: torch.dtype) -> nn.Module:
    if dtype != torch.bfloat16:
        raise ValueError(f"MoE backend cuda runs bf16 models only, not {dtype}")
    return CudaInt4Experts(*args)


# The registry of packed-INT4 experts: backend -> builder(w13_packed, w13_scale, w2_packed, w2_scale, expert_offset,
# num_experts_total, dtype=...) (the `parts` of `make_experts`).
INT4_BACKENDS: dict[str, Callable[..., nn.Module]] = {
    "auto": auto.make_int4,
    "humming": lambda *args, dtype: HummingInt4Experts(*args),
    "cuda": _cuda,
    "triton": lambda *args, dtype: TritonInt4Experts(*args),
    "ref": lambda w13p, w13s, w2p, w2s, offset, total, dtype: RefExperts(
        *dequant_int4_parts(w13p, w13s, w2p, w2s, dtype), offset
    ),
}


def make_experts(
    backend: str,
    parts: dict[str, torch.Tensor],
    expert_offset: int,
    num_experts_total: int,
    dtype: torch.dtype,
    fp8_block: tuple[int, int] = (128, 128),
) -> nn.Module:
    """Build one MoE layer's local experts.

    parts (stacked over the local experts, on the device), one of:
    - packed INT4 (`w13_packed`, `w13_scale`, `w2_packed`, `w2_scale`): the named backend; "ref" dequantises (dtype);
    - FP8 blocks (`w13_fp8` [E, 2I, D], `w13_scale_inv`, `w2_fp8` [E, D, I], `w2_scale_inv`; K2-Instruct, tiles of
      fp8_block): HummingFp8Experts for "humming" and "auto"; every other backend has no FP8 kernel and gets them
      dequantised (dtype) into RefExperts;
    - dequantised (`w13` [E, 2I, D], `w2` [E, D, I]): always RefExperts (no quantised kernel applies).
    "auto" on INT4: HummingInt4Experts with cuda_decode (kimi's CUDA GEMM at decode sizes where it can run, see
    HummingInt4Experts._cuda_unavailable); without humming-kernels, CudaInt4Experts at every size (with a warning).
    Raises ValueError for an unknown backend, or backend "cuda" with a dtype other than bf16; the backends' own
    errors (CudaInt4Experts, HummingInt4Experts, HummingFp8Experts) pass through.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown MoE backend {backend!r}; choose from {', '.join(BACKENDS)}")
    if "w13_fp8" in parts:
        if backend in ("humming", "auto"):
            return HummingFp8Experts(
                parts["w13_fp8"],
                parts["w13_scale_inv"],
                parts["w2_fp8"],
                parts["w2_scale_inv"],
                expert_offset,
                num_experts_total,
                fp8_block,
                dtype,
            )
        parts = dequant_fp8_parts(parts, fp8_block, dtype)
    if "w13" in parts:
        return RefExperts(parts["w13"].to(dtype), parts["w2"].to(dtype), expert_offset)
    return INT4_BACKENDS[backend](
        parts["w13_packed"],
        parts["w13_scale"],
        parts["w2_packed"],
        parts["w2_scale"],
        expert_offset,
        num_experts_total,
        dtype=dtype,
    )


def make_experts_or_ref(
    backend: str, parts, expert_offset: int, num_experts_total: int, dtype, fp8_block: tuple[int, int] = (128, 128)
) -> nn.Module:
    """make_experts, falling back to the dequantised reference (with a warning naming the error) when the INT4 or
    FP8 kernel rejects the shapes (e.g. tiny test models: Triton tiles need D % 128 == 0 and I % 128 == 0)."""
    if "w13_fp8" in parts:
        if backend in ("humming", "auto"):
            try:
                return make_experts(backend, parts, expert_offset, num_experts_total, dtype, fp8_block)
            except Exception as e:
                log.warning(
                    "FP8 experts on humming failed to set up (%s: %s); dequantised, using ref", type(e).__name__, e
                )
        return make_experts("ref", parts, expert_offset, num_experts_total, dtype, fp8_block)
    if backend != "ref" and "w13_packed" in parts:
        D, inter = parts["w2_packed"].shape[1], parts["w2_packed"].shape[2] * 8
        if backend == "triton" and (D % 128 or inter % 128):
            log.warning("MoE backend triton: D %d / I %d not multiples of 128; using ref", D, inter)
            backend = "ref"
        try:
            return make_experts(backend, parts, expert_offset, num_experts_total, dtype)
        except Exception as e:
            log.warning("MoE backend %s failed to set up (%s: %s); using ref", backend, type(e).__name__, e)
            backend = "ref"
    return make_experts(backend, parts, expert_offset, num_experts_total, dtype)
