"""Per-head bf16 GEMM for decode-sized M (Triton): y[m, h, :] = x[m, h, :] @ W[h]^T, M <= 64 rows.

Why: absorbed MLA (docs/model-format.md, Math) multiplies every query row by two per-head matrices of kv_b_proj in
each layer: q_lat = q_nope @ W_UK (64 heads x [128 -> 512]) and o = o_lat @ W_UV^T (64 heads x [512 -> 128]),
8.4 MB of bf16 weights each. With torch.bmm this needs the head-major transposes around it (a copy kernel for
q_lat) and cuBLAS's batched kernel reads the weights at a fraction of copy bandwidth at M = 8 (measured: ~1.2
ms of a 25 ms decode step for the 2 x 61 calls; docs/performance.md). This kernel reads x and writes
y through strides in the token-major layouts the model already has ([M, H, K] views, e.g. q_nope is a slice of
q [M, H, 192]; y can be written straight into [M, H * N] for o_proj), one launch, no copies.

Math: y[m, h, n] = sum_k x[m, h, k] * w[h, n, k], products and sums in fp32 (tensor-core dots of bf16 inputs),
rounded once to x's dtype. This equals torch.bmm(x.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1).

Algorithm (written for this project): program (h, pid_n) owns head h and output columns
[pid_n * BLOCK_N, + BLOCK_N); it loops over K BLOCK_K at a time, loading the weight tile w[h, n-slab, k-slab]
([BLOCK_N, BLOCK_K], K contiguous) and the x tile [BLOCK_M, BLOCK_K] of head h, accumulating in fp32 with tl.dot
(or, with swap_ab, W_tile @ x_tile^T so the weight tile is the wide MMA operand). Rows >= M of x and rows >= N of
w are clamped to the last valid row (loaded, never stored); K is masked when K % BLOCK_K != 0.

Dispatch (`bmm_heads`): the Triton kernel where tools/bench_bmm.py measured it faster than the torch path (the
table kimi/kernels/tuning/bmm_small_m.json, or the file named by $KIMI_BMM_SMALL_M_TABLE, keyed by (M bucket, N, K);
used only on the GPU it was measured on), else torch.bmm plus the copies; $KIMI_BMM_SMALL_M_TABLE=off gives the torch
path everywhere. CUDA graphs: no host sync, no
allocation besides the output (caching allocator).
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass

import torch

from kimi.errors import BackendUnavailableError
from kimi.kernels import tuning
from kimi.kernels.triton import linear_small_m as _lsm
from kimi.kernels.triton.common import HAS_TRITON, tl, triton

__all__ = ["CONFIGS", "HAS_TRITON", "MAX_M", "BmmConfig", "bmm_heads", "bmm_heads_ref", "bmm_small_m", "lookup"]

MAX_M = 64


@dataclass(frozen=True)
class BmmConfig:
    """Launch parameters: block_n output columns and block_k reduction step per program (the weight tile is
    [block_n, block_k]); num_warps / num_stages (Triton); swap_ab: compute W_tile @ x_tile^T."""

    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    swap_ab: bool = False

    def name(self) -> str:
        return f"n{self.block_n}_k{self.block_k}_w{self.num_warps}_st{self.num_stages}{'_swap' if self.swap_ab else ''}"


# swept by tools/bench_bmm.py (each a separate compile per BLOCK_M)
CONFIGS: tuple[BmmConfig, ...] = (
    BmmConfig(block_n=64, block_k=128, num_warps=4, num_stages=3),
    BmmConfig(block_n=32, block_k=128, num_warps=4, num_stages=4),
    BmmConfig(block_n=128, block_k=128, num_warps=4, num_stages=3),
    BmmConfig(block_n=32, block_k=256, num_warps=4, num_stages=2),
    BmmConfig(block_n=64, block_k=64, num_warps=4, num_stages=4),
    BmmConfig(block_n=64, block_k=128, num_warps=4, num_stages=3, swap_ab=True),
    BmmConfig(block_n=128, block_k=64, num_warps=4, num_stages=4, swap_ab=True),
    BmmConfig(block_n=32, block_k=256, num_warps=4, num_stages=2, swap_ab=True),
    BmmConfig(block_n=16, block_k=512, num_warps=4, num_stages=2, swap_ab=False),
)


if HAS_TRITON:
    from kimi.kernels.triton.pdl import launch_kwargs, wait_and_release

    @triton.jit(do_not_specialize=["M"])
    def _bmm_small_m_kernel(
        x_ptr,
        w_ptr,
        y_ptr,
        M,
        N,
        K,
        s_xm,
        s_xh,
        s_wh,
        s_wn,
        s_ym,
        s_yh,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SWAP_AB: tl.constexpr,
        EVEN_K: tl.constexpr,
        EVEN_N: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        wait_and_release(PDL)  # kimi.kernels.triton.pdl
        h = tl.program_id(0).to(tl.int64)
        pid_n = tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        rows_x = tl.minimum(offs_m, M - 1).to(tl.int64)  # padded rows re-read row M-1, never stored
        if EVEN_N:
            rows_w = offs_n.to(tl.int64)
        else:
            rows_w = tl.minimum(offs_n, N - 1).to(tl.int64)
        x_ptrs = x_ptr + h * s_xh + rows_x[:, None] * s_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
        w_ptrs = w_ptr + h * s_wh + rows_w[:, None] * s_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
        if SWAP_AB:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                xt = tl.load(x_ptrs)
                wt = tl.load(w_ptrs)
            else:
                km = (k0 + offs_k) < K
                xt = tl.load(x_ptrs, mask=km[None, :], other=0.0)
                wt = tl.load(w_ptrs, mask=km[None, :], other=0.0)
            if SWAP_AB:
                acc = tl.dot(wt, tl.trans(xt), acc)  # [BLOCK_N, BLOCK_M]
            else:
                acc = tl.dot(xt, tl.trans(wt), acc)  # [BLOCK_M, BLOCK_N]
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if SWAP_AB:
            y_ptrs = y_ptr + h * s_yh + offs_m[None, :].to(tl.int64) * s_ym + offs_n[:, None]
            mask = (offs_m[None, :] < M) & (offs_n[:, None] < N)
        else:
            y_ptrs = y_ptr + h * s_yh + offs_m[:, None].to(tl.int64) * s_ym + offs_n[None, :]
            mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None) -> None:
    if x.dim() != 3 or w.dim() != 3:
        raise ValueError(f"expected x [M, H, K] and w [H, N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    M, H, K = x.shape
    Hw, N, Kw = w.shape
    if Hw != H or Kw != K:
        raise ValueError(f"head / K mismatch: x {tuple(x.shape)} vs w {tuple(w.shape)}")
    _lsm.check_operands(x, w, M, N, K)
    if out is not None and (
        out.shape != (M, H, N) or out.dtype != x.dtype or out.device != x.device or out.stride(2) != 1
    ):
        raise ValueError(
            f"out must be [{M}, {H}, {N}] {x.dtype} on {x.device} with unit stride on N, "
            f"got {tuple(out.shape)} {out.dtype} {out.device} strides {out.stride()}"
        )


def bmm_small_m(
    x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, config: BmmConfig | None = None
) -> torch.Tensor:
    """y[m, h] = x[m, h] @ w[h]^T with the Triton kernel (always; no dispatch).

    Args:
        x: [M, H, K] bf16 (or fp16), 1 <= M <= 64, unit stride on K (the M and H strides are free), CUDA.
        w: [H, N, K] same dtype and device, unit stride on K (per head the nn.Linear layout [out, in]).
        out: optional [M, H, N] output (same dtype / device, unit stride on N, other strides free, e.g. a view
            of a [M, H * N] buffer); written and returned.
        config: launch config; default: the table's pick for this shape, else BmmConfig().

    Returns: y [M, H, N] in x's dtype (fp32 accumulation, one rounding).

    Raises: RuntimeError without Triton; ValueError for shapes / dtypes / devices / strides outside the above.
    """
    if not HAS_TRITON:
        raise BackendUnavailableError("bmm_small_m needs Triton (not installed)")
    _check(x, w, out)
    M, H, K = x.shape
    N = w.shape[1]
    if config is None:
        config = lookup(M, N, K, x.device) or BmmConfig()
    y = out if out is not None else torch.empty((M, H, N), dtype=x.dtype, device=x.device)
    bm = max(16, 1 << (M - 1).bit_length())
    bn, bk = config.block_n, config.block_k
    _bmm_small_m_kernel[(H, triton.cdiv(N, bn))](
        x,
        w,
        y,
        M,
        N,
        K,
        x.stride(0),
        x.stride(1),
        w.stride(0),
        w.stride(1),
        y.stride(0),
        y.stride(1),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        SWAP_AB=config.swap_ab,
        EVEN_K=K % bk == 0,
        EVEN_N=N % bn == 0,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **launch_kwargs(x.device),
    )
    return y


def bmm_heads_ref(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The torch path (any device, any M): x [M, H, K], w [H, N, K] -> [M, H, N] via torch.bmm over heads, which
    writes the [M, H, N] result (or `out`, unit last-dim stride) in place through its head-major view (row stride
    H * N, batch stride N: a valid strided-batched output, no transpose copy; torch copies internally only for
    layouts its bmm cannot write)."""
    if out is None:
        out = torch.empty((x.shape[0], w.shape[0], w.shape[1]), dtype=x.dtype, device=x.device)  # [M, H, N]
    torch.bmm(x.transpose(0, 1), w.transpose(1, 2), out=out.transpose(0, 1))
    return out


