"""Fused Triton kernels for the GPU decode path (kimi/worker/gpu_model.py), each with its plain-PyTorch reference.

The CPU model keeps the references (kimi/ops/norm.py, rope.py, moe.py); the GPU model calls the fused ops.

- `rms_norm` / `add_rms_norm`: RMSNorm in fp32 over the last dim, optionally after a residual add of one or two
  deltas (`h_new = h + d1 (+ d2)`; returns (h_new, rmsnorm(h_new))). Strided rows allowed (row stride only).
- `silu_mul`: `silu(y[:, :I]) * y[:, I:]` for y [M, 2I] (the merged gate/up GEMM output).
- `mla_rope_kv_write`: one kernel per step and layer for the MLA latent path: rmsnorm(kv_a[:, :L]) and
  rope(kv_a[:, L:]) written into the paged cache at slot_mapping, plus rope of q_pe into a contiguous [T, H, R].
- `router_topk`: noaux_tc router: sigmoid(x @ gate^T) (bf16 inputs, fp32 accumulation: bf16 products are exact in
  fp32, so this equals the fp32 reference up to summation order), top-k of `s + bias`, weights = s normalised
  and scaled. Two kernels (split-K logits with fp32 atomics into a zeroed buffer; per-row top-k).
- `moe_align_fused`: kimi.ops.moe_int4_triton.moe_align's outputs from two kernels (histogram + padded offsets +
  block experts in one program; atomic slot claims for the pairs). Pairs within one expert are in arbitrary
  order (each GEMM row is independent of the others; the combine reads pairs by id).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

__all__ = [
    "rms_norm", "add_rms_norm", "silu_mul", "mla_rope_kv_write", "router_topk", "moe_align_fused",
    "add_rms_norm_ref", "silu_mul_ref", "mla_rope_kv_write_ref", "router_topk_ref",
]


# ---- RMSNorm (+ residual add) ----------------------------------------------------------------------------


@triton.jit
def _rmsnorm_kernel(x_ptr, x_stride, d1_ptr, d1_stride, d2_ptr, d2_stride, w_ptr, h_ptr, h_stride, y_ptr, y_stride,
                    D, eps, HAS_D1: tl.constexpr, HAS_D2: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < D
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
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * y_stride + offs, (w * (x * r)).to(y_ptr.dtype.element_ty), mask=m)


def _nw(block: int) -> int:
    return 8 if block >= 4096 else (4 if block >= 1024 else 2)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, D] (last dim contiguous, any row stride) -> rmsnorm [T, D] in x.dtype (fp32 math)."""
    T, D = x.shape
    assert x.stride(1) == 1
    y = torch.empty((T, D), dtype=x.dtype, device=x.device) if out is None else out
    if T == 0:
        return y
    B = triton.next_power_of_2(D)
    _rmsnorm_kernel[(T,)](x, x.stride(0), x, 0, x, 0, weight, y, 0, y, y.stride(0), D, eps,
                          HAS_D1=False, HAS_D2=False, BLOCK=B, num_warps=_nw(B))
    return y


