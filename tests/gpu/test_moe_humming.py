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
