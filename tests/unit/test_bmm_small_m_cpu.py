"""CPU tests of kimi.kernels.triton.bmm_small_m: off the GPU `bmm_heads` is the torch path (equal to an einsum), the
input
checks, and (where Triton's interpreter is usable) the kernel itself under TRITON_INTERPRET=1 in a subprocess, in
fp16 (the interpreter's bf16 arithmetic is not faithful)."""

import os
import textwrap

import pytest
import torch

from kimi.kernels.triton import bmm_small_m as bmm
from tests.unit.triton_interp import run_interpreted


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_dispatch_is_torch_path(dtype):
    torch.manual_seed(0)
    q = torch.randn(5, 4, 24, dtype=dtype)
    x = q[..., :16]  # strided view, as q_nope is
    w = torch.randn(4, 32, 16, dtype=dtype)
    ref = torch.einsum("mhk,hnk->mhn", x.float(), w.float())
    y = bmm.bmm_heads(x, w)
    assert y.shape == (5, 4, 32) and y.is_contiguous()
    assert torch.allclose(y.float(), ref, rtol=2e-2, atol=2e-2)
    out = torch.full((5, 4 * 32), float("nan"), dtype=dtype)
    r = bmm.bmm_heads(x, w, out=out.view(5, 4, 32))
    assert r.data_ptr() == out.data_ptr() and torch.equal(out.view(5, 4, 32), y)


def test_input_checks():
    x, w = torch.randn(4, 2, 64, dtype=torch.bfloat16), torch.randn(2, 32, 64, dtype=torch.bfloat16)
    if not bmm.HAS_TRITON:
        with pytest.raises(RuntimeError):
            bmm.bmm_small_m(x, w)
        return
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        pytest.skip("interpreter accepts CPU tensors")
    for bad_x, bad_w in [(x, w), (x[:, :1], w), (x.float(), w), (torch.randn(65, 2, 64, dtype=torch.bfloat16), w)]:
        with pytest.raises(ValueError):
            bmm.bmm_small_m(bad_x, bad_w)


_INTERP_SCRIPT = textwrap.dedent("""
    import torch
    from kimi.kernels.triton.bmm_small_m import BmmConfig, bmm_small_m
    torch.manual_seed(0)
    cases = [(1, 4, 64, 32, BmmConfig(block_n=32, block_k=32)),
             (8, 3, 40, 48, BmmConfig(block_n=32, block_k=32)),                 # ragged K and N
             (17, 2, 64, 128, BmmConfig(block_n=16, block_k=64, swap_ab=True)),
             (33, 2, 96, 64, BmmConfig(block_n=64, block_k=32))]
    for M, H, N, K, cfg in cases:
        q = torch.randn(M, H, K + 8).half()
        x = q[..., :K]                                  # strided rows / heads
        w = torch.randn(H, N, K).half()
        ref = torch.einsum("mhk,hnk->mhn", x.float(), w.float())
        y = torch.full((M, H * N + 3), float("nan")).half()
        out = y[:, :H * N].view(M, H, N)                  # strided output rows
        bmm_small_m(x, w, out=out, config=cfg)
        assert not torch.isnan(out).any(), (M, H, N, K, cfg)
        assert torch.isnan(y[:, H * N:]).all()            # nothing written past the view
        err = (out.float() - ref).abs().max().item()
        assert err <= 1e-2 * ref.abs().max().item(), (M, H, N, K, cfg, err)
    print("OK")
""")


def test_kernel_under_triton_interpreter():
    r = run_interpreted(_INTERP_SCRIPT, timeout=120)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
