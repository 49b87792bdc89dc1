"""CPU tests of the fused Triton kernels (kimi/kernels/triton/fused.py) under Triton's interpreter (TRITON_INTERPRET=1,
in a
subprocess: the variable must be set before Triton is imported), against the plain-PyTorch references, on small
random inputs. fp16 / fp32 only (the interpreter's bf16 arithmetic is not faithful). Skipped, with the reason,
where Triton is not installed or its interpreter does not work with the installed numpy.

Covered: rms_norm / add_rms_norm (odd D, strided rows, out=); mla_rope_kv_write (both head-group sizes, odd H and L,
nothing but the mapped cache slots written); router_topk on both paths (one fused kernel with arrival counters, and the
two-kernel path) incl. several split-K pieces, E not a multiple of the expert tile, several row tiles, counters back at
zero, bitwise run-to-run determinism, exact ties, rows marked invalid (row_valid); moe_align_fused on both paths (the
single program's and the grid path's outputs equal moe_align's exactly; the two-kernel path's as sets per expert) and
the P threshold dispatch, and sized by a max_pairs bound; silu_mul_rows over an align's listed rows (exactly the local
pairs). The GPU versions of these checks: tests/gpu/test_fused.py.
"""

import textwrap

from tests.unit.triton_interp import run_interpreted

_PRELUDE = textwrap.dedent("""
    import torch
    from kimi.kernels.triton import fused
    from kimi.kernels.triton import linear_small_m as lsm
    torch.manual_seed(0)

    def rel(a, b):
        a, b = a.double(), b.double()
        return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
""")

_RMSNORM = textwrap.dedent("""
    for dt in (torch.float16, torch.float32):
        for T, D in [(1, 200), (3, 1000), (2, 1024)]:
            h, d1, d2 = (torch.randn(T, D).to(dt) for _ in range(3))
            w = (torch.rand(D) + 0.5).to(dt)
            ry = fused.add_rms_norm_ref(h, torch.zeros_like(h), None, w, 1e-6)[1]
            assert rel(fused.rms_norm(h, w, 1e-6), ry) <= 1e-3, (dt, T, D)
            big = torch.randn(T, D + 37).to(dt)  # strided rows, out=
            out = torch.full((T, D), float("nan")).to(dt)
            r = fused.rms_norm(big[:, :D], w, 1e-6, out=out)
            ref = fused.add_rms_norm_ref(big[:, :D], torch.zeros(T, D, dtype=dt), None, w, 1e-6)[1]
            assert r is out and rel(out, ref) <= 1e-3
            hn, yn = fused.add_rms_norm(h, d1, None, w, 1e-6)
            rh, ryy = fused.add_rms_norm_ref(h, d1, None, w, 1e-6)
            assert torch.equal(hn, rh) and rel(yn, ryy) <= 1e-3, (dt, T, D)
            hn, yn = fused.add_rms_norm(h, d1, d2, w, 1e-6)
            rh, ryy = fused.add_rms_norm_ref(h, d1, d2, w, 1e-6)
            assert rel(hn, rh) <= 1e-3 and rel(yn, ryy) <= 1e-3, (dt, T, D)
            # y normalises the stored (rounded) residual
            assert rel(yn, fused.add_rms_norm_ref(hn, torch.zeros_like(hn), None, w, 1e-6)[1]) <= 1e-6
    print("OK rmsnorm")
""")

_MLA = textwrap.dedent("""
    for T, H, N, R, L in [(1, 12, 16, 64, 96), (3, 64, 16, 64, 512), (70, 5, 8, 16, 40)]:  # T > 64: head group 32
        ql, bs, nb, P = 24, 4, 40, 50
        q = torch.randn(T, H, N + R).half()
        kv_a = torch.randn(T, ql + L + R).half()[:, ql:]  # strided rows
        w = (torch.rand(L) + 0.5).half()
        ang = torch.rand(P, R // 2) * 6.28
        cos, sin = ang.cos().contiguous(), ang.sin().contiguous()
        pos = torch.randint(0, P, (T,))
        slot = torch.randperm(nb * bs)[:T]
        c1 = torch.full((nb, bs, L + R), float("nan")).half()
        c2 = c1.clone()
        o = fused.mla_rope_kv_write(q, kv_a, w, 1e-6, cos, sin, pos, slot, c1, N)
        ro = fused.mla_rope_kv_write_ref(q, kv_a, w, 1e-6, cos, sin, pos, slot, c2, N)
        assert o.shape == (T, H, R) and o.is_contiguous() and not o.isnan().any()
        assert rel(o, ro) <= 1e-3, (T, H)
        f1, f2 = c1.view(-1, L + R), c2.view(-1, L + R)
        assert not f1[slot].isnan().any()
        assert rel(f1[slot][:, :L], f2[slot][:, :L]) <= 1e-3 and rel(f1[slot][:, L:], f2[slot][:, L:]) <= 1e-3
        mask = torch.ones(nb * bs, dtype=torch.bool)
        mask[slot] = False
        assert f1[mask].isnan().all()  # nothing else written
    print("OK mla")
""")

