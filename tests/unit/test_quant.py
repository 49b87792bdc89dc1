"""kimi.model.quant against the compressed-tensors library (INT4) and explicit index math (INT4, FP8)."""

from __future__ import annotations

import pytest
import torch

from kimi.model.quant import FP8_MAX, dequant_fp8_block, dequant_int4, pack_int4, quant_fp8_block, unpack_int4

ct_helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize  # noqa: E402
from compressed_tensors.quantization.utils.helpers import calculate_qparams  # noqa: E402

pack_to_int32 = ct_helpers.pack_to_int32
unpack_from_int32 = ct_helpers.unpack_from_int32

CT_ARGS = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)


def _rand_w(n: int, k: int, seed: int) -> torch.Tensor:
    """float32 [n, k] with a different magnitude per group of 32."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.rand(n, k // 32, 1, generator=g) + 0.01
    return (torch.randn(n, k // 32, 32, generator=g) * mag).view(n, k)


@pytest.mark.parametrize("n,k,seed", [(16, 64, 0), (48, 256, 1), (7, 896, 2)])
def test_pack_int4_matches_compressed_tensors(n: int, k: int, seed: int) -> None:
    w = _rand_w(n, k, seed)
    packed, scale = pack_int4(w)
    assert packed.dtype == torch.int32 and packed.shape == (n, k // 8)
    assert scale.dtype == torch.bfloat16 and scale.shape == (n, k // 32)

    # The library's own scale choice (symmetric int4 -> absmax / 7.5), stored as bf16 like the checkpoints.
    groups = w.view(n, k // 32, 32)
    ref_scale, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), CT_ARGS)
    ref_scale = ref_scale.to(torch.bfloat16)
    assert torch.equal(scale, ref_scale)
    # The library's quantizer and packer, byte for byte.
    ref_q = ct_quantize(w, ref_scale, zp, CT_ARGS, dtype=torch.int8)
    assert int(ref_q.min()) >= -8 and int(ref_q.max()) <= 7
    assert int(ref_q.min()) == -8  # the absmax of a negative group lands on -8 (exercises the clamp range)
    ref_packed = pack_to_int32(ref_q, 4)
    assert torch.equal(packed, ref_packed)
    assert torch.equal(packed.view(torch.uint8), ref_packed.view(torch.uint8))
    # Dequant agrees with the library's dequantize, which multiplies in the scale's dtype (bf16); ours is the
    # exact float32 product (q has 4 bits, the scale 8), so rounding ours to bf16 must give the library's.
    ref_w = ct_dequantize(ref_q, ref_scale, zp, CT_ARGS, dtype=torch.float32)
    assert torch.equal(dequant_int4(packed, scale, dtype=torch.bfloat16).float(), ref_w)
    assert torch.equal(dequant_int4(packed, scale), ref_q.float() * ref_scale.float().repeat_interleave(32, -1))


def test_unpack_int4_matches_compressed_tensors_on_random_words() -> None:
    g = torch.Generator().manual_seed(3)
    words = torch.randint(-(2**31), 2**31, (33, 40), generator=g, dtype=torch.int64).to(torch.int32)
    assert (words < 0).any() and (words > 0).any()
    ours = unpack_int4(words)
    ref = unpack_from_int32(words, 4, torch.Size((33, 320)))
    assert ours.dtype == torch.int8 and ours.shape == (33, 320)
    assert torch.equal(ours, ref)


def test_int4_roundtrip_of_values() -> None:
    g = torch.Generator().manual_seed(4)
    q = torch.randint(-8, 8, (24, 128), generator=g, dtype=torch.int8)
    assert torch.equal(unpack_int4(pack_to_int32(q, 4)), q)
    # Weights that are exact multiples of a bf16 scale whose group absmax is 7.5 * scale survive exactly.
    scale = (torch.rand(24, 4, generator=g) + 0.5).to(torch.bfloat16)
    q[:, ::32] = -8  # absmax of every group is 8 * scale -> scale' = 8/7.5 * scale, not the same grid
    q[:, 1::32] = 7
    w = q.float() * scale.float().repeat_interleave(32, -1)
    packed, s2 = pack_int4(w)
    back = dequant_int4(packed, s2)
    # Quantisation error is at most half a step of the chosen scale (no clamping beyond -8 / 7).
    step = s2.float().repeat_interleave(32, -1)
    assert ((back - w).abs() <= step / 2 + 1e-6).all()
    assert torch.equal(unpack_int4(packed), torch.clamp(torch.round(w / step), -8, 7).to(torch.int8))


def test_int4_bit_layout_and_dequant_formula_by_explicit_index_math() -> None:
    n, k = 5, 64
    w = _rand_w(n, k, 5)
    packed, scale = pack_int4(w)
    deq = dequant_int4(packed, scale)
    q = unpack_int4(packed)
    words = packed.tolist()
    sc = scale.float().tolist()
    for r in range(n):
        for c in range(k):
            word = words[r][c // 8] & 0xFFFFFFFF
            nibble = (word >> (4 * (c % 8))) & 0xF
            assert q[r, c].item() == nibble - 8
            assert deq[r, c].item() == pytest.approx((nibble - 8) * sc[r][c // 32], abs=0, rel=1e-6)
            q_expect = max(-8, min(7, round(w[r, c].item() / sc[r][c // 32])))
            assert nibble - 8 == q_expect or abs(w[r, c].item() / sc[r][c // 32] % 1 - 0.5) < 1e-4
    # Little-endian byte view (docs/model-format.md, Tensors): byte b holds k = 2b (low nibble) and k = 2b + 1 (high).
    by = packed.view(torch.uint8)
    assert by.shape == (n, k // 2)
    assert torch.equal((by & 0xF).to(torch.int16) - 8, q[:, 0::2].to(torch.int16))
    assert torch.equal((by >> 4).to(torch.int16) - 8, q[:, 1::2].to(torch.int16))


def test_int4_zero_group_gets_eps_scale() -> None:
    w = torch.randn(3, 64)
    w[1, 32:] = 0.0
    packed, scale = pack_int4(w)
    assert scale[1, 1].item() == torch.finfo(torch.bfloat16).eps  # never 0 (no division by zero)
    assert torch.equal(unpack_int4(packed)[1, 32:], torch.zeros(32, dtype=torch.int8))
    assert torch.equal(dequant_int4(packed, scale)[1, 32:], torch.zeros(32))


def test_int4_errors() -> None:
    with pytest.raises(ValueError):
        pack_int4(torch.randn(4, 40))  # K not a multiple of 32
    with pytest.raises(ValueError):
        unpack_int4(torch.zeros(4, 4, dtype=torch.int64))
    packed, scale = pack_int4(torch.randn(4, 64))
    with pytest.raises(ValueError):
        dequant_int4(packed, scale[:, :1])


@pytest.mark.parametrize("n,k,block", [(200, 300, (128, 128)), (128, 256, (128, 128)), (70, 50, (32, 16))])
def test_fp8_block_dequant_by_explicit_loops(n: int, k: int, block: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g) * (torch.rand(n, 1, generator=g) * 4 + 0.1)
    q, scale_inv = quant_fp8_block(w, block)
    b0, b1 = block
    assert q.dtype == torch.float8_e4m3fn and q.shape == (n, k)
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == (-(-n // b0), -(-k // b1))
    deq = dequant_fp8_block(q, scale_inv, block)
    qf = q.float().tolist()
    s = scale_inv.tolist()
    expect = torch.tensor([[qf[i][j] * s[i // b0][j // b1] for j in range(k)] for i in range(n)])
    assert torch.equal(deq, expect)
    # Each tile's absmax maps to the e4m3 max, and the reconstruction is within e4m3 precision (3 mantissa bits).
    for bi in range(scale_inv.shape[0]):
        for bj in range(scale_inv.shape[1]):
            tile = q.float()[bi * b0 : (bi + 1) * b0, bj * b1 : (bj + 1) * b1]
            assert tile.abs().max().item() == FP8_MAX
    assert ((deq - w).abs() <= w.abs() * 2**-4 + scale_inv.max() * 2**-9).all()
    assert deq.dtype == torch.float32
    assert dequant_fp8_block(q, scale_inv, block, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_fp8_errors_and_zero_tile() -> None:
    w = torch.zeros(130, 20)
    w[:128] = torch.randn(128, 20)
    q, s = quant_fp8_block(w)
    assert s.shape == (2, 1) and s[1, 0].item() == 1.0  # an all-zero tile gets scale 1, not a division by zero
    assert torch.equal(dequant_fp8_block(q, s)[128:], torch.zeros(2, 20))
    with pytest.raises(ValueError):
        dequant_fp8_block(q, s[:1])


def test_make_experts_dequantises_fp8_parts_without_an_fp8_kernel():
    """FP8 expert parts (K2-Instruct tiles) under backends without an FP8 kernel ("ref", "triton") become RefExperts
    over dequant_fp8_block's weights: the same outputs as RefExperts built from those weights directly."""
    from kimi.backends.experts import make_experts
    from kimi.backends.experts.reference import RefExperts, dequant_fp8_parts
    from kimi.model.quant import dequant_fp8_block, quant_fp8_block

    g = torch.Generator().manual_seed(3)
    E, D, inter = 3, 256, 128
    w13 = torch.randn((E, 2 * inter, D), generator=g) / 16
    w2 = torch.randn((E, D, inter), generator=g) / 11
    q13 = [quant_fp8_block(w13[e]) for e in range(E)]
    q2 = [quant_fp8_block(w2[e]) for e in range(E)]
    parts = {
        "w13_fp8": torch.stack([q for q, _ in q13]),
        "w13_scale_inv": torch.stack([s for _, s in q13]),
        "w2_fp8": torch.stack([q for q, _ in q2]),
        "w2_scale_inv": torch.stack([s for _, s in q2]),
    }
    want13 = torch.stack([dequant_fp8_block(q, s) for q, s in q13])
    assert torch.equal(dequant_fp8_parts(parts, (128, 128), torch.float32)["w13"], want13)
    x = torch.randn((5, D), generator=g)
    ids = torch.tensor([[0, 1], [2, 5], [1, 2], [7, 0], [2, 2]])
    w = torch.rand((5, 2), generator=g)
    direct = RefExperts(want13, torch.stack([dequant_fp8_block(q, s) for q, s in q2]), 0)(x, w, ids)
    for backend in ("ref", "triton"):
        m = make_experts(backend, dict(parts), 0, 8, torch.float32)
        assert isinstance(m, RefExperts)
        assert torch.equal(m(x, w, ids), direct)
    exact = RefExperts(w13, w2, 0)(x, w, ids)
    assert (direct - exact).norm() < 0.05 * exact.norm()  # e4m3's own rounding (3 mantissa bits) only
