"""kimi.ops.l2_prefetch on the GPU: the bulk L2 prefetch kernel compiles for both cache policies, changes no data,
and leaves the GEMMs that read the prefetched weights bit-equal, eagerly and inside a CUDA graph.
Shapes: Kimi-K2.6's W_UV [64, 128, 512] and o_proj [7168, 8192] (bf16), fresh random values per test; the outputs
of the GEMMs are poisoned (NaN) before each run. The model-level check (graph replay bit-equal with the prefetch
on and off) is tests/gpu/test_gpu_model.py::test_attention_l2_prefetch_changes_no_output."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

DEV = "cuda"


def _weights(seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    w_uv = torch.randn(64, 128, 512, generator=g, device=DEV).to(torch.bfloat16)
    o_proj = (torch.randn(7168, 8192, generator=g, device=DEV) * 0.02).to(torch.bfloat16)
    x = torch.randn(32, 64, 512, generator=g, device=DEV).to(torch.bfloat16)
    return w_uv, o_proj, x


def _gemms(w_uv, o_proj, x):
    """The two GEMMs after the attention (kimi's kernels where their tables apply): o_lat @ W_UV^T, then o_proj."""
    from kimi.ops.bmm_small_m import bmm_heads
    from kimi.worker.gpu_model import dense_linear

    o = torch.full((x.shape[0], 64 * 128), float("nan"), device=DEV, dtype=torch.bfloat16)
    bmm_heads(x, w_uv, out=o.view(x.shape[0], 64, 128))
    return dense_linear(o, o_proj)


@pytest.mark.parametrize("evict_last", [True, False])
@pytest.mark.parametrize("fraction", [0.1, 0.3, 1.0])
def test_prefetch_changes_no_data_and_no_gemm_output(fraction, evict_last, monkeypatch):
    from kimi.ops import l2_prefetch

    w_uv, o_proj, x = _weights(int(fraction * 10) + 2 * evict_last)
    w_uv0, o_proj0 = w_uv.clone(), o_proj.clone()
    ref = _gemms(w_uv, o_proj, x)
    torch.cuda.synchronize()
    monkeypatch.setattr(l2_prefetch, "ATTN_PREFETCH", (fraction, evict_last))
    assert l2_prefetch.prefetch_before_attention(w_uv, o_proj)
    got = _gemms(w_uv, o_proj, x)
    torch.cuda.synchronize()
    assert torch.equal(w_uv, w_uv0) and torch.equal(o_proj, o_proj0)
    assert torch.isfinite(got).all()
    assert torch.equal(got, ref)


def test_prefetch_in_a_cuda_graph(monkeypatch):
    """Captured with the GEMMs after it, replayed over new inputs: bit-equal to the eager GEMMs without it."""
    from kimi.ops import l2_prefetch

    w_uv, o_proj, x = _weights(7)
    monkeypatch.setattr(l2_prefetch, "ATTN_PREFETCH", (0.3, True))
    _gemms(w_uv, o_proj, x)  # warm-up: Triton JIT outside the capture
    l2_prefetch.prefetch_before_attention(w_uv, o_proj)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(g):
        assert l2_prefetch.prefetch_before_attention(w_uv, o_proj)
        out = _gemms(w_uv, o_proj, x)
    torch.cuda.current_stream().wait_stream(s)
    monkeypatch.setattr(l2_prefetch, "ATTN_PREFETCH", None)
    for seed in (1, 2):
        x.copy_(torch.randn(x.shape, generator=torch.Generator(device=DEV).manual_seed(seed), device=DEV))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
        assert torch.equal(out, _gemms(w_uv, o_proj, x))


def test_unaligned_rows_raise():
    from kimi.ops import l2_prefetch

    w = torch.zeros(16, 100, device=DEV, dtype=torch.bfloat16)  # row pitch 200 bytes
    with pytest.raises(ValueError, match="pitch"):
        l2_prefetch.region_rows(w, 0.5)