_ROUTER = textwrap.dedent("""
    for T, E, D, k, norm in [(1, 64, 300, 8, True), (5, 72, 1100, 8, True), (20, 64, 1100, 4, False),
                             (40, 40, 520, 8, True)]:
        x = torch.randn(T, D).half()
        gw = (torch.randn(E, D) * D ** -0.5).half()
        bias = torch.randn(E) * 0.05
        rw, rids = fused.router_topk_ref(x, gw, bias, k, 2.5, norm)
        for path in (True, False):
            w, ids = fused._router_topk(x, gw, bias, k, 2.5, norm, path)
            assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == (T, k)
            assert torch.equal(ids, rids), (T, E, D, path)  # same ids in the same (descending) order
            assert ((w - rw).abs() / rw.abs()).max().item() <= 1e-5, (T, E, D, path)
            w2, ids2 = fused._router_topk(x, gw, bias, k, 2.5, norm, path)
            assert torch.equal(w, w2) and torch.equal(ids, ids2)  # deterministic
        w3, ids3 = fused.router_topk(x, gw, bias, k, 2.5, norm)  # default dispatch
        assert torch.equal(ids3, rids)
        # the large-T launch of the two-kernel path (unsplit K, bigger tiles), forced from 1 row on
        large = fused.LAUNCH["router_logits_large"] | {"m_min": 1, "bt": 16, "be": 32, "bk": 64}
        launch = fused.LAUNCH | {"router_logits_large": large}
        w4, ids4 = fused._router_topk(x, gw, bias, k, 2.5, norm, False, launch=launch)
        assert torch.equal(ids4, rids) and ((w4 - rw).abs() / rw.abs()).max().item() <= 1e-5, (T, E, D, "large")
    # many calls: the counter regions wrap around and every counter is back at 0 after each call
    x = torch.randn(20, 1100).half()
    gw = (torch.randn(64, 1100) * 0.03).half()
    bias = torch.zeros(64)
    ref = fused._router_topk(x, gw, bias, 8, 1.0, True, False)
    for _ in range(lsm.NUM_COUNTER_REGIONS + 3):
        w, ids = fused._router_topk(x, gw, bias, 8, 1.0, True, True)
        # same ids; weights to fp32 rounding (the two paths sum the logits in different orders)
        assert torch.equal(ids, ref[1]) and ((w - ref[0]).abs() / ref[0].abs()).max().item() <= 1e-5
    assert all(int(b.abs().sum()) == 0 for b in lsm._counters.values())
    # exact ties (duplicated gate rows): both paths pick the lower expert id first
    gw = (torch.randn(16, 64) * 0.1).half()
    gw[9] = gw[3]
    gw[12] = gw[3]
    x = torch.randn(6, 64).half()
    x[:, :] = x[:, :] + 5 * gw[3].float().half()  # makes expert 3 (and its copies) the top pick
    b = torch.zeros(16)
    a = fused._router_topk(x, gw, b, 4, 1.0, True, True)
    c = fused._router_topk(x, gw, b, 4, 1.0, True, False)
    assert torch.equal(a[1], c[1]) and ((a[0] - c[0]).abs() / c[0].abs()).max().item() <= 1e-5
    assert (a[1][:, :3] == torch.tensor([3, 9, 12])).all()
    # row_valid (the decode graphs' padding rows): rows marked 0 get ids -1 and weights 0, the others are unchanged
    for T, dt in [(5, torch.int64), (20, torch.int32)]:  # 20 rows: two row tiles of the fused kernel
        x = torch.randn(T, 1100).half()
        gw = (torch.randn(64, 1100) * 0.03).half()
        bias = torch.randn(64) * 0.05
        valid = torch.ones(T, dtype=dt)
        valid[T // 2] = 0
        valid[-1] = 0
        rw, rids = fused.router_topk_ref(x, gw, bias, 8, 2.5, True)
        for path in (True, False):
            w, ids = fused._router_topk(x, gw, bias, 8, 2.5, True, path, valid)
            keep = valid != 0
            assert torch.equal(ids[keep], rids[keep]), (T, path)
            assert ((w[keep] - rw[keep]).abs() / rw[keep].abs()).max().item() <= 1e-5, (T, path)
            assert (ids[~keep] == -1).all() and (w[~keep] == 0).all(), (T, path)
            w1, ids1 = fused._router_topk(x, gw, bias, 8, 2.5, True, path, torch.ones(T, dtype=dt))
            assert torch.equal(ids1, rids), (T, path)  # all valid: as without row_valid
        for bad in (torch.ones(T + 1, dtype=dt), torch.ones(T, dtype=torch.float32)):
            try:
                fused.router_topk(x, gw, bias, 8, 2.5, True, row_valid=bad)
            except ValueError as e:
                assert "row_valid" in str(e)
            else:
                raise AssertionError("bad row_valid accepted")
    print("OK router")
""")

