"""Fused Triton kernels (kimi/kernels/triton/fused.py) against their plain-PyTorch references on the GPU.

Fresh random inputs per test, outputs (and the KV cache) poisoned with NaN before the run, bf16 relative error
||out - ref|| / ||ref|| <= 1e-2; router ids and align outputs compared exactly (align: identical to moe_align on the
single-program path, as sets per row block on the two-kernel path). Both paths of router_topk (one fused kernel / two
kernels) and moe_align_fused (one program / two kernels / the grid path, which must equal moe_align exactly; the two
kernels' pairs per expert as sets) are tested forced and by their default dispatch at small and large T (up to 131k
pairs), the fused router also replayed in a CUDA graph (arrival counters reset).
Shapes: the real Kimi-K2.6 ones (D 7168, q_lora 1536, latent 512 + 64, 64 heads, 384 experts top-8, 48 local).
CPU interpreter versions: tests/unit/test_fused_cpu.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from kimi.kernels.triton import linear_small_m as lsm

pytestmark = pytest.mark.gpu

REL_TOL = 1e-2
DEV = "cuda"


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("T", [1, 8, 64, 300])
@pytest.mark.parametrize("D", [7168, 1536])
def test_add_rms_norm(T, D):
    from kimi.kernels.triton import fused

    g = torch.Generator(device=DEV).manual_seed(T * 7 + D)
    h, d1, d2 = (torch.randn(T, D, generator=g, device=DEV).to(torch.bfloat16) for _ in range(3))
    w = (torch.rand(D, generator=g, device=DEV) + 0.5).to(torch.bfloat16)
    y = fused.rms_norm(h, w, 1e-6)
    assert rel_err(y, fused.add_rms_norm_ref(h, torch.zeros_like(h), None, w, 1e-6)[1]) <= REL_TOL
    for dd in (None, d2):
        hn, yn = fused.add_rms_norm(h, d1, dd, w, 1e-6)
        rh, ry = fused.add_rms_norm_ref(h, d1, dd, w, 1e-6)
        assert not hn.isnan().any() and not yn.isnan().any()
        assert rel_err(hn, rh) <= REL_TOL and rel_err(yn, ry) <= REL_TOL
    # strided rows (a slice of a merged projection output)
    big = torch.randn(T, D + 576, generator=g, device=DEV).to(torch.bfloat16)
    out = torch.full((T, D), float("nan"), dtype=torch.bfloat16, device=DEV)
    fused.rms_norm(big[:, :D], w, 1e-6, out=out)
    assert (
        rel_err(
            out,
            fused.add_rms_norm_ref(big[:, :D], torch.zeros(T, D, dtype=torch.bfloat16, device=DEV), None, w, 1e-6)[1],
        )
        <= REL_TOL
    )


@pytest.mark.parametrize("M,I", [(8, 18432), (512, 2048), (64, 4096)])
def test_silu_mul(M, I):
    from kimi.kernels.triton import fused

    g = torch.Generator(device=DEV).manual_seed(M + I)
    y = torch.randn(M, 2 * I, generator=g, device=DEV).to(torch.bfloat16) * 3
    assert rel_err(fused.silu_mul(y, I), fused.silu_mul_ref(y, I)) <= REL_TOL


@pytest.mark.parametrize("T", [1, 8, 32, 64, 100])  # T > 64: the larger head group
def test_mla_rope_kv_write(T):
    from kimi.kernels.triton import fused

    H, N, R, L, ql, bs, nb = 64, 128, 64, 512, 1536, 64, 40
    g = torch.Generator(device=DEV).manual_seed(100 + T)
    q = torch.randn(T, H, N + R, generator=g, device=DEV).to(torch.bfloat16)
    qkv = torch.randn(T, ql + L + R, generator=g, device=DEV).to(torch.bfloat16)
    kv_a = qkv[:, ql:]  # strided rows, as in the model
    w = (torch.rand(L, generator=g, device=DEV) + 0.5).to(torch.bfloat16)
    P = 4096
    ang = torch.rand(P, R // 2, generator=g, device=DEV) * 6.28
    cos, sin = ang.cos().contiguous(), ang.sin().contiguous()
    pos = torch.randint(0, P, (T,), generator=g, device=DEV)
    slot = torch.randperm(nb * bs, generator=g, device=DEV)[:T]
    c1 = torch.full((nb, bs, L + R), float("nan"), dtype=torch.bfloat16, device=DEV)
    c2 = c1.clone()
    o = fused.mla_rope_kv_write(q, kv_a, w, 1e-6, cos, sin, pos, slot, c1, N)
    ro = fused.mla_rope_kv_write_ref(q, kv_a, w, 1e-6, cos, sin, pos, slot, c2, N)
    assert o.is_contiguous() and not o.isnan().any()
    assert rel_err(o, ro) <= REL_TOL
    f1, f2 = c1.view(-1, L + R), c2.view(-1, L + R)
    assert not f1[slot].isnan().any()
    assert rel_err(f1[slot][:, :L], f2[slot][:, :L]) <= REL_TOL
    assert rel_err(f1[slot][:, L:], f2[slot][:, L:]) <= REL_TOL
    mask = torch.ones(nb * bs, dtype=torch.bool, device=DEV)
    mask[slot] = False
    assert f1[mask].isnan().all()  # nothing else written


def _router_inputs(T, seed):
    E, D = 384, 7168
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(T, D, generator=g, device=DEV).to(torch.bfloat16)
    gw = (torch.randn(E, D, generator=g, device=DEV) * D**-0.5).to(torch.bfloat16)
    bias = torch.randn(E, generator=g, device=DEV) * 0.05
    return x, gw, bias


def _check_router(w, ids, rw, rids):
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    same = (ids.sort(1).values == rids.sort(1).values).all(1)
    assert same.float().mean().item() >= 0.99  # fp32 summation order may swap a near-tie
    so, ro = ids.argsort(1), rids.argsort(1)
    assert rel_err(w.gather(1, so)[same], rw.gather(1, ro)[same]) <= 1e-5


@pytest.mark.parametrize("path", [None, True, False])  # default dispatch, one fused kernel, two kernels
@pytest.mark.parametrize("T", [1, 8, 64, 256, 300, 2048])  # 2048: the large-T launch (prefill)
def test_router_topk(T, path):
    from kimi.kernels.triton import fused

    x, gw, bias = _router_inputs(T, 200 + T)
    w, ids = (
        fused.router_topk(x, gw, bias, 8, 2.827)
        if path is None
        else fused._router_topk(x, gw, bias, 8, 2.827, True, path)
    )
    rw, rids = fused.router_topk_ref(x, gw, bias, 8, 2.827)
    _check_router(w, ids, rw, rids)
    for _ in range(3):  # run-to-run deterministic, bit for bit
        w2, ids2 = fused._router_topk(x, gw, bias, 8, 2.827, True, path)
        assert torch.equal(w, w2) and torch.equal(ids, ids2)
    torch.cuda.synchronize()
    assert all(int(b.abs().sum()) == 0 for b in lsm._counters.values())  # arrival counters back at 0


@pytest.mark.parametrize("gemm", [True, False])  # the logits by cuBLAS (fp32 out) / by the Triton kernel
@pytest.mark.parametrize("T", [128, 1024, 1031])
def test_router_topk_logits_paths(T, gemm):
    """Both logits paths of the two-kernel router against the fp32 reference, deterministic run to run, with padded
    rows (row_valid 0) given no expert; and the default path at T (ROUTER_GEMM_MIN_T) is one of the two."""
    from kimi.kernels.triton import fused

    x, gw, bias = _router_inputs(T, 300 + T)
    w, ids = fused._router_topk(x, gw, bias, 8, 2.827, True, False, gemm=gemm)
    rw, rids = fused.router_topk_ref(x, gw, bias, 8, 2.827)
    _check_router(w, ids, rw, rids)
    for _ in range(3):
        w2, ids2 = fused._router_topk(x, gw, bias, 8, 2.827, True, False, gemm=gemm)
        assert torch.equal(w, w2) and torch.equal(ids, ids2)
    valid = (torch.arange(T, device=DEV) % 3 != 0).to(torch.int64)
    wv, idv = fused._router_topk(x, gw, bias, 8, 2.827, True, False, valid, gemm=gemm)
    keep = valid.bool()
    assert torch.equal(idv[keep], ids[keep]) and torch.equal(wv[keep], w[keep])
    assert (idv[~keep] == -1).all() and (wv[~keep] == 0).all()
    default = fused.router_topk(x, gw, bias, 8, 2.827)
    forced = fused._router_topk(x, gw, bias, 8, 2.827, True, False, gemm=0 < fused.ROUTER_GEMM_MIN_T <= T)
    assert torch.equal(default[1], forced[1]) and torch.equal(default[0], forced[0])


def test_router_topk_cuda_graph():
    """The fused path captured in a graph (20 calls, rotating counter regions), replayed 3 times = eager."""
    from kimi.kernels.triton import fused

    x, gw, bias = _router_inputs(8, 7)
    ref = fused._router_topk(x, gw, bias, 8, 2.827, True, True)  # eager first: allocates the counters
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fused.router_topk(x, gw, bias, 8, 2.827)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = [fused.router_topk(x, gw, bias, 8, 2.827) for _ in range(20)]
    for _ in range(3):
        for w, ids in outs:
            w.fill_(float("nan"))
            ids.fill_(-1)
        g.replay()
        torch.cuda.synchronize()
        for w, ids in outs:
            assert torch.equal(w, ref[0]) and torch.equal(ids, ref[1])
    assert all(int(b.abs().sum()) == 0 for b in lsm._counters.values())


@pytest.mark.parametrize("T,bm", [(8, 8), (64, 8), (256, 8), (256, 16)])
def test_silu_mul_rows(T, bm):
    """silu_mul_rows over moe_align_fused's rows (K2.6 I = 2048, 48 local of 384 experts): exactly the local
    pairs' rows written (out poisoned with NaN first), each equal to silu_mul_ref; also inside a CUDA graph."""
    from kimi.kernels.triton import fused

    g = torch.Generator(device=DEV).manual_seed(700 + T + bm)
    I = 2048
    ids = torch.rand(T, 384, generator=g, device=DEV).topk(8, 1).indices.to(torch.int64)
    s, _, npd, _ = fused.moe_align_fused(ids, 48, 96, bm)
    P = T * 8
    y = torch.randn(P, 2 * I, generator=g, device=DEV).to(torch.bfloat16) * 3
    loc = ((ids >= 96) & (ids < 144)).reshape(-1).nonzero().flatten()
    out = torch.full((P, I), float("nan"), dtype=torch.bfloat16, device=DEV)
    fused.silu_mul_rows(y, s, npd, I, out=out)
    assert torch.equal((~out.isnan().all(1)).nonzero().flatten(), loc)
    assert rel_err(out[loc], fused.silu_mul_ref(y[loc], I)) <= REL_TOL
    out2 = torch.full_like(out, float("nan"))
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        fused.silu_mul_rows(y, s, npd, I, out=out2)
    gr.replay()
    torch.cuda.synchronize()
    unlisted = out.isnan().all(1)
    assert torch.equal(out2[loc], out[loc]) and out2[unlisted].isnan().all()