def add_rms_norm(h: torch.Tensor, d1: torch.Tensor, d2: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """(h + d1 (+ d2), rmsnorm(that)): h, d1, d2 [T, D]; returns (h_new [T, D] h.dtype, y [T, D] h.dtype)."""
    T, D = h.shape
    h_new = torch.empty((T, D), dtype=h.dtype, device=h.device)
    y = torch.empty((T, D), dtype=h.dtype, device=h.device)
    if T == 0:
        return h_new, y
    B = triton.next_power_of_2(D)
    d2_ = d1 if d2 is None else d2
    _rmsnorm_kernel[(T,)](h, h.stride(0), d1, d1.stride(0), d2_, d2_.stride(0), weight, h_new, h_new.stride(0),
                          y, y.stride(0), D, eps, HAS_D1=True, HAS_D2=d2 is not None, BLOCK=B, num_warps=_nw(B))
    return h_new, y


def add_rms_norm_ref(h, d1, d2, weight, eps):
    """Reference: `h + (d1 + d2)` in the model dtype (as the model's residual adds), then kimi.ops.norm.rms_norm."""
    from kimi.ops.norm import rms_norm as ref

    d = d1 if d2 is None else d1 + d2
    h_new = h + d
    return h_new, ref(h_new, weight, eps)


# ---- SiLU * up -------------------------------------------------------------------------------------------


@triton.jit
def _silu_mul_kernel(y_ptr, y_stride, o_ptr, o_stride, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < I
    g = tl.load(y_ptr + row * y_stride + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(y_ptr + row * y_stride + I + offs, mask=m, other=0.0).to(tl.float32)
    s = g / (1.0 + tl.exp(-g))
    tl.store(o_ptr + row * o_stride + offs, (s.to(o_ptr.dtype.element_ty).to(tl.float32) * u).to(o_ptr.dtype.element_ty),
             mask=m)


def silu_mul(y: torch.Tensor, inter: int | None = None) -> torch.Tensor:
    """y [M, 2I] -> silu(y[:, :I]) * y[:, I:] [M, I] (y.dtype; silu rounded to y.dtype first, as torch does)."""
    M, two_i = y.shape
    inter = two_i // 2 if inter is None else inter
    assert y.stride(1) == 1
    o = torch.empty((M, inter), dtype=y.dtype, device=y.device)
    if M == 0:
        return o
    BLOCK = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(M, triton.cdiv(inter, BLOCK))](y, y.stride(0), o, o.stride(0), inter, BLOCK=BLOCK, num_warps=4)
    return o


def silu_mul_ref(y: torch.Tensor, inter: int | None = None) -> torch.Tensor:
    inter = y.shape[1] // 2 if inter is None else inter
    return F.silu(y[:, :inter]) * y[:, inter:]


# ---- MLA: q_pe rope, kv latent rmsnorm + k_pe rope, paged cache write -------------------------------------


@triton.jit
def _mla_rope_kv_kernel(q_ptr, q_s0, q_s1, kva_ptr, kva_s0, w_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr,
                        cache_ptr, qpe_ptr, H, N, L, eps, R2: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_L: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    i = tl.arange(0, R2)
    c = tl.load(cos_ptr + pos * R2 + i)
    s = tl.load(sin_ptr + pos * R2 + i)
    R = 2 * R2
    row_stride = L + R
    # latent: rmsnorm(kv_a[t, :L]) -> cache[slot, :L]
    lo = tl.arange(0, BLOCK_L)
    lm = lo < L
    x = tl.load(kva_ptr + t * kva_s0 + lo, mask=lm, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / L + eps)
    w = tl.load(w_ptr + lo, mask=lm, other=0.0).to(tl.float32)
    ckv = (w * (x * r)).to(kva_ptr.dtype.element_ty)
    tl.store(cache_ptr + slot * row_stride + lo, ckv.to(cache_ptr.dtype.element_ty), mask=lm)
    # k_pe: rope(kv_a[t, L:]) -> cache[slot, L:]
    k0 = tl.load(kva_ptr + t * kva_s0 + L + 2 * i).to(tl.float32)
    k1 = tl.load(kva_ptr + t * kva_s0 + L + 2 * i + 1).to(tl.float32)
    tl.store(cache_ptr + slot * row_stride + L + 2 * i, (k0 * c - k1 * s).to(kva_ptr.dtype.element_ty).to(cache_ptr.dtype.element_ty))
    tl.store(cache_ptr + slot * row_stride + L + 2 * i + 1, (k1 * c + k0 * s).to(kva_ptr.dtype.element_ty).to(cache_ptr.dtype.element_ty))
    # q_pe: rope(q[t, h, N:]) -> qpe[t, h, :]
    hh = tl.arange(0, BLOCK_H)
    hm = hh < H
    qb = q_ptr + t * q_s0 + hh[:, None] * q_s1 + N + 2 * i[None, :]
    q0 = tl.load(qb, mask=hm[:, None], other=0.0).to(tl.float32)
    q1 = tl.load(qb + 1, mask=hm[:, None], other=0.0).to(tl.float32)
    ob = qpe_ptr + t * H * R + hh[:, None] * R + 2 * i[None, :]
    tl.store(ob, (q0 * c[None, :] - q1 * s[None, :]).to(qpe_ptr.dtype.element_ty), mask=hm[:, None])
    tl.store(ob + 1, (q1 * c[None, :] + q0 * s[None, :]).to(qpe_ptr.dtype.element_ty), mask=hm[:, None])


def mla_rope_kv_write(q: torch.Tensor, kv_a: torch.Tensor, kv_norm_w: torch.Tensor, eps: float,
                      cos_cache: torch.Tensor, sin_cache: torch.Tensor, positions: torch.Tensor,
                      slot_mapping: torch.Tensor, kv_cache: torch.Tensor, nope: int) -> torch.Tensor:
    """q [T, H, N + R] (last dim contiguous), kv_a [T, L + R] (row stride any) -> q_pe roped [T, H, R] contiguous.

    Writes cache.view(-1, L + R)[slot_mapping[t]] = cat(rmsnorm(kv_a[t, :L]), rope(kv_a[t, L:])) for every t.
    cos_cache / sin_cache: [P, R/2] float32 contiguous (RotaryEmbedding's, mscale folded in).
    """
    T, H, NR = q.shape
    R = NR - nope
    L = kv_a.shape[1] - R
    assert q.stride(2) == 1 and kv_a.stride(1) == 1 and kv_cache.is_contiguous() and kv_cache.shape[-1] == L + R
    qpe = torch.empty((T, H, R), dtype=q.dtype, device=q.device)
    if T == 0:
        return qpe
    _mla_rope_kv_kernel[(T,)](q, q.stride(0), q.stride(1), kv_a, kv_a.stride(0), kv_norm_w, cos_cache, sin_cache,
                              positions, slot_mapping, kv_cache, qpe, H, nope, L, eps, R2=R // 2,
                              BLOCK_H=triton.next_power_of_2(H), BLOCK_L=triton.next_power_of_2(L), num_warps=4)
    return qpe


def mla_rope_kv_write_ref(q, kv_a, kv_norm_w, eps, cos_cache, sin_cache, positions, slot_mapping, kv_cache, nope):
    """Reference: the GPUMLAAttention / MLAAttention sequence (rms_norm, apply_rope_interleaved, index_copy_)."""
    from kimi.ops.norm import rms_norm as ref_norm
    from kimi.ops.rope import apply_rope_interleaved

    T, H, NR = q.shape
    R = NR - nope
    L = kv_a.shape[1] - R
    cos, sin = cos_cache[positions], sin_cache[positions]
    ckv = ref_norm(kv_a[:, :L], kv_norm_w, eps)
    k_pe = apply_rope_interleaved(kv_a[:, L:], cos, sin)
    q_pe = apply_rope_interleaved(q[..., nope:], cos, sin)
    kv_cache.view(-1, L + R).index_copy_(0, slot_mapping, torch.cat([ckv, k_pe], -1).to(kv_cache.dtype))
    return q_pe.contiguous()


# ---- router ----------------------------------------------------------------------------------------------


@triton.jit
def _router_logits_kernel(x_ptr, x_s0, w_ptr, w_s0, out_ptr, T, E, D, K_SPLIT,
                          BT: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, F32_DOT: tl.constexpr):
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
        a = tl.load(x_ptr + rt[:, None].to(tl.int64) * x_s0 + rk[None, :], mask=(rt[:, None] < T) & km[None, :], other=0.0)
        b = tl.load(w_ptr + re[None, :].to(tl.int64) * w_s0 + rk[:, None], mask=(re[None, :] < E) & km[:, None], other=0.0)
        if F32_DOT:  # the CPU interpreter's bf16 dot is wrong; exact products in fp32 instead
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    # split-K partial sums go to their own slice [pk] (summed in a fixed order by the top-k kernel): the logits
    # do not depend on the order the splits finish in, so routing is run-to-run deterministic
    base = out_ptr + pk.to(tl.int64) * T * E
    tl.store(base + rt[:, None].to(tl.int64) * E + re[None, :], acc, mask=(rt[:, None] < T) & (re[None, :] < E))


@triton.jit
def _router_topk_kernel(logit_ptr, bias_ptr, w_out, id_out, T, E, N_SPLIT, scale, K: tl.constexpr, NORM: tl.constexpr,
                        BLOCK_E: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    em = e < E
    z = tl.zeros((BLOCK_E,), dtype=tl.float32)
    for sp in range(0, N_SPLIT):  # the split-K partials of _router_logits_kernel, in split order
        z += tl.load(logit_ptr + (sp * T + t) * E + e, mask=em, other=0.0)
    sc = 1.0 / (1.0 + tl.exp(-z))
    choice = tl.where(em, sc + tl.load(bias_ptr + e, mask=em, other=0.0), float("-inf"))
    kk = tl.arange(0, K)
    ws = tl.zeros((K,), dtype=tl.float32)
    ids = tl.zeros((K,), dtype=tl.int64)
    for j in tl.static_range(K):
        m = tl.max(choice, axis=0)
        idx = tl.min(tl.where(choice == m, e, BLOCK_E), axis=0)
        wj = tl.sum(tl.where(e == idx, sc, 0.0), axis=0)
        ws = tl.where(kk == j, wj, ws)
        ids = tl.where(kk == j, idx.to(tl.int64), ids)
        choice = tl.where(e == idx, float("-inf"), choice)
    if NORM:
        ws = ws / tl.sum(ws, axis=0)
    tl.store(w_out + t * K + kk, ws * scale)
    tl.store(id_out + t * K + kk, ids)


def router_topk(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor, top_k: int, scale: float,
                norm_topk_prob: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """kimi.ops.moe.select_experts on the GPU: x [T, D], gate_weight [E, D] (model dtype), bias [E] f32 ->
    (topk_weights [T, k] f32, topk_ids [T, k] int64). top_k must be a power of two (8 for Kimi)."""
    T, D = x.shape
    E = gate_weight.shape[0]
    assert x.stride(1) == 1 and gate_weight.stride(1) == 1 and top_k & (top_k - 1) == 0
    w = torch.empty((T, top_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((T, top_k), dtype=torch.int64, device=x.device)
    if T == 0:
        return w, ids
    BT, BE, BK = 16, 32, 128
    n_split = max(1, min(triton.cdiv(D, 512), 16))
    k_split = triton.cdiv(triton.cdiv(D, n_split), BK) * BK
    n_split = triton.cdiv(D, k_split)
    if x.dtype != gate_weight.dtype:
        x = x.to(gate_weight.dtype)
    logits = torch.empty((n_split, T, E), dtype=torch.float32, device=x.device)  # split-K partials
    _router_logits_kernel[(triton.cdiv(E, BE), n_split, triton.cdiv(T, BT))](
        x, x.stride(0), gate_weight, gate_weight.stride(0), logits, T, E, D, k_split, BT=BT, BE=BE, BK=BK, F32_DOT=_INTERPRET, num_warps=4)
    _router_topk_kernel[(T,)](logits, bias.float(), w, ids, T, E, n_split, float(scale), K=top_k, NORM=bool(norm_topk_prob),
                              BLOCK_E=triton.next_power_of_2(E), num_warps=4)
    return w, ids


def router_topk_ref(x, gate_weight, bias, top_k, scale, norm_topk_prob=True):
    from kimi.ops.moe import select_experts

    return select_experts(x, gate_weight, bias, top_k, scale, norm_topk_prob)


# ---- MoE align -------------------------------------------------------------------------------------------


@triton.jit
def _align_count_kernel(ids_ptr, P, E, offset, bm, max_blocks, sorted_ptr, cursor_ptr, bexp_ptr, npad_ptr, cap,
                        BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr):
    # one program: histogram of local experts, padded offsets, cursors, block experts, sentinel fill
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
    tl.store(cursor_ptr + eo, pad_start, mask=eo < E)
    total = tl.sum(padded, axis=0)
    tl.store(npad_ptr, total)
    for b0 in range(0, max_blocks, BLOCK_B):
        bo = b0 + tl.arange(0, BLOCK_B)
        bstart = bo * bm
        ge = (pad_end[None, :] <= bstart[:, None]) & (eo[None, :] < E)
        be = tl.minimum(tl.sum(ge.to(tl.int32), axis=1), E - 1)
        tl.store(bexp_ptr + bo, be, mask=bo < max_blocks)
    for c0 in range(0, cap, BLOCK_P):
        co = c0 + tl.arange(0, BLOCK_P)
        tl.store(sorted_ptr + co, tl.zeros((BLOCK_P,), dtype=tl.int32) + P, mask=co < cap)


@triton.jit
def _align_scatter_kernel(ids_ptr, P, E, offset, sorted_ptr, cursor_ptr, BLOCK: tl.constexpr):
    po = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    pm = po < P
    loc = tl.load(ids_ptr + po, mask=pm, other=-1).to(tl.int32) - offset
    ok = pm & (loc >= 0) & (loc < E)
    dest = tl.atomic_add(cursor_ptr + tl.where(ok, loc, 0), tl.where(ok, 1, 0), mask=ok)
    tl.store(sorted_ptr + dest, po.to(tl.int32), mask=ok)


def moe_align_fused(topk_ids: torch.Tensor, num_local_experts: int, expert_offset: int, block_m: int):
    """Same outputs and contract as kimi.ops.moe_int4_triton.moe_align (pairs within an expert in any order)."""
    T, k = topk_ids.shape
    P = T * k
    E = num_local_experts
    dev = topk_ids.device
    max_blocks = (P + block_m - 1) // block_m + min(E, P)
    cap = max_blocks * block_m
    ids = topk_ids.reshape(-1)
    sorted_ids = torch.empty((cap,), dtype=torch.int32, device=dev)
    block_expert = torch.empty((max_blocks,), dtype=torch.int32, device=dev)
    num_padded = torch.empty((1,), dtype=torch.int32, device=dev)
    cursor = torch.empty((E,), dtype=torch.int32, device=dev)
    BLOCK_E = triton.next_power_of_2(E + 1)
    BLOCK_B = max(16, min(128, 8192 // BLOCK_E))
    _align_count_kernel[(1,)](ids, P, E, expert_offset, block_m, max_blocks, sorted_ids, cursor, block_expert,
                              num_padded, cap, BLOCK_P=1024, BLOCK_E=BLOCK_E, BLOCK_B=BLOCK_B, num_warps=8)
    if P:
        _align_scatter_kernel[(triton.cdiv(P, 256),)](ids, P, E, expert_offset, sorted_ids, cursor, BLOCK=256,
                                                      num_warps=4)
    return sorted_ids, block_expert, num_padded, max_blocks
