"""Fused Triton kernels for the GPU decode path (kimi/model/gpu_forward.py), each with its plain-PyTorch reference.

The CPU model keeps the references (kimi/model/norm.py, rope.py, moe.py); the GPU model calls the fused ops.
All launches are CUDA-graph capturable: no host synchronisation, no tensor-dependent host control flow; the only
persistent buffer (the router's int32 arrival counters) is allocated by the first call outside capture.

- `rms_norm` / `add_rms_norm`: RMSNorm in fp32 over the last dim, optionally after a residual add of one or two
  deltas (`h_new = h + d1 (+ d2)`; returns (h_new, rmsnorm(h_new))). Strided rows allowed (row stride only).
  One program per row; the weight load is issued first (before the h_new store, which the compiler must assume
  may alias it), so a program waits for one round of loads instead of two.
- `silu_mul`: `silu(y[:, :I]) * y[:, I:]` for y [M, 2I] (the merged gate/up GEMM output).
- `mla_rope_kv_write`: one kernel per step and layer for the MLA latent path: rmsnorm(kv_a[:, :L]) and
  rope(kv_a[:, L:]) written into the paged cache at slot_mapping, plus rope of q_pe into a contiguous [T, H, R].
  Grid (T, head groups + 1): each row's q heads are split over several programs, the last program of a row does
  the latent rmsnorm + k_pe rope + cache write. Interleaved rope pairs are loaded as contiguous rows and split
  into even / odd lanes in registers (tl.reshape + tl.split), re-interleaved with tl.join for the store.
- `router_topk`: noaux_tc router: sigmoid(x @ gate^T) (bf16 inputs, fp32 accumulation: bf16 products are exact in
  fp32, so this equals the fp32 reference up to summation order), top-k of `s + bias`, weights = s normalised
  and scaled. For T <= ROUTER_FUSED_MAX_T one kernel (split-K, "last arriving program reduces" with int32
  arrival counters, see `_router_fused_kernel`); above, or when the counter buffer does not exist yet under
  graph capture, two kernels (split-K partials, or from ROUTER_GEMM_MIN_T rows on one cuBLAS GEMM with fp32
  output; per-row sum in split order + top-k). Both are run-to-run
  deterministic: partial sums are added in the fixed split order, never with float atomics.
- `moe_align_fused`: kimi.kernels.triton.moe_w4a16.moe_align's outputs. For P = T*k <= ALIGN_ONE_PROGRAM_MAX_P one
  program (histogram, padded offsets, block experts, sentinel fill, and each pair's slot = padded start of its
  expert + its rank among that expert's pairs by a one-hot cumsum): the same pair order as moe_align's stable
  sort, deterministic. Above, two kernels (histogram program; atomic slot claims: pairs within one expert in
  arbitrary order, which the GEMMs and the combine do not depend on). From P >= ALIGN_GRID_MIN_P (prefill) the
  grid path: per-program histograms of ALIGN_GRID_BLOCK pairs, one program for the offsets and block experts,
  then every program places its pairs by one-hot rank: moe_align's order again, no atomics.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kimi.kernels import tuning
from kimi.kernels.triton.common import INTERPRET
from kimi.kernels.triton.linear_small_m import COUNTER_REGION as _COUNTER_REGION
from kimi.kernels.triton.linear_small_m import _counter_region
from kimi.kernels.triton.pdl import launch_kwargs, wait_and_release

__all__ = [
    "ALIGN_GRID_MIN_P",
    "ALIGN_ONE_PROGRAM_MAX_P",
    "LAUNCH",
    "LAUNCH_FIELDS",
    "ROUTER_FUSED_MAX_T",
    "add_rms_norm",
    "add_rms_norm_ref",
    "mla_rope_kv_write",
    "mla_rope_kv_write_ref",
    "moe_align_fused",
    "rms_norm",
    "router_topk",
    "router_topk_ref",
    "silu_mul",
    "silu_mul_ref",
    "silu_mul_rows",
    "use_launch",
]

# Both one-kernel paths below are SLOWER than the two-kernel paths in the K2.6 decode step on an H200 (eager kernel
# time per step at 8 / 32 local sequences: router 1.27 / 3.42 ms against 0.57 / 0.61, align 0.95 / 3.49 ms against
# 0.29 / 0.48; docs/performance.md, Tried and not kept), so they are off (thresholds 0); they stay selectable
# (router_topk(fused=True), moe_align_fused(one_program=True)) and tested.
ROUTER_FUSED_MAX_T = 0  # router_topk: one fused kernel up to this many rows, the two-kernel path above
ALIGN_ONE_PROGRAM_MAX_P = 0  # moe_align_fused: one program up to this many (token, slot) pairs
# moe_align_fused from this many pairs on: the grid path. tools/bench_fused.py --ops align_grid (H200; grid vs two
# kernels at block 16 / 96): 12.8 / 11.7 vs 6.1 / 5.2 us at 2048 pairs, 16.2 / 13.0 vs 12.3 / 10.0 at 8192, 20.6 / 13.2
# vs 20.7 / 14.7 at 16384, 105 / 50 vs 141 / 94 at 131072. ALIGN_GRID_BLOCK pairs per program.
ALIGN_GRID_MIN_P = 16384
ALIGN_GRID_BLOCK = 256

# Launch parameters of the decode-path kernels below, {launch name: config} with the fields of LAUNCH_FIELDS, from
# kimi/kernels/tuning/small_kernels.json (its tuner regenerates it). Read at each call (CUDA graphs keep the values of
# their capture); rms_norm, add_rms_norm, silu_mul_rows, _router_topk and _moe_align take another as `launch`, and
# `use_launch` replaces this module's.
LAUNCH_FIELDS: dict[str, tuple[str, ...]] = {
    "rmsnorm": ("warps",),  # warps None: by the row width (_nw)
    "silu_rows": ("rows", "block", "warps"),  # rows per program, column block
    "router_logits": ("bt", "be", "bk", "warps", "split_elems"),  # row / expert / K tiles, K elements per split
    "router_logits_large": ("m_min", "bt", "be", "bk", "warps", "split_elems"),  # instead, from m_min rows on
    "router_topk": ("warps",),
    "align_count": ("warps",),
    "align_scatter": ("block", "warps"),  # pairs per program
}
LAUNCH: dict[str, dict[str, Any]] = tuning.launch_configs(tuning.load("small_kernels"), LAUNCH_FIELDS)


def use_launch(launch: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Make `launch` ({name: config} with exactly LAUNCH_FIELDS' names and fields, e.g. `tuning.launch_configs` of
    another small_kernels table) the launch of every later call that passes none; returns the previous LAUNCH.
    Raises ValueError when a name or a config's fields differ."""
    global LAUNCH
    if sorted(launch) != sorted(LAUNCH_FIELDS) or any(sorted(launch[k]) != sorted(f) for k, f in LAUNCH_FIELDS.items()):
        raise ValueError(f"use_launch: want the names and fields {LAUNCH_FIELDS}, got {launch}")
    old, LAUNCH = LAUNCH, {k: dict(v) for k, v in launch.items()}
    return old


# ---- RMSNorm (+ residual add) ----------------------------------------------------------------------------


@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    x_stride,
    d1_ptr,
    d1_stride,
    d2_ptr,
    d2_stride,
    w_ptr,
    h_ptr,
    h_stride,
    y_ptr,
    y_stride,
    D,
    eps,
    HAS_D1: tl.constexpr,
    HAS_D2: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < D
    # the weight first: loaded after the h store below, it would wait for that store (h may alias w as far as
    # the compiler knows), adding a second memory round trip to the program. A weight: read before the PDL wait.
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    wait_and_release(PDL)
    x = tl.load(x_ptr + row * x_stride + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_D1:
        x += tl.load(d1_ptr + row * d1_stride + offs, mask=m, other=0.0).to(tl.float32)
        if HAS_D2:
            x += tl.load(d2_ptr + row * d2_stride + offs, mask=m, other=0.0).to(tl.float32)
        xr = x.to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * h_stride + offs, xr, mask=m)
        x = xr.to(tl.float32)  # normalise the stored (rounded) residual, as the reference does
    ms = tl.sum(x * x, axis=0) / D
    r = 1.0 / tl.sqrt(ms + eps)
    tl.store(y_ptr + row * y_stride + offs, (w * (x * r)).to(y_ptr.dtype.element_ty), mask=m)


