"""Benchmark the fused decode kernels of kimi/kernels/triton/fused.py against their alternatives (A/B).

Every case times two implementations, "new" and "old", and records which of them the model runs at that size
(`model_runs`, from the thresholds in kimi.kernels.triton.fused: ROUTER_FUSED_MAX_T, ALIGN_ONE_PROGRAM_MAX_P,
ALIGN_GRID_MIN_P, LAUNCH["router_logits_large"]["m_min"] of kimi/kernels/tuning/small_kernels.json); those thresholds
come from these measurements.

Ops and shapes (Kimi-K2.6, one rank of the decode step):
  - rms_norm / add_rms_norm (D 7168; rms_norm also D 1536, the q_a norm), T = 8 and 32 rows. "old": the previous
    kernel (weight loaded after the h_new store), kept in this file.
  - mla_rope_kv_write (H 64, N 128, R 64, L 512, paged cache of 64-token blocks), T = 8 and 32. "old": the previous
    grid-(T,) kernel, kept in this file.
  - router_topk (E 384, D 7168, top-8), T = 8, 32, 64, 256: "new" = the one fused kernel (fused._router_topk forced
    fused), "old" = the two-kernel path. 20 distinct gate matrices (110 MB, > L2), cycled, so each call reads its gate
    from HBM as in the model.
  - moe_align_fused (48 local experts of 384, top-8), T = 64, 256, 512 tokens (P = 512, 2048, 4096 pairs), block_m
    16 and 64: "new" = the single program, "old" = the two-kernel path.
  - align_grid: moe_align_fused's grid path against the two-kernel path, T = 256 .. 16384 (prefill sizes).
  - router_large: the two-kernel router's large-T launch (bigger tiles, K unsplit) against its decode launch, T = 512,
    2048, 8192 (both with the Triton logits kernel).
  - router_gemm: the two-kernel router's logits by one cuBLAS GEMM against the Triton logits kernel, T = 64 .. 4096.
  - silu_mul (for reference, no alternative): M 8 and 512 rows, I 2048.
Before timing, each new output is compared with the old one (rmsnorm / mla: max abs difference; router: ids equal;
align: identical sets per row block) and the result goes into the report.

Timing: one sample = one CUDA-graph replay of R (default 20) back-to-back calls, CUDA-event timed and divided by R
(graphs are how the decode step runs; they keep Triton's host launch cost out); a torch.cuda._sleep before each
sample lets the host queue the events and the replay ahead of the GPU. Median of --samples (default 50) samples.

Output: a table on stdout (us per call, old, new, speed-up), JSON to --out with every measurement, and the
snapshot (--snapshot: fused.json; fused_<ops joined by '-'> for other --ops, e.g. fused_router_gemm.json).

Usage: python tools/bench_fused.py [--samples 50] [--reps 20] [--ops rmsnorm,mla,router,align,align_grid,...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import traceback

import torch

from kimi.benchmarks import snapshot
from kimi.benchmarks.gpu import GraphTimer, require_gpu

# GPU packages: a CPU-only install still gets --help; main() then exits with one line (require_gpu)
_MISSING = None
try:
    import triton
    import triton.language as tl

    from kimi.kernels.triton import fused
except ImportError as _e:
    _MISSING = _e

    class triton:
        jit = staticmethod(lambda fn: fn)

    tl = None

DEV = "cuda"
BF16 = torch.bfloat16


def log(*a):
    print(*a, flush=True)


# ---- the previous kernels of rms_norm and mla_rope_kv_write (the alternatives they beat) ----------------------


@triton.jit
def _old_rmsnorm_kernel(
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
):
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
        x = xr.to(tl.float32)
    ms = tl.sum(x * x, axis=0) / D
    r = 1.0 / tl.sqrt(ms + eps)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * y_stride + offs, (w * (x * r)).to(y_ptr.dtype.element_ty), mask=m)


def old_rms_norm(x, weight, eps):
    T, D = x.shape
    y = torch.empty((T, D), dtype=x.dtype, device=x.device)
    B = triton.next_power_of_2(D)
    _old_rmsnorm_kernel[(T,)](
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
        num_warps=fused._nw(B),
    )
    return y


def old_add_rms_norm(h, d1, d2, weight, eps):
    T, D = h.shape
    h_new = torch.empty((T, D), dtype=h.dtype, device=h.device)
    y = torch.empty((T, D), dtype=h.dtype, device=h.device)
    B = triton.next_power_of_2(D)
    d2_ = d1 if d2 is None else d2
    _old_rmsnorm_kernel[(T,)](
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
        num_warps=fused._nw(B),
    )
    return h_new, y


@triton.jit
def _old_mla_rope_kv_kernel(
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
    R2: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    i = tl.arange(0, R2)
    c = tl.load(cos_ptr + pos * R2 + i)
    s = tl.load(sin_ptr + pos * R2 + i)
    R = 2 * R2
    row_stride = L + R
    lo = tl.arange(0, BLOCK_L)
    lm = lo < L
    x = tl.load(kva_ptr + t * kva_s0 + lo, mask=lm, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / L + eps)
    w = tl.load(w_ptr + lo, mask=lm, other=0.0).to(tl.float32)
    ckv = (w * (x * r)).to(kva_ptr.dtype.element_ty)
    tl.store(cache_ptr + slot * row_stride + lo, ckv.to(cache_ptr.dtype.element_ty), mask=lm)
    k0 = tl.load(kva_ptr + t * kva_s0 + L + 2 * i).to(tl.float32)
    k1 = tl.load(kva_ptr + t * kva_s0 + L + 2 * i + 1).to(tl.float32)
    tl.store(
        cache_ptr + slot * row_stride + L + 2 * i,
        (k0 * c - k1 * s).to(kva_ptr.dtype.element_ty).to(cache_ptr.dtype.element_ty),
    )
    tl.store(
        cache_ptr + slot * row_stride + L + 2 * i + 1,
        (k1 * c + k0 * s).to(kva_ptr.dtype.element_ty).to(cache_ptr.dtype.element_ty),
    )
    hh = tl.arange(0, BLOCK_H)
    hm = hh < H
    qb = q_ptr + t * q_s0 + hh[:, None] * q_s1 + N + 2 * i[None, :]
    q0 = tl.load(qb, mask=hm[:, None], other=0.0).to(tl.float32)
    q1 = tl.load(qb + 1, mask=hm[:, None], other=0.0).to(tl.float32)
    ob = qpe_ptr + t * H * R + hh[:, None] * R + 2 * i[None, :]
    tl.store(ob, (q0 * c[None, :] - q1 * s[None, :]).to(qpe_ptr.dtype.element_ty), mask=hm[:, None])
    tl.store(ob + 1, (q1 * c[None, :] + q0 * s[None, :]).to(qpe_ptr.dtype.element_ty), mask=hm[:, None])


def old_mla_rope_kv_write(q, kv_a, kv_norm_w, eps, cos_cache, sin_cache, positions, slot_mapping, kv_cache, nope):
    T, H, NR = q.shape
    R = NR - nope
    L = kv_a.shape[1] - R
    qpe = torch.empty((T, H, R), dtype=q.dtype, device=q.device)
    _old_mla_rope_kv_kernel[(T,)](
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
        R2=R // 2,
        BLOCK_H=triton.next_power_of_2(H),
        BLOCK_L=triton.next_power_of_2(L),
        num_warps=4,
    )
    return qpe


# ---- cases ---------------------------------------------------------------------------------------------------


def rmsnorm_cases(reps):
    g = torch.Generator(device=DEV).manual_seed(0)
    for T in (8, 32):
        for name, D, nd in (
            ("rms_norm", 7168, 0),
            ("rms_norm", 1536, 0),
            ("add_rms_norm d1", 7168, 1),
            ("add_rms_norm d1+d2", 7168, 2),
        ):
            h, d1, d2 = (torch.randn(T, D, generator=g, device=DEV).to(BF16) for _ in range(3))
            w = (torch.rand(D, generator=g, device=DEV) + 0.5).to(BF16)
            if nd == 0:
                new = lambda h=h, w=w: fused.rms_norm(h, w, 1e-6)  # noqa: E731
                old = lambda h=h, w=w: old_rms_norm(h, w, 1e-6)  # noqa: E731
                diff = (new().float() - old().float()).abs().max().item()
            else:
                dd = d2 if nd == 2 else None
                new = lambda h=h, d1=d1, dd=dd, w=w: fused.add_rms_norm(h, d1, dd, w, 1e-6)  # noqa: E731
                old = lambda h=h, d1=d1, dd=dd, w=w: old_add_rms_norm(h, d1, dd, w, 1e-6)  # noqa: E731
                diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(new(), old()))
            meta = {"op": name, "shape": f"T={T} D={D}", "check": f"max|new-old|={diff:g}", "model_runs": "new"}
            meta |= {"new_is": "weight loaded before the residual store", "old_is": "weight loaded after it"}
            yield meta, [new] * reps, [old] * reps


def mla_cases(reps):
    H, N, R, L, ql, bs, nb = 64, 128, 64, 512, 1536, 64, 256
    g = torch.Generator(device=DEV).manual_seed(1)
    for T in (8, 32):
        q = torch.randn(T, H, N + R, generator=g, device=DEV).to(BF16)
        kv_a = torch.randn(T, ql + L + R, generator=g, device=DEV).to(BF16)[:, ql:]
        w = (torch.rand(L, generator=g, device=DEV) + 0.5).to(BF16)
        ang = torch.rand(8192, R // 2, generator=g, device=DEV) * 6.28
        cos, sin = ang.cos().contiguous(), ang.sin().contiguous()
        pos = torch.randint(0, 8192, (T,), generator=g, device=DEV)
        slot = torch.randperm(nb * bs, generator=g, device=DEV)[:T]
        c_new = torch.zeros(nb, bs, L + R, dtype=BF16, device=DEV)
        c_old = torch.zeros_like(c_new)
        args = (q, kv_a, w, 1e-6, cos, sin, pos, slot)
        new = lambda a=args, c=c_new: fused.mla_rope_kv_write(*a, c, N)  # noqa: E731
        old = lambda a=args, c=c_old: old_mla_rope_kv_write(*a, c, N)  # noqa: E731
        diff = max(
            (new().float() - old().float()).abs().max().item(), (c_new.float() - c_old.float()).abs().max().item()
        )
        meta = {"op": "mla_rope_kv_write", "shape": f"T={T} H={H} R={R} L={L}", "check": f"max|new-old|={diff:g}"}
        meta |= {"model_runs": "new", "new_is": "programs over (token, head group)", "old_is": "one program per token"}
        yield meta, [new] * reps, [old] * reps


def router_cases(reps):
    E, D = 384, 7168
    g = torch.Generator(device=DEV).manual_seed(2)
    gates = [(torch.randn(E, D, generator=g, device=DEV) * D**-0.5).to(BF16) for _ in range(reps)]
    bias = torch.randn(E, generator=g, device=DEV) * 0.05
    for T in (8, 32, 64, 256):
        x = torch.randn(T, D, generator=g, device=DEV).to(BF16)
        a = fused._router_topk(x, gates[0], bias, 8, 2.827, True, True)
        b = fused._router_topk(x, gates[0], bias, 8, 2.827, True, False)
        check = f"ids equal={torch.equal(a[1], b[1])} max|dw|={(a[0] - b[0]).abs().max().item():g}"
        new = [lambda gw=gw, x=x: fused._router_topk(x, gw, bias, 8, 2.827, True, True) for gw in gates]
        old = [lambda gw=gw, x=x: fused._router_topk(x, gw, bias, 8, 2.827, True, False) for gw in gates]
        meta = {"op": "router_topk", "shape": f"T={T} E={E} D={D}", "check": check}
        meta |= {"model_runs": "new" if T <= fused.ROUTER_FUSED_MAX_T else "old"}
        meta |= {"new_is": "one fused kernel", "old_is": "logits kernel + top-k kernel"}
        yield meta, new, old


def align_cases(reps):
    g = torch.Generator(device=DEV).manual_seed(3)
    for T in (64, 256, 512):
        ids = torch.rand(T, 384, generator=g, device=DEV).topk(8, 1).indices.to(torch.int64)
        for bm in (16, 64):
            a = fused._moe_align(ids, 48, 96, bm, True)
            b = fused._moe_align(ids, 48, 96, bm, False)
            ok = (
                torch.equal(a[1], b[1])
                and torch.equal(a[2], b[2])
                and torch.equal(a[0].view(-1, bm).sort(1).values, b[0].view(-1, bm).sort(1).values)
            )
            new = lambda ids=ids, bm=bm: fused._moe_align(ids, 48, 96, bm, True)  # noqa: E731
            old = lambda ids=ids, bm=bm: fused._moe_align(ids, 48, 96, bm, False)  # noqa: E731
            meta = {"op": "moe_align_fused", "shape": f"T={T} P={T * 8} bm={bm}", "check": f"same={ok}"}
            meta |= {"model_runs": "new" if T * 8 <= fused.ALIGN_ONE_PROGRAM_MAX_P else "old"}
            meta |= {"new_is": "one program", "old_is": "count kernel + scatter kernel"}
            yield meta, [new] * reps, [old] * reps


def _router_decode_launch(x, gw, bias):
    """The two-kernel router with the decode launch (split K, small tiles) at any T."""
    launch = fused.LAUNCH | {"router_logits_large": fused.LAUNCH["router_logits_large"] | {"m_min": 1 << 30}}
    return fused._router_topk(x, gw, bias, 8, 2.827, True, False, launch=launch, gemm=False)


def router_large_cases(reps):
    """The two-kernel router at prefill row counts: the large-T launch against the decode launch."""
    E, D = 384, 7168
    g = torch.Generator(device=DEV).manual_seed(6)
    gates = [(torch.randn(E, D, generator=g, device=DEV) * D**-0.5).to(BF16) for _ in range(reps)]
    bias = torch.randn(E, generator=g, device=DEV) * 0.05
    for T in (512, 2048, 8192):
        x = torch.randn(T, D, generator=g, device=DEV).to(BF16)
        a = fused._router_topk(x, gates[0], bias, 8, 2.827, True, False, gemm=False)
        b = _router_decode_launch(x, gates[0], bias)
        same = (a[1].sort(1).values == b[1].sort(1).values).all(1).float().mean().item()
        check = f"rows with equal id sets={same:.4f} max|dw|={(a[0] - b[0]).abs().max().item():g}"
        new = [lambda gw=gw, x=x: fused._router_topk(x, gw, bias, 8, 2.827, True, False, gemm=False) for gw in gates]
        old = [lambda gw=gw, x=x: _router_decode_launch(x, gw, bias) for gw in gates]
        meta = {"op": "router_topk large-T launch vs decode launch", "shape": f"T={T} E={E} D={D}", "check": check}
        meta |= {"model_runs": "new" if fused.LAUNCH["router_logits_large"]["m_min"] <= T else "old"}
        meta |= {"new_is": "large-T launch (64 x 64 tiles, K unsplit)", "old_is": "decode launch (split K)"}
        yield meta, new, old


def router_gemm_cases(reps):
    """The two-kernel router's logits by one cuBLAS GEMM (fp32 out) against its Triton logits kernel (the launch of
    each T), T = 64 .. 4096."""
    E, D = 384, 7168
    g = torch.Generator(device=DEV).manual_seed(7)
    gates = [(torch.randn(E, D, generator=g, device=DEV) * D**-0.5).to(BF16) for _ in range(reps)]
    bias = torch.randn(E, generator=g, device=DEV) * 0.05

    def run(x, gw, gemm):
        return fused._router_topk(x, gw, bias, 8, 2.827, True, False, gemm=gemm)

    for T in (64, 128, 256, 512, 1024, 2048, 4096):
        x = torch.randn(T, D, generator=g, device=DEV).to(BF16)
        a, b = run(x, gates[0], True), run(x, gates[0], False)
        same = (a[1].sort(1).values == b[1].sort(1).values).all(1).float().mean().item()
        check = f"rows with equal id sets={same:.4f} max|dw|={(a[0] - b[0]).abs().max().item():g}"
        new = [lambda gw=gw, x=x: run(x, gw, True) for gw in gates]
        old = [lambda gw=gw, x=x: run(x, gw, False) for gw in gates]
        meta = {"op": "router_topk logits GEMM vs Triton logits", "shape": f"T={T} E={E} D={D}", "check": check}
        meta |= {"model_runs": "new" if 0 < fused.ROUTER_GEMM_MIN_T <= T else "old"}
        meta |= {"new_is": "cuBLAS GEMM, fp32 out", "old_is": "Triton logits kernel"}
        yield meta, new, old


def align_grid_cases(reps):
    """The grid path against the two-kernel path at decode to prefill pair counts (P = 8 T)."""
    g = torch.Generator(device=DEV).manual_seed(5)
    for T in (256, 512, 1024, 2048, 16384):
        ids = torch.rand(T, 384, generator=g, device=DEV).topk(8, 1).indices.to(torch.int64)
        for bm in (16, 96):
            a = fused._moe_align(ids, 48, 96, bm, None, grid=True)
            b = fused._moe_align(ids, 48, 96, bm, False, grid=False)
            key = a[1].repeat_interleave(bm).long() * (T * 8 + 1)  # pairs per expert as sets (atomic slots)
            ok = (
                torch.equal(a[1], b[1])
                and torch.equal(a[2], b[2])
                and torch.equal((key + a[0].long()).sort().values, (key + b[0].long()).sort().values)
            )
            new = lambda ids=ids, bm=bm: fused._moe_align(ids, 48, 96, bm, None, grid=True)  # noqa: E731
            old = lambda ids=ids, bm=bm: fused._moe_align(ids, 48, 96, bm, False, grid=False)  # noqa: E731
            meta = {
                "op": "moe_align_fused grid vs two kernels",
                "shape": f"T={T} P={T * 8} bm={bm}",
                "check": f"same={ok}",
            }
            meta |= {"model_runs": "new" if T * 8 >= fused.ALIGN_GRID_MIN_P else "old"}
            meta |= {"new_is": "grid path", "old_is": "count kernel + scatter kernel"}
            yield meta, [new] * reps, [old] * reps


def silu_cases(reps):
    g = torch.Generator(device=DEV).manual_seed(4)
    for M in (8, 512):
        y = torch.randn(M, 4096, generator=g, device=DEV).to(BF16)
        yield (
            {"op": "silu_mul", "shape": f"M={M} I=2048", "check": "", "model_runs": "new", "new_is": "silu_mul"},
            [lambda y=y: fused.silu_mul(y, 2048)] * reps,
            None,
        )


CASES = {
    "rmsnorm": rmsnorm_cases,
    "mla": mla_cases,
    "router": router_cases,
    "align": align_cases,
    "align_grid": align_grid_cases,
    "router_large": router_large_cases,
    "router_gemm": router_gemm_cases,
    "silu": silu_cases,
}


def summarize(report: dict) -> dict:
    """The snapshot's table: per case the implementation the model runs at that size against the other one."""
    rows = []
    for m in report["results"]:
        if m.get("old_us") is None:
            rows.append([m["op"], m["shape"], m.get("new_is"), round(m["new_us"], 2), None, None, None])
            continue
        runs = m.get("model_runs", "new")
        other = "old" if runs == "new" else "new"
        rows.append(
            [
                m["op"],
                m["shape"],
                m.get(f"{runs}_is", runs),
                round(m[f"{runs}_us"], 2),
                m.get(f"{other}_is", other),
                round(m[f"{other}_us"], 2),
                round(m[f"{other}_us"] / m[f"{runs}_us"], 2),
            ]
        )
    return {
        "columns": ["op", "shape", "the model runs", "(us)", "the alternative", "(us)", "alternative / model"],
        "rows": rows,
        "notes": [f"CUDA-graph replay of {report['reps']} calls per sample, median of {report['samples']} samples"],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=snapshot.HelpFormatter)
    ap.add_argument("--samples", type=int, default=50, help="timed graph replays per measurement")
    ap.add_argument("--reps", type=int, default=20, help="calls per graph replay")
    ap.add_argument("--ops", default=",".join(CASES), help=f"comma list of: {', '.join(CASES)}")
    ap.add_argument("--out", default=None, help="write the full JSON result here")
    snapshot.add_arguments(ap)
    args = ap.parse_args()
    require_gpu(ap.prog, _MISSING)
    date = datetime.datetime.now().strftime("%Y%m%d_%H%M%S")
    gpu = torch.cuda.get_device_name()
    report = {
        "args": vars(args),
        "gpu": gpu,
        "date": date,
        "reps": args.reps,
        "samples": args.samples,
        "thresholds": {
            "ROUTER_FUSED_MAX_T": fused.ROUTER_FUSED_MAX_T,
            "ALIGN_ONE_PROGRAM_MAX_P": fused.ALIGN_ONE_PROGRAM_MAX_P,
        },
        "results": [],
        "error": None,
    }
    log(f"{gpu}  torch {torch.__version__}  triton {triton.__version__}  CUDA {torch.version.cuda}")
    log(f"{'op':24s} {'shape':26s} {'old us':>8s} {'new us':>8s} {'x':>6s}  check")
    timer = GraphTimer(args.samples)
    try:
        for op in args.ops.split(","):
            for meta, new, old in CASES[op](args.reps):
                meta["new_us"] = timer.time_calls(new)
                meta["old_us"] = timer.time_calls(old) if old is not None else None
                report["results"].append(meta)
                o = f"{meta['old_us']:8.2f}" if old is not None else f"{'-':>8s}"
                x = f"{meta['old_us'] / meta['new_us']:6.2f}" if old is not None else f"{'':6s}"
                log(f"{meta['op']:24s} {meta['shape']:26s} {o} {meta['new_us']:8.2f} {x}  {meta['check']}")
    except Exception:  # still write what was measured
        report["error"] = traceback.format_exc()
        log(report["error"])
    report["conditions"] = conds = snapshot.conditions()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    if args.snapshot and not report["error"]:
        snapshot.write(
            args.snapshot,
            benchmark="fused",
            config="" if args.ops == ",".join(CASES) else args.ops.replace(",", "-"),
            summary=summarize(report),
            results=report,
            conds=conds,
        )
    return 1 if report["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
