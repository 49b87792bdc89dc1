"""Bandwidth-bound bf16 GEMM for decode-sized M (Triton): y = x @ W^T with M <= 64 rows.

Why: a decode step reads ~21 GB of dense bf16 weights per rank (attention projections, shared expert, dense
layer 0, lm_head) with only M = 1..64 activation rows, so every one of those GEMMs is a stream over W.
cuBLAS (`F.linear`) often picks split-K with a separate reduction kernel and reaches ~3.1 TB/s of the
~4.26 TB/s an H200 copies at. This kernel aims at copy bandwidth for the shapes where it measures faster.

Math: y[m, n] = sum_k x[m, k] * W[n, k], products and sums in fp32 (tensor-core dots of bf16 inputs),
rounded once to the output dtype (bf16 or fp16, same as x). This is `torch.nn.functional.linear(x, W)`
without bias.

Algorithm (written for this project; the split-K "last CTA reduces" fix-up is the usual serial-reduction
scheme, as in CUTLASS's split-K serial / stream-K fix-up, from the description):

- Program (pid_n, pid_k) owns rows [pid_n*BLOCK_N, +BLOCK_N) of W (= columns of y) and the K range
  [pid_k*K_PER_SPLIT, +K_PER_SPLIT). It loops over that range BLOCK_K at a time, loading the W tile
  [BLOCK_N, BLOCK_K] (rows contiguous in K: wide vector loads, software-pipelined by Triton with
  `num_stages`) and the x tile [BLOCK_M, BLOCK_K], and accumulates `x @ W^T` in fp32 with tl.dot.
  BLOCK_M = max(16, next power of two >= M) (tl.dot needs >= 16); rows >= M of x are clamped to row M-1
  (loaded, never stored), rows >= N of W clamped to row N-1 likewise, so the hot loop has no masks when
  K % BLOCK_K == 0.
- Two load paths, chosen per config: `tma=False` uses per-thread pointers (16-byte cp.async into shared
  memory, Triton's multi-stage pipeline); `tma=True` uses host-built TMA tensor descriptors (the copy engine
  fills shared memory and zero-fills rows >= M / >= N and columns >= K), falling back to the pointer path
  when a tensor violates TMA's 16-byte alignment rules. num_stages is capped so the stage buffers fit in
  shared memory (`_num_stages`). M, split_k and the iteration counts are not specialised on (one compile
  per tile config, BLOCK_M and split / no split).
- `swap_ab` computes the transposed product W_tile @ x_tile^T ([BLOCK_N, BLOCK_M]) instead, so the weight
  tile is the wide MMA operand (Hopper's wgmma wants M >= 64); the benchmark decides whether it helps.
- split_k == 1: each program stores its [BLOCK_M, BLOCK_N] tile of y.
  split_k  > 1 (for shapes with too few column slabs to fill the GPU, e.g. 2112 x 7168): each program
  writes its fp32 partial tile into a workspace [split_k, n_tiles, BLOCK_M*BLOCK_N] (caching allocator,
  torch.empty per call, no zeroing needed), then, after a CTA barrier, increments an int32 arrival counter
  of its column slab (atomic, acq_rel, gpu scope). The program that arrives last sums the split_k partials
  in the fixed order 0..split_k-1 (so the result is deterministic, independent of arrival order), stores
  y, and resets the counter to 0 for the next call. One kernel: no memset, no separate reduction launch.
  Counters live in a per-device buffer of NUM_COUNTER_REGIONS regions allocated once (zeros); successive
  calls rotate through the regions so two calls in flight on different streams (or graph branches) do not
  share counters unless 64 split-K calls apart.

CUDA graphs: no host synchronisation, no tensor-dependent host logic; the workspace comes from torch's
caching allocator (the graph's pool under capture). The counter buffer must exist before capture: it is
allocated by the first call on a device outside capture (the model's warm-up). A first call *under
capture* with split_k > 1 falls back to F.linear for that call (with a warning) rather than allocating
inside the graph.

Config choice: `linear()` uses Triton only for (M bucket, N, K) entries of a table measured by tools/bench_gemm.py,
where the best Triton config beat F.linear. The table is read once from kimi/kernels/tuning/linear_small_m.json (or the
file named by $KIMI_LINEAR_SMALL_M_TABLE) and only used when the current GPU's name equals the one the table was
measured on; otherwise (or without Triton, or on CPU, or for M > 64, other dtypes, non-contiguous W, ...) `linear()` is
`F.linear`; $KIMI_LINEAR_SMALL_M_TABLE=off (no table) gives F.linear everywhere. Tables are keyed by bucket: M=1 -> 1,
2..8 -> 8, 9..16 -> 16, 17..32 -> 32, 33..64 -> 64. (Two q_b entries were added by hand, see the table's "notes".)

PDL (kimi/kernels/triton/pdl.py, Hopper): the kernels are launched with programmatic dependent launch; each program
first issues `prefetch.global.L2` for the first PREFETCH_TILES W tiles of its K range (weights only), then waits for the
kernel ahead (`griddepcontrol.wait`), then lets the next kernel launch.

Limits: x [M, K] and W [N, K] with unit stride on the last dim, same dtype (bf16 / fp16), 1 <= M <= 64;
any N, K >= 1 (K % BLOCK_K != 0 takes a masked path); pointer offsets are 64-bit.
"""