def _nw(block: int, launch: dict[str, dict[str, Any]] | None = None) -> int:
    """Warps of the RMSNorm kernel at a row block of `block` columns: (launch or LAUNCH)["rmsnorm"]["warps"], else
    by the row width (small_kernels.json's notes hold the measurement)."""
    warps = (launch or LAUNCH)["rmsnorm"]["warps"]
    if warps:
        return warps
    return 8 if block >= 2048 else (4 if block >= 1024 else 2)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    launch: dict[str, dict[str, Any]] | None = None,
) -> torch.Tensor:
    """x [T, D] (last dim contiguous, any row stride), weight [D] -> rmsnorm [T, D] in x.dtype (fp32 math,
    kimi.model.norm.rms_norm). out: optional [T, D] destination (unit last-dim stride), returned. launch: {name:
    config} as LAUNCH (default LAUNCH; its "rmsnorm" entry is read)."""
    T, D = x.shape
    assert x.stride(1) == 1
    y = torch.empty((T, D), dtype=x.dtype, device=x.device) if out is None else out
    if T == 0:
        return y
    B = triton.next_power_of_2(D)
    _rmsnorm_kernel[(T,)](
        x,
        x.stride(0),
        x,
        0,
        x,
        0,
        weight,
        y,
        0,
        y,
        y.stride(0),
        D,
        eps,
        HAS_D1=False,
        HAS_D2=False,
        BLOCK=B,
        num_warps=_nw(B, launch),
        **launch_kwargs(x.device),
    )
    return y


def add_rms_norm(
    h: torch.Tensor,
    d1: torch.Tensor,
    d2: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    launch: dict[str, dict[str, Any]] | None = None,
):
    """(h + d1 (+ d2), rmsnorm(that)): h, d1, d2 [T, D] (unit last-dim stride); returns (h_new [T, D] h.dtype,
    y [T, D] h.dtype). The sum is rounded to h.dtype once and y normalises that rounded value (add_rms_norm_ref).
    launch: as rms_norm's."""
    T, D = h.shape
    h_new = torch.empty((T, D), dtype=h.dtype, device=h.device)
    y = torch.empty((T, D), dtype=h.dtype, device=h.device)
    if T == 0:
        return h_new, y
    B = triton.next_power_of_2(D)
    d2_ = d1 if d2 is None else d2
    _rmsnorm_kernel[(T,)](
        h,
        h.stride(0),
        d1,
        d1.stride(0),
        d2_,
        d2_.stride(0),
        weight,
        h_new,
        h_new.stride(0),
        y,
        y.stride(0),
        D,
        eps,
        HAS_D1=True,
        HAS_D2=d2 is not None,
        BLOCK=B,
        num_warps=_nw(B, launch),
        **launch_kwargs(h.device),
    )
    return h_new, y


def add_rms_norm_ref(h, d1, d2, weight, eps):
    """Reference: `h + (d1 + d2)` in the model dtype (as the model's residual adds), then kimi.model.norm.rms_norm."""
    from kimi.model.norm import rms_norm as ref

    d = d1 if d2 is None else d1 + d2
    h_new = h + d
    return h_new, ref(h_new, weight, eps)


# ---- SiLU * up -------------------------------------------------------------------------------------------


