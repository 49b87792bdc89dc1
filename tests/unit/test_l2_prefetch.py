"""kimi.ops.l2_prefetch off the GPU: argument checks, and no work issued (a prefetch is only a hint)."""

import pytest
import torch

from kimi.ops import l2_prefetch


def test_cpu_tensor_issues_nothing():
    w = torch.zeros(64, 256, dtype=torch.bfloat16)
    assert not l2_prefetch.active(w.device)
    assert l2_prefetch.prefetch_rows(w, 128) == 0
    assert l2_prefetch.prefetch_rows(w) == 0
    assert l2_prefetch.prefetch_rows(w, 0, "evict_normal") == 0


@pytest.mark.parametrize("bad,match", [
    (lambda: l2_prefetch.prefetch_rows(torch.zeros(64), 8), "2-D"),
    (lambda: l2_prefetch.prefetch_rows(torch.zeros(64, 256).t(), 8), "unit last-dim stride"),
    (lambda: l2_prefetch.prefetch_rows(torch.zeros(64, 257, dtype=torch.bfloat16)[:, :256], 8), "multiples of 16"),
    (lambda: l2_prefetch.prefetch_rows(torch.zeros(64, 256), 8, "evict_first"), "policy"),
])
def test_bad_arguments(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


def test_plan_default_is_valid():
    assert l2_prefetch.PLAN["policy"] in l2_prefetch.POLICIES
    assert set(l2_prefetch.PLAN) == {"o_proj_cols", "qkv_a_cols", "policy"}
