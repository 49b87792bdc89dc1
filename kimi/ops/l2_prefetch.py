"""Weight prefetch into the GPU's L2 cache while latency-bound kernels run (Hopper, Triton).

Why: a decode step is a chain of kernels. Some of them leave HBM mostly idle: FlashInfer's MLA decode (~35 us per
layer at 32 x 2k, reading its KV at about half the copy bandwidth), the MoE combine and the residual add + RMSNorm
after it. The weights the next GEMMs will stream do not depend on anything computed in the step, so their first
bytes can be fetched into L2 during those kernels; the GEMM then reads that part from L2 and streams only the rest
from HBM. Which weights and how much is `PLAN`; the decode graph applies it (kimi.worker.gpu_model), measured by
tools/bench_decode.py (A/B variants `l2pf_*`) and tools/bench_l2_prefetch.py.

What the kernel does: for a 2-D view W [rows, cols] (unit last-dim stride, 16-byte aligned rows), one
`cp.async.bulk.prefetch.L2.global` of the first `cols` elements of every row (PTX ISA, "cp.async.bulk.prefetch"; sm_90),
with an L2 eviction-priority policy from `createpolicy.fractional` (PTX ISA, "createpolicy"): evict_last keeps the
prefetched lines over lines filled with normal priority (a KV stream passing through L2 meanwhile), evict_normal is
the default. A prefetch is a hint: it changes no memory contents and no result, only where later reads are served
from. Row prefixes, not whole rows, because kimi.ops.linear_small_m's programs each own a slab of W's rows and all
walk K from its start: the prefix of every row is what every program reads first.

Off CUDA (and under Triton's CPU interpreter, which has no inline PTX) `prefetch_rows` does nothing.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - CPU-only installs
    HAS_TRITON = False

__all__ = ["PLAN", "POLICIES", "prefetch_rows", "active", "L2Prefetcher"]

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

POLICIES = ("evict_last", "evict_normal")

# What the decode graph prefetches (read at capture time; tools/bench_decode.py's l2pf_* variants set it):
# - "o_proj_cols": the first columns (of 8192) of o_proj's weight rows, plus all of W_UV, issued after the q_b GEMM so
#   they arrive while the absorbed-MLA kernels run; 0 = off;
# - "qkv_a_cols": the first columns (of 7168) of the NEXT layer's merged q_a + kv_a weight, issued when the MoE's
#   down GEMM is done, so they arrive during the combine and the residual add + RMSNorm; 0 = off;
# - "policy": one of POLICIES.
PLAN = {"o_proj_cols": 0, "qkv_a_cols": 0, "policy": "evict_last"}

_BLOCK = 128

if HAS_TRITON:

    @triton.jit
    def _prefetch_rows_kernel(w_ptr, stride_row, rows, nbytes, EVICT_LAST: tl.constexpr, BLOCK: tl.constexpr):
        """One bulk L2 prefetch of nbytes from the start of each row r < rows (rows past the end repeat the last)."""
        r = tl.minimum(tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), rows - 1).to(tl.int64)
        p = w_ptr + r * stride_row  # byte pointers (w_ptr is uint8)
        n = tl.full([BLOCK], 0, tl.int32) + nbytes
        if EVICT_LAST:
            tl.inline_asm_elementwise(
                "{ .reg .b64 pol; createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
                "cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; } // dummy $0",
                "=r,l,r", [p, n], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(
                "cp.async.bulk.prefetch.L2.global [$1], $2; // dummy $0",
                "=r,l,r", [p, n], dtype=tl.int32, is_pure=False, pack=1)


def active(device: torch.device) -> bool:
    """Whether prefetches are issued on `device`: Triton, a CUDA (not ROCm) GPU of compute capability >= 9.0, not the
    interpreter."""
    if not HAS_TRITON or _INTERPRET or device.type != "cuda" or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def prefetch_rows(w: torch.Tensor, cols: int | None = None, policy: str = "evict_last") -> int:
    """Prefetch w[:, :cols] (all columns when cols is None or >= w.shape[1]) into L2 on the current stream.

    w: 2-D, unit last-dim stride, data pointer and row stride (in bytes) multiples of 16; any dtype. cols is rounded
    down so that each row's prefix is a multiple of 16 bytes. Returns the bytes requested (0 when nothing was issued:
    off CUDA / sm < 90 / the interpreter, or cols == 0). Raises ValueError for another layout or an unknown policy.
    Graph-capturable (one kernel launch, no host synchronisation)."""
    if policy not in POLICIES:
        raise ValueError(f"prefetch_rows: policy {policy!r} not one of {POLICIES}")
    if w.dim() != 2 or w.stride(1) != 1:
        raise ValueError(f"prefetch_rows: w must be 2-D with unit last-dim stride, got {tuple(w.shape)} {w.stride()}")
    es = w.element_size()
    row_bytes = w.stride(0) * es
    if w.data_ptr() % 16 or row_bytes % 16:
        raise ValueError("prefetch_rows: w's data pointer and row stride must be multiples of 16 bytes")
    c = w.shape[1] if cols is None else min(int(cols), w.shape[1])
    nbytes = (c * es) // 16 * 16
    if nbytes <= 0 or w.shape[0] == 0 or not active(w.device):
        return 0
    rows = w.shape[0]
    base = w.view(torch.uint8)  # [rows, cols * es]: the kernel's pointer is to bytes
    with torch.cuda.device(w.device):
        _prefetch_rows_kernel[(triton.cdiv(rows, _BLOCK),)](base, row_bytes, rows, nbytes,
                                                           EVICT_LAST=policy == "evict_last", BLOCK=_BLOCK,
                                                           num_warps=4)
    return nbytes * rows


class L2Prefetcher:
    """Prefetches issued on their own CUDA stream, forked from the current stream (so they start when the work queued
    so far is done) and joined back later. Under CUDA-graph capture the fork / join become graph edges.

    fork(regions): regions = [(w, cols), ...] as `prefetch_rows` takes them. join(): the current stream waits for
    the prefetch kernels (which only issue the requests: they end as soon as those are sent), if any are pending.
    Every fork must be joined before a capture ends."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device=device)
        self.pending = False
        self.bytes_issued = 0

    def fork(self, regions, policy: str) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            for w, cols in regions:
                self.bytes_issued += prefetch_rows(w, cols, policy)
        self.pending = True

    def join(self) -> None:
        if self.pending:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
            self.pending = False