@triton.jit
def _silu_mul_kernel(y_ptr, y_stride, o_ptr, o_stride, I, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait_and_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < I
    g = tl.load(y_ptr + row * y_stride + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(y_ptr + row * y_stride + I + offs, mask=m, other=0.0).to(tl.float32)
    s = g / (1.0 + tl.exp(-g))
    tl.store(
        o_ptr + row * o_stride + offs,
        (s.to(o_ptr.dtype.element_ty).to(tl.float32) * u).to(o_ptr.dtype.element_ty),
        mask=m,
    )


def silu_mul(y: torch.Tensor, inter: int | None = None) -> torch.Tensor:
    """y [M, 2I] -> silu(y[:, :I]) * y[:, I:] [M, I] (y.dtype; silu rounded to y.dtype first, as torch does)."""
    M, two_i = y.shape
    inter = two_i // 2 if inter is None else inter
    assert y.stride(1) == 1
    o = torch.empty((M, inter), dtype=y.dtype, device=y.device)
    if M == 0:
        return o
    BLOCK = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(M, triton.cdiv(inter, BLOCK))](
        y, y.stride(0), o, o.stride(0), inter, BLOCK=BLOCK, num_warps=4, **launch_kwargs(y.device)
    )
    return o


def silu_mul_ref(y: torch.Tensor, inter: int | None = None) -> torch.Tensor:
    inter = y.shape[1] // 2 if inter is None else inter
    return F.silu(y[:, :inter]) * y[:, inter:]


@triton.jit
def _silu_mul_rows_kernel(
    y_ptr,
    y_stride,
    o_ptr,
    o_stride,
    rows_ptr,
    nrows_ptr,
    P,
    I,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr = 0,
    PDL: tl.constexpr = False,
):
    # program (slot block, column block): rows rows_ptr[slot] for the ROWS slots of the block, slots past
    # *nrows_ptr and row ids >= P (the align's pad sentinel) skipped; GROUP > 0: gate / up columns interleaved in
    # groups of GROUP (kimi.kernels.cuda.moe_w4a16.glu_interleave), else gate [0, I), up [I, 2I)
    wait_and_release(PDL)
    s0 = tl.program_id(0) * ROWS
    n = tl.load(nrows_ptr)
    if s0 < n:  # the ROWS rows of the block in one [ROWS, BLOCK] tile (one memory round trip, not ROWS)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        if GROUP > 0:
            g_col = (offs // GROUP) * (2 * GROUP) + offs % GROUP
            u_col = g_col + GROUP
        else:
            g_col = offs
            u_col = offs + I
        sl = s0 + tl.arange(0, ROWS)
        r = tl.load(rows_ptr + sl, mask=sl < n, other=P)
        ok = r < P
        r64 = tl.where(ok, r, 0).to(tl.int64)
        mm = ok[:, None] & (offs < I)[None, :]
        base = r64[:, None] * y_stride
        g = tl.load(y_ptr + base + g_col[None, :], mask=mm, other=0.0).to(tl.float32)
        u = tl.load(y_ptr + base + u_col[None, :], mask=mm, other=0.0).to(tl.float32)
        a = (g / (1.0 + tl.exp(-g))).to(o_ptr.dtype.element_ty).to(tl.float32)
        tl.store(o_ptr + r64[:, None] * o_stride + offs[None, :], (a * u).to(o_ptr.dtype.element_ty), mask=mm)


def silu_mul_rows(
    y: torch.Tensor,
    rows: torch.Tensor,
    num_rows: torch.Tensor,
    inter: int | None = None,
    rows_per_program: int | None = None,
    out: torch.Tensor | None = None,
    interleave: int = 0,
    launch: dict[str, dict[str, Any]] | None = None,
) -> torch.Tensor:
    """silu_mul for the rows a MoE align lists only: y [P, 2I] (unit last-dim stride), rows [cap] int32 row ids
    (moe_align's sorted_ids: values >= P are pads, skipped), num_rows [1] int32 on the device (how many leading
    entries of rows are valid: moe_align's num_padded) -> o [P, I] (y.dtype) where o[r] = silu(y[r, :I]) * y[r, I:]
    for every listed row r; the other rows of o are left UNINITIALISED (the down GEMM reads only listed rows).
    out: optional [P, I] destination (unit last-dim stride), returned; its unlisted rows are not written.
    rows_per_program: listed rows per program, rounded up to a power of two (loaded as one [rows, block] tile);
    default the "silu_rows" entry of launch ({name: config} as LAUNCH; default LAUNCH), which also gives the column
    block and warps. interleave: 0, or G > 0 when y's columns are gate / up groups of G
    (kimi.kernels.cuda.moe_w4a16.glu_interleave: o[r, G j + i] = silu(y[r, 2 G j + i]) * y[r, 2 G j + G + i]).

    Why: the gate_up GEMM writes only the rows of local (token, expert) pairs, about 1/ep_size of the P = T * k
    rows; silu_mul over all P rows reads and writes ~ep_size x more than needed. Same math as `silu_mul`
    (silu rounded to y.dtype, then the product rounded). No host sync (num_rows stays on the device): the grid
    covers all cap slots and programs past num_rows exit at once. CUDA-graph capturable. Raises ValueError when
    I is not a multiple of interleave."""
    P, two_i = y.shape
    inter = two_i // 2 if inter is None else inter
    assert y.stride(1) == 1 and rows.dtype == torch.int32 and num_rows.numel() == 1
    if interleave < 0 or (interleave and inter % interleave):
        raise ValueError(f"silu_mul_rows: interleave {interleave} does not divide I = {inter}")
    o = torch.empty((P, inter), dtype=y.dtype, device=y.device) if out is None else out
    assert o.shape == (P, inter) and o.stride(1) == 1
    cap = rows.numel()
    if P == 0 or cap == 0:
        return o
    lp = (launch or LAUNCH)["silu_rows"]
    BLOCK = min(lp["block"], triton.next_power_of_2(inter))
    R = triton.next_power_of_2(lp["rows"] if rows_per_program is None else rows_per_program)
    _silu_mul_rows_kernel[(triton.cdiv(cap, R), triton.cdiv(inter, BLOCK))](
        y,
        y.stride(0),
        o,
        o.stride(0),
        rows,
        num_rows,
        P,
        inter,
        ROWS=R,
        BLOCK=BLOCK,
        GROUP=int(interleave),
        num_warps=lp["warps"],
        **launch_kwargs(y.device),
    )
    return o


def glu_split(y: torch.Tensor, inter: int, interleave: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate [M, I], up [M, I]) of a gate_up output y [M, 2I]: y[:, :I], y[:, I:], or with interleave G > 0 the
    column groups `silu_mul_rows(..., interleave=G)` reads (copies)."""
    if not interleave:
        return y[:, :inter], y[:, inter:]
    v = y.reshape(y.shape[0], inter // interleave, 2, interleave)
    return v[:, :, 0].reshape(-1, inter), v[:, :, 1].reshape(-1, inter)


# ---- MLA: q_pe rope, kv latent rmsnorm + k_pe rope, paged cache write -------------------------------------


@triton.jit
def _rope_pairs(x, c, s, ROWS: tl.constexpr, R: tl.constexpr):
    """Interleaved rope of x [ROWS, R] fp32 (pairs (2i, 2i+1)) with c, s [R/2] fp32 -> [ROWS, R] fp32:
    y[2i] = x[2i] c_i - x[2i+1] s_i, y[2i+1] = x[2i+1] c_i + x[2i] s_i (kimi.model.rope.apply_rope_interleaved)."""
    x0, x1 = tl.split(tl.reshape(x, (ROWS, R // 2, 2)))
    cc = c[None, :]
    ss = s[None, :]
    return tl.reshape(tl.join(x0 * cc - x1 * ss, x1 * cc + x0 * ss), (ROWS, R))


@triton.jit
def _mla_rope_kv_kernel(
    q_ptr,
    q_s0,
    q_s1,
    kva_ptr,
    kva_s0,
    w_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    slot_ptr,
    cache_ptr,
    qpe_ptr,
    H,
    N,
    L,
    eps,
    R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_L: tl.constexpr,
    PDL: tl.constexpr = False,
):
    # grid (T, cdiv(H, BLOCK_H) + 1): programs 0.. of a row rope BLOCK_H heads of q_pe each; the last one does
    # the latent rmsnorm, the k_pe rope and the cache write of that row
    wait_and_release(PDL)
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    R2: tl.constexpr = R // 2
    ri = tl.arange(0, R)
    if g == tl.num_programs(1) - 1:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        lo = tl.arange(0, BLOCK_L)
        lm = lo < L
        row = kva_ptr + t * kva_s0
        w = tl.load(w_ptr + lo, mask=lm, other=0.0).to(tl.float32)
        x = tl.load(row + lo, mask=lm, other=0.0).to(tl.float32)
        kp = tl.load(row + L + ri).to(tl.float32)  # k_pe [R], contiguous
        pos = tl.load(pos_ptr + t).to(tl.int64)
        c = tl.load(cos_ptr + pos * R2 + tl.arange(0, R2))
        s = tl.load(sin_ptr + pos * R2 + tl.arange(0, R2))
        # latent: rmsnorm(kv_a[t, :L]) -> cache[slot, :L]
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / L + eps)
        ckv = (w * (x * r)).to(kva_ptr.dtype.element_ty)
        crow = cache_ptr + slot * (L + R)
        tl.store(crow + lo, ckv.to(cache_ptr.dtype.element_ty), mask=lm)
        # k_pe: rope(kv_a[t, L:]) -> cache[slot, L:]
        kr = tl.reshape(_rope_pairs(tl.reshape(kp, (1, R)), c, s, 1, R), (R,))
        tl.store(crow + L + ri, kr.to(kva_ptr.dtype.element_ty).to(cache_ptr.dtype.element_ty))
    else:
        # q_pe: rope(q[t, h, N:]) -> qpe[t, h, :] for h in this program's head group
        hh = g * BLOCK_H + tl.arange(0, BLOCK_H)
        hm = hh[:, None] < H
        qv = tl.load(q_ptr + t * q_s0 + hh[:, None].to(tl.int64) * q_s1 + N + ri[None, :], mask=hm, other=0.0).to(
            tl.float32
        )  # [BLOCK_H, R], rows contiguous
        pos = tl.load(pos_ptr + t).to(tl.int64)
        c = tl.load(cos_ptr + pos * R2 + tl.arange(0, R2))
        s = tl.load(sin_ptr + pos * R2 + tl.arange(0, R2))
        qr = _rope_pairs(qv, c, s, BLOCK_H, R)
        tl.store(qpe_ptr + t * H * R + hh[:, None] * R + ri[None, :], qr.to(qpe_ptr.dtype.element_ty), mask=hm)


def mla_rope_kv_write(
    q: torch.Tensor,
    kv_a: torch.Tensor,
    kv_norm_w: torch.Tensor,
    eps: float,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache: torch.Tensor,
    nope: int,
) -> torch.Tensor:
    """q [T, H, N + R] (last dim contiguous), kv_a [T, L + R] (row stride any) -> q_pe roped [T, H, R] contiguous.

    Writes cache.view(-1, L + R)[slot_mapping[t]] = cat(rmsnorm(kv_a[t, :L]), rope(kv_a[t, L:])) for every t.
    cos_cache / sin_cache: [P, R/2] float32 contiguous (RotaryEmbedding's, mscale folded in); positions,
    slot_mapping: [T] integer; kv_norm_w [L]; kv_cache contiguous [..., L + R]. R must be a power of two.
    Math: mla_rope_kv_write_ref (rms_norm in fp32, rope in fp32, each rounded once to the model dtype).
    """
    T, H, NR = q.shape
    R = NR - nope
    L = kv_a.shape[1] - R
    assert q.stride(2) == 1 and kv_a.stride(1) == 1 and kv_cache.is_contiguous() and kv_cache.shape[-1] == L + R
    assert R >= 2 and R & (R - 1) == 0
    qpe = torch.empty((T, H, R), dtype=q.dtype, device=q.device)
    if T == 0:
        return qpe
    BH = min(triton.next_power_of_2(H), 8 if T <= 64 else 32)  # small T: more programs per row
    _mla_rope_kv_kernel[(T, triton.cdiv(H, BH) + 1)](
        q,
        q.stride(0),
        q.stride(1),
        kv_a,
        kv_a.stride(0),
        kv_norm_w,
        cos_cache,
        sin_cache,
        positions,
        slot_mapping,
        kv_cache,
        qpe,
        H,
        nope,
        L,
        eps,
        R=R,
        BLOCK_H=BH,
        BLOCK_L=triton.next_power_of_2(L),
        num_warps=4,
        **launch_kwargs(q.device),
    )
    return qpe


def mla_rope_kv_write_ref(q, kv_a, kv_norm_w, eps, cos_cache, sin_cache, positions, slot_mapping, kv_cache, nope):
    """Reference: the fused (kimi.model.gpu_forward.mla_forward) / reference MLAAttention sequence (rms_norm,
    apply_rope_interleaved, index_copy_)."""
    from kimi.model.norm import rms_norm as ref_norm
    from kimi.model.rope import apply_rope_interleaved

    _T, _H, NR = q.shape
    R = NR - nope
    L = kv_a.shape[1] - R
    cos, sin = cos_cache[positions], sin_cache[positions]
    ckv = ref_norm(kv_a[:, :L], kv_norm_w, eps)
    k_pe = apply_rope_interleaved(kv_a[:, L:], cos, sin)
    q_pe = apply_rope_interleaved(q[..., nope:], cos, sin)
    kv_cache.view(-1, L + R).index_copy_(0, slot_mapping, torch.cat([ckv, k_pe], -1).to(kv_cache.dtype))
    return q_pe.contiguous()


# ---- router ----------------------------------------------------------------------------------------------

# int32 arrival counters of the fused router kernel: kimi.kernels.triton.linear_small_m's per-device buffer, allocated
# once (zeros) outside graph capture, split in regions that successive calls rotate through (_counter_region); the
# kernel leaves every counter at 0.
_warned_capture = [False]


@triton.jit
def _router_fused_kernel(
    x_ptr,
    x_s0,
    w_ptr,
    w_s0,
    bias_ptr,
    part_ptr,
    logit_ptr,
    cnt_ptr,
    wout_ptr,
    idout_ptr,
    valid_ptr,
    T,
    E,
    D,
    K_SPLIT,
    scale,
    TOPK: tl.constexpr,
    NORM: tl.constexpr,
    BT: tl.constexpr,
    BE: tl.constexpr,
    BK: tl.constexpr,
    SUB: tl.constexpr,
    BLOCK_E: tl.constexpr,
    F32_DOT: tl.constexpr,
    HAS_VALID: tl.constexpr = False,
):
    """Grid (n_e = cdiv(E, BE), n_split, n_t = cdiv(T, BT)). Program (pe, pk, pt) computes the fp32 partial
    z[rows pt*BT.., experts pe*BE..] over K range [pk*K_SPLIT, +K_SPLIT) and stores it to its own workspace tile
    part[pt, pe, pk]. Then (CTA barrier, acq_rel atomic on counter[pt, pe]) the program that arrives last for
    (pt, pe) sums the n_split tiles in the fixed order 0..n_split-1 (deterministic whatever the arrival order),
    stores the logits tile, resets counter[pt, pe], and arrives on counter2[pt]; the last of the n_e tiles of row
    block pt resets counter2[pt] and does sigmoid + bias + top-k + normalisation for those rows, SUB rows at a
    time (_router_topk_rows). (The usual split-K "serial reduction" fix-up, written for this project.)

    Top-k: each (row, expert) gets one int64 key = (order-preserving int32 image of s + bias) << 32 |
    (BLOCK_E - 1 - expert), so one max-reduction per pick yields the largest value and, among exact ties, the
    lowest expert id; the picked key is then knocked out. Weights: sigmoid of the gathered logits (the same
    expression as the scores, so the same values)."""
    pe = tl.program_id(0)
    pk = tl.program_id(1)
    pt = tl.program_id(2)
    n_e = tl.num_programs(0)
    n_split = tl.num_programs(1)
    n_t = tl.num_programs(2)
    rt = pt * BT + tl.arange(0, BT)
    re = pe * BE + tl.arange(0, BE)
    rows_x = tl.minimum(rt, T - 1).to(tl.int64)  # rows >= T re-read row T-1 (never stored)
    rows_w = tl.minimum(re, E - 1).to(tl.int64)  # experts >= E likewise
    acc = tl.zeros((BT, BE), dtype=tl.float32)
    k0 = pk * K_SPLIT
    for kk in range(0, K_SPLIT, BK):  # K_SPLIT is a multiple of BK
        rk = k0 + kk + tl.arange(0, BK)
        km = rk[None, :] < D
        a = tl.load(x_ptr + rows_x[:, None] * x_s0 + rk[None, :], mask=km, other=0.0)  # [BT, BK]
        b = tl.load(w_ptr + rows_w[:, None] * w_s0 + rk[None, :], mask=km, other=0.0)  # [BE, BK]
        if F32_DOT:  # the CPU interpreter's bf16 dot is wrong; exact products in fp32 instead
            acc += tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(b))
    tile = tl.arange(0, BT)[:, None] * BE + tl.arange(0, BE)[None, :]
    grp = pt * n_e + pe
    pbase = part_ptr + grp.to(tl.int64) * n_split * (BT * BE)
    tl.store(pbase + pk * (BT * BE) + tile, acc)
    tl.debug_barrier()  # every thread's partial is written before the (single-thread) release below
    arrived = tl.atomic_add(cnt_ptr + grp, 1, sem="acq_rel", scope="gpu")
    if arrived == n_split - 1:  # last split of (pt, pe): reduce in split order
        z = tl.load(pbase + tile, cache_modifier=".cg")
        for sp in range(1, n_split):
            z += tl.load(pbase + sp * (BT * BE) + tile, cache_modifier=".cg")
        tl.atomic_xchg(cnt_ptr + grp, 0, sem="relaxed", scope="gpu")
        # logits [n_t * BT, E]: padded rows exist, so only the expert mask
        tl.store(logit_ptr + rt[:, None].to(tl.int64) * E + re[None, :], z, mask=re[None, :] < E)
        tl.debug_barrier()
        c2 = cnt_ptr + n_t * n_e + pt
        done = tl.atomic_add(c2, 1, sem="acq_rel", scope="gpu")
        if done == n_e - 1:  # last expert tile of row block pt: top-k of its rows, SUB rows at a time
            tl.atomic_xchg(c2, 0, sem="relaxed", scope="gpu")
            for sb in tl.static_range(BT // SUB):
                if pt * BT + sb * SUB < T:  # (sub-blocks past the last row are skipped)
                    _router_topk_rows(
                        logit_ptr,
                        bias_ptr,
                        wout_ptr,
                        idout_ptr,
                        valid_ptr,
                        pt * BT + sb * SUB,
                        T,
                        E,
                        scale,
                        TOPK,
                        NORM,
                        SUB,
                        BLOCK_E,
                        HAS_VALID,
                    )


@triton.jit
def _topk_key(choice, valid, e, BLOCK_E: tl.constexpr):
    """Top-k selection keys (elementwise, any shape): int64 (order-preserving int32 image of the fp32 `choice`)
    << 32 | (BLOCK_E - 1 - e), so one max-reduction gives the largest value and, among exact ties, the lowest
    id e; entries not `valid` get (int32 min) << 32, the floor below every valid key."""
    bits = choice.to(tl.int32, bitcast=True)
    ordered = tl.where(valid, tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF), -2147483648)  # int32 order == float order
    return (ordered.to(tl.int64) << 32) | tl.where(valid, BLOCK_E - 1 - e, 0).to(tl.int64)


@triton.jit
def _router_topk_rows(
    logit_ptr,
    bias_ptr,
    wout_ptr,
    idout_ptr,
    valid_ptr,
    r0,
    T,
    E,
    scale,
    TOPK: tl.constexpr,
    NORM: tl.constexpr,
    SUB: tl.constexpr,
    BLOCK_E: tl.constexpr,
    HAS_VALID: tl.constexpr,
):
    """sigmoid + bias + top-k + normalisation of logits rows [r0, r0 + SUB) (rows >= T not stored; the logits
    buffer has them; with HAS_VALID, rows whose valid_ptr entry is 0 store ids -1 and weights 0). Loads with .cg:
    the logits were written by other programs (see _router_fused_kernel)."""
    rt = r0 + tl.arange(0, SUB)
    e = tl.arange(0, BLOCK_E)
    em = e[None, :] < E
    lrow = logit_ptr + rt[:, None].to(tl.int64) * E
    zz = tl.load(lrow + e[None, :], mask=em, other=0.0, cache_modifier=".cg")  # [SUB, BLOCK_E]
    sc = 1.0 / (1.0 + tl.exp(-zz))
    choice = sc + tl.load(bias_ptr + e, mask=e < E, other=0.0)[None, :]
    key = _topk_key(choice, em, e[None, :], BLOCK_E)  # [SUB, BLOCK_E]
    floor_key = tl.full((SUB, BLOCK_E), -2147483648, tl.int64) << 32  # below every valid key
    kk = tl.arange(0, TOPK)
    ids = tl.zeros((SUB, TOPK), dtype=tl.int32)
    for j in tl.static_range(TOPK):
        m = tl.max(key, axis=1)  # [SUB]
        low = (m - ((m >> 32) << 32)).to(tl.int32)  # the inverted expert id
        ids = tl.where(kk[None, :] == j, BLOCK_E - 1 - low[:, None], ids)
        key = tl.where(key == m[:, None], floor_key, key)
    zk = tl.load(lrow + ids, cache_modifier=".cg")  # [SUB, TOPK] logits of the picks
    ws = 1.0 / (1.0 + tl.exp(-zk))
    if NORM:
        ws = ws / tl.sum(ws, axis=1)[:, None]
    om = rt[:, None] < T
    optr = rt[:, None].to(tl.int64) * TOPK + kk[None, :]
    ws = ws * scale
    ids = ids.to(tl.int64)
    if HAS_VALID:  # padded rows: no expert
        ok = tl.load(valid_ptr + rt, mask=rt < T, other=0)[:, None] != 0
        ws = tl.where(ok, ws, 0.0)
        ids = tl.where(ok, ids, -1)
    tl.store(wout_ptr + optr, ws, mask=om)
    tl.store(idout_ptr + optr, ids, mask=om)


@triton.jit
def _router_logits_kernel(
    x_ptr,
    x_s0,
    w_ptr,
    w_s0,
    out_ptr,
    T,
    E,
    D,
    K_SPLIT,
    BT: tl.constexpr,
    BE: tl.constexpr,
    BK: tl.constexpr,
    F32_DOT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_and_release(PDL)
    pe = tl.program_id(0)
    pk = tl.program_id(1)
    pt = tl.program_id(2)
    rt = pt * BT + tl.arange(0, BT)
    re = pe * BE + tl.arange(0, BE)
    acc = tl.zeros((BT, BE), dtype=tl.float32)
    k0 = pk * K_SPLIT
    for kk in range(0, K_SPLIT, BK):
        rk = k0 + kk + tl.arange(0, BK)
        km = (rk < D) & (rk < k0 + K_SPLIT)
        a = tl.load(
            x_ptr + rt[:, None].to(tl.int64) * x_s0 + rk[None, :], mask=(rt[:, None] < T) & km[None, :], other=0.0
        )
        b = tl.load(
            w_ptr + re[None, :].to(tl.int64) * w_s0 + rk[:, None], mask=(re[None, :] < E) & km[:, None], other=0.0
        )
        if F32_DOT:  # the CPU interpreter's bf16 dot is wrong; exact products in fp32 instead
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    # split-K partial sums go to their own slice [pk] (summed in a fixed order by the top-k kernel): the logits
    # do not depend on the order the splits finish in, so routing is run-to-run deterministic
    base = out_ptr + pk.to(tl.int64) * T * E
    tl.store(base + rt[:, None].to(tl.int64) * E + re[None, :], acc, mask=(rt[:, None] < T) & (re[None, :] < E))


@triton.jit
def _router_topk_kernel(
    logit_ptr,
    bias_ptr,
    w_out,
    id_out,
    valid_ptr,
    T,
    E,
    N_SPLIT,
    scale,
    K: tl.constexpr,
    NORM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    HAS_VALID: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    wait_and_release(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    em = e < E
    z = tl.zeros((BLOCK_E,), dtype=tl.float32)
    for sp in range(N_SPLIT):  # the split-K partials of _router_logits_kernel, in split order
        z += tl.load(logit_ptr + (sp * T + t) * E + e, mask=em, other=0.0)
    sc = 1.0 / (1.0 + tl.exp(-z))
    choice = sc + tl.load(bias_ptr + e, mask=em, other=0.0)
    key = _topk_key(choice, em, e, BLOCK_E)  # one max per pick (see _topk_key)
    floor_key = tl.full((BLOCK_E,), -2147483648, tl.int64) << 32  # below every valid key
    kk = tl.arange(0, K)
    ids = tl.zeros((K,), dtype=tl.int32)
    for j in tl.static_range(K):
        m = tl.max(key, axis=0)
        ids = tl.where(kk == j, BLOCK_E - 1 - (m & 0xFFFFFFFF).to(tl.int32), ids)
        key = tl.where(key == m, floor_key, key)
    ws = tl.sum(tl.where(e[None, :] == ids[:, None], sc[None, :], 0.0), axis=1)  # [K] scores of the picks
    if NORM:
        ws = ws / tl.sum(ws, axis=0)
    ws = ws * scale
    ids = ids.to(tl.int64)
    if HAS_VALID:  # a padded row: no expert
        ok = tl.load(valid_ptr + t) != 0
        ws = tl.where(ok, ws, 0.0)
        ids = tl.where(ok, ids, -1)
    tl.store(w_out + t * K + kk, ws)
    tl.store(id_out + t * K + kk, ids)


_RT_BT, _RT_BE, _RT_BK = 16, 32, 128
_RT_SUB = 8  # rows per top-k step of the fused kernel ([8, 512] int64 keys: 64 registers a thread at 4 warps)
# The two-kernel path's logits from ROUTER_GEMM_MIN_T rows on (CUDA) by one cuBLAS GEMM (torch.mm, out_dtype
# float32: bf16 products accumulated and stored in fp32, the Triton logits kernel's math) instead of the Triton kernel
# (0: never). Logits + top-k on an H200 (snapshot h200/fused_router_gemm): 11.3 / 11.9 / 15.7 / 21.5 / 32.3 us against
# 16.5 / 24.3 / 40.4 / 50.6 / 59.3 at 128 / 256 / 512 / 1024 / 2048 rows, within 5% at 64; below 128 rows (decode
# batches) the split-K kernel as measured in the decode step.
ROUTER_GEMM_MIN_T = 128


def _router_split(D: int, split_elems: int = 512, bk: int = _RT_BK) -> tuple[int, int]:
    """(n_split, k_split): K split in pieces of about split_elems, a multiple of bk, at most 16 pieces (512 for
    Kimi's D=7168: 14 splits)."""
    n_split = max(1, min(triton.cdiv(D, split_elems), 16))
    k_split = triton.cdiv(triton.cdiv(D, n_split), bk) * bk
    return triton.cdiv(D, k_split), k_split


def _router_topk_two_kernel(
    x, gate_weight, bias, top_k, scale, norm_topk_prob, w, ids, row_valid=None, launch=None, gemm=None
):
    """The two-kernel path (large T): split-K partials [n_split, T, E] fp32 (from ROUTER_GEMM_MIN_T rows on, on CUDA:
    the logits [T, E] of one cuBLAS GEMM), then one top-k program per row. launch: {name: config} as LAUNCH (default
    LAUNCH); gemm: True / False forces the GEMM or the Triton logits (on CUDA), None picks by T."""
    T, D = x.shape
    E = gate_weight.shape[0]
    launch = launch or LAUNCH
    lp = launch["router_logits"]
    if launch["router_logits_large"]["m_min"] <= T:
        lp = launch["router_logits_large"]
    if gemm is None:
        gemm = 0 < ROUTER_GEMM_MIN_T <= T
    if gemm and x.is_cuda and not INTERPRET:
        n_split = 1
        logits = torch.mm(x, gate_weight.t(), out_dtype=torch.float32)  # [T, E] fp32: one "split"
    else:
        n_split, k_split = _router_split(D, lp["split_elems"], lp["bk"])
        logits = torch.empty((n_split, T, E), dtype=torch.float32, device=x.device)  # split-K partials
        _router_logits_kernel[(triton.cdiv(E, lp["be"]), n_split, triton.cdiv(T, lp["bt"]))](
            x,
            x.stride(0),
            gate_weight,
            gate_weight.stride(0),
            logits,
            T,
            E,
            D,
            k_split,
            BT=lp["bt"],
            BE=lp["be"],
            BK=lp["bk"],
            F32_DOT=INTERPRET,
            num_warps=lp["warps"],
            **launch_kwargs(x.device),
        )
    _router_topk_kernel[(T,)](
        logits,
        bias,
        w,
        ids,
        ids if row_valid is None else row_valid,
        T,
        E,
        n_split,
        float(scale),
        K=top_k,
        NORM=bool(norm_topk_prob),
        BLOCK_E=triton.next_power_of_2(E),
        HAS_VALID=row_valid is not None,
        num_warps=launch["router_topk"]["warps"],
        **launch_kwargs(x.device),
    )
    return w, ids


def _router_topk_fused(x, gate_weight, bias, top_k, scale, norm_topk_prob, w, ids, cnt, row_valid=None):
    """The one-kernel path (_router_fused_kernel); cnt: a zeroed int32 counter region."""
    T, D = x.shape
    E = gate_weight.shape[0]
    n_split, k_split = _router_split(D)
    n_e, n_t = triton.cdiv(E, _RT_BE), triton.cdiv(T, _RT_BT)
    part = torch.empty((n_t * n_e * n_split * _RT_BT * _RT_BE,), dtype=torch.float32, device=x.device)
    logits = torch.empty((n_t * _RT_BT, E), dtype=torch.float32, device=x.device)
    _router_fused_kernel[(n_e, n_split, n_t)](
        x,
        x.stride(0),
        gate_weight,
        gate_weight.stride(0),
        bias,
        part,
        logits,
        cnt,
        w,
        ids,
        ids if row_valid is None else row_valid,
        T,
        E,
        D,
        k_split,
        float(scale),
        TOPK=top_k,
        NORM=bool(norm_topk_prob),
        BT=_RT_BT,
        BE=_RT_BE,
        BK=_RT_BK,
        SUB=_RT_SUB,
        BLOCK_E=triton.next_power_of_2(E),
        F32_DOT=INTERPRET,
        HAS_VALID=row_valid is not None,
        num_warps=4,
    )
    return w, ids


def router_topk(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    scale: float,
    norm_topk_prob: bool = True,
    row_valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """kimi.model.moe.select_experts on the GPU: x [T, D], gate_weight [E, D] (model dtype), bias [E] f32 ->
    (topk_weights [T, k] f32, topk_ids [T, k] int64), ids in descending order of s + bias.

    row_valid: None, or [T] int32 / int64 on x's device, read by the kernel (so a CUDA graph replays it with the values
    of each replay): rows where it is 0 get ids -1 and weights 0, i.e. no expert (every experts backend and the combine
    skip ids outside their local range; DeepEP's dispatch skips -1). The decode graphs mark their padding rows so
    (kimi/worker/cuda_graph.py).

    top_k must be a power of two (8 for Kimi) and <= E; x and gate_weight need unit last-dim stride
    (AssertionError otherwise). One kernel for T <= ROUTER_FUSED_MAX_T, two above. The one-kernel path needs the
    counter buffer, allocated by the first call outside CUDA-graph capture; a first call under capture takes the
    two-kernel path (with a warning). Deterministic run to run on either path (no float atomics); ids equal the
    reference's except where two scores are within fp32 summation-order noise of each other.
    """
    return _router_topk(x, gate_weight, bias, top_k, scale, norm_topk_prob, None, row_valid)


def _router_topk(
    x, gate_weight, bias, top_k, scale, norm_topk_prob, fused: bool | None, row_valid=None, launch=None, gemm=None
):
    """router_topk with the path forced (fused True / False; None: by T), the two-kernel path's launch ({name:
    config} as LAUNCH; default LAUNCH) and its logits (gemm, as _router_topk_two_kernel's). For tests and the tools."""
    T, _D = x.shape
    E = gate_weight.shape[0]
    assert x.stride(1) == 1 and gate_weight.stride(1) == 1 and top_k & (top_k - 1) == 0 and top_k <= E
    if row_valid is not None and (
        row_valid.shape != (T,) or row_valid.device != x.device or row_valid.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError(
            f"router_topk: row_valid must be [T] = [{T}] int32 / int64 on {x.device}, got "
            f"{tuple(row_valid.shape)} {row_valid.dtype} on {row_valid.device}"
        )
    w = torch.empty((T, top_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((T, top_k), dtype=torch.int64, device=x.device)
    if T == 0:
        return w, ids
    if x.dtype != gate_weight.dtype:
        x = x.to(gate_weight.dtype)
    bias = bias.float()
    n_t, n_e = triton.cdiv(T, _RT_BT), triton.cdiv(E, _RT_BE)
    use_fused = (T <= ROUTER_FUSED_MAX_T) if fused is None else fused
    if use_fused and n_t * (n_e + 1) <= _COUNTER_REGION:
        cnt = _counter_region(x.device)
        if cnt is not None:
            return _router_topk_fused(x, gate_weight, bias, top_k, scale, norm_topk_prob, w, ids, cnt, row_valid)
        if not _warned_capture[0]:
            _warned_capture[0] = True
            warnings.warn(
                "router_topk: first call is under CUDA-graph capture; using the two-kernel path "
                "(call once eagerly before capturing)",
                stacklevel=2,
            )
    return _router_topk_two_kernel(x, gate_weight, bias, top_k, scale, norm_topk_prob, w, ids, row_valid, launch, gemm)


def router_topk_ref(x, gate_weight, bias, top_k, scale, norm_topk_prob=True):
    from kimi.model.moe import select_experts

    return select_experts(x, gate_weight, bias, top_k, scale, norm_topk_prob)


# ---- MoE align -------------------------------------------------------------------------------------------


@triton.jit
def _align_block_experts(pad_end, E, bm, max_blocks, bexp_ptr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr):
    """block_expert[b] = the expert whose padded range holds row b * bm (pad_end [BLOCK_E] int32, 0 past E;
    blocks past the last expert's range get E - 1: num_padded bounds what the GEMMs read)."""
    eo = tl.arange(0, BLOCK_E)
    for b0 in range(0, max_blocks, BLOCK_B):
        bo = b0 + tl.arange(0, BLOCK_B)
        bstart = bo * bm
        ge = (pad_end[None, :] <= bstart[:, None]) & (eo[None, :] < E)
        be = tl.minimum(tl.sum(ge.to(tl.int32), axis=1), E - 1)
        tl.store(bexp_ptr + bo, be, mask=bo < max_blocks)


@triton.jit
def _align_header(
    ids_ptr,
    P,
    E,
    offset,
    bm,
    max_blocks,
    sorted_ptr,
    bexp_ptr,
    npad_ptr,
    cap,
    BLOCK_P: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    """Histogram of local experts, padded offsets, num_padded, block experts, sentinel fill of sorted_ids[:cap].
    Returns pad_start [BLOCK_E] int32 (0 past E)."""
    eo = tl.arange(0, BLOCK_E)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for p0 in range(0, P, BLOCK_P):
        po = p0 + tl.arange(0, BLOCK_P)
        pm = po < P
        loc = tl.load(ids_ptr + po, mask=pm, other=-1).to(tl.int32) - offset
        key = tl.where(pm & (loc >= 0) & (loc < E), loc, E)
        counts += tl.histogram(key, BLOCK_E)
    counts = tl.where(eo < E, counts, 0)
    padded = (counts + bm - 1) // bm * bm
    pad_end = tl.cumsum(padded, axis=0)
    pad_start = pad_end - padded
    total = tl.sum(padded, axis=0)
    tl.store(npad_ptr, total)
    _align_block_experts(pad_end, E, bm, max_blocks, bexp_ptr, BLOCK_E, BLOCK_B)
    for c0 in range(0, cap, BLOCK_F):
        co = c0 + tl.arange(0, BLOCK_F)
        tl.store(sorted_ptr + co, tl.zeros((BLOCK_F,), dtype=tl.int32) + P, mask=co < cap)
    return pad_start


# The align kernels' sizes (pairs, blocks, capacity) change with every step and their divisibility by 16 follows no
# simple rule of the token count, so none is specialized on: one compiled kernel serves every step (the warm-up covers
# them all; kimi.worker.warmup).
@triton.jit(do_not_specialize=["P", "max_blocks", "cap"])
def _align_count_kernel(
    ids_ptr,
    P,
    E,
    offset,
    bm,
    max_blocks,
    sorted_ptr,
    cursor_ptr,
    bexp_ptr,
    npad_ptr,
    cap,
    BLOCK_P: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_B: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_and_release(PDL)
    # one program: histogram of local experts, padded offsets, cursors, block experts, sentinel fill
    pad_start = _align_header(
        ids_ptr, P, E, offset, bm, max_blocks, sorted_ptr, bexp_ptr, npad_ptr, cap, BLOCK_P, BLOCK_E, BLOCK_B, BLOCK_P
    )
    eo = tl.arange(0, BLOCK_E)
    tl.store(cursor_ptr + eo, pad_start, mask=eo < E)


@triton.jit(do_not_specialize=["P", "cap"])
def _align_scatter_kernel(
    ids_ptr, P, E, offset, sorted_ptr, cursor_ptr, cap, BLOCK: tl.constexpr, PDL: tl.constexpr = False
):
    wait_and_release(PDL)
    po = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    pm = po < P
    loc = tl.load(ids_ptr + po, mask=pm, other=-1).to(tl.int32) - offset
    ok = pm & (loc >= 0) & (loc < E)
    dest = tl.atomic_add(cursor_ptr + tl.where(ok, loc, 0), tl.where(ok, 1, 0), mask=ok)
    tl.store(sorted_ptr + dest, po.to(tl.int32), mask=ok & (dest < cap))


@triton.jit(do_not_specialize=["P", "max_blocks", "cap"])
def _align_one_kernel(
    ids_ptr,
    P,
    E,
    offset,
    bm,
    max_blocks,
    sorted_ptr,
    bexp_ptr,
    npad_ptr,
    cap,
    BLOCK_C: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    """One program: _align_header, then the pairs in chunks of BLOCK_C: one-hot [BLOCK_C, BLOCK_E] of each
    pair's local expert, inclusive cumsum down the chunk = rank of the pair among its expert's pairs in the chunk
    (+1); slot = pad_start[e] + pairs of e in earlier chunks + rank. Pairs keep ascending id order within an
    expert (what moe_align's stable sort gives). No atomics."""
    base = _align_header(
        ids_ptr, P, E, offset, bm, max_blocks, sorted_ptr, bexp_ptr, npad_ptr, cap, BLOCK_C, BLOCK_E, BLOCK_B, BLOCK_F
    )
    tl.debug_barrier()  # the sentinel fill is done (by all threads) before any pair's slot is written
    eo = tl.arange(0, BLOCK_E)
    for p0 in range(0, P, BLOCK_C):
        po = p0 + tl.arange(0, BLOCK_C)
        pm = po < P
        loc = tl.load(ids_ptr + po, mask=pm, other=-1).to(tl.int32) - offset
        ok = pm & (loc >= 0) & (loc < E)
        key = tl.where(ok, loc, E)  # column E (< BLOCK_E) collects the non-local pairs, never used
        oh = (key[:, None] == eo[None, :]).to(tl.int32)  # [BLOCK_C, BLOCK_E]
        rank = tl.cumsum(oh, axis=0)
        dest = tl.sum(oh * (rank - 1 + base[None, :]), axis=1)  # [BLOCK_C]
        tl.store(sorted_ptr + dest, po.to(tl.int32), mask=ok & (dest < cap))
        base += tl.sum(oh, axis=0)


@triton.jit(do_not_specialize=["P", "cap", "fill_per"])
def _align_grid_count_kernel(
    ids_ptr,
    P,
    E,
    offset,
    sorted_ptr,
    part_ptr,
    cap,
    fill_per,
    BLOCK: tl.constexpr,
    BLOCK_E: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Grid path, 1 of 3, program g: the histogram of pairs [g * BLOCK, (g + 1) * BLOCK) over the local experts ->
    part[g, :] (column E: non-local pairs), and the sentinel P into sorted_ids[g * fill_per, (g + 1) * fill_per)."""
    wait_and_release(PDL)
    g = tl.program_id(0)
    eo = tl.arange(0, BLOCK_E)
    po = g * BLOCK + tl.arange(0, BLOCK)
    pm = po < P
    loc = tl.load(ids_ptr + po, mask=pm, other=-1).to(tl.int32) - offset
    key = tl.where(pm & (loc >= 0) & (loc < E), loc, E)
    tl.store(part_ptr + g * BLOCK_E + eo, tl.histogram(key, BLOCK_E))
    for c0 in range(0, fill_per, BLOCK):
        co = c0 + tl.arange(0, BLOCK)
        tl.store(
            sorted_ptr + g * fill_per + co,
            tl.zeros((BLOCK,), dtype=tl.int32) + P,
            mask=(co < fill_per) & (g * fill_per + co < cap),
        )


@triton.jit(do_not_specialize=["G", "max_blocks"])
def _align_grid_offsets_kernel(
    part_ptr,
    G,
    E,
    bm,
    max_blocks,
    bexp_ptr,
    npad_ptr,
    BLOCK_G: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_B: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Grid path, 2 of 3, one program: totals over the G partial histograms, padded offsets, num_padded, block
    experts; then part[g, e] <- padded start of expert e + its pairs in programs < g (each program's first slot
    per expert)."""
    wait_and_release(PDL)
    eo = tl.arange(0, BLOCK_E)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for g0 in range(0, G, BLOCK_G):
        go = g0 + tl.arange(0, BLOCK_G)
        c = tl.load(part_ptr + go[:, None] * BLOCK_E + eo[None, :], mask=(go < G)[:, None], other=0)
        counts += tl.sum(c, axis=0)
    counts = tl.where(eo < E, counts, 0)
    padded = (counts + bm - 1) // bm * bm
    pad_end = tl.cumsum(padded, axis=0)
    tl.store(npad_ptr, tl.sum(padded, axis=0))
    _align_block_experts(pad_end, E, bm, max_blocks, bexp_ptr, BLOCK_E, BLOCK_B)
    run = pad_end - padded
    for g0 in range(0, G, BLOCK_G):
        go = g0 + tl.arange(0, BLOCK_G)
        msk = (go < G)[:, None]
        ptrs = part_ptr + go[:, None] * BLOCK_E + eo[None, :]
        c = tl.load(ptrs, mask=msk, other=0)
        tl.store(ptrs, tl.cumsum(c, axis=0) - c + run[None, :], mask=msk)
        run += tl.sum(c, axis=0)


@triton.jit(do_not_specialize=["P", "cap"])
def _align_grid_place_kernel(
    ids_ptr,
    P,
    E,
    offset,
    sorted_ptr,
    part_ptr,
    cap,
    BLOCK: tl.constexpr,
    BLOCK_E: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Grid path, 3 of 3, program g: each local pair of its slice to part[g, e] + its rank among the slice's pairs
    of e (one-hot cumsum): ascending pair order within an expert, as moe_align's stable sort. No atomics."""
    wait_and_release(PDL)
    g = tl.program_id(0)
    eo = tl.arange(0, BLOCK_E)
    base = tl.load(part_ptr + g * BLOCK_E + eo)
    po = g * BLOCK + tl.arange(0, BLOCK)
    pm = po < P
    loc = tl.load(ids_ptr + po, mask=pm, other=-1).to(tl.int32) - offset
    ok = pm & (loc >= 0) & (loc < E)
    oh = (tl.where(ok, loc, E)[:, None] == eo[None, :]).to(tl.int32)  # [BLOCK, BLOCK_E]
    dest = tl.sum(oh * (tl.cumsum(oh, axis=0) - 1 + base[None, :]), axis=1)
    tl.store(sorted_ptr + dest, po.to(tl.int32), mask=ok & (dest < cap))


def _align_sizes(topk_ids: torch.Tensor, num_local_experts: int, block_m: int, max_pairs: int | None = None):
    T, k = topk_ids.shape
    P = T * k
    L = P if max_pairs is None else max(0, min(P, max_pairs))  # local pairs at most
    max_blocks = (L + block_m - 1) // block_m + min(num_local_experts, L)
    return P, max_blocks, max_blocks * block_m


def moe_align_fused(
    topk_ids: torch.Tensor, num_local_experts: int, expert_offset: int, block_m: int, max_pairs: int | None = None
):
    """kimi.kernels.triton.moe_w4a16.moe_align on the GPU: same outputs and contract.

    topk_ids [T, k] integer global expert ids (contiguous or reshapeable to [T*k]); experts
    [expert_offset, expert_offset + E) are local. Returns (sorted_ids [max_blocks * block_m] int32 with sentinel
    T*k in pads, block_expert [max_blocks] int32, num_padded [1] int32, max_blocks). For T*k <=
    ALIGN_ONE_PROGRAM_MAX_P one program (pairs in moe_align's order: identical outputs, deterministic); from
    ALIGN_GRID_MIN_P on the grid path (three kernels, identical outputs too); between, two kernels (pairs within an
    expert in arbitrary order, possibly in another of its blocks).

    max_pairs: an upper bound on the local pairs that the caller knows (e.g. DeepEP's low-latency layout: T*k
    rows, of which at most the step's tokens x top-k hold a local expert); it sizes max_blocks and sorted_ids
    from min(T*k, max_pairs) instead of T*k, so the GEMM grids behind the align stay small. Slots past the
    buffers are never written, but a wrong bound loses the pairs past it.
    """
    return _moe_align(topk_ids, num_local_experts, expert_offset, block_m, None, max_pairs=max_pairs)


def _moe_align(
    topk_ids,
    num_local_experts,
    expert_offset,
    block_m,
    one_program: bool | None,
    grid: bool | None = None,
    max_pairs: int | None = None,
    grid_min_p: int | None = None,
    launch: dict[str, dict[str, Any]] | None = None,
):
    """moe_align_fused with the path forced (grid True: the grid path; else one_program True / False; None for both:
    by T*k, the grid path from grid_min_p pairs on, default ALIGN_GRID_MIN_P) and the two-kernel path's launch
    ({name: config} as LAUNCH; default LAUNCH). Tests and the tools."""
    P, max_blocks, cap = _align_sizes(topk_ids, num_local_experts, block_m, max_pairs)
    E = num_local_experts
    dev = topk_ids.device
    ids = topk_ids.reshape(-1)
    sorted_ids = torch.empty((cap,), dtype=torch.int32, device=dev)
    block_expert = torch.empty((max_blocks,), dtype=torch.int32, device=dev)
    num_padded = torch.empty((1,), dtype=torch.int32, device=dev)
    BLOCK_E = triton.next_power_of_2(E + 1)
    BLOCK_B = max(16, min(128, 8192 // BLOCK_E))
    if grid or (grid is None and one_program is None and (ALIGN_GRID_MIN_P if grid_min_p is None else grid_min_p) <= P):
        BLOCK = ALIGN_GRID_BLOCK
        G = max(1, triton.cdiv(P, BLOCK))
        part = torch.empty((G, BLOCK_E), dtype=torch.int32, device=dev)  # partial histograms, then bases
        fill_per = triton.cdiv(cap, G)
        kw = launch_kwargs(dev)
        _align_grid_count_kernel[(G,)](
            ids, P, E, expert_offset, sorted_ids, part, cap, fill_per, BLOCK=BLOCK, BLOCK_E=BLOCK_E, num_warps=4, **kw
        )
        _align_grid_offsets_kernel[(1,)](
            part,
            G,
            E,
            block_m,
            max_blocks,
            block_expert,
            num_padded,
            BLOCK_G=64,
            BLOCK_E=BLOCK_E,
            BLOCK_B=BLOCK_B,
            num_warps=8,
            **kw,
        )
        _align_grid_place_kernel[(G,)](
            ids, P, E, expert_offset, sorted_ids, part, cap, BLOCK=BLOCK, BLOCK_E=BLOCK_E, num_warps=4, **kw
        )
        return sorted_ids, block_expert, num_padded, max_blocks
    if (P <= ALIGN_ONE_PROGRAM_MAX_P) if one_program is None else one_program:
        BLOCK_C = max(16, min(triton.next_power_of_2(max(P, 1)), 8192 // BLOCK_E, 256))  # [C, BLOCK_E] int32
        _align_one_kernel[(1,)](
            ids,
            P,
            E,
            expert_offset,
            block_m,
            max_blocks,
            sorted_ids,
            block_expert,
            num_padded,
            cap,
            BLOCK_C=BLOCK_C,
            BLOCK_E=BLOCK_E,
            BLOCK_B=BLOCK_B,
            BLOCK_F=1024,
            num_warps=8,
        )
        return sorted_ids, block_expert, num_padded, max_blocks
    cursor = torch.empty((E,), dtype=torch.int32, device=dev)
    _align_count_kernel[(1,)](
        ids,
        P,
        E,
        expert_offset,
        block_m,
        max_blocks,
        sorted_ids,
        cursor,
        block_expert,
        num_padded,
        cap,
        BLOCK_P=1024,
        BLOCK_E=BLOCK_E,
        BLOCK_B=BLOCK_B,
        num_warps=(launch or LAUNCH)["align_count"]["warps"],
        **launch_kwargs(dev),
    )
    if P:
        sc = (launch or LAUNCH)["align_scatter"]
        _align_scatter_kernel[(triton.cdiv(P, sc["block"]),)](
            ids,
            P,
            E,
            expert_offset,
            sorted_ids,
            cursor,
            cap,
            BLOCK=sc["block"],
            num_warps=sc["warps"],
            **launch_kwargs(dev),
        )
    return sorted_ids, block_expert, num_padded, max_blocks
