"""GPU kernels against their plain-PyTorch references (fresh random inputs, poisoned outputs).

- fused_experts_int4 (Triton W4A16 MoE) vs kimi.model.moe.fused_experts_ref on the dequantised weights
  (kimi.model.quant.dequant_int4), computed in float32 on the GPU; tolerance ||out - ref|| / ||ref|| <= 1e-2.
- FlashInferMLADecode vs kimi.model.attention.mla_decode_ref (float32), same tolerance.
Outputs are pre-filled with NaN, so an unwritten element fails the check.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

REL_TOL = 1e-2


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def make_int4_experts(E: int, H: int, I: int, gen: torch.Generator, device="cuda"):
    """Random experts quantised with kimi.model.quant.pack_int4; returns packed, scales and fp32 dequantised."""
    from kimi.model.quant import pack_int4

    p13, s13, p2, s2 = [], [], [], []
    for _ in range(E):
        w13 = torch.randn(2 * I, H, generator=gen, device=device) * (1.0 / H**0.5)
        w2 = torch.randn(H, I, generator=gen, device=device) * (1.0 / I**0.5)
        a, b = pack_int4(w13)
        c, d = pack_int4(w2)
        p13.append(a), s13.append(b), p2.append(c), s2.append(d)
    p13, s13, p2, s2 = (torch.stack(t) for t in (p13, s13, p2, s2))
    return p13, s13, p2, s2


def dequant_experts(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    from kimi.model.quant import dequant_int4

    return torch.stack([dequant_int4(packed[e], scale[e]) for e in range(packed.shape[0])])


def random_routing(T: int, E_total: int, k: int, gen: torch.Generator, device="cuda"):
    scores = torch.rand(T, E_total, generator=gen, device=device)
    topk_w, topk_ids = scores.topk(k, dim=1)
    topk_w = topk_w / topk_w.sum(1, keepdim=True) * 2.827  # Kimi's routed scaling
    return topk_w.float(), topk_ids.to(torch.int64)


_REAL = {}


def _real_experts():
    if not _REAL:
        gen = torch.Generator(device="cuda").manual_seed(1234)
        p13, s13, p2, s2 = make_int4_experts(48, 7168, 2048, gen)
        _REAL.update(p13=p13, s13=s13, p2=p2, s2=s2)
    return _REAL


@pytest.mark.parametrize(
    "T,H,I,E,E_total,k,offset",
    [
        (7, 256, 128, 4, 8, 3, 2),  # tiny
        (8, 7168, 2048, 48, 384, 8, 96),
        (64, 7168, 2048, 48, 384, 8, 96),
        (256, 7168, 2048, 48, 384, 8, 96),
        (2048, 7168, 2048, 48, 384, 8, 96),
    ],
)
def test_fused_experts_int4(T, H, I, E, E_total, k, offset):
    from kimi.kernels.triton.moe_w4a16 import fused_experts_int4
    from kimi.model.moe import fused_experts_ref

    gen = torch.Generator(device="cuda").manual_seed(T * 7919 + H)
    if H == 7168:
        w = _real_experts()
        p13, s13, p2, s2 = w["p13"], w["s13"], w["p2"], w["s2"]
    else:
        p13, s13, p2, s2 = make_int4_experts(E, H, I, gen)
    x = torch.randn(T, H, generator=gen, device="cuda").to(torch.bfloat16)
    topk_w, topk_ids = random_routing(T, E_total, k, gen)
    if T >= 8:  # make sure some tokens route to the local range at small T
        topk_ids[0, 0] = offset
        topk_ids[1, 0] = offset + E - 1
    out = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device="cuda")
    fused_experts_int4(x, p13, s13, p2, s2, topk_w, topk_ids, expert_offset=offset, num_experts_total=E_total, out=out)
    torch.cuda.synchronize()
    d13 = dequant_experts(p13, s13)
    d2 = dequant_experts(p2, s2)
    ref = fused_experts_ref(x.float(), d13, d2, topk_w, topk_ids, expert_offset=offset)
    del d13, d2
    assert not torch.isnan(out).any(), "unwritten / NaN output"
    err = rel_err(out, ref)
    print(f"moe T={T} H={H} I={I} E={E} rel_err={err:.2e}")
    assert err < REL_TOL


@pytest.mark.parametrize("B", [8, 64])
def test_flashinfer_mla_decode(B):
    from kimi.backends.attention.flashinfer import FlashInferMLADecode
    from kimi.model.attention import mla_decode_ref

    H, L, R, bs, ctx = 64, 512, 64, 64, 2048
    gen = torch.Generator(device="cuda").manual_seed(B)
    seq_lens = torch.randint(ctx // 2, ctx + 1, (B,), generator=gen, device="cuda")
    seq_lens[0] = ctx
    seq_lens[-1] = 1 + int(torch.randint(0, 63, (1,), generator=gen, device="cuda"))  # a short one
    max_blocks = ctx // bs
    num_blocks = B * max_blocks + 1
    perm = torch.randperm(num_blocks - 1, generator=gen, device="cuda") + 1  # block 0 = null block
    block_tables = perm[: B * max_blocks].view(B, max_blocks).to(torch.int64)
    nblk = (seq_lens + bs - 1) // bs
    block_tables[torch.arange(max_blocks, device="cuda")[None, :] >= nblk[:, None]] = 0
    kv_cache = torch.randn(num_blocks, bs, L + R, generator=gen, device="cuda").to(torch.bfloat16)
    q_lat = torch.randn(B, H, L, generator=gen, device="cuda").to(torch.bfloat16)
    q_pe = torch.randn(B, H, R, generator=gen, device="cuda").to(torch.bfloat16)
    scale = 0.130861  # Kimi softmax scale (192^-0.5 * mscale^2), docs/model-format.md, Math
    mla = FlashInferMLADecode(H, scale)
    mla.plan(seq_lens.tolist(), block_tables, bs)
    out = torch.full((B, H, L), float("nan"), dtype=torch.bfloat16, device="cuda")
    mla.run(q_lat, q_pe, kv_cache, out=out)
    torch.cuda.synchronize()
    ref = mla_decode_ref(q_lat, q_pe, kv_cache, block_tables, seq_lens, scale)
    assert not torch.isnan(out).any()
    err = rel_err(out, ref)
    print(f"mla B={B} rel_err={err:.2e}")
    assert err < REL_TOL


@pytest.mark.parametrize("T,H,I,E,E_total,k,offset", [(7, 256, 128, 4, 8, 3, 2), (64, 7168, 2048, 48, 384, 8, 96)])
@pytest.mark.parametrize("swap_ab", [False, True])
def test_fused_experts_int4_variants(T, H, I, E, E_total, k, offset, swap_ab):
    """Both operand orders of the kernels against the reference."""
    from kimi.kernels.triton.moe_w4a16 import MoeTileConfig, fused_experts_int4
    from kimi.model.moe import fused_experts_ref

    gen = torch.Generator(device="cuda").manual_seed(T * 31 + swap_ab)
    if H == 7168:
        w = _real_experts()
        p13, s13, p2, s2 = w["p13"], w["s13"], w["p2"], w["s2"]
    else:
        p13, s13, p2, s2 = make_int4_experts(E, H, I, gen)
    x = torch.randn(T, H, generator=gen, device="cuda").to(torch.bfloat16)
    topk_w, topk_ids = random_routing(T, E_total, k, gen)
    cfg = MoeTileConfig(16, 64, 128, 64, 128, 4, 4, swap_ab)
    out = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device="cuda")
    fused_experts_int4(x, p13, s13, p2, s2, topk_w, topk_ids, expert_offset=offset, config=cfg, out=out)
    ref = fused_experts_ref(x.float(), dequant_experts(p13, s13), dequant_experts(p2, s2), topk_w, topk_ids, offset)
    assert not torch.isnan(out).any()
    err = rel_err(out, ref)
    print(f"moe variant swap_ab={swap_ab} T={T} rel_err={err:.2e}")
    assert err < REL_TOL
