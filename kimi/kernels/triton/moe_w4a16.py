"""Fused W4A16 MoE (routed experts, INT4 pack-quantized weights) in Triton.

`fused_experts_int4` computes the same function as `kimi.model.moe.fused_experts_ref` but reads the
checkpoint's compressed-tensors **pack-quantized** INT4 weights directly (docs/model-format.md, Tensors):

- `w13_packed` int32 [E, 2I, H/8]: rows 0..I-1 are gate_proj, rows I..2I-1 up_proj; element k of row n is the
  nibble in bits [4*(k%8), 4*(k%8)+4) of word k//8, signed value = nibble - 8.
- `w13_scale` bf16 (or f16/f32) [E, 2I, H/32]; W[n, k] = (nibble - 8) * scale[n, k // 32].
- `w2_packed` int32 [E, H, I/8], `w2_scale` [E, H, I/32] likewise (down_proj, [out=H, in=I]).

Algorithm (the usual "moe_align + grouped GEMM" scheme, e.g. vLLM's fused_moe / SGLang; written from the
description, no code copied):

1. Align (plain torch ops on the device, no host sync, so it can be captured in a CUDA graph): the
   T*k (token, slot) pairs whose expert is local ([offset, offset+E)) are sorted by local expert; each
   expert's run is padded to a multiple of BLOCK_M with the sentinel T*k. `block_expert[b]` names the expert
   of each BLOCK_M row block; `num_padded` (a 1-element device tensor) bounds the blocks in use. The grid is
   sized by the static bound cdiv(T*k, BLOCK_M) + min(E, T*k) blocks; blocks past `num_padded` exit at once.
2. gate_up kernel: each program owns BLOCK_M sorted rows of one expert and BLOCK_N columns of the
   intermediate; it gathers the rows of x, unpacks/dequantises the matching gate and up tiles of
   w13 (BLOCK_K inputs at a time) in registers, accumulates both in fp32 with tensor-core dots, and writes
   silu(gate) * up as bf16 into `act[sorted position, :]` (rows contiguous per expert).
3. down kernel: same tiling over `act` and w2, writes the un-weighted per-pair output y[pair, :] (bf16).
4. combine kernel: out[t] = sum_j [local(t, j)] * topk_weights[t, j] * y[t*k + j]  (fp32 sum, bf16 out).
   Routing weights are applied exactly once, here; pairs of non-local experts are never read.

Dequantisation uses the float "magic number" trick: (nibble | 0x4B000000) reinterpreted as fp32 is
2^23 + nibble, so subtracting 2^23 + 8 gives the signed value exactly, without an int->float conversion.

Limits: H % 128 == 0 and I % 64 == 0 for the default tiles (both true for Kimi: H=7168, I=2048); the
kernel checks and raises ValueError otherwise; group size fixed at 32; activations bf16 (or f16);
at most 2^31 elements per tensor. Accumulation is fp32; the intermediate silu(gate)*up is rounded to the
activation dtype (as in bf16 inference engines), so results match the fp32 reference to bf16 accuracy
(relative error ~1e-3 .. 5e-3, tests use 1e-2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kimi.errors import BackendUnavailableError
from kimi.kernels import tuning
from kimi.kernels.triton.common import HAS_TRITON, tl, triton

GROUP_SIZE = 32

__all__ = ["HAS_TRITON", "MoeTileConfig", "default_config", "fused_experts_int4", "moe_align"]


@dataclass(frozen=True)
class MoeTileConfig:
    """Tile sizes of the two grouped GEMMs.

    block_m: rows (token-expert pairs) per program, also the per-expert padding multiple (16 .. 128).
    block_n1 / block_k1: intermediate columns / inputs per step of the gate_up GEMM.
    block_n2 / block_k2: output columns / inputs per step of the down GEMM.
    num_warps / num_stages: Triton launch parameters of both GEMMs.
    swap_ab: compute (W x^T) so the dequantised weight tile is the left (register) MMA operand and the
        few token rows the narrow side (the small-M trick for decode). Correct, but measured no faster
        on H200 with Triton 3.6 (docs/performance.md, Tried and not kept), so off by default.
    """

    block_m: int = 16
    block_n1: int = 64
    block_k1: int = 128
    block_n2: int = 64
    block_k2: int = 128
    num_warps: int = 4
    num_stages: int = 4
    swap_ab: bool = False


def default_config(num_tokens: int, top_k: int, num_experts_total: int) -> MoeTileConfig:
    """Heuristic tiles from the expected rows per expert (T*k / total experts, EP-independent).

    Decode (few rows per expert) is weight-bandwidth-bound: smallest BLOCK_M the tensor cores take (16).
    Prefill: larger BLOCK_M to re-use each dequantised weight tile over more rows. Both picks are the fastest
    of the configs swept on an H200, not a full autotune.
    """
    rows_per_expert = num_tokens * top_k / max(num_experts_total, 1)
    if rows_per_expert <= 16:
        return MoeTileConfig(
            block_m=16, block_n1=64, block_k1=128, block_n2=64, block_k2=128, num_warps=4, num_stages=4
        )
    return MoeTileConfig(block_m=64, block_n1=128, block_k1=128, block_n2=128, block_k2=128, num_warps=8, num_stages=3)


def moe_align(topk_ids: torch.Tensor, num_local_experts: int, expert_offset: int, block_m: int):
    """Sort (token, slot) pairs by local expert, padding each expert's run to a multiple of block_m.

    Args:
        topk_ids: [T, k] integer global expert ids (any device).
        num_local_experts: E, experts [expert_offset, expert_offset + E) are local.
        expert_offset: first local global expert id.
        block_m: padding multiple.

    Returns:
        sorted_ids: [max_blocks * block_m] int32 pair indices t*k + j grouped by expert, sentinel T*k in pads.
        block_expert: [max_blocks] int32 local expert of each row block (clamped to E-1 past the end).
        num_padded: [1] int32 number of valid padded rows (a multiple of block_m).
        max_blocks: the static grid bound cdiv(T*k, block_m) + min(E, T*k).
    Pure torch, no host synchronisation (graph-capturable).
    """
    T, k = topk_ids.shape
    P = T * k
    E = num_local_experts
    dev = topk_ids.device
    max_blocks = (P + block_m - 1) // block_m + min(E, P)
    cap = max_blocks * block_m
    local = topk_ids.reshape(-1).to(torch.int64) - expert_offset  # [P]
    valid = (local >= 0) & (local < E)  # [P]
    key = torch.where(valid, local, torch.full_like(local, E))  # [P] invalid pairs sort last
    order = torch.sort(key, stable=True).indices  # [P] pair ids grouped by expert
    counts = torch.zeros(E + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))  # [E+1]
    cnt = counts[:E]
    padded = (cnt + block_m - 1) // block_m * block_m  # [E]
    pad_end = torch.cumsum(padded, 0)  # [E]
    pad_start = pad_end - padded  # [E]
    cnt_start = torch.cumsum(cnt, 0) - cnt  # [E]
    skey = key[order]  # [P] sorted keys
    is_local = skey < E
    skey_c = skey.clamp(max=E - 1)
    rank = torch.arange(P, device=dev) - cnt_start[skey_c]  # [P] rank within its expert
    dest = torch.where(is_local, pad_start[skey_c] + rank, torch.full_like(rank, cap))  # [P]
    sorted_ids = torch.full((cap + 1,), P, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    sorted_ids = sorted_ids[:cap]
    block_start = torch.arange(max_blocks, device=dev, dtype=torch.int64) * block_m  # [max_blocks]
    block_expert = torch.searchsorted(pad_end, block_start, right=True).clamp_(max=E - 1).to(torch.int32)
    num_padded = pad_end[-1:].to(torch.int32)  # [1]
    return sorted_ids, block_expert, num_padded, max_blocks


if HAS_TRITON:
    from kimi.kernels.triton.pdl import launch_kwargs, wait_and_release

    @triton.jit
    def _load_dequant(
        wbase, sbase, offs_n, stride_wn, stride_sn, k0, BN: tl.constexpr, BK: tl.constexpr, OUT_DTYPE: tl.constexpr
    ):
        """Load and dequantise W[offs_n, k0:k0+BK] -> [BN, BK] OUT_DTYPE, W = (nibble - 8) * scale.

        Loads the [BN, BK/8] int32 words and [BN, BK/32] scales once and expands them with broadcast +
        reshape. (nibble | 0x4B000000) read as fp32 is 2^23 + nibble: subtracting 2^23 + 8 gives nibble - 8
        exactly. (A variant gathering [BN, BK] words with repeated addresses measured ~15x slower on H200.)
        """
        rows = offs_n[:, None].to(tl.int64)
        offs_kw = k0 // 8 + tl.arange(0, BK // 8)
        offs_g = k0 // 32 + tl.arange(0, BK // 32)
        words = tl.load(wbase + rows * stride_wn + offs_kw[None, :])  # [BN, BK/8]
        scales = tl.load(sbase + rows * stride_sn + offs_g[None, :])  # [BN, BK/32]
        shifts = tl.arange(0, 8) * 4
        nib = (words[:, :, None] >> shifts[None, None, :]) & 0xF  # [BN, BK/8, 8]
        f = (nib | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
        f = tl.reshape(f, (BN, BK // 32, 32))
        w = tl.reshape(f * scales.to(tl.float32)[:, :, None], (BN, BK))
        return w.to(OUT_DTYPE)

    @triton.jit
    def _gate_up_kernel(
        x_ptr,
        wp_ptr,
        ws_ptr,
        act_ptr,
        sorted_ids_ptr,
        block_expert_ptr,
        num_padded_ptr,
        K,
        I,
        num_pairs,
        top_k,
        stride_xt,
        stride_we,
        stride_wn,
        stride_se,
        stride_sn,
        stride_act,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SWAP_AB: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        num_padded = tl.load(num_padded_ptr)
        if pid_m * BLOCK_M >= num_padded:
            return
        e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ids_ptr + offs_m)
        row_ok = pair < num_pairs
        tok = (pair // top_k).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :]
        g_base = wp_ptr + e * stride_we
        u_base = g_base + I * stride_wn
        gs_base = ws_ptr + e * stride_se
        us_base = gs_base + I * stride_sn
        if SWAP_AB:
            acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            wg = _load_dequant(g_base, gs_base, offs_n, stride_wn, stride_sn, k0, BLOCK_N, BLOCK_K, a.dtype)
            wu = _load_dequant(u_base, us_base, offs_n, stride_wn, stride_sn, k0, BLOCK_N, BLOCK_K, a.dtype)
            if SWAP_AB:  # weights as the (register) A operand, tokens as the narrow N side
                acc_g = tl.dot(wg, tl.trans(a), acc_g)
                acc_u = tl.dot(wu, tl.trans(a), acc_u)
            else:
                acc_g = tl.dot(a, tl.trans(wg), acc_g)
                acc_u = tl.dot(a, tl.trans(wu), acc_u)
            a_ptrs += BLOCK_K
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        if SWAP_AB:
            out_ptrs = act_ptr + offs_m[None, :].to(tl.int64) * stride_act + offs_n[:, None]
        else:
            out_ptrs = act_ptr + offs_m[:, None].to(tl.int64) * stride_act + offs_n[None, :]
        tl.store(out_ptrs, act.to(act_ptr.dtype.element_ty))

    @triton.jit
    def _down_kernel(
        act_ptr,
        wp_ptr,
        ws_ptr,
        y_ptr,
        sorted_ids_ptr,
        block_expert_ptr,
        num_padded_ptr,
        K,
        num_pairs,
        stride_act,
        stride_we,
        stride_wn,
        stride_se,
        stride_sn,
        stride_y,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SWAP_AB: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        num_padded = tl.load(num_padded_ptr)
        if pid_m * BLOCK_M >= num_padded:
            return
        e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ids_ptr + offs_m)
        row_ok = pair < num_pairs
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = act_ptr + offs_m[:, None].to(tl.int64) * stride_act + offs_k[None, :]
        w_base = wp_ptr + e * stride_we
        s_base = ws_ptr + e * stride_se
        if SWAP_AB:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(a_ptrs)
            w = _load_dequant(w_base, s_base, offs_n, stride_wn, stride_sn, k0, BLOCK_N, BLOCK_K, a.dtype)
            if SWAP_AB:
                acc = tl.dot(w, tl.trans(a), acc)
            else:
                acc = tl.dot(a, tl.trans(w), acc)
            a_ptrs += BLOCK_K
        if SWAP_AB:
            y_ptrs = y_ptr + pair[None, :].to(tl.int64) * stride_y + offs_n[:, None]
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[None, :])
        else:
            y_ptrs = y_ptr + pair[:, None].to(tl.int64) * stride_y + offs_n[None, :]
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None])

    @triton.jit
    def _combine_kernel(
        y_ptr,
        w_ptr,
        ids_ptr,
        out_ptr,
        N,
        top_k,
        expert_lo,
        expert_hi,
        stride_y,
        stride_out,
        TOPK_P2: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        wait_and_release(PDL)  # kimi.kernels.triton.pdl
        t = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_j = tl.arange(0, TOPK_P2)
        jm = offs_j < top_k
        ids = tl.load(ids_ptr + t * top_k + offs_j, mask=jm, other=-1)
        ok = jm & (ids >= expert_lo) & (ids < expert_hi)
        wts = tl.load(w_ptr + t * top_k + offs_j, mask=ok, other=0.0).to(tl.float32)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = offs_n < N
        rows = (t * top_k + offs_j).to(tl.int64)
        y = tl.load(y_ptr + rows[:, None] * stride_y + offs_n[None, :], mask=ok[:, None] & nm[None, :], other=0.0)
        acc = tl.sum(y.to(tl.float32) * wts[:, None], axis=0)
        tl.store(out_ptr + t * stride_out + offs_n, acc.to(out_ptr.dtype.element_ty), mask=nm)


def _check(x, w13_packed, w13_scale, w2_packed, w2_scale, topk_weights, topk_ids):
    if not HAS_TRITON:
        raise BackendUnavailableError("fused_experts_int4 needs Triton")
    T, H = x.shape
    E, two_i, hw = w13_packed.shape
    inter = two_i // 2
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"x must be bf16/f16, got {x.dtype}")
    if w13_packed.dtype != torch.int32 or w2_packed.dtype != torch.int32:
        raise ValueError("packed weights must be int32")
    if hw * 8 != H or tuple(w13_scale.shape) != (E, two_i, H // GROUP_SIZE):
        raise ValueError(f"w13 shapes {tuple(w13_packed.shape)} / {tuple(w13_scale.shape)} do not fit H={H}")
    if tuple(w2_packed.shape) != (E, H, inter // 8) or tuple(w2_scale.shape) != (E, H, inter // GROUP_SIZE):
        raise ValueError(f"w2 shapes {tuple(w2_packed.shape)} / {tuple(w2_scale.shape)} do not fit H={H}, I={inter}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != T:
        raise ValueError("topk_ids / topk_weights must be [T, k]")
    for t in (x, w13_packed, w13_scale, w2_packed, w2_scale):
        if t.stride(-1) != 1:
            raise ValueError("last dims must be contiguous")
    return T, H, E, inter


def fused_experts_int4(
    x: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_offset: int = 0,
    config: MoeTileConfig | None = None,
    num_experts_total: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weighted sum of local SwiGLU INT4 experts (same function as `fused_experts_ref`).

    Args:
        x: [T, H] bf16/f16 activations (rows contiguous).
        w13_packed: [E, 2I, H/8] int32, w13_scale: [E, 2I, H/32] (gate rows then up rows).
        w2_packed: [E, H, I/8] int32, w2_scale: [E, H, I/32].
        topk_weights: [T, k] float32, topk_ids: [T, k] int64 global expert ids.
        expert_offset: global id of local expert 0; only ids in [offset, offset+E) contribute.
        config: tile sizes (default from `default_config`).
        num_experts_total: routed experts of the model, for the default heuristic (default 8*E).
        out: optional [T, H] x.dtype output buffer (every element is written).

    Returns:
        [T, H] in x.dtype; rows with no local pair are 0.
    Raises:
        ValueError on shape / dtype / divisibility mismatch.
    """
    T, H, E, inter = _check(x, w13_packed, w13_scale, w2_packed, w2_scale, topk_weights, topk_ids)
    k = topk_ids.shape[1]
    cfg = config or default_config(T, k, num_experts_total or 8 * E)
    if H % cfg.block_k1 or inter % cfg.block_n1 or inter % cfg.block_k2 or H % cfg.block_n2:
        raise ValueError(f"H={H}, I={inter} not divisible by tiles {cfg}")
    if cfg.block_k1 % 32 or cfg.block_k2 % 32:
        raise ValueError("block_k must be a multiple of the group size 32")
    if out is None:
        out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    elif out.shape != (T, H) or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError("out must be a [T, H] tensor of x.dtype with contiguous rows")
    if T == 0:
        return out
    sorted_ids, block_expert, num_padded, max_blocks = moe_align(topk_ids, E, expert_offset, cfg.block_m)
    P = T * k
    act = torch.empty((max_blocks * cfg.block_m, inter), dtype=x.dtype, device=x.device)  # by sorted position
    y = torch.empty((P, H), dtype=x.dtype, device=x.device)  # per pair, un-weighted
    grid1 = (max_blocks, inter // cfg.block_n1)
    _gate_up_kernel[grid1](
        x,
        w13_packed,
        w13_scale,
        act,
        sorted_ids,
        block_expert,
        num_padded,
        H,
        inter,
        P,
        k,
        x.stride(0),
        w13_packed.stride(0),
        w13_packed.stride(1),
        w13_scale.stride(0),
        w13_scale.stride(1),
        act.stride(0),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n1,
        BLOCK_K=cfg.block_k1,
        SWAP_AB=cfg.swap_ab,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    grid2 = (max_blocks, H // cfg.block_n2)
    _down_kernel[grid2](
        act,
        w2_packed,
        w2_scale,
        y,
        sorted_ids,
        block_expert,
        num_padded,
        inter,
        P,
        act.stride(0),
        w2_packed.stride(0),
        w2_packed.stride(1),
        w2_scale.stride(0),
        w2_scale.stride(1),
        y.stride(0),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n2,
        BLOCK_K=cfg.block_k2,
        SWAP_AB=cfg.swap_ab,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    combine_into(y, topk_weights, topk_ids, expert_offset, E, out)
    return out


# combine_into's launch {"block_n": columns per program, "warps": warps}: the "combine" entry of
# kimi/kernels/tuning/small_kernels.json (its tuner regenerates it).
COMBINE_LAUNCH_FIELDS: dict[str, tuple[str, ...]] = {"combine": ("block_n", "warps")}
COMBINE_LAUNCH: dict[str, Any] = tuning.launch_configs(tuning.load("small_kernels"), COMBINE_LAUNCH_FIELDS)["combine"]


def use_combine_launch(launch: dict[str, Any]) -> dict[str, Any]:
    """Make `launch` ({"block_n": int, "warps": int}) the launch of every later combine_into call that passes none;
    returns the previous COMBINE_LAUNCH. Raises ValueError on other fields."""
    global COMBINE_LAUNCH
    if sorted(launch) != sorted(COMBINE_LAUNCH_FIELDS["combine"]):
        raise ValueError(f"use_combine_launch: want the fields block_n, warps; got {launch}")
    old, COMBINE_LAUNCH = COMBINE_LAUNCH, dict(launch)
    return old


def combine_into(
    y,
    topk_weights,
    topk_ids,
    expert_offset,
    num_local_experts,
    out,
    launch: dict[str, Any] | None = None,
):
    """out[t] = sum_j [ids[t,j] local] * w[t,j] * y[t*k+j] (fp32 sum). y: [T*k, H]; out: [T, H]. launch:
    {"block_n": columns per program, "warps": warps} (default COMBINE_LAUNCH)."""
    T, k = topk_ids.shape
    H = out.shape[1]
    tw = topk_weights.contiguous()
    ti = topk_ids.contiguous()
    launch = launch or COMBINE_LAUNCH
    bn = launch["block_n"]
    _combine_kernel[(T, triton.cdiv(H, bn))](
        y,
        tw,
        ti,
        out,
        H,
        k,
        expert_offset,
        expert_offset + num_local_experts,
        y.stride(0),
        out.stride(0),
        TOPK_P2=triton.next_power_of_2(k),
        BLOCK_N=bn,
        num_warps=launch["warps"],
        **launch_kwargs(out.device),
    )
    return out