from __future__ import annotations

import os
import threading
import warnings
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from kimi.errors import BackendUnavailableError
from kimi.kernels import tuning
from kimi.kernels.triton.common import HAS_TRITON, INTERPRET, tl, triton

__all__ = [
    "CONFIGS",
    "HAS_TRITON",
    "MAX_M",
    "M_BUCKETS",
    "SmallMConfig",
    "linear",
    "linear_small_m",
    "load_table",
    "lookup",
    "m_bucket",
    "prologue_config",
]

MAX_M = 64
M_BUCKETS = (1, 8, 16, 32, 64)
NUM_COUNTER_REGIONS = 64
COUNTER_REGION = 4096  # max column slabs (n_tiles) of a split-K call


@dataclass(frozen=True)
class SmallMConfig:
    """Launch parameters of one kernel variant.

    block_n: rows of W (columns of y) per program; block_k: K step of the loop (the W tile is
    [block_n, block_k] bf16); split_k: programs sharing one column slab's K range (1 = no split);
    num_warps / num_stages: Triton launch parameters (num_stages = depth of the load pipeline, lowered for
    large BLOCK_M so the x and W tile buffers fit in shared memory, see `_num_stages`);
    swap_ab: compute W_tile @ x_tile^T instead of x_tile @ W_tile^T.
    tma: load the tiles with TMA (host tensor descriptors) instead of per-thread cp.async; falls back to the
    pointer kernel when the tensors do not meet TMA's alignment rules (see `_tma_ok`).
    """

    block_n: int = 64
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    swap_ab: bool = False
    tma: bool = False

    def name(self) -> str:
        return (
            f"n{self.block_n}_k{self.block_k}_s{self.split_k}_w{self.num_warps}_st{self.num_stages}"
            f"{'_swap' if self.swap_ab else ''}{'_tma' if self.tma else ''}"
        )


# Tile configs the benchmark sweeps (each also with several split_k values). Kept small: every entry is a separate
# compile per BLOCK_M.
CONFIGS: tuple[SmallMConfig, ...] = (
    SmallMConfig(block_n=64, block_k=256, num_warps=4, num_stages=4),
    SmallMConfig(block_n=64, block_k=128, num_warps=4, num_stages=6),
    SmallMConfig(block_n=128, block_k=128, num_warps=4, num_stages=4),
    SmallMConfig(block_n=128, block_k=256, num_warps=8, num_stages=3),
    SmallMConfig(block_n=32, block_k=512, num_warps=4, num_stages=4),
    SmallMConfig(block_n=64, block_k=256, num_warps=4, num_stages=4, swap_ab=True),
    SmallMConfig(block_n=128, block_k=128, num_warps=4, num_stages=4, swap_ab=True),
    SmallMConfig(block_n=64, block_k=256, num_warps=4, num_stages=4, tma=True),
    SmallMConfig(block_n=128, block_k=128, num_warps=4, num_stages=4, tma=True),
    SmallMConfig(block_n=64, block_k=256, num_warps=4, num_stages=4, swap_ab=True, tma=True),
)


def m_bucket(m: int) -> int:
    """Table bucket of M: the smallest of M_BUCKETS >= m. Raises ValueError for m < 1 or m > MAX_M."""
    if m < 1 or m > MAX_M:
        raise ValueError(f"M={m} outside 1..{MAX_M}")
    for b in M_BUCKETS:
        if m <= b:
            return b
    raise AssertionError  # unreachable


