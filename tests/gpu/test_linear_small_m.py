"""GPU tests of the small-M Triton GEMM (kimi.kernels.triton.linear_small_m) against a float32 reference.

Reference: x.float() @ w.float().T on fresh random bf16 inputs; outputs are poisoned with NaN before the kernel
runs; tolerance max |y - ref| <= 1e-2 * max |ref| (bf16 output rounding is ~4e-3 relative).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from kimi.kernels.triton import linear_small_m as lsm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not lsm.HAS_TRITON, reason="needs Triton"),
]

# Kimi-K2.6 decode shapes (N, K); lm_head at reduced N (the kernel does not depend on N beyond the grid; 20000
# is not a multiple of 64/128, which exercises the clamped-row path).
SHAPES = [
    (2112, 7168),
    (12288, 1536),
    (7168, 8192),
    (4096, 7168),
    (7168, 2048),
    (36864, 7168),
    (7168, 18432),
    (20000, 7168),
]
MS = [1, 3, 8, 16, 24, 33, 64]


def _check(x, w, y):
    ref = x.float() @ w.float().T  # [M, N]
    assert not torch.isnan(y).any(), "NaN left in the output (some tile not written)"
    err = (y.float() - ref).abs().max().item()
    tol = 1e-2 * ref.abs().max().item()
    assert err <= tol, f"max abs err {err:.4g} > {tol:.4g}"


def _configs_for(M, N, K):
    """The config production would use (table pick, else default) plus a split-K variant."""
    cfg = lsm.lookup(M, N, K, torch.device("cuda")) or lsm.SmallMConfig()
    out = [cfg]
    if cfg.split_k == 1 and math.ceil(N / cfg.block_n) < 256:
        out.append(lsm.SmallMConfig(**{**lsm.table_entry(cfg), "split_k": 4}))
    return out


@pytest.mark.parametrize("N,K", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_shapes_vs_fp32_reference(N, K):
    torch.manual_seed(N + K)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    for M in MS:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        for cfg in _configs_for(M, N, K):
            y = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            lsm.linear_small_m(x, w, out=y, config=cfg)
            torch.cuda.synchronize()
            try:
                _check(x, w, y)
            except AssertionError as e:
                raise AssertionError(f"M={M} N={N} K={K} {cfg.name()}: {e}") from None


@pytest.mark.parametrize("base", lsm.CONFIGS, ids=[c.name() for c in lsm.CONFIGS])
def test_every_config(base):
    """Every swept config (split 1 and 3, ragged K, N not a multiple of the tile, M=1 / 5 / 33 / 64)."""
    torch.manual_seed(1)
    for N, K in [(2112, 7168), (1000, 1000)]:
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        for M in (1, 5, 33, 64):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            for s in (1, 3):
                cfg = lsm.SmallMConfig(**{**lsm.table_entry(base), "split_k": s})
                y = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
                lsm.linear_small_m(x, w, out=y, config=cfg)
                try:
                    _check(x, w, y)
                except AssertionError as e:
                    raise AssertionError(f"M={M} N={N} K={K} {cfg.name()}: {e}") from None


def test_table_entries():
    """Every entry of the installed table (if any) at its bucket's largest M and one M below."""
    table = lsm.load_table()
    if not table["entries"] or table["gpu"] != torch.cuda.get_device_name():
        pytest.skip("no linear_small_m table for this GPU")
    torch.manual_seed(2)
    for (bucket, N, K), cfg in table["entries"].items():
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        for M in sorted({bucket, max(1, bucket - 3)}):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            y = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            lsm.linear_small_m(x, w, out=y, config=cfg)
            _check(x, w, y)


