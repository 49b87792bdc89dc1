"""GPU test of the humming MoE backend (kimi.backends.experts.HummingInt4Experts) at the real Kimi expert shapes
with the schedules it picks there (kimi/kernels/tuning/humming.json entries and humming's heuristic), against the
dequantised reference backend on the same packed weights.

Shapes: 48 local experts of 384, top-8, hidden 7168, expert intermediate 2048, at 64 and 256 MoE tokens (the
bench's 8 and 32 local sequences under EP8: 64 and 256 expected local pairs). Fresh random inputs and routing per
case; tolerance max |y - ref| <= 2e-2 * max |ref| (bf16 GEMM outputs and intermediate, fp32 reference products).
"""

import pytest
import torch

from kimi.model.weights import random_packed_experts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("T", [64, 256])
def test_humming_backend_matches_ref_at_kimi_shapes(T):
    pytest.importorskip("humming")
    from kimi.backends.experts import make_experts

    E, D, inter, k, E_total, offset = 48, 7168, 2048, 8, 384, 96
    gen = torch.Generator(device="cuda").manual_seed(T)
    p13, s13 = random_packed_experts(E, 2 * inter, D, gen, "cuda")
    p2, s2 = random_packed_experts(E, D, inter, gen, "cuda")
    parts = lambda: {
        "w13_packed": p13.clone(),
        "w13_scale": s13.clone(),
        "w2_packed": p2.clone(),
        "w2_scale": s2.clone(),
    }
    hum = make_experts("humming", parts(), offset, E_total, torch.bfloat16)
    x = torch.randn((T, D), device="cuda", generator=gen).to(torch.bfloat16)
    ids = torch.rand((T, E_total), device="cuda", generator=gen).topk(k, dim=-1).indices
    wts = torch.rand((T, k), device="cuda", generator=gen)
    y = hum(x, wts, ids).float()
    c1, c2 = hum._configs(hum._m_local(T, k))
    from kimi.backends.experts.humming import humming_table_config

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
    print(
        f"T={T} gate_up {c1.get('block_shape')} ctas/SM {c1.get('num_ctas_per_sm')}, down {c2.get('block_shape')}: "
        f"max err {err:.3g} of max |ref| {scale:.3g}"
    )
    assert scale > 0 and err <= 2e-2 * scale, f"max err {err:.3g} vs max |ref| {scale:.3g}"


@pytest.mark.parametrize("T,E", [(8, 48), (64, 48), (256, 48), (2048, 48), (512, 24)])
def test_humming_fp8_backend_matches_ref(T, E):
    """FP8 block-quantised experts (K2-Instruct format: float8_e4m3fn, float32 scale per 128 x 128 tile) kept FP8 by
    HummingFp8Experts, against the reference backend on the same weights dequantised (kimi.model.quant), at the real
    shapes (48 local of 384 under EP8, 24 under EP16, D 7168, I 2048); tolerance max |y - ref| <= 2e-2 * max |ref|. The
    weights on the device take FP8 bytes (at most 1.1x the checkpoint's, humming's bf16 group scales included), and a
    CUDA graph's replay equals the eager call (allclose at the same tolerance: stream-K sums may differ in order)."""
    pytest.importorskip("humming")
    from kimi.backends.experts import make_experts
    from kimi.backends.experts.fp8 import HummingFp8Experts
    from kimi.model.weights import random_fp8_experts

    D, inter, k, E_total, offset = 7168, 2048, 8, 384, 96
    gen = torch.Generator(device="cuda").manual_seed(2000 + T)
    w13, s13 = random_fp8_experts(E, 2 * inter, D, gen, "cuda")
    w2, s2 = random_fp8_experts(E, D, inter, gen, "cuda")
    parts = lambda: {
        "w13_fp8": w13.clone(),
        "w13_scale_inv": s13.clone(),
        "w2_fp8": w2.clone(),
        "w2_scale_inv": s2.clone(),
    }
    ckpt_bytes = sum(t.numel() * t.element_size() for t in (w13, s13, w2, s2))
    hum = make_experts("humming", parts(), offset, E_total, torch.bfloat16)
    assert isinstance(hum, HummingFp8Experts)
    held = sum(t.numel() * t.element_size() for n, t in hum.state_dict().items() if not n.endswith("locks"))
    assert held <= 1.1 * ckpt_bytes, (held, ckpt_bytes)
    x = torch.randn((T, D), device="cuda", generator=gen).to(torch.bfloat16)
    ids = torch.rand((T, E_total), device="cuda", generator=gen).topk(k, dim=-1).indices
    wts = torch.rand((T, k), device="cuda", generator=gen)
    y = hum(x, wts, ids)
    out = torch.full_like(y, float("nan"))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out.copy_(hum(x, wts, ids))
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    y, out = y.float(), out.float()
    c1, c2 = hum._configs(hum._m_local(T, k))
    if E == 24 and torch.cuda.get_device_name() == "NVIDIA H200":  # humming.json's fp8 entry (EP16) ran
        assert c1["block_shape"] == [16, 256, 64], c1
    del hum, g
    torch.cuda.empty_cache()
    ref = make_experts("ref", parts(), offset, E_total, torch.bfloat16)
    y_ref = ref(x, wts, ids).float()
    assert torch.isfinite(y).all()
    err = (y - y_ref).abs().max().item()
    gerr = (out - y).abs().max().item()
    scale = y_ref.abs().max().item()
    print(
        f"T={T} fp8 gate_up {c1.get('block_shape')}, down {c2.get('block_shape')}: max err {err:.3g} of max |ref| "
        f"{scale:.3g}; graph vs eager {gerr:.3g}; {held / 2**20:.0f} MiB held for {ckpt_bytes / 2**20:.0f} MiB"
    )
    assert scale > 0 and err <= 2e-2 * scale, f"max err {err:.3g} vs max |ref| {scale:.3g}"
    assert gerr <= 2e-2 * scale, f"graph replay vs eager {gerr:.3g}"


def test_fp8_parts_fall_back_to_ref_off_humming():
    """FP8 parts under a backend without an FP8 kernel (triton) are dequantised into RefExperts, and humming
    rejects shapes whose gate / up tiles would straddle (I not a multiple of 128) with a ValueError naming them."""
    pytest.importorskip("humming")
    from kimi.backends.experts import make_experts
    from kimi.backends.experts.fp8 import HummingFp8Experts
    from kimi.backends.experts.reference import RefExperts
    from kimi.model.weights import random_fp8_experts

    gen = torch.Generator(device="cuda").manual_seed(5)
    w13, s13 = random_fp8_experts(4, 2 * 64, 256, gen, "cuda")
    w2, s2 = random_fp8_experts(4, 256, 64, gen, "cuda")
    parts = {"w13_fp8": w13, "w13_scale_inv": s13, "w2_fp8": w2, "w2_scale_inv": s2}
    assert isinstance(make_experts("triton", dict(parts), 0, 16, torch.bfloat16), RefExperts)
    with pytest.raises(ValueError, match="multiples of the 128 x 128"):
        HummingFp8Experts(w13, s13, w2, s2, 0, 16)