_ALIGN = textwrap.dedent("""
    from kimi.kernels.triton.moe_w4a16 import moe_align
    # (40, 8, 8) / (24, 8, 8): experts with one and with two blocks in one align
    cases = [(0, 8, 16), (1, 8, 8), (8, 8, 16), (33, 4, 16), (200, 8, 64), (200, 8, 16), (40, 8, 8), (24, 8, 8)]
    for T, k, bm in cases:
        ids = torch.rand(T, 32).topk(k, 1).indices.to(torch.int64)  # 32 global experts, 12 local from 8
        rs, rbe, rn, rmb = moe_align(ids, 12, 8, bm)
        for one in (True, False):
            s, be, npd, mb = fused._moe_align(ids, 12, 8, bm, one)
            assert s.dtype == be.dtype == npd.dtype == torch.int32
            assert mb == rmb and torch.equal(be, rbe) and torch.equal(npd, rn), (T, bm, one)
            if one:
                assert torch.equal(s, rs), (T, bm)  # same order as moe_align's stable sort
            else:  # atomic slots: the same pairs (and pads) in each expert's padded range, in any order
                key = be.repeat_interleave(bm).long() * (T * k + 1)
                assert torch.equal((key + s.long()).sort().values, (key + rs.long()).sort().values), (T, bm)
        # the grid path: several programs (256 pairs each), moe_align's exact output and order
        s, be, npd, mb = fused._moe_align(ids, 12, 8, bm, None, grid=True)
        assert mb == rmb and torch.equal(be, rbe) and torch.equal(npd, rn) and torch.equal(s, rs), (T, bm, "grid")
    # dispatch: from grid_min_p (ALIGN_GRID_MIN_P) pairs on, the grid path (exact order)
    ids = torch.rand(70, 32).topk(8, 1).indices.to(torch.int64)  # 560 pairs, 3 programs
    s, be, npd, mb = fused._moe_align(ids, 12, 8, 16, None, grid_min_p=512)
    rs, rbe, rn, rmb = moe_align(ids, 12, 8, 16)
    assert torch.equal(s, rs) and torch.equal(be, rbe) and torch.equal(npd, rn)
    # dispatch: P above the threshold takes the two-kernel path, still correct
    T = fused.ALIGN_ONE_PROGRAM_MAX_P // 8 + 3
    ids = torch.rand(T, 32).topk(8, 1).indices.to(torch.int64)
    s, be, npd, mb = fused.moe_align_fused(ids, 12, 8, 64)
    rs, rbe, rn, rmb = moe_align(ids, 12, 8, 64)
    assert mb == rmb and torch.equal(be, rbe) and torch.equal(npd, rn)
    key = be.repeat_interleave(64).long() * (T * 8 + 1)
    assert torch.equal((key + s.long()).sort().values, (key + rs.long()).sort().values)
    # max_pairs (DeepEP's low-latency layout: 12 local experts x 64 rows, the first counts[e] of each local, the
    # rest -1): buffers and blocks sized by the bound, the same blocks, num_padded and pairs as moe_align's
    counts = torch.randint(0, 7, (12,))
    ids = torch.where(torch.arange(64)[None, :] < counts[:, None], torch.arange(12)[:, None] + 8, -1).reshape(-1, 1)
    real = int(counts.sum())
    rs, rbe, rn, rmb = moe_align(ids, 12, 8, 16)
    for one, grid in ((True, False), (False, False), (None, True)):
        s, be, npd, mb = fused._moe_align(ids, 12, 8, 16, one, grid=grid, max_pairs=real + 3)
        assert mb == -(-(real + 3) // 16) + 12 < rmb and s.numel() == mb * 16, (one, grid)
        assert torch.equal(npd, rn) and torch.equal(be, rbe[:mb]), (one, grid)
        n = int(npd)
        if one is not False:
            assert torch.equal(s[:n], rs[:n]), (one, grid)
        key = be.repeat_interleave(16)[:n].long() * (ids.numel() + 1)
        assert torch.equal((key + s[:n].long()).sort().values, (key + rs[:n].long()).sort().values), (one, grid)
        # a bound below the real pairs: sized by it, the pairs that fit are still real local pairs
        s, be, npd, mb = fused._moe_align(ids, 12, 8, 16, one, grid=grid, max_pairs=real // 3)
        kept = s[s < ids.numel()].long()
        assert s.numel() == mb * 16 and (ids[kept, 0] >= 0).all(), (one, grid)
    print("OK align")
""")