@pytest.mark.parametrize("one", [None, True, False, "grid"])  # default dispatch, one program, two kernels, grid
@pytest.mark.parametrize(
    "T,bm", [(1, 16), (8, 8), (64, 16), (64, 64), (256, 16), (256, 8), (512, 64), (2048, 64), (16384, 96)]
)
def test_moe_align_fused(T, bm, one):
    from kimi.kernels.triton import fused
    from kimi.kernels.triton.moe_w4a16 import moe_align

    g = torch.Generator(device=DEV).manual_seed(300 + T)
    ids = torch.rand(T, 384, generator=g, device=DEV).topk(8, 1).indices.to(torch.int64)
    if one is None:
        s, be, npd, mb = fused.moe_align_fused(ids, 48, 96, bm)
    else:
        s, be, npd, mb = fused._moe_align(ids, 48, 96, bm, None if one == "grid" else one, grid=one == "grid")
    rs, rbe, rn, rmb = moe_align(ids, 48, 96, bm)
    assert mb == rmb and torch.equal(be, rbe) and torch.equal(npd, rn)
    grid = one == "grid" or (one is None and T * 8 >= fused.ALIGN_GRID_MIN_P)
    if one is True or grid or (one is None and T * 8 <= fused.ALIGN_ONE_PROGRAM_MAX_P):
        assert torch.equal(s, rs)  # the single program and the grid path keep moe_align's (stable sort) order
    # the two-kernel path's atomic slots: each expert's padded range holds the same pairs (and pads), in any order
    # and so possibly in other blocks of that expert
    key = be.repeat_interleave(bm).long() * (T * 8 + 1)
    assert torch.equal((key + s.long()).sort().values, (key + rs.long()).sort().values)


