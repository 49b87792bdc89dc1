"""CPU tests of kimi.kernels.triton.linear_small_m: the dispatch is F.linear off the GPU, the table file format, and
(where
Triton is installed and its interpreter works with the installed numpy) the kernel itself under
TRITON_INTERPRET=1 in a subprocess, in fp16 (the interpreter's bf16 arithmetic is not faithful)."""

import json
import os
import textwrap

import pytest
import torch
import torch.nn.functional as F

from kimi.kernels.triton import linear_small_m as lsm
from tests.unit.triton_interp import run_interpreted


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_dispatch_is_f_linear(dtype):
    torch.manual_seed(0)
    w = torch.randn(2112, 256, dtype=dtype)
    for shape in [(1, 256), (8, 256), (2, 3, 256), (100, 256)]:
        x = torch.randn(*shape, dtype=dtype)
        assert torch.equal(lsm.linear(x, w), F.linear(x, w))


def test_m_bucket():
    assert [lsm.m_bucket(m) for m in (1, 2, 8, 9, 16, 17, 32, 33, 64)] == [1, 8, 8, 16, 16, 32, 32, 64, 64]
    for bad in (0, 65):
        with pytest.raises(ValueError):
            lsm.m_bucket(bad)


def test_table_file(tmp_path):
    assert lsm.load_table(tmp_path / "missing.json") == {"gpu": None, "entries": {}}
    p = tmp_path / "t.json"
    p.write_text(
        json.dumps(
            {
                "gpu": "NVIDIA H200",
                "date": "2026-01-01",
                "tuner": "test",
                "entries": [
                    {
                        "m": 8,
                        "n": 2112,
                        "k": 7168,
                        "config": {
                            "block_n": 64,
                            "block_k": 256,
                            "split_k": 4,
                            "num_warps": 4,
                            "num_stages": 4,
                            "swap_ab": False,
                        },
                    }
                ],
            }
        )
    )
    t = lsm.load_table(p)
    assert t["gpu"] == "NVIDIA H200"
    assert t["entries"] == {(8, 2112, 7168): lsm.SmallMConfig(block_n=64, block_k=256, split_k=4)}
    p.write_text(json.dumps({"gpu": "x", "date": "", "tuner": "t", "entries": [{"m": 8, "n": 2112, "config": {}}]}))
    with pytest.raises(ValueError):
        lsm.load_table(p)  # no k
    p.write_text(
        json.dumps({"gpu": "x", "date": "", "tuner": "t", "entries": [{"m": 8, "n": 1, "k": 1, "config": {"x": 1}}]})
    )
    with pytest.raises(ValueError):
        lsm.load_table(p)  # not a SmallMConfig field


def test_linear_small_m_rejects_cpu_tensors():
    x, w = torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(32, 64, dtype=torch.bfloat16)
    if not lsm.HAS_TRITON:
        with pytest.raises(RuntimeError):
            lsm.linear_small_m(x, w)
    elif os.environ.get("TRITON_INTERPRET", "0") != "1":
        with pytest.raises(ValueError):
            lsm.linear_small_m(x, w)


_INTERP_SCRIPT = textwrap.dedent("""
    import torch
    from kimi.kernels.triton.linear_small_m import SmallMConfig, linear_small_m
    torch.manual_seed(0)
    cases = [(1, 64, 256, SmallMConfig(block_n=32, block_k=64)),
             (3, 40, 200, SmallMConfig(block_n=32, block_k=64)),                   # ragged K, N < tile
             (17, 96, 512, SmallMConfig(block_n=32, block_k=64, split_k=3)),       # split-K fix-up
             (5, 100, 300, SmallMConfig(block_n=32, block_k=64, split_k=2, swap_ab=True)),
             (33, 64, 256, SmallMConfig(block_n=32, block_k=64, swap_ab=True)),
             (5, 100, 320, SmallMConfig(block_n=32, block_k=64, split_k=2, tma=True)),          # TMA descriptors
             (17, 96, 512, SmallMConfig(block_n=32, block_k=64, split_k=3, swap_ab=True, tma=True))]
    for M, N, K, cfg in cases:
        x, w = torch.randn(M, K).half(), torch.randn(N, K).half()
        ref = x.float() @ w.float().T
        for _ in range(2):  # the second call checks the split-K counters were reset
            y = torch.full((M, N), float("nan")).half()
            linear_small_m(x, w, out=y, config=cfg)
            err = (y.float() - ref).abs().max().item()
            assert err <= 1e-2 * ref.abs().max().item(), (M, N, K, cfg, err)
    print("OK")
""")


_INTERP_PROLOGUE = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from kimi.kernels.triton.linear_small_m import SmallMConfig, linear_small_m
    from kimi.model.norm import rms_norm
    torch.manual_seed(0)
    cases = [(3, 40, 200, SmallMConfig(block_n=32, block_k=64)),                    # ragged K, N < tile
             (8, 96, 256, SmallMConfig(block_n=32, block_k=64, split_k=2, swap_ab=True)),
             (5, 64, 192, SmallMConfig(block_n=32, block_k=64, tma=True)),
             (17, 96, 256, SmallMConfig(block_n=32, block_k=64, split_k=2, swap_ab=True, tma=True))]
    for M, N, K, cfg in cases:
        w = torch.randn(N, K).half()
        x = (torch.randn(M, K + 8) * 3).half()[:, :K]          # strided rows, as q_a is a slice of qkv_a
        g = (torch.rand(K) + 0.5).half()
        ref = rms_norm(x.float(), g.float(), 1e-6).half().float() @ w.float().T
        y = torch.full((M, N), float("nan")).half()
        linear_small_m(x, w, out=y, config=cfg, norm_weight=g, eps=1e-6)
        err = (y.float() - ref).abs().max().item()
        assert err <= 1e-2 * ref.abs().max().item(), ("rmsnorm", M, N, K, cfg, err)
        x2 = torch.randn(M, 2 * K).half()
        ref2 = (F.silu(x2[:, :K].float()).half().float() * x2[:, K:].float()).half().float() @ w.float().T
        y2 = torch.full((M, N), float("nan")).half()
        linear_small_m(x2, w, out=y2, config=cfg, silu_mul=True)
        err2 = (y2.float() - ref2).abs().max().item()
        assert err2 <= 1e-2 * ref2.abs().max().item(), ("silu_mul", M, N, K, cfg, err2)
    print("OK")
""")


def test_kernel_under_triton_interpreter():
    r = run_interpreted(_INTERP_SCRIPT, timeout=120)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


def test_prologues_under_triton_interpreter():
    """The fused RMSNorm and SiLU * up prologues (pointer and TMA kernels, split-K) against the unfused ops."""
    r = run_interpreted(_INTERP_PROLOGUE, timeout=180)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


def test_prologue_checks_and_cpu_dispatch():
    x, w = torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(32, 64, dtype=torch.bfloat16)
    assert lsm.prologue_config(x, w) is None  # CPU tensors: never the fused kernel
    if lsm.HAS_TRITON and os.environ.get("TRITON_INTERPRET", "0") != "1":
        with pytest.raises(ValueError):
            lsm.linear_small_m(x, w, norm_weight=torch.ones(64), silu_mul=True)