def _block_m(m: int) -> int:
    return max(16, 1 << (m - 1).bit_length())


SMEM_BUDGET = 220 * 1024  # H100/H200: 227 KiB of shared memory per block


def _num_stages(cfg: SmallMConfig, block_m: int, prologue: int = 0) -> int:
    """cfg.num_stages, lowered (not below 2) so that num_stages buffers of the x (two with the SiLU prologue) and
    W tiles fit SMEM_BUDGET."""
    stage_bytes = ((2 if prologue == 2 else 1) * block_m + cfg.block_n) * cfg.block_k * 2
    return max(2, min(cfg.num_stages, SMEM_BUDGET // stage_bytes))


# With PDL (kimi.kernels.triton.pdl), each program first prefetches into L2 the first PREFETCH_TILES W tiles of its K
# range ([BLOCK_N, BLOCK_K] each; weights are never written during a step, so this may run before
# griddepcontrol.wait, while the kernel ahead finishes), then waits. 0: no prefetch. A constexpr: CUDA graphs keep
# the value of their capture (`set_prefetch_tiles`).
PREFETCH_TILES = 2


def set_prefetch_tiles(n: int) -> int:
    """Set PREFETCH_TILES (W tiles prefetched per program, >= 0) for later launches; returns the previous value
    (benchmarks A/B it). Raises ValueError for n < 0."""
    global PREFETCH_TILES
    if n < 0:
        raise ValueError(f"prefetch tiles {n} < 0")
    previous, PREFETCH_TILES = PREFETCH_TILES, int(n)
    return previous


if HAS_TRITON:
    from triton.tools.tensor_descriptor import TensorDescriptor

    from kimi.kernels.triton.pdl import launch_kwargs, wait_and_release

    @triton.jit
    def _prefetch_w(w_ptr, stride_wn, rows_w, k0, K, n_iters, PREFETCH: tl.constexpr, BLOCK_K: tl.constexpr):
        """prefetch.global.L2 of W[rows_w, k0 + j * BLOCK_K + (0..BLOCK_K)) for j < min(PREFETCH, n_iters): one
        prefetch per 128-byte line (64 two-byte elements), columns clamped to K - 1 (never past a row)."""
        lines = tl.arange(0, BLOCK_K // 64) * 64
        for j in tl.static_range(PREFETCH):
            if j < n_iters:
                cols = tl.minimum(k0 + j * BLOCK_K + lines, K - 1)
                p = w_ptr + rows_w[:, None] * stride_wn + cols[None, :]
                tl.inline_asm_elementwise(
                    "prefetch.global.L2 [$1]; // dummy $0", "=r,l", [p], dtype=tl.int32, is_pure=False, pack=1
                )

    @triton.jit
    def _row_rstd(x_ptr, stride_xm, M, K, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        """[BLOCK_M] fp32 1 / sqrt(mean(x[m, :K]^2) + eps) of the (clamped) rows of x (the RMSNorm prologue)."""
        rows = tl.minimum(tl.arange(0, BLOCK_M), M - 1).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            xv = tl.load(
                x_ptr + rows[:, None] * stride_xm + (k0 + offs_k)[None, :], mask=(k0 + offs_k)[None, :] < K, other=0.0
            ).to(tl.float32)
            ss += tl.sum(xv * xv, axis=1)
        return 1.0 / tl.sqrt(ss / K + eps)

    @triton.jit
    def _prologue(xt, ut, g_ptr, rstd, k, K, PROLOGUE: tl.constexpr, BLOCK_K: tl.constexpr):
        """The x tile [BLOCK_M, BLOCK_K] the GEMM multiplies, from the loaded tile(s), rounded to x's dtype as the
        unfused ops round their outputs. PROLOGUE 0: xt as is; 1 (RMSNorm): gamma[k] * (xt * rstd[m]);
        2 (SiLU * up): silu(xt) rounded, times ut (the up half's tile)."""
        if PROLOGUE == 1:
            offs_k = k + tl.arange(0, BLOCK_K)
            g = tl.load(g_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
            return (g[None, :] * (xt.to(tl.float32) * rstd[:, None])).to(xt.dtype)
        elif PROLOGUE == 2:
            gt = xt.to(tl.float32)
            sg = (gt / (1.0 + tl.exp(-gt))).to(xt.dtype).to(tl.float32)
            return (sg * ut.to(tl.float32)).to(xt.dtype)
        else:
            return xt

    @triton.jit
    def _store_tile(
        acc,
        y_ptr,
        ws_ptr,
        cnt_ptr,
        M,
        N,
        SPLIT_K,
        stride_ym,
        pid_n,
        pid_k,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        USE_SPLIT: tl.constexpr,
        SWAP_AB: tl.constexpr,
    ):
        """Write the fp32 tile `acc` ([BLOCK_M, BLOCK_N], or [BLOCK_N, BLOCK_M] when SWAP_AB) of y; with split-K,
        via the workspace and the last-arrival reduction described in the module docstring."""
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if SWAP_AB:
            y_ptrs = y_ptr + offs_m[None, :].to(tl.int64) * stride_ym + offs_n[:, None]
            y_mask = (offs_m[None, :] < M) & (offs_n[:, None] < N)
            tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + offs_m[None, :]  # index within a workspace tile
        else:
            y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
            y_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
            tile = offs_m[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        if USE_SPLIT:
            n_tiles = tl.num_programs(0)
            ws_tile = ws_ptr + pid_n.to(tl.int64) * (BLOCK_M * BLOCK_N)
            split_stride = n_tiles.to(tl.int64) * (BLOCK_M * BLOCK_N)
            tl.store(ws_tile + pid_k * split_stride + tile, acc)
            tl.debug_barrier()  # every thread's partial is written before the (single-thread) release below
            arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:  # last of the slab: reduce in fixed order 0..SPLIT_K-1
                total = tl.load(ws_tile + tile, cache_modifier=".cg")
                for s in range(1, SPLIT_K):
                    total += tl.load(ws_tile + s * split_stride + tile, cache_modifier=".cg")
                tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=y_mask)
                tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")
        else:
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)

    @triton.jit(do_not_specialize=["M", "SPLIT_K", "ITERS", "LAST_ITERS"])
    def _linear_small_m_kernel(
        x_ptr,
        w_ptr,
        y_ptr,
        ws_ptr,
        cnt_ptr,
        g_ptr,
        M,
        N,
        K,
        K_PER_SPLIT,
        SPLIT_K,
        ITERS,
        LAST_ITERS,
        stride_xm,
        stride_wn,
        stride_ym,
        eps,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        USE_SPLIT: tl.constexpr,
        SWAP_AB: tl.constexpr,
        EVEN_K: tl.constexpr,
        EVEN_N: tl.constexpr,
        PROLOGUE: tl.constexpr = 0,
        PDL: tl.constexpr = False,
        PREFETCH: tl.constexpr = 0,
    ):
        """Pointer (cp.async) variant. ITERS / LAST_ITERS: K steps of every split but the last / of the last
        (plain arguments: Triton's interpreter cannot bound a loop by a program_id-derived value). PDL /
        PREFETCH: kimi.kernels.triton.pdl, PREFETCH_TILES."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_kb = tl.arange(0, BLOCK_K)
        rows_x = tl.minimum(offs_m, M - 1).to(tl.int64)  # padded rows re-read row M-1, never stored
        if EVEN_N:
            rows_w = offs_n.to(tl.int64)
        else:
            rows_w = tl.minimum(offs_n, N - 1).to(tl.int64)  # likewise for rows >= N
        k_start = pid_k * K_PER_SPLIT
        num_iters = ITERS
        if pid_k == SPLIT_K - 1:
            num_iters = LAST_ITERS
        if PDL and PREFETCH > 0:
            _prefetch_w(w_ptr, stride_wn, rows_w, k_start, K, num_iters, PREFETCH, BLOCK_K)
        wait_and_release(PDL)
        x_ptrs = x_ptr + rows_x[:, None] * stride_xm + (k_start + offs_kb)[None, :]  # [BLOCK_M, BLOCK_K]
        w_ptrs = w_ptr + rows_w[:, None] * stride_wn + (k_start + offs_kb)[None, :]  # [BLOCK_N, BLOCK_K]
        rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
        if PROLOGUE == 1:
            rstd = _row_rstd(x_ptr, stride_xm, M, K, eps, BLOCK_M, BLOCK_K)
        if SWAP_AB:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for i in range(num_iters):
            ut = None
            if EVEN_K:
                xt = tl.load(x_ptrs)
                wt = tl.load(w_ptrs)
                if PROLOGUE == 2:
                    ut = tl.load(x_ptrs + K)
            else:
                kmask = (k_start + i * BLOCK_K + offs_kb) < K
                xt = tl.load(x_ptrs, mask=kmask[None, :], other=0.0)
                wt = tl.load(w_ptrs, mask=kmask[None, :], other=0.0)
                if PROLOGUE == 2:
                    ut = tl.load(x_ptrs + K, mask=kmask[None, :], other=0.0)
            xt = _prologue(xt, ut, g_ptr, rstd, k_start + i * BLOCK_K, K, PROLOGUE, BLOCK_K)
            if SWAP_AB:
                acc = tl.dot(wt, tl.trans(xt), acc)  # [BLOCK_N, BLOCK_M]
            else:
                acc = tl.dot(xt, tl.trans(wt), acc)  # [BLOCK_M, BLOCK_N]
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        _store_tile(
            acc, y_ptr, ws_ptr, cnt_ptr, M, N, SPLIT_K, stride_ym, pid_n, pid_k, BLOCK_M, BLOCK_N, USE_SPLIT, SWAP_AB
        )

    @triton.jit(do_not_specialize=["M", "SPLIT_K", "ITERS", "LAST_ITERS"])
    def _linear_small_m_tma_kernel(
        x_desc,
        w_desc,
        y_ptr,
        ws_ptr,
        cnt_ptr,
        x_ptr,
        g_ptr,
        w_ptr,
        M,
        N,
        K,
        K_PER_SPLIT,
        SPLIT_K,
        ITERS,
        LAST_ITERS,
        stride_ym,
        stride_xm,
        stride_wn,
        eps,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        USE_SPLIT: tl.constexpr,
        SWAP_AB: tl.constexpr,
        PROLOGUE: tl.constexpr = 0,
        PDL: tl.constexpr = False,
        PREFETCH: tl.constexpr = 0,
    ):
        """TMA variant: x and W tiles come through host-built tensor descriptors (x: shape [M, K], box
        [BLOCK_M, BLOCK_K]; W: [N, K], box [BLOCK_N, BLOCK_K]); out-of-range rows / K are zero-filled by the
        copy engine, so there is no masking or clamping."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        k = pid_k * K_PER_SPLIT
        num_iters = ITERS
        if pid_k == SPLIT_K - 1:
            num_iters = LAST_ITERS
        n0 = pid_n * BLOCK_N
        if PDL and PREFETCH > 0:
            rows_w = tl.minimum(n0 + tl.arange(0, BLOCK_N), N - 1).to(tl.int64)
            _prefetch_w(w_ptr, stride_wn, rows_w, k, K, num_iters, PREFETCH, BLOCK_K)
        wait_and_release(PDL)
        if SWAP_AB:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
        if PROLOGUE == 1:
            rstd = _row_rstd(x_ptr, stride_xm, M, K, eps, BLOCK_M, BLOCK_K)
        for _i in range(num_iters):
            xt = x_desc.load([0, k])  # [BLOCK_M, BLOCK_K]
            wt = w_desc.load([n0, k])  # [BLOCK_N, BLOCK_K]
            ut = None
            if PROLOGUE == 2:
                ut = x_desc.load([0, k + K])  # the up half (x's descriptor spans [M, 2K])
            xt = _prologue(xt, ut, g_ptr, rstd, k, K, PROLOGUE, BLOCK_K)
            if SWAP_AB:
                acc = tl.dot(wt, tl.trans(xt), acc)
            else:
                acc = tl.dot(xt, tl.trans(wt), acc)
            k += BLOCK_K
        _store_tile(
            acc, y_ptr, ws_ptr, cnt_ptr, M, N, SPLIT_K, stride_ym, pid_n, pid_k, BLOCK_M, BLOCK_N, USE_SPLIT, SWAP_AB
        )


_counter_lock = threading.Lock()
_counters: dict[int, torch.Tensor] = {}  # device index -> int32 [NUM_COUNTER_REGIONS * COUNTER_REGION]
_next_region = [0]


def _counter_region(device: torch.device) -> torch.Tensor | None:
    """The next counter region (int32 [COUNTER_REGION], zero between calls) of `device`; None when the buffer
    does not exist yet and the current stream is being captured (it must not be allocated inside a graph)."""
    if device.type != "cuda":
        idx = -1  # interpreter on CPU
    else:
        idx = device.index if device.index is not None else torch.cuda.current_device()
    with _counter_lock:
        buf = _counters.get(idx)
        if buf is None:
            if idx >= 0 and torch.cuda.is_current_stream_capturing():
                return None
            buf = torch.zeros(NUM_COUNTER_REGIONS * COUNTER_REGION, dtype=torch.int32, device=device)
            _counters[idx] = buf
        r = _next_region[0]
        _next_region[0] = (r + 1) % NUM_COUNTER_REGIONS
    return buf[r * COUNTER_REGION : (r + 1) * COUNTER_REGION]


def _tma_ok(x: torch.Tensor, w: torch.Tensor, bm: int, bn: int, bk: int) -> bool:
    """TMA descriptor requirements: 16-byte aligned bases and row strides, boxes of at most 256 per dim."""
    e = x.element_size()
    return (
        x.data_ptr() % 16 == 0
        and w.data_ptr() % 16 == 0
        and (x.stride(0) * e) % 16 == 0
        and (w.stride(0) * e) % 16 == 0
        and max(bm, bn, bk) <= 256
    )


def check_operands(x: torch.Tensor, w: torch.Tensor, M: int, N: int, K: int) -> None:
    """The checks the small-M kernels share (this module's and kimi.kernels.triton.bmm_small_m's): 1 <= M <= MAX_M, N,
    K >= 1,
    x and w bf16 / fp16 of one dtype on one CUDA device (any device under the interpreter), unit stride on their
    last (K) dim. Raises ValueError naming what is wrong."""
    if not 1 <= M <= MAX_M:
        raise ValueError(f"M={M} outside 1..{MAX_M}")
    if N < 1 or K < 1:
        raise ValueError(f"empty weight {tuple(w.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16) or w.dtype != x.dtype:
        raise ValueError(f"dtypes must be bf16/fp16 and equal, got x {x.dtype}, w {w.dtype}")
    if not ((x.is_cuda or INTERPRET) and w.device == x.device):
        raise ValueError(f"x and w must be on one CUDA device, got {x.device} and {w.device}")
    if x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError(f"x and w need unit stride on K, got strides {x.stride()} and {w.stride()}")


def _check(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None, x_cols_per_k: int = 1) -> None:
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"expected x [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    M, Kx = x.shape
    N, Kw = w.shape
    K = Kx // x_cols_per_k
    if Kw != K or Kx != K * x_cols_per_k:
        raise ValueError(f"K mismatch: x {tuple(x.shape)} vs w {tuple(w.shape)}")
    check_operands(x, w, M, N, K)
    if out is not None and (
        out.shape != (M, N) or out.dtype != x.dtype or out.device != x.device or out.stride(1) != 1
    ):
        raise ValueError(
            f"out must be [{M}, {N}] {x.dtype} on {x.device} with unit stride on N, "
            f"got {tuple(out.shape)} {out.dtype} {out.device} strides {out.stride()}"
        )


def linear_small_m(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor | None = None,
    config: SmallMConfig | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    silu_mul: bool = False,
) -> torch.Tensor:
    """y = x @ w^T with the Triton small-M kernel (always; no dispatch), optionally with a fused prologue.

    Args:
        x: [M, K] bf16 (or fp16), 1 <= M <= 64, unit stride on K (row stride free), CUDA; [M, 2K] with silu_mul.
        w: [N, K] same dtype and device, unit stride on K (nn.Linear layout).
        out: optional [M, N] output (same dtype/device, unit stride on N); written and returned.
        config: kernel variant; default: the table's pick for this shape, else SmallMConfig().
        norm_weight: [K] RMSNorm weight: y = rmsnorm(x) @ w^T, rmsnorm(x)[m, k] = norm_weight[k] * x[m, k] /
            sqrt(mean_k(x[m]^2) + eps) in fp32, rounded to x's dtype before the product (as
            kimi.kernels.triton.fused.rms_norm
            then a GEMM; the q_a_layernorm of docs/model-format.md, Math).
        silu_mul: y = (silu(x[:, :K]) * x[:, K:]) @ w^T, silu rounded to x's dtype first and the product rounded
            again (as kimi.kernels.triton.fused.silu_mul then a GEMM; the gated MLP's down projection).

    Returns:
        y [M, N], dtype of x: fp32 accumulation, one rounding.

    Raises:
        RuntimeError if Triton is not installed; ValueError for shapes / dtypes / devices / strides outside
        the limits above (see the module docstring) or both prologues at once.
    """
    if not HAS_TRITON:
        raise BackendUnavailableError("linear_small_m needs Triton (not installed)")
    if norm_weight is not None and silu_mul:
        raise ValueError("linear_small_m: norm_weight and silu_mul are exclusive")
    _check(x, w, out, 2 if silu_mul else 1)
    prologue = 1 if norm_weight is not None else (2 if silu_mul else 0)
    if norm_weight is not None and (
        norm_weight.shape != (w.shape[1],) or norm_weight.device != x.device or not norm_weight.is_contiguous()
    ):
        raise ValueError(
            f"norm_weight must be a contiguous [{w.shape[1]}] tensor on {x.device}, "
            f"got {tuple(norm_weight.shape)} on {norm_weight.device}"
        )
    M = x.shape[0]
    N, K = w.shape
    g = norm_weight if prologue == 1 else x  # any pointer when unused
    if config is None:
        config = lookup(M, N, K, x.device) or SmallMConfig()
    y = out if out is not None else torch.empty((M, N), dtype=x.dtype, device=x.device)
    bm, bn, bk = _block_m(M), config.block_n, config.block_k
    n_tiles = triton.cdiv(N, bn)
    k_blocks = triton.cdiv(K, bk)
    split = max(1, min(config.split_k, k_blocks))
    k_per_split = triton.cdiv(k_blocks, split) * bk
    split = triton.cdiv(K, k_per_split)  # no empty splits
    cnt = ws = None
    if split > 1:
        if n_tiles > COUNTER_REGION:
            split, k_per_split = 1, k_blocks * bk
        else:
            cnt = _counter_region(x.device)
            if cnt is None:
                warnings.warn(
                    "linear_small_m: first split-K call is under CUDA-graph capture; using F.linear "
                    "for it (call once eagerly before capturing)",
                    stacklevel=2,
                )
                return _unfused(x, w, y if out is not None else None, norm_weight, eps, silu_mul)
            ws = torch.empty((split, n_tiles, bm * bn), dtype=torch.float32, device=x.device)
    if split == 1:
        k_per_split = k_blocks * bk
        cnt = ws = y  # unused by the kernel; any pointer
    iters, last_iters = k_per_split // bk, triton.cdiv(K - (split - 1) * k_per_split, bk)
    use_split = split > 1
    pdl = launch_kwargs(x.device)
    if pdl["PDL"] and bk >= 64 and x.element_size() == 2:  # _prefetch_w: 128-byte lines of 2-byte elements
        pdl["PREFETCH"] = PREFETCH_TILES
    if config.tma and _tma_ok(x, w, bm, bn, bk):
        x_desc = TensorDescriptor(x, [M, x.shape[1]], [x.stride(0), 1], [bm, bk])
        w_desc = TensorDescriptor(w, [N, K], [w.stride(0), 1], [bn, bk])
        _linear_small_m_tma_kernel[(n_tiles, split)](
            x_desc,
            w_desc,
            y,
            ws,
            cnt,
            x,
            g,
            w,
            M,
            N,
            K,
            k_per_split,
            split,
            iters,
            last_iters,
            y.stride(0),
            x.stride(0),
            w.stride(0),
            float(eps),
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk,
            USE_SPLIT=use_split,
            SWAP_AB=config.swap_ab,
            PROLOGUE=prologue,
            num_warps=config.num_warps,
            num_stages=_num_stages(config, bm, prologue),
            **pdl,
        )
    else:
        _linear_small_m_kernel[(n_tiles, split)](
            x,
            w,
            y,
            ws,
            cnt,
            g,
            M,
            N,
            K,
            k_per_split,
            split,
            iters,
            last_iters,
            x.stride(0),
            w.stride(0),
            y.stride(0),
            float(eps),
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk,
            USE_SPLIT=use_split,
            SWAP_AB=config.swap_ab,
            EVEN_K=K % bk == 0,
            EVEN_N=N % bn == 0,
            PROLOGUE=prologue,
            num_warps=config.num_warps,
            num_stages=_num_stages(config, bm, prologue),
            **pdl,
        )
    return y


def _unfused(x, w, out, norm_weight, eps, silu_mul):
    """The prologue (torch references kimi.model.norm.rms_norm / F.silu, same roundings) then F.linear."""
    if norm_weight is not None:
        from kimi.model.norm import rms_norm

        x = rms_norm(x, norm_weight, eps)
    elif silu_mul:
        K = x.shape[1] // 2
        x = F.silu(x[:, :K]) * x[:, K:]
    return torch.matmul(x, w.t(), out=out) if out is not None else F.linear(x, w)


# ----------------------------------------------------------------------------------------------------- dispatch

_table_lock = threading.Lock()
_table: dict | None = None  # {"gpu": name, "entries": {(bucket, N, K): SmallMConfig}}
_gpu_ok: dict[int, bool] = {}


def load_table(path: str | os.PathLike | None = None) -> dict:
    """The table tools/bench_gemm.py writes (kimi.kernels.tuning "linear_small_m": `path`, else
    $KIMI_LINEAR_SMALL_M_TABLE, else the shipped file) as {"gpu": name or None, "entries": {(bucket, N, K):
    SmallMConfig}}. A missing file gives no entries; a malformed one raises ValueError."""
    return tuning.by_bucket(tuning.load("linear_small_m", path), SmallMConfig)


def _get_table() -> dict:
    global _table
    if _table is None:
        with _table_lock:
            if _table is None:
                _table = load_table()
    return _table


def lookup(M: int, N: int, K: int, device: torch.device) -> SmallMConfig | None:
    """The measured-faster config for (bucket(M), N, K) on `device`, or None (use F.linear)."""
    table = _get_table()
    if not table["entries"] or not 1 <= M <= MAX_M or device.type != "cuda":
        return None
    idx = device.index if device.index is not None else torch.cuda.current_device()
    ok = _gpu_ok.get(idx)
    if ok is None:
        ok = _gpu_ok[idx] = torch.cuda.get_device_name(idx) == table["gpu"]
    if not ok:
        return None
    return table["entries"].get((m_bucket(M), N, K))


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y = x @ w^T (F.linear without bias), Triton small-M kernel where measured faster, else F.linear.

    x [..., K], w [N, K] -> y [..., N] (dtype of x). The Triton kernel is used when: Triton is installed, x and w
    are CUDA bf16/fp16 of one dtype, x flattens to M <= 64 rows with unit stride on K, w has unit stride on K, and
    the table (see module docstring) has an entry for (bucket(M), N, K) on this GPU. Everything else, including CPU
    tensors, is exactly F.linear(x, w). Errors are F.linear's.
    """
    if (
        not HAS_TRITON
        or not x.is_cuda
        or x.dtype not in (torch.bfloat16, torch.float16)
        or w.dtype != x.dtype
        or w.dim() != 2
        or x.dim() < 1
        or w.device != x.device
        or w.stride(-1) != 1
        or x.shape[-1] != w.shape[1]
    ):
        return F.linear(x, w)
    K = x.shape[-1]
    M = x.numel() // K if K else 0
    if not 1 <= M <= MAX_M:
        return F.linear(x, w)
    cfg = lookup(M, w.shape[0], K, x.device)
    if cfg is None:
        return F.linear(x, w)
    x2 = x.reshape(M, K)
    if x2.stride(1) != 1:
        return F.linear(x, w)
    return linear_small_m(x2, w, config=cfg).reshape(*x.shape[:-1], w.shape[0])


def prologue_config(x: torch.Tensor, w: torch.Tensor, silu_mul: bool = False) -> SmallMConfig | None:
    """The config to run `linear_small_m` with a fused prologue (norm_weight, or silu_mul) for x [M, K] ([M, 2K]
    with silu_mul) and w [N, K], or None: then run the prologue op and `linear` apart. Not None only when `linear`
    itself would take the Triton path for (M, N, K) (the table's entry; the plain GEMM's config is used). Whether to
    fuse at all is the caller's policy (kimi.backends.linear.prologue_config_for)."""
    if not (
        HAS_TRITON
        and x.is_cuda
        and x.dim() == 2
        and w.dim() == 2
        and x.dtype == w.dtype
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.stride(1) == 1
        and w.stride(1) == 1
        and w.device == x.device
        and x.shape[1] == w.shape[1] * (2 if silu_mul else 1)
        and 1 <= x.shape[0] <= MAX_M
    ):
        return None
    return lookup(x.shape[0], w.shape[0], w.shape[1], x.device)


def table_entry(cfg: SmallMConfig) -> dict:
    """The JSON form of one table entry (what tools/bench_gemm.py writes)."""
    return asdict(cfg)
