"""kimi.ops.l2_prefetch on the GPU (pytest -m gpu): the kernel runs for both policies at the shapes the decode graph
uses, issues the bytes asked for, and changes no memory."""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


@pytest.mark.parametrize("policy", ["evict_last", "evict_normal"])
@pytest.mark.parametrize("shape,cols,dtype", [((7168, 8192), 2048, torch.bfloat16), ((2112, 7168), None, torch.bfloat16),
                                              ((8192, 512), None, torch.bfloat16), ((5, 40), 9, torch.float32),
                                              ((3, 64), 64, torch.uint8)])
def test_prefetch_rows_runs_and_changes_nothing(policy, shape, cols, dtype):
    from kimi.ops.l2_prefetch import prefetch_rows

    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(shape, device="cuda", generator=g) * 100).to(dtype)
    before = w.clone()
    n = prefetch_rows(w, cols, policy)
    c = shape[1] if cols is None else cols
    assert n == shape[0] * (c * w.element_size() // 16 * 16)
    torch.cuda.synchronize()  # a bad address or instruction would surface here
    assert torch.equal(w, before)
    # captured in a CUDA graph and replayed
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        prefetch_rows(w, cols, policy)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(w, before)
