"""FP8 block-quantised dense linear layers kept in FP8 on the GPU (K2-Instruct's attention projections, shared
experts and dense layer-0 MLP).

Format (DeepSeek-V3 / K2-Instruct, docs/model-format.md, Tensors): W [N, K] float8_e4m3fn with one float32
`weight_scale_inv` per (bn, bk) tile (128 x 128 in every Kimi checkpoint), ragged last tiles by ceil:
``W[n, k] = float(w[n, k]) * scale_inv[n // bn, k // bk]``.

Math: y[m, n] = sum_k x[m, k] * W[n, k] (weight-only quantisation, W8A16: the activations stay bf16). The kernel
converts each FP8 weight tile to the activation dtype (exact: every e4m3 value is a bf16 / fp16 value), takes the
tensor-core dot of one bk-wide K block in fp32, multiplies that partial sum by the rows' tile scale (fp32) and
accumulates in fp32; y is rounded once. The reference (`fp8_linear_ref`) dequantises W to the activation dtype first
(`kimi.model.quant.dequant_fp8_block`, as the bf16 model loaded before this module existed) and calls F.linear; the two
differ by that rounding of W*s to bf16 (the kernel keeps the product in fp32), below the bf16 GEMM's own rounding.

Why: in FP8 K2-Instruct's dense weights take half the memory of the bf16 copy the loader makes otherwise
(attention 202 -> 110 MB per layer, kv_b_proj staying bf16; shared expert 88 -> 44 MB). A decode step reads half
the bytes, but at these sizes (15-60 MB per GEMM) the kernel does not turn that into time: 1-2% slower per step than
the bf16 path (docs/performance.md), so kimi.model.weights keeps them FP8 only on request (`fp8_dense`).

Paths (`fp8_linear`):
- M <= 64 rows on CUDA: the Triton kernel below, one program per BLOCK_N rows of W and split-K range (split-K
  partials reduced by the last program to arrive, in fixed order: deterministic and graph-safe, the scheme of
  kimi.kernels.triton.linear_small_m), k_unroll W tiles [BLOCK_N, bk] per iteration software-pipelined (`num_stages`),
  the activation tiles [BLOCK_M, bk] alongside; programmatic dependent launch (kimi.kernels.triton.pdl) with an L2
  prefetch of the first W tiles before the wait, as kimi.kernels.triton.linear_small_m.
- More rows (prefill) or no Triton / CPU: W is dequantised to the activation dtype, a chunk of rows at a time
  (`fp8_linear_dequant`: at most DEQUANT_CHUNK_BYTES of transient weights), and multiplied by F.linear (cuBLAS).
- `Fp8Linear` layers handed to humming-kernels (`Fp8Linear.to_humming`; kimi.model.weights' fp8_dense "humming",
  for whole-tile shapes) run humming's dense W8A16 GEMM for every M instead.

Config choice: `lookup` reads kimi/kernels/tuning/linear_fp8.json (measured by tools/bench_fp8_linear.py on the GPU
named in it), else `default_config`.
"""

from __future__ import annotations

import functools
import os
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kimi.errors import BackendUnavailableError, ProtocolError
from kimi.kernels import tuning
from kimi.kernels.triton.common import HAS_TRITON, INTERPRET, tl, triton
from kimi.model.quant import dequant_fp8_block

__all__ = [
    "HAS_TRITON",
    "MAX_M",
    "Fp8Config",
    "Fp8Linear",
    "default_config",
    "fp8_linear",
    "fp8_linear_dequant",
    "fp8_linear_ref",
    "fp8_linear_small_m",
    "load_table",
    "lookup",
]

MAX_M = 64
PREFETCH_TILES = 2  # W tiles per program prefetched into L2 before the PDL wait


