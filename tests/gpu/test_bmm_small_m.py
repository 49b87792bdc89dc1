"""GPU tests of the per-head small-M GEMM (kimi.kernels.triton.bmm_small_m) against a float32 reference.

Reference: torch.einsum("mhk,hnk->mhn") of x.float(), w.float() on fresh random bf16 inputs; outputs poisoned with
NaN first; tolerance max |y - ref| <= 1e-2 * max |ref| (bf16 output rounding is ~4e-3 relative).
"""

import pytest
import torch

from kimi.kernels.triton import bmm_small_m as bmm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not bmm.HAS_TRITON, reason="needs Triton"),
]

H = 64
SHAPES = {"uk": (512, 128), "uv": (128, 512)}  # (N, K) per head: q_nope -> q_lat, o_lat -> o
MS = [1, 3, 8, 16, 33, 64]


def _inputs(M, N, K, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(M, H, K + 64, device="cuda", dtype=torch.bfloat16, generator=g)
    x = q[..., :K]  # strided, as q_nope is a slice of q [M, H, 192]
    w = torch.randn(H, N, K, device="cuda", dtype=torch.bfloat16, generator=g)
    return x, w, torch.einsum("mhk,hnk->mhn", x.float(), w.float())


def _check(y, ref, what):
    assert not torch.isnan(y).any(), f"{what}: NaN left in the output"
    err = (y.float() - ref).abs().max().item()
    tol = 1e-2 * ref.abs().max().item()
    assert err <= tol, f"{what}: max abs err {err:.4g} > {tol:.4g}"


@pytest.mark.parametrize("cfg", bmm.CONFIGS, ids=[c.name() for c in bmm.CONFIGS])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_config_vs_fp32(cfg, shape):
    N, K = SHAPES[shape]
    for M in MS:
        x, w, ref = _inputs(M, N, K, M * 7 + N)
        buf = torch.full((M, H * N), float("nan"), device="cuda", dtype=torch.bfloat16)
        bmm.bmm_small_m(x, w, out=buf.view(M, H, N), config=cfg)
        _check(buf.view(M, H, N), ref, f"{shape} M={M} {cfg.name()}")
        _check(bmm.bmm_small_m(x, w, config=cfg), ref, f"{shape} M={M} {cfg.name()} (allocated out)")


def test_ragged_shapes():
    cfg = bmm.BmmConfig(block_n=64, block_k=128)
    for M, N, K in [(5, 100, 72), (9, 48, 300)]:
        x, w, ref = _inputs(M, N, K, N + K)
        _check(bmm.bmm_small_m(x, w, config=cfg), ref, f"M={M} N={N} K={K}")


def test_dispatch_and_graph_replay():
    """bmm_heads (table pick or the torch path) equals the reference, also replayed from a CUDA graph with new
    inputs copied into the captured buffers."""
    for shape, (N, K) in SHAPES.items():
        for M in (1, 8, 32, 64, 100):  # 100: past MAX_M, the torch path
            x, w, ref = _inputs(M, N, K, M + 1)
            _check(bmm.bmm_heads(x, w), ref, f"dispatch {shape} M={M}")
        M = 8
        x, w, _ = _inputs(M, N, K, 3)
        xs = x.clone()
        out = torch.full((M, H, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            bmm.bmm_heads(xs, w, out=out)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            bmm.bmm_heads(xs, w, out=out)
        x2, _, _ = _inputs(M, N, K, 99)
        xs.copy_(x2)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        _check(out, torch.einsum("mhk,hnk->mhn", x2.float(), w.float()), f"graph {shape}")
