"""L2 prefetch of the routed experts' first gate_up weights while a MoE layer's routing runs (decode steps).

Why: between a layer's post-attention RMSNorm and its routed gate_up GEMM, the main stream runs a chain of small,
latency-bound kernels (router logits, top-k, dispatch, align: ~30 us at 32 local sequences) while the shared expert
streams 88 MB on the side stream at ~2.7-3 TB/s, so part of the HBM bandwidth idles. The gate_up GEMM's first CTAs
read the first local experts (the align orders its blocks by expert), each warp from the start of its K range, so
those bytes can be in L2 before the GEMM starts. `prefetch_gate_up_l2` issues `prefetch.global.L2::evict_last` (PTX
ISA, "prefetch") for them: no data changes, nothing waits for it.

What is fetched (`gate_up_ranges`): for each of the first `experts` local experts and each of the GEMM's `kw` warp K
ranges (kimi.ops.moe_int4_cuda's layout: weights [E, K/16, 2N] int32 and scales [E, K/32, N] bf16, k16 steps and
scale groups outermost, so a K range of an expert is one contiguous run of bytes), the first `frac` of the range.
"""

from __future__ import annotations

import torch

__all__ = ["gate_up_ranges", "prefetch_gate_up_l2", "LINE", "GATE_UP_PREFETCH"]

LINE = 128  # bytes per prefetch (an L2 line)
# What the decode step prefetches (kimi.ops.moe_backend's experts `prefetch_l2`, issued by kimi.worker.gpu_model at
# the start of each MoE layer's routing, inside CUDA-graph capture): the first `experts` local experts (0: off), the
# first `frac` of each warp's K range, for steps of at least `min_pairs` expected local pairs (below, the first
# experts are often not hit). Read when a graph is captured (tools/bench_decode.py A/Bs it).
GATE_UP_PREFETCH = {"experts": 0, "frac": 0.25, "min_pairs": 192}


def gate_up_ranges(weights: torch.Tensor, scales: torch.Tensor, kw: int, experts: int,
                   frac: float) -> list[tuple[torch.Tensor, int, int, int, int, int]]:
    """The byte runs to prefetch: per tensor (weights, scales) a tuple (tensor, stride_e, stride_q, length, n_e,
    n_q): run (e, q) starts at byte e * stride_e + q * stride_q of the tensor and is `length` bytes long, for e <
    n_e, q < n_q. weights [E, K/16, 2N] int32, scales [E, K/32, N] (contiguous); kw: the GEMM's warps splitting K;
    experts: how many local experts from 0 (at most E); frac: 0..1 of each warp's range. Empty when nothing is asked.
    Raises ValueError for a kw that does not split K into whole k64 chunks or a frac outside [0, 1]."""
    if not 0.0 <= frac <= 1.0:
        raise ValueError(f"gate_up_ranges: frac {frac} not in [0, 1]")
    E, k16, _ = weights.shape
    if kw <= 0 or (k16 // 4) % kw:
        raise ValueError(f"gate_up_ranges: {kw} warps do not split {k16 // 4} k64 chunks")
    n_e = min(max(int(experts), 0), E)
    out = []
    for t in (weights, scales):
        stride_e = t[0].numel() * t.element_size()
        stride_q = stride_e // kw
        length = int(stride_q * frac) // LINE * LINE
        if n_e and length:
            out.append((t, stride_e, stride_q, length, n_e, kw))
    return out


def prefetch_gate_up_l2(weights: torch.Tensor, scales: torch.Tensor, kw: int, experts: int, frac: float) -> None:
    """Issue the L2 prefetches of `gate_up_ranges` on the current CUDA stream (one Triton kernel per tensor, one
    prefetch per 128-byte line). Graph-capturable; returns at once. Nothing for tensors off CUDA. Raises what
    gate_up_ranges raises."""
    ranges = gate_up_ranges(weights, scales, kw, experts, frac)
    if not ranges or not weights.is_cuda:
        return
    import triton

    from kimi.ops.fused import _INTERPRET

    if _INTERPRET:  # no PTX under the CPU interpreter; the ranges are what the tests check there
        return
    kernel = _kernel()
    block = 1024
    for t, stride_e, stride_q, length, n_e, n_q in ranges:
        lines = length // LINE
        kernel[(n_e * n_q, triton.cdiv(lines, block))](t.view(torch.uint8), stride_e, stride_q, lines, n_q,
                                                       BLOCK=block, num_warps=4)


_KERNEL = None


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def _l2_prefetch_kernel(base_ptr, stride_e, stride_q, n_lines, n_q, BLOCK: tl.constexpr):
            r = tl.program_id(0)
            e = r // n_q
            q = r - e * n_q
            idx = tl.minimum(tl.program_id(1) * BLOCK + tl.arange(0, BLOCK), n_lines - 1)  # clamped: never past the run
            off = e.to(tl.int64) * stride_e + q.to(tl.int64) * stride_q + idx.to(tl.int64) * 128
            tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; // dummy $0", "=r,l", [base_ptr + off],
                                      dtype=tl.int32, is_pure=False, pack=1)

        _KERNEL = _l2_prefetch_kernel
    return _KERNEL