@dataclass(frozen=True)
class Fp8Config:
    """Launch parameters of the small-M FP8 kernel: block_n rows of W per program, num_warps, num_stages (depth of
    the load pipeline), k_unroll scale-tile-wide K blocks per loop iteration, split_k programs per column slab
    (0: automatic). The K block is the scale tile's bk."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    k_unroll: int = 2
    split_k: int = 0  # 0: enough splits for about two programs per SM (`_splits`)

    def name(self) -> str:
        return f"n{self.block_n}_w{self.num_warps}_st{self.num_stages}_u{self.k_unroll}_s{self.split_k}"


def _check_weight(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> None:
    """ValueError unless w is [N, K] float8_e4m3fn and scale_inv its ceil-divided (bn, bk) tile grid."""
    if w.dtype != torch.float8_e4m3fn or w.dim() != 2:
        raise ValueError(f"fp8_linear: w must be a 2-D float8_e4m3fn tensor, got {w.dtype} {tuple(w.shape)}")
    N, K = w.shape
    bn, bk = block
    if bn < 1 or bk < 1:
        raise ValueError(f"fp8_linear: bad block {block}")
    grid = (-(-N // bn), -(-K // bk))
    if tuple(scale_inv.shape) != grid:
        raise ValueError(
            f"fp8_linear: scale_inv is {tuple(scale_inv.shape)}, want {grid} for w {tuple(w.shape)} and block {block}"
        )


def _check_args(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> None:
    """_check_weight, and x [..., K] floating."""
    _check_weight(w, scale_inv, block)
    K = w.shape[1]
    if x.shape[-1] != K:
        raise ValueError(f"fp8_linear: x has {x.shape[-1]} columns, w {K}")
    if not x.is_floating_point() or x.dtype == torch.float8_e4m3fn:
        raise ValueError(f"fp8_linear: x must be a floating (bf16 / fp16 / fp32) tensor, got {x.dtype}")


def fp8_linear_ref(
    x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """Reference: F.linear(x, dequant_fp8_block(w, scale_inv, block) rounded to x's dtype). x [..., K] floating,
    w [N, K] float8_e4m3fn, scale_inv [ceil(N / bn), ceil(K / bk)] float -> [..., N] in x's dtype. Raises
    ValueError for mismatched shapes / dtypes."""
    _check_args(x, w, scale_inv, block)
    return F.linear(x, dequant_fp8_block(w, scale_inv, block, torch.float32).to(x.dtype))


DEQUANT_CHUNK_BYTES = 128 << 20  # transient float32 + x-dtype weight bytes per chunk of fp8_linear_dequant


def fp8_linear_dequant(
    x: torch.Tensor,
    w: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    chunk_bytes: int | None = None,
) -> torch.Tensor:
    """fp8_linear_ref computed over chunks of W's rows (whole scale tiles; the last one ragged), so the transient
    dequantised weight stays under chunk_bytes (default DEQUANT_CHUNK_BYTES) instead of N x K x 6 bytes (1.5 GB
    for layer 0's gate_up): each chunk's output columns are F.linear over that chunk. The same products as the
    reference; the last bits may differ from it where the GEMM library picks another algorithm for the narrower N.
    Same arguments, result and errors as fp8_linear_ref."""
    _check_args(x, w, scale_inv, block)
    N, K = w.shape
    bn = block[0]
    rows = max(bn, (chunk_bytes or DEQUANT_CHUNK_BYTES) // (K * (4 + x.element_size())) // bn * bn)
    if rows >= N:
        return fp8_linear_ref(x, w, scale_inv, block)
    y = x.new_empty(*x.shape[:-1], N)
    for n0 in range(0, N, rows):
        n1 = min(N, n0 + rows)
        wc = dequant_fp8_block(w[n0:n1], scale_inv[n0 // bn : -(-n1 // bn)], block, torch.float32).to(x.dtype)
        y[..., n0:n1] = F.linear(x, wc)
    return y


if HAS_TRITON:
    from kimi.kernels.triton.linear_small_m import COUNTER_REGION, _counter_region, _store_tile
    from kimi.kernels.triton.pdl import launch_kwargs, wait_and_release

    @triton.jit(do_not_specialize=["M", "SPLIT_K", "KB_PER_SPLIT", "ITERS", "LAST_ITERS"])
    def _fp8_linear_kernel(
        x_ptr,
        w_ptr,
        s_ptr,
        y_ptr,
        ws_ptr,
        cnt_ptr,
        M,
        N,
        K,
        n_kb,
        KB_PER_SPLIT,
        SPLIT_K,
        ITERS,
        LAST_ITERS,
        stride_xm,
        stride_wn,
        stride_sn,
        stride_ym,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BK: tl.constexpr,
        SBN: tl.constexpr,
        KU: tl.constexpr,
        USE_SPLIT: tl.constexpr,
        EVEN_N: tl.constexpr,
        PDL: tl.constexpr = False,
        PREFETCH: tl.constexpr = 0,
    ):
        """Program (pid_n, pid_k) owns W rows [pid_n * BLOCK_N, +BLOCK_N) (= columns of y) and the K blocks
        [pid_k * KB_PER_SPLIT, +KB_PER_SPLIT) of BK columns (BK = the scale tile's width: one scale per row and
        block), KU blocks per loop iteration (unrolled: more bytes in flight). ITERS / LAST_ITERS: iterations of
        every split but the last / of the last (plain arguments: the interpreter cannot bound a loop by a
        program_id-derived value). acc [BLOCK_N, BLOCK_M] fp32 (W as the wide MMA operand); rows >= M of x and
        >= N of W are clamped to the last row (read, never stored). Split-K partials:
        kimi.kernels.triton.linear_small_m's
        deterministic last-arrival reduction (_store_tile)."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BK)
        rows_x = tl.minimum(offs_m, M - 1).to(tl.int64)
        if EVEN_N:
            rows_w = offs_n.to(tl.int64)
        else:
            rows_w = tl.minimum(offs_n, N - 1).to(tl.int64)
        s_rows = (rows_w // SBN) * stride_sn  # [BLOCK_N] offsets of each row's scale row
        kb0 = pid_k * KB_PER_SPLIT
        kb_end = tl.minimum(kb0 + KB_PER_SPLIT, n_kb)
        n_iters = ITERS
        if pid_k == SPLIT_K - 1:
            n_iters = LAST_ITERS
        if PDL and PREFETCH > 0:  # weights only (no kernel of the step writes them): one line per 128 bytes
            for j in tl.static_range(PREFETCH):
                p = w_ptr + rows_w * stride_wn + tl.minimum((kb0 + j) * BK, K - 1)
                tl.inline_asm_elementwise(
                    "prefetch.global.L2 [$1]; // dummy $0", "=r,l", [p], dtype=tl.int32, is_pure=False, pack=1
                )
        wait_and_release(PDL)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for it in range(n_iters):
            for u in tl.static_range(KU):
                kb = kb0 + it * KU + u
                valid = kb < kb_end
                cols = kb * BK + offs_k
                kmask = (cols < K) & valid
                wt = tl.load(w_ptr + rows_w[:, None] * stride_wn + cols[None, :], mask=kmask[None, :], other=0.0)
                xt = tl.load(x_ptr + rows_x[:, None] * stride_xm + cols[None, :], mask=kmask[None, :], other=0.0)
                s = tl.load(s_ptr + s_rows + kb, mask=(rows_w >= 0) & valid, other=0.0)  # [BLOCK_N] fp32
                acc += tl.dot(wt.to(xt.dtype), tl.trans(xt)) * s[:, None]  # [BLOCK_N, BLOCK_M]
        _store_tile(
            acc, y_ptr, ws_ptr, cnt_ptr, M, N, SPLIT_K, stride_ym, pid_n, pid_k, BLOCK_M, BLOCK_N, USE_SPLIT, True
        )


def _block_m(m: int) -> int:
    return max(16, triton.next_power_of_2(m)) if triton is not None else max(16, 1 << (m - 1).bit_length())


def default_config(N: int, K: int, num_sms: int = 132) -> Fp8Config:
    """The config for shapes the table has no entry for: Fp8Config() (64-row programs, two K blocks per iteration,
    3 stages, automatic split-K), whatever N, K and num_sms."""
    return Fp8Config()


def _splits(cfg: Fp8Config, n_tiles: int, n_kb: int, num_sms: int) -> int:
    """split_k of a call: the config's, else enough for about 2 * num_sms programs; at most n_kb / k_unroll and 1
    when the column slabs alone fill the GPU twice."""
    if cfg.split_k > 0:
        s = cfg.split_k
    elif n_tiles >= 2 * num_sms:
        s = 1
    else:
        s = -(-2 * num_sms // n_tiles)
    return max(1, min(s, n_kb // max(1, cfg.k_unroll) or 1))


def load_table(path: str | os.PathLike | None = None) -> dict:
    """{"gpu": name or None, "entries": {(M bucket, N, K): Fp8Config}} of the table tools/bench_fp8_linear.py writes
    (kimi.kernels.tuning "linear_fp8": `path`, else $KIMI_LINEAR_FP8_TABLE, else the shipped file; configs hold
    Fp8Config's fields, any left out at their defaults); a missing file gives no entries. Raises ValueError on a
    malformed file or entry."""
    return tuning.by_bucket(tuning.load("linear_fp8", path), Fp8Config)


_TABLE: dict | None = None


def _m_bucket(m: int) -> int:
    for b in (1, 8, 16, 32, 64):
        if m <= b:
            return b
    raise ValueError(f"M {m} > {MAX_M}")


_CHOSEN: dict[tuple, Fp8Config] = {}


@functools.cache
def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (132 off CUDA: the interpreter's stand-in), queried once."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def lookup(M: int, N: int, K: int, device: torch.device) -> Fp8Config:
    """The table's config for (M bucket, N, K) when the table was measured on this GPU, else default_config
    (memoised per device and shape: no device queries on later calls)."""
    global _TABLE
    key = (_m_bucket(M), N, K, device.type, device.index)
    got = _CHOSEN.get(key)
    if got is not None:
        return got
    if _TABLE is None:
        _TABLE = load_table()
    cfg = None
    if _TABLE["gpu"] is not None and device.type == "cuda" and torch.cuda.get_device_name(device) == _TABLE["gpu"]:
        cfg = _TABLE["entries"].get((_m_bucket(M), N, K))
    if cfg is None:
        cfg = default_config(N, K, _num_sms(device))
    _CHOSEN[key] = cfg
    return cfg


def fp8_linear_small_m(
    x: torch.Tensor,
    w: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    out: torch.Tensor | None = None,
    config: Fp8Config | None = None,
) -> torch.Tensor:
    """y = x @ W^T with the Triton FP8 kernel (always; no dispatch).

    Args:
        x: [M, K] bf16 / fp16, 1 <= M <= 64, unit stride on K, on the GPU (or CPU under TRITON_INTERPRET=1).
        w: [N, K] float8_e4m3fn, contiguous. scale_inv: [ceil(N / bn), ceil(K / bk)] float32, contiguous.
        block: (bn, bk) of the scale tiles; bk must be a power of two >= 16 (it is the kernel's K step).
        out: optional [M, N] output (x's dtype, unit stride on N).
        config: launch parameters; default `lookup`.

    Returns:
        y [M, N] in x's dtype (fp32 accumulation, one rounding).

    Raises:
        RuntimeError without Triton; ValueError for shapes / dtypes / strides outside the above.
    """
    if not HAS_TRITON:
        raise BackendUnavailableError("fp8_linear_small_m needs Triton (not installed)")
    _check_args(x, w, scale_inv, block)
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_M or x.stride(1) != 1:
        raise ValueError(
            f"fp8_linear_small_m: x must be [M <= {MAX_M}, K] with unit stride on K, "
            f"got {tuple(x.shape)} strides {x.stride()}"
        )
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"fp8_linear_small_m: x must be bf16 or fp16, got {x.dtype}")
    if not w.is_contiguous() or not scale_inv.is_contiguous() or scale_inv.dtype != torch.float32:
        raise ValueError("fp8_linear_small_m: w and scale_inv (float32) must be contiguous")
    if x.device != w.device or x.device != scale_inv.device or (x.device.type != "cuda" and not INTERPRET):
        raise ValueError(
            f"fp8_linear_small_m: tensors must be on one CUDA device (x {x.device}, w {w.device}, "
            f"scale_inv {scale_inv.device})"
        )
    bn, bk = block
    if bk < 16 or bk & (bk - 1):
        raise ValueError(f"fp8_linear_small_m: the scale tile width {bk} must be a power of two >= 16")
    M, K = x.shape
    N = w.shape[0]
    if config is None:
        config = lookup(M, N, K, x.device)
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (M, N) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"fp8_linear_small_m: out must be [{M}, {N}] {x.dtype} with unit stride on N")
    n_kb = triton.cdiv(K, bk)
    bm, bn_p, ku = _block_m(M), config.block_n, max(1, config.k_unroll)
    n_tiles = triton.cdiv(N, bn_p)
    split = _splits(config, n_tiles, n_kb, _num_sms(x.device)) if n_tiles <= COUNTER_REGION else 1
    kb_per = triton.cdiv(n_kb, split)
    split = triton.cdiv(n_kb, kb_per)  # no empty splits
    ws = cnt = out  # unused without split-K; any pointer
    if split > 1:
        region = _counter_region(x.device)
        if region is None:  # first split-K call under capture: no counters yet, no split this time
            split, kb_per = 1, n_kb
        else:
            cnt = region
            ws = torch.empty((split, n_tiles, bm * bn_p), dtype=torch.float32, device=x.device)
    iters = triton.cdiv(kb_per, ku)
    last_iters = triton.cdiv(n_kb - (split - 1) * kb_per, ku)
    kw = launch_kwargs(x.device)
    _fp8_linear_kernel[(n_tiles, split)](
        x,
        w,
        scale_inv,
        out,
        ws,
        cnt,
        M,
        N,
        K,
        n_kb,
        kb_per,
        split,
        iters,
        last_iters,
        x.stride(0),
        w.stride(0),
        scale_inv.stride(0),
        out.stride(0),
        BLOCK_M=bm,
        BLOCK_N=bn_p,
        BK=bk,
        SBN=bn,
        KU=ku,
        USE_SPLIT=split > 1,
        EVEN_N=N % bn_p == 0,
        PREFETCH=PREFETCH_TILES if kw["PDL"] else 0,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **kw,
    )
    return out


def fp8_linear(
    x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """y = x @ W^T for FP8 block weights: x [..., K] (bf16 / fp16 / fp32) -> [..., N] in x's dtype. Dispatch: the
    Triton kernel for 1..64 rows of bf16 / fp16 on CUDA, else fp8_linear_dequant (the reference by row chunks). Raises
    ValueError for mismatched shapes / dtypes."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    M = x2.shape[0]
    bk = block[1]
    if (
        HAS_TRITON
        and x2.is_cuda
        and 1 <= M <= MAX_M
        and x2.dtype in (torch.bfloat16, torch.float16)
        and bk >= 16
        and not bk & (bk - 1)
    ):
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        return fp8_linear_small_m(x2, w, scale_inv, block).view(*lead, w.shape[0])
    if M == 0:
        _check_args(x, w, scale_inv, block)
        return x.new_empty(*lead, w.shape[0])
    return fp8_linear_dequant(x, w, scale_inv, block)


class Fp8Linear(nn.Module):
    """A bias-free linear layer whose weight stays FP8: weight [N, K] float8_e4m3fn and weight_scale_inv
    [ceil(N / bn), ceil(K / bk)] float32 (registered as frozen parameters, so parameter byte counts see the FP8
    bytes), block = (bn, bk). `forward(x)` = `fp8_linear(x, weight, weight_scale_inv, block)`.

    Raises ValueError (construction) when the scale grid does not match the weight."""

    def __init__(self, weight: torch.Tensor, weight_scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)):
        super().__init__()
        _check_weight(weight, weight_scale_inv, block)
        # both None once `to_humming` handed them over
        self.weight: nn.Parameter | None = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.weight_scale_inv: nn.Parameter | None = nn.Parameter(
            weight_scale_inv.float().contiguous(), requires_grad=False
        )
        self.block = (int(block[0]), int(block[1]))
        self.out_features, self.in_features = weight.shape
        self.hl: Any = None  # a humming-kernels HummingLayer once `to_humming` succeeded
        self._tuning: dict[int, dict] = {}
        # humming's heuristic schedules run with Stream-K off: its fix-up made a CUDA-graph replay differ from the eager
        # call in the last bit (tests/gpu/test_linear_fp8.py), i.e. the result depended on timing; without it every
        # output element is one program's fixed-order sum. True: humming's own choice (benchmarks compare the two).
        self.humming_stream_k = False

    @property
    def shape(self) -> torch.Size:
        """(N, K), as the bf16 weight it replaces."""
        return torch.Size((self.out_features, self.in_features))

    def _fp8(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight, weight_scale_inv); RuntimeError after to_humming."""
        if self.weight is None or self.weight_scale_inv is None:
            raise ProtocolError("Fp8Linear: the weight was handed to humming")
        return self.weight, self.weight_scale_inv

    @property
    def is_cuda(self) -> bool:
        return bool((self._fp8()[0] if self.hl is None else self.hl.weight).is_cuda)

    def to_humming(self, dtype: torch.dtype = torch.bfloat16) -> bool:
        """Hand the weight to humming-kernels' dense W8A16 GEMM (its `fp8` schema, layout transformed once; the
        FP8 tensors here are then released): possible on CUDA when N and K are multiples of the scale tile and
        humming imports. Returns whether it did. humming keeps each tile scale as a per-row group scale in `dtype`
        (a bf16 rounding of the float32 scale, relative 2^-9; HummingFp8Experts does the same)."""
        N, K = self.shape
        bn, bk = self.block
        if self.hl is not None:
            return True
        weight, scale = self._fp8()
        if not weight.is_cuda or N % bn or K % bk:
            return False
        try:
            from humming.layer import HummingLayer
        except ImportError:
            return False
        dev = weight.device
        with torch.cuda.device(dev):
            hl = HummingLayer(
                shape_n=N,
                shape_k=K,
                weight_config=dict(quant_method="fp8", weight_block_size=[bn, bk]),
                torch_dtype=dtype,
            )
            hl.to(dev)
            hl.load_from_tensors({"weight": weight.data, "weight_scale_inv": scale.data})
            hl.transform()
        self.weight = self.weight_scale_inv = None
        self.hl = hl
        return True

    def _humming_tuning(self, M: int) -> dict:
        """humming's heuristic schedule for M rows (the next power of two; Stream-K off unless humming_stream_k),
        cached: no host heuristics per call."""
        b = 1 << max(0, M - 1).bit_length()
        cfg = self._tuning.get(b)
        if cfg is None:
            from humming.tune import get_heuristics_config

            cfg = get_heuristics_config(self.hl.humming_config, shape_m=b, gemm_type="dense")
            if not self.humming_stream_k and cfg.get("use_stream_k"):
                cfg = {**cfg, "use_stream_k": False}
            self._tuning[b] = cfg
        return cfg

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype."""
        if self.hl is None:
            w, s = self.weight, self.weight_scale_inv
            assert w is not None and s is not None, "released only by to_humming, which sets hl"
            return fp8_linear(x, w, s, self.block)
        K = self.in_features
        if x.shape[-1] != K:
            raise ValueError(f"Fp8Linear: x has {x.shape[-1]} columns, the layer {K}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, K)
        if x2.shape[0] == 0:
            return x.new_empty(*lead, self.out_features)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        return self.hl(x2, tuning_config=self._humming_tuning(x2.shape[0])).view(*lead, self.out_features)

    def dequantized(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The weight dequantised: [N, K] `dtype` (not after to_humming: RuntimeError)."""
        if self.hl is not None:
            raise ProtocolError("Fp8Linear.dequantized: the weight was handed to humming")
        return dequant_fp8_block(*self._fp8(), self.block, torch.float32).to(dtype)

    @classmethod
    def cat(cls, parts: list[Fp8Linear], pad_rows_to: int = 1) -> Fp8Linear:
        """One layer whose output is the parts' outputs concatenated (weights stacked along N), e.g. gate + up or
        q_a + kv_a, followed by zero rows up to a multiple of pad_rows_to (so that humming can take a merge with a
        ragged last part: q_a 1536 + kv_a 576 rows -> 2176; callers slice the real columns). Every part but the last
        must have N a multiple of bn (its scale rows must not straddle) and all the same K and block; pad_rows_to
        must divide bn. Raises ValueError otherwise (or after to_humming)."""
        block, K = parts[0].block, parts[0].in_features
        for p in parts:
            if p.hl is not None:
                raise ValueError("Fp8Linear.cat: a part was already handed to humming")
            if p.block != block or p.in_features != K:
                raise ValueError(f"Fp8Linear.cat: parts differ in block / K ({p.block} {tuple(p.shape)})")
        for p in parts[:-1]:
            if p.out_features % block[0]:
                raise ValueError(
                    f"Fp8Linear.cat: a part of {p.out_features} rows is not a multiple of the "
                    f"{block[0]}-row scale tile (only the last part may be ragged)"
                )
        if block[0] % pad_rows_to:
            raise ValueError(f"Fp8Linear.cat: pad_rows_to {pad_rows_to} must divide the tile's {block[0]} rows")
        rows = [p._fp8()[0].view(torch.uint8) for p in parts]
        n = sum(r.shape[0] for r in rows)
        if n % pad_rows_to:  # zero rows (FP8 0) inside the last scale tile: no new scale rows
            rows.append(torch.zeros((pad_rows_to - n % pad_rows_to, K), dtype=torch.uint8, device=rows[0].device))
        w = torch.cat(rows, 0).view(torch.float8_e4m3fn)
        s = torch.cat([p._fp8()[1] for p in parts], 0)
        return cls(w, s, block)

    def extra_repr(self) -> str:
        return f"N={self.out_features}, K={self.in_features}, block={self.block}, humming={self.hl is not None}"


def table_entry(cfg: Fp8Config) -> dict:
    return asdict(cfg)
