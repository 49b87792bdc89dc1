"""CPU tests of kimi's CUDA W4A16 GEMM's host side: the weight repack (kimi.kernels.cuda.moe_w4a16.repack) read back
through the kernel's fragment layout equals `dequant_int4`, bad shapes are refused, and
kimi/kernels/cuda/csrc/moe_w4a16.cu compiles for
sm_90a (nvcc; skipped with the reason where nvcc is absent). The kernel itself runs in tests/gpu."""

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from kimi.kernels.cuda import moe_w4a16 as mc
from kimi.kernels.cuda.loader import CSRC
from kimi.model.quant import dequant_int4, pack_int4, unpack_int4


@pytest.mark.parametrize("E,N,K", [(1, 64, 64), (3, 192, 192), (2, 128, 512)])
def test_repack_reads_back_as_dequant_int4(E, N, K):
    torch.manual_seed(N + K)
    w = torch.randn(E, N, K)
    packs = [pack_int4(w[e]) for e in range(E)]
    packed = torch.stack([p[0] for p in packs])
    scale = torch.stack([p[1] for p in packs])
    wq, ws = mc.repack(packed, scale)
    assert wq.shape == (E, K // 16, 2 * N) and wq.dtype == torch.int32
    assert ws.shape == (E, K // 32, N) and ws.dtype == torch.bfloat16
    ref = torch.stack([dequant_int4(packed[e], scale[e], 32, torch.bfloat16).float() for e in range(E)])
    assert torch.equal(mc.unrepack(wq, ws), ref)


def test_fragment_layout_covers_each_weight_once():
    row, k = mc._pos_index("cpu")  # [4 words, 32 lanes, 8 nibbles] row in the n64 block, k in the k16 step
    flat = (row * 16 + k.expand(4, 32, 8)).flatten()
    assert sorted(flat.tolist()) == list(range(64 * 16))
    for lane in range(32):  # nibbles 0 and 4 of a word: the two values of A register 0 (row g, columns 2t, 2t + 1)
        g, t = lane // 4, lane % 4
        assert (row[0, lane, 0].item(), k[0, lane, 0].item()) == (g, 2 * t)
        assert (row[0, lane, 4].item(), k[0, lane, 4].item()) == (g, 2 * t + 1)


@pytest.mark.parametrize("shape,err", [((1, 48, 8), "N % 64"), ((1, 64, 4), "K % 64")])
def test_repack_refuses_shapes_the_kernel_cannot_take(shape, err):
    packed = torch.zeros(shape, dtype=torch.int32)
    scale = torch.zeros((shape[0], shape[1], shape[2] * 8 // 32), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=err):
        mc.repack(packed, scale)


def test_indexed_gemm_refuses_wrong_dtypes_and_layouts():
    wq = torch.zeros((1, 4, 128), dtype=torch.int32)
    ws = torch.zeros((1, 2, 64), dtype=torch.bfloat16)
    ids = torch.zeros(16, dtype=torch.int32)
    out = torch.zeros((2, 64), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="x"):
        mc.indexed_gemm(torch.zeros((2, 64)), wq, ws, ids, ids[:1], ids[:1], 1, out)
    with pytest.raises(ValueError, match="want \\[E, K/16, 2N\\]"):  # weights of another layout
        mc.indexed_gemm(
            torch.zeros((2, 64), dtype=torch.bfloat16), wq.view(1, 1, 4, 32, 4), ws, ids, ids[:1], ids[:1], 1, out
        )
    with pytest.raises(ValueError, match="want \\[E, K/16, 2N\\] int32 and \\[E, K/32, N\\] bf16"):
        mc.indexed_gemm(torch.zeros((2, 64), dtype=torch.bfloat16), wq, ws.float(), ids, ids[:1], ids[:1], 1, out)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH (compile check of csrc/)")
def test_kernel_compiles_for_sm90a(tmp_path):
    r = subprocess.run(
        [
            "nvcc",
            "-std=c++17",
            "-O3",
            "-gencode=arch=compute_90a,code=sm_90a",
            "-c",
            str(CSRC / "moe_w4a16.cu"),
            "-o",
            str(tmp_path / "moe_w4a16.o"),
            "-Xptxas",
            "-v",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "spill stores" in r.stderr and " 0 bytes spill stores" in r.stderr
    assert not [ln for ln in r.stderr.splitlines() if "spill stores" in ln and not ln.strip().startswith("0 bytes")]


def _mma_emulation(wq, ws, x):
    """y = W @ x^T for one expert, computed the way the kernel does, from the PTX ISA's mma.m16n8k16 (.bf16) fragment
    tables and the kernel's register decoding only (not from repack's index tables): A register r of lane (g, t) is
    (row g + 8 (r & 1), columns 2t + 8 (r >> 1) + {0, 1}); B register q is (rows 2t + 8q + {0, 1}, column g). The
    kernel fills A register r of 16-row tile c from word c of step j shifted right by (0, 8, 4, 12)[r], the low
    nibbles of its two 16-bit halves as the bf16 values 128 + nibble, and B register q of step j from inputs
    16j + 2t + 8q + {0, 1} (ldmatrix); an MMA of the constant -136 over the same inputs starts each scale group's
    sum (steps 2 grp, 2 grp + 1 of a k64 chunk are group 2c + grp), and the group's scale of row 16 c + g + 8 h
    (ws[group, 64 nb + 8 g + 2 c + h]) multiplies the group's sum.
    wq [K/16, 2N] int32, ws [K/32, N] bf16 (one expert of repack's layout), x [M, K] float -> [N, M] float64."""
    G, N = ws.shape
    K, M = G * 32, x.shape[0]
    w5 = wq.view(K // 16, N // 64, 32, 4)
    y = torch.zeros(N, M, dtype=torch.float64)
    for nb in range(N // 64):
        for c in range(4):
            for grp_g in range(G):
                part = torch.zeros(16, M, dtype=torch.float64)
                for j in (2 * grp_g, 2 * grp_g + 1):  # the group's two k16 steps
                    A = torch.zeros(16, 16, dtype=torch.float64)
                    Bm = torch.zeros(16, M, dtype=torch.float64)
                    for lane in range(32):
                        g, t = lane // 4, lane % 4
                        w = int(w5[j, nb, lane, c]) & 0xFFFFFFFF
                        for r in range(4):
                            sh = (0, 8, 4, 12)[r]
                            for e in range(2):
                                A[g + 8 * (r & 1), 2 * t + 8 * (r >> 1) + e] = 128 + ((w >> (sh + 16 * e)) & 0xF)
                        for q in range(2):
                            for e in range(2):
                                Bm[2 * t + 8 * q + e, :] = x[:, 16 * j + 2 * t + 8 * q + e].double()
                    part += A @ Bm - 136 * Bm.sum(0, keepdim=True)
                sc = ws[grp_g, 64 * nb : 64 * nb + 64].double()
                scale = torch.tensor([sc[8 * (i % 8) + 2 * c + i // 8] for i in range(16)], dtype=torch.float64)
                y[64 * nb + 16 * c : 64 * nb + 16 * c + 16] += scale[:, None] * part
    return y


def test_kernel_fragment_decoding_computes_the_quantised_product():
    torch.manual_seed(5)
    N, K, M = 128, 128, 3
    packed, scale = pack_int4(torch.randn(N, K))
    wq, ws = mc.repack(packed.unsqueeze(0), scale.unsqueeze(0))
    x = torch.randn(M, K).to(torch.bfloat16).float()
    # the unrounded weights (nibble - 8) * scale, in float64: what the kernel sums (dequant_int4 rounds them to bf16)
    w = (unpack_int4(packed).double()) * scale.double().repeat_interleave(32, dim=1)
    ref = w @ x.double().T
    assert torch.allclose(_mma_emulation(wq[0], ws[0], x), ref, rtol=0, atol=1e-9)


def test_config_for_picks_a_configuration_that_runs_the_shape():
    # the table's pick by expected local pairs: gate_up (4, 4, 4) up to 128, (8, 2, 3) up to 384, (8, 2, 2) above;
    # down (4, 2, 4) up to 128, (8, 2, 3) up to 384, (8, 2, 2) above
    assert mc.config_for(4096, 7168) == mc.config_for(4096, 7168, 128) == (4, 4, 4)
    assert mc.config_for(4096, 7168, 129) == mc.config_for(4096, 7168, 384) == (8, 2, 3)
    assert mc.config_for(4096, 7168, 385) == mc.config_for(4096, 7168, 4096) == (8, 2, 2)
    assert mc.config_for(7168, 2048) == mc.config_for(7168, 2048, 128) == (4, 2, 4)
    assert mc.config_for(7168, 2048, 129) == mc.config_for(7168, 2048, 384) == (8, 2, 3)
    assert mc.config_for(7168, 2048, 385) == mc.config_for(7168, 2048, 512) == (8, 2, 2)
    for n, k in [(128, 128), (128, 64), (256, 512), (7168, 2048), (64, 256)]:
        assert mc.config_valid(mc.config_for(n, k), n, k)
    with pytest.raises(ValueError, match="no configuration"):
        mc.config_for(48, 192)  # N % 64 != 0


def test_a_failed_extension_build_is_not_retried(tmp_path, monkeypatch):
    """kimi.kernels.cuda.loader.load raises the first build's error again at once instead of rebuilding (each MoE layer
    asks
    for the extension at model load)."""
    import time

    from kimi.kernels.cuda import loader

    bad = tmp_path / "broken.cpp"
    bad.write_text("this is not C++;\n")
    monkeypatch.setenv("KIMI_CSRC_CACHE", str(tmp_path / "cache"))
    name = "test_broken_build"
    try:
        with pytest.raises(Exception) as first:
            loader.load(name, [str(bad)])
        t0 = time.perf_counter()
        with pytest.raises(Exception) as again:
            loader.load(name, [str(bad)])
        assert again.value is first.value  # the cached failure, not a second build
        assert time.perf_counter() - t0 < 5.0  # a rebuild runs the compiler: seconds
    finally:
        loader._failed.pop(name, None)


def test_glu_interleave_orders_gate_and_up_rows_in_groups():
    """glu_interleave: position 2 G j + i holds gate row G j + i, position 2 G j + G + i up row G j + i (packed words
    and scales alike); a row count that is not whole pairs of groups is refused."""
    torch.manual_seed(0)
    E, I, K, G = 2, 96, 64, 32
    packed = torch.randint(-(2**31), 2**31 - 1, (E, 2 * I, K // 8), dtype=torch.int32)
    scale = torch.rand(E, 2 * I, K // 32).to(torch.bfloat16)
    p, s = mc.glu_interleave(packed, scale, G)
    for pos, src in [(0, 0), (31, 31), (32, I), (63, I + 31), (64, 32), (96, I + 32), (2 * I - 1, 2 * I - 1)]:
        assert torch.equal(p[:, pos], packed[:, src]) and torch.equal(s[:, pos], scale[:, src]), (pos, src)
    assert sorted(mc.glu_rows(I, G).tolist()) == list(range(2 * I))
    with pytest.raises(ValueError, match="whole pairs"):
        mc.glu_interleave(packed[:, :100], scale[:, :100], G)


def test_csrc_ships_inside_the_package():
    """The CUDA sources live in the kimi package and pyproject's package-data ships them (a non-editable install
    builds the extension from its own copy)."""
    import tomllib

    import kimi

    assert CSRC.is_relative_to(Path(kimi.__file__).resolve().parent)
    data = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    globs = data["tool"]["setuptools"]["package-data"]["kimi.kernels.cuda"]
    shipped = {p for g in globs for p in (CSRC.parent).glob(g)}
    assert {CSRC / "moe_w4a16.cu", CSRC / "moe_w4a16_binding.cpp"} <= shipped