def test_strided_views_and_fp16():
    torch.manual_seed(3)
    N, K, M = 2112, 1536, 7
    xb = torch.randn(M, K + 64, device="cuda", dtype=torch.bfloat16)
    x = xb[:, :K]  # row stride K + 64
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    yb = torch.full((M, N + 32), float("nan"), device="cuda", dtype=torch.bfloat16)
    y = yb[:, :N]
    lsm.linear_small_m(x, w, out=y, config=lsm.SmallMConfig(split_k=2))
    _check(x, w, y)
    assert torch.isnan(yb[:, N:]).all(), "wrote outside the output view"
    # a row stride TMA cannot describe (not 16-byte aligned): the TMA config falls back to the pointer kernel
    xo = torch.randn(M, K + 1, device="cuda", dtype=torch.bfloat16)[:, :K]
    for cfg in (lsm.SmallMConfig(tma=True), lsm.SmallMConfig(tma=True, split_k=3)):
        _check(xo, w, lsm.linear_small_m(xo, w, config=cfg))
        _check(x, w, lsm.linear_small_m(x, w, config=cfg))
    xh, wh = x.half(), w.half()
    _check(xh, wh, lsm.linear_small_m(xh, wh, config=lsm.SmallMConfig()))


@pytest.mark.parametrize(
    "cfg",
    [
        lsm.SmallMConfig(),
        lsm.SmallMConfig(split_k=4),
        lsm.SmallMConfig(block_n=128, block_k=128, split_k=3, swap_ab=True),
        lsm.SmallMConfig(split_k=4, tma=True),
    ],
    ids=lambda c: c.name(),
)
def test_cuda_graph_replay_equals_eager(cfg):
    torch.manual_seed(4)
    N, K, M = 2112, 7168, 16
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        lsm.linear_small_m(x, w, out=y, config=cfg)  # compile + counter buffer outside capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        lsm.linear_small_m(x, w, out=y, config=cfg)
    for _ in range(3):  # new inputs each replay; split-K counters must be reset by every call
        x.copy_(torch.randn(M, K, device="cuda", dtype=torch.bfloat16))
        y.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        eager = lsm.linear_small_m(x, w, config=cfg)
        assert torch.equal(y, eager), "graph replay differs from eager (split-K must be deterministic)"
        _check(x, w, y)


