"""GPU tests of kimi's CUDA W4A16 indexed expert GEMM (kimi.kernels.cuda.moe_w4a16,
kimi/kernels/cuda/csrc/moe_w4a16.cu) and the `cuda` MoE
backend built on it.

Reference: every listed row y[r] = x[r // top_k] @ W_e^T in float32, W_e = `dequant_int4` of the expert's packed
weights (rounded to bf16; the kernel applies the scales in fp32 to unrounded products, so the two differ by that
rounding). Fresh random inputs per case; outputs poisoned with NaN before the kernel runs; tolerance
max |y - ref| <= 1e-2 * max |ref| (bf16 output rounding is ~4e-3).
Rows not listed must keep their poison (the kernel writes listed rows only).
"""

import pytest
import torch

from kimi.kernels.cuda import moe_w4a16 as mc
from kimi.model.quant import dequant_int4
from kimi.model.weights import random_packed_experts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _experts(E, N, K, gen):
    return random_packed_experts(E, N, K, gen, "cuda")  # uniform nibbles, bf16 scales


def _routing(T, E_total, k, gen):
    return torch.rand((T, E_total), device="cuda", generator=gen).topk(k, dim=-1).indices


@pytest.mark.parametrize(
    "E,N,K,T,k,E_total,offset",
    [
        (8, 256, 512, 5, 4, 16, 4),  # small: pads, experts with 0..several pairs
        (8, 128, 1024, 64, 8, 8, 0),  # every pair local, blocks with > 8 rows (second n8 half)
        (48, 4096, 7168, 64, 8, 384, 96),  # Kimi gate_up at 8 local sequences under EP8
        (48, 7168, 2048, 256, 8, 384, 96),  # Kimi down at 32 local sequences
    ],
)
def test_indexed_gemm_matches_dequant_reference(E, N, K, T, k, E_total, offset):
    from kimi.kernels.triton.fused import moe_align_fused

    gen = torch.Generator(device="cuda").manual_seed(N + K + T)
    packed, scale = _experts(E, N, K, gen)
    w, s = mc.repack(packed, scale)
    ids = _routing(T, E_total, k, gen)
    P = T * k
    sorted_ids, block_expert, num_padded, _ = moe_align_fused(ids, E, offset, 16)
    local = ((ids >= offset) & (ids < offset + E)).reshape(-1)
    rows = torch.nonzero(local).flatten()
    ex = ids.reshape(-1)[rows] - offset
    for top_k, R in ((k, T), (1, P)):  # gate_up reads x[pair // k], down reads act[pair]
        x = (torch.randn((R, K), device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
        ref = torch.empty((len(rows), N), device="cuda")
        for e in ex.unique().tolist():
            sel = ex == e
            ref[sel] = x[rows[sel] // top_k].float() @ dequant_int4(packed[e], scale[e], 32, torch.bfloat16).float().T
        tol = 1e-2 * ref.abs().max().item()
        cfgs = [(c, "early") for c in mc.CONFIGS if mc.config_valid(c, N, K)]
        for cfg, pdl in cfgs + [(cfgs[0][0], "off"), (cfgs[0][0], "late")]:
            out = torch.full((P, N), float("nan"), dtype=torch.bfloat16, device="cuda")
            mc.indexed_gemm(x, w, s, sorted_ids, block_expert, num_padded, top_k, out, config=cfg, pdl=pdl)
            err = (out[rows].float() - ref).abs().max().item()
            assert err <= tol, f"config {cfg}, pdl {pdl}, top_k {top_k}: max err {err:.3g} > {tol:.3g}"
            others = torch.ones(P, dtype=torch.bool, device="cuda")
            others[rows] = False
            assert torch.isnan(out[others]).all(), f"config {cfg}: a row that is not listed was written"


@pytest.mark.parametrize(
    "E,N,K,T,k,E_total,offset",
    [
        (8, 128, 1024, 60, 8, 8, 0),  # 60 pairs per expert: a last block of 12 rows (pads in the second half)
        (8, 256, 512, 5, 4, 16, 4),  # few pairs: mostly pad rows
        (48, 7168, 2048, 256, 8, 384, 96),  # Kimi down at 32 local sequences
    ],
)
def test_zero_filled_pad_rows_change_no_output(E, N, K, T, k, E_total, offset):
    """zero_pads (the pad rows' inputs zero-filled, no read) against token 0's row as the pads' inputs: bit-equal
    outputs at every configuration, both row modes (x[pair // k] and x[pair]), glu off; rows not listed keep their
    poison. A pad's MMA column is never stored, so its inputs must not change any listed row."""
    from kimi.kernels.triton.fused import moe_align_fused

    gen = torch.Generator(device="cuda").manual_seed(N + T + 3)
    w, s = mc.repack(*_experts(E, N, K, gen))
    ids = _routing(T, E_total, k, gen)
    P = T * k
    sorted_ids, block_expert, num_padded, _ = moe_align_fused(ids, E, offset, 16)
    rows = torch.nonzero(((ids >= offset) & (ids < offset + E)).reshape(-1)).flatten()
    assert (sorted_ids[: int(num_padded.item())] >= P).any(), "the routing left no pad row to test"
    for top_k, R in ((k, T), (1, P)):
        x = (torch.randn((R, K), device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
        for cfg in [c for c in mc.CONFIGS if mc.config_valid(c, N, K)]:
            outs = []
            for zero in (True, False):
                out = torch.full((P, N), float("nan"), dtype=torch.bfloat16, device="cuda")
                mc.indexed_gemm(x, w, s, sorted_ids, block_expert, num_padded, top_k, out, config=cfg, zero_pads=zero)
                outs.append(out)
            assert not torch.isnan(outs[0][rows]).any(), f"config {cfg}: a listed row was not written"
            assert torch.equal(torch.nan_to_num(outs[0], 1e9), torch.nan_to_num(outs[1], 1e9)), (
                f"config {cfg}, top_k {top_k}: zero-filled pads changed the outputs"
            )


def test_indexed_gemm_in_a_cuda_graph():
    from kimi.kernels.triton.fused import moe_align_fused

    gen = torch.Generator(device="cuda").manual_seed(7)
    E, N, K, T, k = 8, 256, 512, 16, 4
    packed, scale = _experts(E, N, K, gen)
    w, s = mc.repack(packed, scale)
    ids = _routing(T, 32, k, gen)
    x = torch.randn((T, K), device="cuda", generator=gen).to(torch.bfloat16)
    out = torch.full((T * k, N), float("nan"), dtype=torch.bfloat16, device="cuda")

    def step():
        a = moe_align_fused(ids, E, 0, 16)
        mc.indexed_gemm(x, w, s, a[0], a[1], a[2], k, out)

    step()
    eager = out.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    out.fill_(float("nan"))
    x.copy_(torch.randn((T, K), device="cuda", generator=gen).to(torch.bfloat16))
    g.replay()
    torch.cuda.synchronize()
    a = moe_align_fused(ids, E, 0, 16)
    fresh = torch.full_like(out, float("nan"))
    mc.indexed_gemm(x, w, s, a[0], a[1], a[2], k, fresh)
    assert torch.equal(torch.nan_to_num(out, 1e9), torch.nan_to_num(fresh, 1e9)), "replay != eager on new inputs"
    assert not torch.equal(torch.nan_to_num(out, 1e9), torch.nan_to_num(eager, 1e9)), "the replay read stale inputs"


@pytest.mark.parametrize(
    "E,I,K,T,k,E_total,offset",
    [
        (8, 128, 512, 9, 4, 16, 4),  # small: pads, blocks with > 8 rows
        (48, 2048, 7168, 256, 8, 384, 96),  # Kimi gate_up at 32 local sequences under EP8
    ],
)
def test_glu_epilogue_matches_silu_of_the_plain_gemm(E, I, K, T, k, E_total, offset):
    """indexed_gemm(glu=True) over glu_interleave'd weights = silu_mul_rows(interleave=32) of the plain GEMM's output
    on the same weights (both round the GEMM output and the SiLU to bf16; the SiLU's exp / division may differ in the
    last bits: within 4 bf16 ulps of the unfused value), and = silu(gate) * up of the fp32 reference within 1e-2 of
    its max; rows not listed keep their poison. Every configuration that runs the shape."""
    from kimi.kernels.triton.fused import moe_align_fused, silu_mul_rows

    gen = torch.Generator(device="cuda").manual_seed(I + T)
    packed, scale = _experts(E, 2 * I, K, gen)
    w, s = mc.repack(*mc.glu_interleave(packed, scale))
    ids = _routing(T, E_total, k, gen)
    P = T * k
    sorted_ids, block_expert, num_padded, _ = moe_align_fused(ids, E, offset, 16)
    rows = torch.nonzero(((ids >= offset) & (ids < offset + E)).reshape(-1)).flatten()
    ex = ids.reshape(-1)[rows] - offset
    x = (torch.randn((T, K), device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
    ref = torch.empty((len(rows), 2 * I), device="cuda")
    for e in ex.unique().tolist():
        sel = ex == e
        ref[sel] = x[rows[sel] // k].float() @ dequant_int4(packed[e], scale[e], 32, torch.bfloat16).float().T
    ref_act = torch.nn.functional.silu(ref[:, :I]) * ref[:, I:]
    others = torch.ones(P, dtype=torch.bool, device="cuda")
    others[rows] = False
    for cfg in [c for c in mc.CONFIGS if mc.config_valid(c, 2 * I, K)]:
        y = torch.full((P, 2 * I), float("nan"), dtype=torch.bfloat16, device="cuda")
        mc.indexed_gemm(x, w, s, sorted_ids, block_expert, num_padded, k, y, config=cfg)
        unfused = silu_mul_rows(y, sorted_ids, num_padded, I, interleave=mc.GLU_GROUP)[rows].float()
        act = torch.full((P, I), float("nan"), dtype=torch.bfloat16, device="cuda")
        mc.indexed_gemm(x, w, s, sorted_ids, block_expert, num_padded, k, act, config=cfg, glu=True)
        fused = act[rows].float()
        ulp = torch.exp2(torch.floor(torch.log2(unfused.abs().clamp_min(1e-30))) - 7)  # bf16 spacing at each value
        ulps = ((fused - unfused).abs() / ulp).max().item()
        assert ulps <= 4.0, f"config {cfg}: fused vs unfused differ by {ulps:.2f} bf16 ulps"
        err = (fused - ref_act).abs().max().item()
        assert err <= 1e-2 * ref_act.abs().max().item(), f"config {cfg}: max err {err:.3g} against the reference"
        assert torch.isnan(act[others]).all(), f"config {cfg}: a row that is not listed was written"
    with pytest.raises(ValueError, match="want"):
        mc.indexed_gemm(x, w, s, sorted_ids, block_expert, num_padded, k, y, glu=True)  # [P, 2I]: not [P, I]


@pytest.mark.parametrize(
    "E,I,D,T,k,E_total,offset",
    [
        (8, 128, 512, 9, 4, 16, 4),  # small: pads, blocks with > 8 rows, empty blocks
        (48, 2048, 7168, 256, 8, 384, 96),  # Kimi at 32 local sequences under EP8
    ],
)
def test_early_weights_down_equals_the_waiting_down(E, I, D, T, k, E_total, offset):
    """The down GEMM with early_weights (expert and first weight chunks read before griddepcontrol.wait) behind a
    gate_up GEMM, as cuda_experts_forward runs them (SiLU·up fused, and the plain gate_up + silu_mul_rows): bit-equal
    to the down GEMM that waits first, at every configuration that runs the shape and every PDL mode, each pair on a
    routing drawn afresh (the align's output buffers still hold the previous routing, so a read of them before it is
    rewritten would show); rows not listed keep their poison. Then in CUDA graphs (align, gate_up, early down), one
    per PDL mode: each replay after new routing ids and inputs are written equals a fresh eager waiting run, and
    writes no other row."""
    from kimi.kernels.triton.fused import moe_align_fused, silu_mul_rows

    gen = torch.Generator(device="cuda").manual_seed(I + T + 1)
    w13, s13 = mc.repack(*mc.glu_interleave(*_experts(E, 2 * I, D, gen)))
    w2, s2 = mc.repack(*_experts(E, D, I, gen))
    ids = _routing(T, E_total, k, gen)
    x = (torch.randn((T, D), device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
    P = T * k
    act = torch.empty((P, I), dtype=torch.bfloat16, device="cuda")
    y1 = torch.empty((P, 2 * I), dtype=torch.bfloat16, device="cuda")
    cfg13 = mc.config_for(2 * I, D)

    def run(early, cfg2, pdl, out, fused=True):
        sorted_ids, block_expert, num_padded, _ = moe_align_fused(ids, E, offset, 16)
        if fused:
            mc.indexed_gemm(x, w13, s13, sorted_ids, block_expert, num_padded, k, act, config=cfg13, pdl=pdl, glu=True)
            a = act
        else:
            mc.indexed_gemm(x, w13, s13, sorted_ids, block_expert, num_padded, k, y1, config=cfg13, pdl=pdl)
            a = silu_mul_rows(y1, sorted_ids, num_padded, I, interleave=mc.GLU_GROUP)
        mc.indexed_gemm(
            a, w2, s2, sorted_ids, block_expert, num_padded, 1, out, config=cfg2, pdl=pdl, early_weights=early
        )
        return out

    def listed():
        rows = torch.nonzero(((ids >= offset) & (ids < offset + E)).reshape(-1)).flatten()
        others = torch.ones(P, dtype=torch.bool, device="cuda")
        others[rows] = False
        return rows, others

    nan = lambda: torch.full((P, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    cases = [(c, pdl, True) for c in mc.CONFIGS if mc.config_valid(c, D, I) for pdl in ("early", "late", "off")]
    cases += [(mc.config_for(D, I, P // 8), pdl, False) for pdl in ("early", "off")]
    for cfg2, pdl, fused in cases:
        ids.copy_(_routing(T, E_total, k, gen))  # a new routing: the early run first, on the align's reused buffers
        got = run(True, cfg2, pdl, nan(), fused)
        want = run(False, cfg2, pdl, nan(), fused)
        rows, others = listed()
        assert not torch.isnan(want[rows]).any()
        assert torch.equal(got[rows], want[rows]), f"config {cfg2}, pdl {pdl}, fused {fused}: early weights differ"
        assert torch.isnan(got[others]).all(), f"config {cfg2}, pdl {pdl}: a row that is not listed was written"

    cfg2 = mc.config_for(D, I, P // 8)
    for pdl in ("early", "late", "off"):
        out = nan()
        run(True, cfg2, pdl, out)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run(True, cfg2, pdl, out)
        for _ in range(3):
            ids.copy_(_routing(T, E_total, k, gen))
            x.copy_((torch.randn((T, D), device="cuda", generator=gen) * 0.5).to(torch.bfloat16))
            out.fill_(float("nan"))
            g.replay()
            want = run(False, cfg2, pdl, nan())
            rows, others = listed()
            assert torch.equal(out[rows], want[rows]), f"pdl {pdl}: a replay differs from a fresh waiting run"
            assert torch.isnan(out[others]).all(), f"pdl {pdl}: a replay wrote a row that is not listed"


def test_cuda_backend_matches_ref_backend():
    from kimi.backends.experts import make_experts

    gen = torch.Generator(device="cuda").manual_seed(3)
    E, D, inter, T, k, E_total, offset = 8, 512, 256, 12, 4, 32, 8
    p13, s13 = _experts(E, 2 * inter, D, gen)
    p2, s2 = _experts(E, D, inter, gen)
    parts = lambda: {
        "w13_packed": p13.clone(),
        "w13_scale": s13.clone(),
        "w2_packed": p2.clone(),
        "w2_scale": s2.clone(),
    }
    ref = make_experts("ref", parts(), offset, E_total, torch.bfloat16)
    ours = make_experts("cuda", parts(), offset, E_total, torch.bfloat16)
    x = torch.randn((T, D), device="cuda", generator=gen).to(torch.bfloat16)
    ids = _routing(T, E_total, k, gen)
    wts = torch.rand((T, k), device="cuda", generator=gen)
    y_ref = ref(x, wts, ids).float()
    for glu in (True, False):  # SiLU(gate) * up in the gate_up GEMM's epilogue / by the silu_mul_rows kernel
        ours.glu = glu
        y = ours(x, wts, ids).float()
        err = (y - y_ref).abs().max().item()
        assert err <= 2e-2 * y_ref.abs().max().item(), f"glu {glu}: max err {err:.3g}"
    with pytest.raises(ValueError, match="bf16"):
        make_experts("cuda", parts(), offset, E_total, torch.float16)


def test_repack_builds_hummings_layout_and_auto_switches_by_size():
    """kimi's repack equals humming's transformed tensors bit for bit (the layout the auto backend shares), and the
    auto backend (HummingInt4Experts with cuda_decode) runs kimi's GEMM up to cuda_max_pairs expected local pairs and
    humming's above, both matching the reference backend (2e-2 of max |ref|)."""
    pytest.importorskip("humming")
    from kimi.backends.experts import make_experts
    from kimi.backends.experts.humming import HummingInt4Experts

    gen = torch.Generator(device="cuda").manual_seed(11)
    E, D, inter, k, E_total, offset = 8, 512, 256, 4, 32, 8
    p13, s13 = _experts(E, 2 * inter, D, gen)
    p2, s2 = _experts(E, D, inter, gen)
    parts = lambda: {
        "w13_packed": p13.clone(),
        "w13_scale": s13.clone(),
        "w2_packed": p2.clone(),
        "w2_scale": s2.clone(),
    }
    auto = make_experts("auto", parts(), offset, E_total, torch.bfloat16)
    assert isinstance(auto, HummingInt4Experts) and auto.cuda_max_pairs > 0
    assert auto.glu_group == mc.GLU_GROUP  # gate_up rows interleaved (kimi's GEMM writes SiLU(gate) * up)
    for layer, (p, s) in ((auto.l1, mc.glu_interleave(p13, s13)), (auto.l2, (p2, s2))):
        w, sc = mc.repack(p, s)
        assert torch.equal(w, layer.weight) and torch.equal(sc, layer.weight_scale)
    ref = make_experts("ref", parts(), offset, E_total, torch.bfloat16)
    calls = []
    orig = mc.indexed_gemm
    for T in (
        4,
        64,
    ):  # 4 * 4 * 8 / 32 = 4 expected local pairs: kimi's GEMM; 64 tokens with max pairs set to 8: humming's
        auto.cuda_max_pairs = 512 if T == 4 else 8
        x = torch.randn((T, D), device="cuda", generator=gen).to(torch.bfloat16)
        ids = _routing(T, E_total, k, gen)
        wts = torch.rand((T, k), device="cuda", generator=gen)
        mc.indexed_gemm = lambda *a, _T=T, **kw: (calls.append(_T), orig(*a, **kw))[1]
        try:
            y = auto(x, wts, ids).float()
        finally:
            mc.indexed_gemm = orig
        y_ref = ref(x, wts, ids).float()
        err = (y - y_ref).abs().max().item()
        assert err <= 2e-2 * y_ref.abs().max().item(), f"T={T}: max err {err:.3g}"
    assert calls == [4, 4], f"kimi's GEMM ran for steps {calls} (want both GEMMs of the T=4 step only)"


def test_auto_uses_hummings_gemm_where_humming_re_encodes_the_weights(caplog):
    """A tensor without the code 0 (value -8) is re-encoded by humming as sign-magnitude, which kimi's kernel does not
    read: the auto backend then says why (a warning) and runs humming's GEMM at every size, still matching the
    reference backend (2e-2 of max |ref|)."""
    pytest.importorskip("humming")
    from kimi.backends.experts import make_experts
    from kimi.backends.experts.humming import HummingInt4Experts

    gen = torch.Generator(device="cuda").manual_seed(13)
    E, D, inter, k, E_total, offset = 8, 512, 256, 4, 32, 8
    p13, s13 = _experts(E, 2 * inter, D, gen)
    p2, s2 = _experts(E, D, inter, gen)
    nib = p13.view(torch.uint8)  # two nibbles per byte: a 0 nibble becomes 1, so no weight is -8
    lo, hi = nib & 0x0F, nib >> 4
    nib.copy_(torch.where(lo == 0, 1, lo) | (torch.where(hi == 0, 1, hi) << 4))
    parts = lambda: {
        "w13_packed": p13.clone(),
        "w13_scale": s13.clone(),
        "w2_packed": p2.clone(),
        "w2_scale": s2.clone(),
    }
    with caplog.at_level("WARNING", logger="kimi"):
        auto = make_experts("auto", parts(), offset, E_total, torch.bfloat16)
    assert isinstance(auto, HummingInt4Experts) and auto.cuda_max_pairs == 0
    assert "not uint4 codes" in caplog.text, caplog.text
    ref = make_experts("ref", parts(), offset, E_total, torch.bfloat16)
    x = torch.randn((6, D), device="cuda", generator=gen).to(torch.bfloat16)
    ids = _routing(6, E_total, k, gen)
    wts = torch.rand((6, k), device="cuda", generator=gen)
    y, y_ref = auto(x, wts, ids).float(), ref(x, wts, ids).float()
    err = (y - y_ref).abs().max().item()
    assert err <= 2e-2 * y_ref.abs().max().item(), f"max err {err:.3g}"


def _low_latency_layout(E_local, E_total, offset, ranks, tokens_per_rank, k, D, gen):
    """What DeepEP's low-latency dispatch delivers to one rank: x [E_local * M * N, D] expert-major (expert e's rows
    at e * M * N, its first count_e valid, the rest NaN: DeepEP leaves them as they were), ids [rows, 1] = the local
    expert's global id for valid rows, -1 for the others. Counts come from routing ranks x tokens_per_rank tokens
    top-k over E_total experts. Returns x, ids, the valid-row mask and the step's tokens."""
    n_tok = ranks * tokens_per_rank
    route = _routing(n_tok, E_total, k, gen)  # [n_tok, k]
    slab = tokens_per_rank * ranks  # M * N rows per local expert
    x = torch.full((E_local * slab, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    ids = torch.full((E_local * slab, 1), -1, device="cuda", dtype=torch.int64)
    for e in range(E_local):
        c = int((route == offset + e).any(1).sum())
        x[e * slab : e * slab + c] = torch.randn((c, D), device="cuda", generator=gen).to(torch.bfloat16)
        ids[e * slab : e * slab + c] = offset + e
    return x, ids, ids[:, 0] >= 0, n_tok


@pytest.mark.parametrize("backend", ["cuda", "auto"])
def test_expert_major_rows_match_the_reference(backend):
    """DeepEP's low-latency layout through run_experts' expert-major call (k == 1, weights not applied, rows
    without a local expert left unset, the align and GEMM grids sized by max_pairs = the step's tokens x top-k):
    every valid row matches the reference backend on the same rows within 2e-2 of max |ref|, is finite although
    the padding rows hold NaN, as the plain call's rows do (which sum k == 1 pairs of weight 1 and write every row).
    With `auto`, a small expected_pairs runs kimi's GEMM and a large one humming's."""
    from kimi.backends.experts import make_experts
    from kimi.model.moe import DispatchResult, run_experts

    if backend == "auto":
        pytest.importorskip("humming")
    gen = torch.Generator(device="cuda").manual_seed(11)
    E, D, inter, k, E_total, offset, ranks, m = 8, 512, 256, 4, 32, 8, 4, 16
    p13, s13 = _experts(E, 2 * inter, D, gen)
    p2, s2 = _experts(E, D, inter, gen)
    parts = lambda: {
        "w13_packed": p13.clone(),
        "w13_scale": s13.clone(),
        "w2_packed": p2.clone(),
        "w2_scale": s2.clone(),
    }
    ours = make_experts(backend, parts(), offset, E_total, torch.bfloat16)
    assert ours.expert_major_ok
    ref = make_experts("ref", parts(), offset, E_total, torch.bfloat16)
    x, ids, valid, n_tok = _low_latency_layout(E, E_total, offset, ranks, m, k, D, gen)
    w = torch.ones(ids.shape, dtype=torch.float32, device="cuda")
    y_ref = ref(torch.where(valid[:, None], x, 0), w, ids).float()[valid]
    scale = y_ref.abs().max().item()
    plain = ours(x, w, ids).float()
    assert (plain[valid] - y_ref).abs().max().item() <= 2e-2 * scale and torch.equal(plain[~valid], 0 * plain[~valid])
    calls = []
    orig = mc.indexed_gemm
    for expected in (4, 4096):  # auto: kimi's GEMM, then humming's (AUTO_CUDA_MAX_PAIRS sits between)
        recv = DispatchResult(x, w, ids, expert_major=True, max_pairs=n_tok * k, expected_pairs=expected)
        mc.indexed_gemm = lambda *a, **kw: (calls.append(expected), orig(*a, **kw))[1]  # noqa: B023 - a spy
        try:
            y = run_experts(ours, recv).float()[valid]
        finally:
            mc.indexed_gemm = orig
        err = (y - y_ref).abs().max().item()
        assert torch.isfinite(y).all() and scale > 0 and err <= 2e-2 * scale, f"expected {expected}: {err:.3g}"
    assert calls == ([4, 4, 4096, 4096] if backend == "cuda" else [4, 4]), calls
    # an idle step (no token on any rank): max_pairs 0, nothing to compute, no empty grid launched
    y = run_experts(ours, DispatchResult(x, w, ids, expert_major=True, max_pairs=0, expected_pairs=1))
    assert y.shape == x.shape and y.dtype == x.dtype
    for kw in ({"expert_major": True}, {}):  # the backends themselves: unset rows / zeros
        y = ours(x, w, ids, max_pairs=0, **kw)
        assert y.shape == x.shape and (kw or torch.equal(y, torch.zeros_like(y)))


def test_a_failed_launch_raises_runtime_error():
    """A configuration the extension was not built with (the launcher returns cudaErrorInvalidValue) is a
    RuntimeError naming the launcher and the configuration: the message is formatted before TORCH_CHECK (streaming
    int64 values into TORCH_CHECK's message segfaults the process)."""
    from kimi.kernels.triton.fused import moe_align_fused

    gen = torch.Generator(device="cuda").manual_seed(11)
    E, N, K, T, k = 4, 128, 256, 4, 2
    w, s = mc.repack(*_experts(E, N, K, gen))
    ids = _routing(T, E, k, gen)
    sorted_ids, block_expert, num_padded, _ = moe_align_fused(ids, E, 0, 16)
    x = torch.randn((T, K), device="cuda", generator=gen).to(torch.bfloat16)
    out = torch.empty((T * k, N), dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match=r"kimi_w4a16_indexed_gemm: .*\(nt=3, kw=1, stages=1, n=128, k=256\)"):
        mc.load_extension().indexed_gemm(
            x, w, s, sorted_ids, block_expert, num_padded, out, k, 3, 1, 1, 0, False, False, True
        )
    torch.cuda.synchronize()  # the device is still usable
    mc.indexed_gemm(x, w, s, sorted_ids, block_expert, num_padded, k, out)
    torch.cuda.synchronize()