@pytest.mark.parametrize("one", [True, False, "grid"])
def test_moe_align_fused_max_pairs(one):
    """DeepEP's low-latency layout (rows expert-major, most of them without a local expert): with max_pairs = a
    bound on the local pairs, the align's buffers and block count come from the bound, and its blocks, num_padded
    and (per block) pairs equal the unbounded align's; with a bound too small it writes nothing past its buffers
    (the pairs past the bound are lost, nothing else changes)."""
    from kimi.kernels.triton import fused

    g = torch.Generator(device=DEV).manual_seed(7)
    E, off, slab, bm = 48, 96, 1024, 16  # 48 local experts x 1024 rows (128 tokens x 8 ranks)
    counts = torch.randint(0, 12, (E,), generator=g, device=DEV)
    row = torch.arange(slab, device=DEV)
    ids = torch.where(row[None, :] < counts[:, None], torch.arange(E, device=DEV)[:, None] + off, -1).reshape(-1, 1)
    real = int(counts.sum())
    run = lambda mp: fused._moe_align(
        ids,
        E,
        off,
        bm,
        None if one == "grid" else one,
        grid=one == "grid",
        max_pairs=mp,
    )
    s0, be0, n0, mb0 = run(None)
    bound = real + 5
    s, be, n, mb = run(bound)
    assert mb == -(-bound // bm) + E and mb < mb0 and s.numel() == mb * bm
    assert torch.equal(n, n0) and torch.equal(be, be0[:mb])
    npd = int(n)
    key = lambda sv, bev: (bev.repeat_interleave(bm)[:npd].long() * (ids.numel() + 1) + sv[:npd].long()).sort().values
    assert torch.equal(key(s, be), key(s0, be0))


_TOO_SMALL_BOUND = """
import torch
from kimi.kernels.triton import fused
E, off, slab = 48, 96, 1024
g = torch.Generator(device="cuda").manual_seed(8)
counts = torch.randint(17, 41, (E,), generator=g, device="cuda")  # 2-3 blocks of 16 each
row = torch.arange(slab, device="cuda")
ids = torch.where(row[None, :] < counts[:, None], torch.arange(E, device="cuda")[:, None] + off, -1).reshape(-1, 1)
for one, grid in ((True, False), (False, False), (None, True)):
    s, be, n, mb = fused._moe_align(ids, E, off, 16, one, grid=grid, max_pairs=int(counts.sum()) // 4)
    torch.cuda.synchronize()
    assert s.numel() == mb * 16
    assert int(n) > s.numel(), (int(n), s.numel())  # the pairs' slots reach far past the buffer: the masks act
print("ok")
"""


def test_moe_align_fused_too_small_bound_stays_in_bounds():
    """A max_pairs below the real local pairs loses pairs but never writes past sorted_ids: the three align paths
    run under compute-sanitizer's memcheck, which must report no error."""
    import shutil
    import subprocess
    import sys

    cs = shutil.which("compute-sanitizer") or (
        "/usr/local/cuda/bin/compute-sanitizer" if os.path.exists("/usr/local/cuda/bin/compute-sanitizer") else None
    )
    if cs is None:
        pytest.skip("compute-sanitizer not installed")
    # without torch's caching allocator every tensor is its own cudaMalloc, so memcheck sees a write past one
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    r = subprocess.run(
        [cs, "--tool", "memcheck", "--error-exitcode", "3", sys.executable, "-c", _TOO_SMALL_BOUND],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert r.returncode == 0 and "ok" in r.stdout, (r.returncode, r.stdout[-3000:], r.stderr[-3000:])