def test_split_k_is_deterministic():
    torch.manual_seed(5)
    w = torch.randn(2112, 7168, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(64, 7168, device="cuda", dtype=torch.bfloat16)
    cfg = lsm.SmallMConfig(split_k=8)
    first = lsm.linear_small_m(x, w, config=cfg)
    for _ in range(20):
        assert torch.equal(lsm.linear_small_m(x, w, config=cfg), first)


def test_dispatch():
    torch.manual_seed(6)
    w = torch.randn(300, 520, device="cuda", dtype=torch.bfloat16)  # not in any table: F.linear exactly
    x = torch.randn(2, 3, 520, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(lsm.linear(x, w), F.linear(x, w))
    xl = torch.randn(65, 520, device="cuda", dtype=torch.bfloat16)  # M > 64: F.linear
    assert torch.equal(lsm.linear(xl, w), F.linear(xl, w))
    # a tabled shape (if a table is installed for this GPU) goes through Triton and keeps the leading dims
    table = lsm.load_table()
    if table["entries"] and table["gpu"] == torch.cuda.get_device_name():
        (bucket, N, K), _ = next(iter(table["entries"].items()))
        wt = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        xt = torch.randn(1, bucket, K, device="cuda", dtype=torch.bfloat16)
        y = lsm.linear(xt, wt)
        assert y.shape == (1, bucket, N)
        _check(xt[0], wt, y[0])


def test_errors():
    w = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError):
        lsm.linear_small_m(torch.randn(65, 128, device="cuda", dtype=torch.bfloat16), w)
    with pytest.raises(ValueError):
        lsm.linear_small_m(torch.randn(4, 127, device="cuda", dtype=torch.bfloat16), w)
    with pytest.raises(ValueError):
        lsm.linear_small_m(torch.randn(4, 128, device="cuda", dtype=torch.float32), w)
    with pytest.raises(ValueError):
        lsm.linear_small_m(torch.randn(4, 128, device="cuda", dtype=torch.bfloat16), w.t().contiguous().t())


@pytest.mark.parametrize("kind", ["rmsnorm", "silu_mul"])
def test_fused_prologues_vs_unfused(kind):
    """The RMSNorm (q_a_layernorm -> q_b) and SiLU * up (-> down) prologues against the unfused ops in fp32 after
    the same roundings; table configs where present, plus a pointer and a split-K variant."""
    from kimi.model.norm import rms_norm

    N, K = (12288, 1536) if kind == "rmsnorm" else (7168, 2048)
    torch.manual_seed(7)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    g = torch.rand(K, device="cuda", dtype=torch.bfloat16) + 0.5
    for M in (1, 5, 8, 32, 64):
        if kind == "rmsnorm":
            x = (torch.randn(M, K + 576, device="cuda", dtype=torch.bfloat16) * 3)[:, :K]  # a slice of qkv_a
            xin = rms_norm(x.float(), g.float(), 1e-6).to(torch.bfloat16)
            kw = dict(norm_weight=g, eps=1e-6)
        else:
            x = torch.randn(M, 2 * K, device="cuda", dtype=torch.bfloat16)
            xin = (F.silu(x[:, :K].float()).to(torch.bfloat16).float() * x[:, K:].float()).to(torch.bfloat16)
            kw = dict(silu_mul=True)
        base = lsm.lookup(M, N, K, torch.device("cuda")) or lsm.SmallMConfig()
        cfgs = [
            base,
            lsm.SmallMConfig(**{**lsm.table_entry(base), "tma": False}),
            lsm.SmallMConfig(**{**lsm.table_entry(base), "split_k": 2}),
        ]
        for cfg in cfgs:
            y = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            lsm.linear_small_m(x, w, out=y, config=cfg, **kw)
            try:
                _check(xin, w, y)
            except AssertionError as e:
                raise AssertionError(f"{kind} M={M} {cfg.name()}: {e}") from None


@pytest.mark.parametrize("M", [8, 32])
def test_pdl_chain_in_graph_equals_eager_without_pdl(M):
    """A decode-like chain of PDL kernels (norm -> split-K GEMM -> norm -> GEMM -> add+norm -> bmm -> GEMM,
    each reading the one before) captured in one CUDA graph with PDL on (kimi.kernels.triton.pdl) and L2 prefetch,
    replayed on new inputs copied into the static buffer, equals the same chain run eagerly with PDL off, bit for bit
    (same kernels and math; only the launch differs). A wait placed after a dependent read would show up as
    values of the previous replay's inputs (each replay gets new ones) or as the NaN the outputs are poisoned with."""
    from kimi.kernels.triton import fused, pdl
    from kimi.kernels.triton.bmm_small_m import bmm_small_m

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90")
    g = torch.Generator(device="cuda").manual_seed(M)
    D, Q, H, N = 7168, 1536, 64, 128

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * s).to(torch.bfloat16)

    w_n1, w_n2 = rnd(D, s=0.1) + 1, rnd(Q, s=0.1) + 1
    w_a, w_b, w_o = rnd(Q + 576, D, s=D**-0.5), rnd(H * N, Q, s=Q**-0.5), rnd(D, H * N, s=(H * N) ** -0.5)
    w_h = rnd(H, N, N, s=N**-0.5)

    def chain(x):
        h = fused.rms_norm(x, w_n1, 1e-6)
        qa = lsm.linear(h, w_a)  # split-K table entry for [2112, 7168]
        qn = fused.rms_norm(qa[:, :Q], w_n2, 1e-6)
        q = lsm.linear(qn, w_b).view(-1, H, N)
        o = bmm_small_m(q, w_h).reshape(-1, H * N)
        y = lsm.linear(o, w_o)
        return fused.add_rms_norm(x, y, None, w_n1, 1e-6)

    saved = pdl.set_enabled(False)
    try:
        xs = [rnd(M, D) for _ in range(3)]
        refs = [chain(x) for x in xs]
        pdl.set_enabled(True)
        static_x = xs[0].clone()
        chain(static_x)  # warm-up: compile the PDL variants, counter buffer outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(static_x)
        for x, (rh, ry) in zip(xs, refs):
            for t in out:
                t.fill_(float("nan"))
            static_x.copy_(x)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out[0], rh) and torch.equal(out[1], ry)
        # eager with PDL on too
        for x, (rh, ry) in zip(xs, refs):
            hn, yn = chain(x)
            assert torch.equal(hn, rh) and torch.equal(yn, ry)
    finally:
        pdl.set_enabled(saved)