_SILU_ROWS = textwrap.dedent("""
    from kimi.kernels.triton.moe_w4a16 import moe_align
    cases = [(1, 8, 8, 40, 4), (9, 8, 16, 100, 8), (33, 4, 16, 64, 3), (20, 8, 8, 48, 1), (0, 8, 8, 16, 4)]
    for T, k, bm, I, R in cases:
        ids = torch.rand(T, 32).topk(k, 1).indices.to(torch.int64)  # 32 global experts, 12 local from 8
        s, be, npd, mb = fused._moe_align(ids, 12, 8, bm, False)
        P = T * k
        y = torch.randn(P, 2 * I).half() * 3
        out = torch.full((P, I), float("nan")).half()
        o = fused.silu_mul_rows(y, s, npd, I, rows_per_program=R, out=out)
        assert o is out and o.dtype == y.dtype
        listed = sorted({int(r) for r in s[: int(npd)] if int(r) < P})
        loc = ((ids >= 8) & (ids < 20)).reshape(-1).nonzero().flatten().tolist()
        assert listed == loc, (T, listed, loc)  # exactly the local pairs
        written = ~o.isnan().all(1)
        assert written.nonzero().flatten().tolist() == loc, T  # listed rows written, no other row
        if listed:
            rows = torch.tensor(listed)
            assert rel(o[rows], fused.silu_mul_ref(y[rows], I)) <= 1e-3, (T, k, bm, I)
        # slots past num_rows are skipped even where the table lists real rows
        o0 = torch.full((P, I), float("nan")).half()
        fused.silu_mul_rows(y, s, torch.zeros(1, dtype=torch.int32), I, out=o0)
        assert o0.isnan().all()
    # gate / up interleaved in groups of G (kimi.kernels.cuda.moe_w4a16.glu_interleave's order): the same result as the
    # plain layout's on the columns permuted back
    from kimi.kernels.cuda.moe_w4a16 import glu_rows
    for T, I, G in [(5, 64, 32), (3, 48, 8)]:
        ids = torch.rand(T, 32).topk(8, 1).indices.to(torch.int64)
        s, be, npd, mb = fused._moe_align(ids, 12, 8, 16, False)
        y = torch.randn(T * 8, 2 * I).half() * 3
        yi = y[:, glu_rows(I, G)]  # column c of yi = column glu_rows[c] of y
        o = fused.silu_mul_rows(yi, s, npd, I, interleave=G)
        rows = sorted({int(r) for r in s[: int(npd)] if int(r) < T * 8})
        if rows:
            rows = torch.tensor(rows)
            assert torch.equal(o[rows], fused.silu_mul_rows(y, s, npd, I)[rows]), (T, I, G)
            g, u = fused.glu_split(yi[rows], I, G)
            assert torch.equal(g, y[rows, :I]) and torch.equal(u, y[rows, I:])
    try:
        fused.silu_mul_rows(y, s, npd, I, interleave=7)
        raise AssertionError("interleave 7 of I = 48 accepted")
    except ValueError as e:
        assert "interleave 7" in str(e)
    print("OK silu_rows")
""")


def _run(body: str, tag: str) -> None:
    r = run_interpreted(_PRELUDE + body, timeout=180)
    assert r.returncode == 0 and f"OK {tag}" in r.stdout, r.stdout + r.stderr


def test_rmsnorm_interpreter():
    _run(_RMSNORM, "rmsnorm")


def test_mla_rope_kv_write_interpreter():
    _run(_MLA, "mla")


def test_router_topk_interpreter():
    _run(_ROUTER, "router")


def test_moe_align_interpreter():
    _run(_ALIGN, "align")


def test_silu_mul_rows_interpreter():
    _run(_SILU_ROWS, "silu_rows")