# ----------------------------------------------------------------------------------------------------- dispatch

_table_lock = threading.Lock()
_table: dict | None = None
_gpu_ok: dict[int, bool] = {}


def _get_table() -> dict:
    global _table
    if _table is None:
        with _table_lock:
            if _table is None:
                _table = tuning.by_bucket(tuning.load("bmm_small_m"), BmmConfig)
    return _table


def lookup(M: int, N: int, K: int, device: torch.device) -> BmmConfig | None:
    """The measured-faster config for (bucket(M), N, K) on `device`, or None (use the torch path)."""
    if not 1 <= M <= MAX_M or device.type != "cuda":
        return None
    table = _get_table()
    if not table["entries"]:
        return None
    idx = device.index if device.index is not None else torch.cuda.current_device()
    ok = _gpu_ok.get(idx)
    if ok is None:
        ok = _gpu_ok[idx] = torch.cuda.get_device_name(idx) == table["gpu"]
    return table["entries"].get((_lsm.m_bucket(M), N, K)) if ok else None


def bmm_heads(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """y[m, h] = x[m, h] @ w[h]^T: x [M, H, K], w [H, N, K] -> [M, H, N] (x's dtype), written into `out` when
    given (any strides). Triton kernel where the table says it is faster (see the module docstring), else
    `bmm_heads_ref`. Errors: torch.bmm's."""
    if (
        HAS_TRITON
        and x.is_cuda
        and x.dim() == 3
        and w.dim() == 3
        and x.dtype == w.dtype
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.stride(2) == 1
        and w.stride(2) == 1
        and w.device == x.device
        and x.shape[1] == w.shape[0]
        and x.shape[2] == w.shape[2]
        and (out is None or out.stride(2) == 1)
    ):
        cfg = lookup(x.shape[0], w.shape[1], x.shape[2], x.device)
        if cfg is not None:
            return bmm_small_m(x, w, out=out, config=cfg)
    return bmm_heads_ref(x, w, out)


def table_entry(cfg: BmmConfig) -> dict:
    """The JSON form of one table entry (what tools/bench_bmm.py writes)."""
    return asdict(cfg)
