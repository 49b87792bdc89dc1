"""GPU test of the humming MoE backend (kimi.ops.moe_backend.HummingInt4Experts) at the real Kimi expert shapes
with the schedules it picks there (kimi/ops/humming_table.json entries and humming's heuristic), against the
dequantised reference backend on the same packed weights.

Shapes: 48 local experts of 384, top-8, hidden 7168, expert intermediate 2048, at 64 and 256 MoE tokens (the
bench's 8 and 32 local sequences under EP8: 64 and 256 expected local pairs). Fresh random inputs and routing per
case; tolerance max |y - ref| <= 2e-2 * max |ref| (bf16 GEMM outputs and intermediate, fp32 reference products).
"""

import pytest
import torch

from kimi.worker.dummy_weights import random_packed_experts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("T", [64, 256])
def test_humming_backend_matches_ref_at_kimi_shapes(T):
    pytest.importorskip("humming")
    from kimi.ops.moe_backend import make_experts

    E, D, inter, k, E_total, offset = 48, 7168, 2048, 8, 384, 96
    gen = torch.Generator(device="cuda").manual_seed(T)
    p13, s13 = random_packed_experts(E, 2 * inter, D, gen, "cuda")
    p2, s2 = random_packed_experts(E, D, inter, gen, "cuda")
    parts = lambda: {"w13_packed": p13.clone(), "w13_scale": s13.clone(), "w2_packed": p2.clone(),  # noqa: E731
                     "w2_scale": s2.clone()}
    hum = make_experts("humming", parts(), offset, E_total, torch.bfloat16)
    x = torch.randn((T, D), device="cuda", generator=gen).to(torch.bfloat16)
    ids = torch.rand((T, E_total), device="cuda", generator=gen).topk(k, dim=-1).indices
    wts = torch.rand((T, k), device="cuda", generator=gen)
    y = hum(x, wts, ids).float()
    c1, c2 = hum._configs(T, k)
    from kimi.ops.moe_backend import humming_table_config

    m_local = T * k * E // E_total
    for c, (n, kk) in ((c1, (2 * inter, D)), (c2, (D, inter))):  # the table's entry (if any) is what ran
        entry = humming_table_config(n, kk, m_local, torch.cuda.get_device_name(), heuristic={}) or {}
        assert all(c[f] == v for f, v in entry.items()), (n, kk, entry, c)
    del hum
    torch.cuda.empty_cache()
    ref = make_experts("ref", parts(), offset, E_total, torch.bfloat16)
    y_ref = ref(x, wts, ids).float()
    assert torch.isfinite(y).all()
    err = (y - y_ref).abs().max().item()
    scale = y_ref.abs().max().item()
    print(f"T={T} gate_up {c1.get('block_shape')} ctas/SM {c1.get('num_ctas_per_sm')}, down {c2.get('block_shape')}: "
          f"max err {err:.3g} of max |ref| {scale:.3g}")
    assert scale > 0 and err <= 2e-2 * scale, f"max err {err:.3g} vs max |ref| {scale:.3g}"


@pytest.mark.parametrize("T,skew,n_skew", [(256, 0.0, 0), (256, 3.0, 4), (256, 0.03, 24), (16, 0.0, 0), (64, -1.0, 0)])
def test_humming_split_align_matches_ref(T, skew, n_skew):
    """The split align path (HummingInt4Experts._forward_split: experts with <= 8 local pairs in 8-row blocks, the
    others in 16-row blocks by a second launch of each GEMM) against the reference backend, forced on, at token
    counts whose chosen schedules take 8-row blocks. skew > 0 biases the routing towards n_skew local experts
    (3.0 over 4: experts with 17+ pairs, several 16-row blocks; 0.03 over 24: many experts with 9-16 pairs);
    T=16: list B mostly empty; skew -1 routes every pair off this rank (both lists empty: zeros). Also a CUDA
    graph's replay equals the eager call bit for bit."""
    pytest.importorskip("humming")
    from kimi.ops.moe_backend import HummingInt4Experts, make_experts

    E, D, inter, k, E_total, offset = 48, 7168, 2048, 8, 384, 96
    gen = torch.Generator(device="cuda").manual_seed(1000 + T)
    p13, s13 = random_packed_experts(E, 2 * inter, D, gen, "cuda")
    p2, s2 = random_packed_experts(E, D, inter, gen, "cuda")
    parts = lambda: {"w13_packed": p13.clone(), "w13_scale": s13.clone(), "w2_packed": p2.clone(),  # noqa: E731
                     "w2_scale": s2.clone()}
    hum = make_experts("humming", parts(), offset, E_total, torch.bfloat16)
    hum.split_min_pairs = 0.0
    hum._tuning.clear()
    x = torch.randn((T, D), device="cuda", generator=gen).to(torch.bfloat16)
    scores = torch.rand((T, E_total), device="cuda", generator=gen)
    if skew > 0:
        scores[:, offset : offset + n_skew] += skew * torch.rand((T, n_skew), device="cuda", generator=gen)
    if skew < 0:
        scores[:, offset : offset + E] = -1.0
    ids = scores.topk(k, dim=-1).indices
    wts = torch.rand((T, k), device="cuda", generator=gen)
    if hum._split_configs(T, k) is None:
        pytest.fail(f"split align did not apply at T={T}: schedules {hum._configs(T, k)}")
    cnt = torch.bincount((ids[(ids >= offset) & (ids < offset + E)] - offset).flatten(), minlength=E)
    y = hum(x, wts, ids)
    torch.cuda.synchronize()
    out = torch.empty_like(y)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out.copy_(hum(x, wts, ids))
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, y), "graph replay differs from the eager call"
    y = y.float()
    del hum, g
    torch.cuda.empty_cache()
    ref = make_experts("ref", parts(), offset, E_total, torch.bfloat16)
    y_ref = ref(x, wts, ids).float()
    assert torch.isfinite(y).all()
    err = (y - y_ref).abs().max().item()
    scale = y_ref.abs().max().item()
    print(f"T={T} skew={skew}: experts with 9-16 / 17+ pairs {int(((cnt > 8) & (cnt <= 16)).sum())} / "
          f"{int((cnt > 16).sum())}; max err {err:.3g} of max |ref| {scale:.3g}")
    if skew < 0:
        assert scale == 0 and err == 0
    else:
        assert scale > 0 and err <= 2e-2 * scale, f"max err {err:.3g} vs max |ref| {scale:.3g}"
    if skew > 0:  # the case exercises what it is for
        assert (cnt > 16).any() if n_skew == 4 else int(((cnt > 8) & (cnt <= 16)).sum()) >= 5
    assert HummingInt4Experts.split_min_pairs == float("inf")  # the instance override did not leak
