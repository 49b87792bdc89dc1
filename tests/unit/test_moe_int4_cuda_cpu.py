"""CPU tests of kimi's CUDA W4A16 GEMM's host side: the weight repack (kimi.ops.moe_int4_cuda.repack) read back
through the kernel's fragment layout equals `dequant_int4`, bad shapes are refused, and csrc/moe_w4a16.cu compiles for
sm_90a (nvcc; skipped with the reason where nvcc is absent). The kernel itself runs in tests/gpu."""

import shutil
import subprocess

import pytest
import torch

from kimi.ops import moe_int4_cuda as mc
from kimi.ops.cuda_ext import CSRC
from kimi.ops.quant import dequant_int4, pack_int4, unpack_int4


@pytest.mark.parametrize("E,N,K", [(1, 16, 64), (3, 48, 192), (2, 64, 512)])
def test_repack_reads_back_as_dequant_int4(E, N, K):
    torch.manual_seed(N + K)
    w = torch.randn(E, N, K)
    packs = [pack_int4(w[e]) for e in range(E)]
    packed = torch.stack([p[0] for p in packs])
    scale = torch.stack([p[1] for p in packs])
    wq, ws = mc.repack(packed, scale)
    assert wq.shape == (E, K // 64, N // 16, 32, 4) and wq.dtype == torch.int32
    assert ws.shape == (E, K // 64, N // 16, 8, 4) and ws.dtype == torch.bfloat16
    ref = torch.stack([dequant_int4(packed[e], scale[e], 32, torch.bfloat16).float() for e in range(E)])
    assert torch.equal(mc.unrepack(wq, ws), ref)


def test_fragment_layout_covers_each_weight_once():
    row, k = mc._pos_index("cpu")
    flat = (row.expand(4, 32, 8) * 64 + k).flatten()
    assert sorted(flat.tolist()) == list(range(16 * 64))
    for j in range(4):
        # k16 step j lies in scale group j // 2 (its MMA result can take the group's scale) ...
        assert set((k[j] // 32).flatten().tolist()) == {j // 2}
        # ... and a lane's inputs of it are 4 consecutive ones (one 8-byte load)
        for lane in range(32):
            assert sorted(set(k[j, lane].tolist())) == list(range(16 * j + 4 * (lane % 4), 16 * j + 4 * (lane % 4) + 4))


@pytest.mark.parametrize("shape,err", [((1, 20, 8), "N % 16"), ((1, 16, 4), "K % 64")])
def test_repack_refuses_shapes_the_kernel_cannot_take(shape, err):
    packed = torch.zeros(shape, dtype=torch.int32)
    scale = torch.zeros((shape[0], shape[1], shape[2] * 8 // 32), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=err):
        mc.repack(packed, scale)


def test_indexed_gemm_refuses_wrong_dtypes():
    wq = torch.zeros((1, 1, 1, 32, 4), dtype=torch.int32)
    ws = torch.zeros((1, 1, 1, 8, 4), dtype=torch.bfloat16)
    ids = torch.zeros(16, dtype=torch.int32)
    with pytest.raises(ValueError, match="x"):
        mc.indexed_gemm(torch.zeros((2, 64)), wq, ws, ids, ids[:1], ids[:1], 1, torch.zeros((2, 16), dtype=torch.bfloat16))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH (compile check of csrc/)")
def test_kernel_compiles_for_sm90a(tmp_path):
    r = subprocess.run(["nvcc", "-std=c++17", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "-c",
                        str(CSRC / "moe_w4a16.cu"), "-o", str(tmp_path / "moe_w4a16.o"), "-Xptxas", "-v"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "spill stores" in r.stderr and " 0 bytes spill stores" in r.stderr
    assert not [ln for ln in r.stderr.splitlines() if "spill stores" in ln and not ln.strip().startswith("0 bytes")]


def _mma_emulation(wq, ws, x):
    """y = W @ x^T for one expert, computed the way the kernel does, from the PTX ISA's mma.m16n8k16 (.bf16) fragment
    tables and the kernel's register decoding only (not from repack's index tables): A register r of lane (g, t) is
    (row g + 8 (r & 1), columns 2t + 8 (r >> 1) + {0, 1}); B register q is (rows 2t + 8q + {0, 1}, column g). The
    kernel fills A register r from nibbles 4r and 16 + 4r of word j as the bf16 values 128 + nibble, and B register q
    of step j from inputs 16j + 4t + 2q + {0, 1}; an MMA of the constant -136 over the same inputs starts each scale
    group's sum (steps 2 grp, 2 grp + 1 are group 2c + grp), and the group's scale of the row (row g: ws[.., g, 2 grp],
    row g + 8: ws[.., g, 2 grp + 1]) multiplies the group's sum.
    wq [kc, nt, 32, 4] int32, ws [kc, nt, 8, 4] bf16 (one expert of repack's chunk-major layout), x [M, K] float
    -> [nt * 16, M] float64."""
    kc, nt = wq.shape[:2]
    M = x.shape[0]
    y = torch.zeros(nt * 16, M, dtype=torch.float64)
    for tile in range(nt):
        for c in range(kc):
            for grp in range(2):
                part = torch.zeros(16, M, dtype=torch.float64)
                for j in (2 * grp, 2 * grp + 1):
                    A = torch.zeros(16, 16, dtype=torch.float64)
                    Bm = torch.zeros(16, M, dtype=torch.float64)
                    for lane in range(32):
                        g, t = lane // 4, lane % 4
                        w = int(wq[c, tile, lane, j]) & 0xFFFFFFFF
                        for r in range(4):
                            for e in range(2):
                                A[g + 8 * (r & 1), 2 * t + 8 * (r >> 1) + e] = 128 + ((w >> (4 * r + 16 * e)) & 0xF)
                        for q in range(2):
                            for e in range(2):
                                Bm[2 * t + 8 * q + e, :] = x[:, c * 64 + 16 * j + 4 * t + 2 * q + e].double()
                    part += A @ Bm - 136 * Bm.sum(0, keepdim=True)
                sc = ws[c, tile].double()  # [8 g, 4]
                scale = torch.cat([sc[:, 2 * grp], sc[:, 2 * grp + 1]])  # rows 0..7, 8..15
                y[tile * 16 : tile * 16 + 16] += scale[:, None] * part
    return y


def test_kernel_fragment_decoding_computes_the_quantised_product():
    torch.manual_seed(5)
    N, K, M = 32, 128, 3
    packed, scale = pack_int4(torch.randn(N, K))
    wq, ws = mc.repack(packed.unsqueeze(0), scale.unsqueeze(0))
    x = torch.randn(M, K).to(torch.bfloat16).float()
    # the unrounded weights (nibble - 8) * scale, in float64: what the kernel sums (dequant_int4 rounds them to bf16)
    w = (unpack_int4(packed).double()) * scale.double().repeat_interleave(32, dim=1)
    ref = w @ x.double().T
    assert torch.allclose(_mma_emulation(wq[0], ws[0], x), ref, rtol=0, atol=1e-9)


def test_config_for_picks_a_configuration_that_runs_the_shape():
    assert mc.config_for(4096, 7168) == mc.TABLE[(4096, 7168)]
    for n, k in [(128, 128), (128, 64), (256, 512), (7168, 2048)]:
        assert mc.config_valid(mc.config_for(n, k), n, k)
    with pytest.raises(ValueError, match="no configuration"):
        mc.config_for(48, 192)  # N / 16 = 3: no NT of CONFIGS divides it
