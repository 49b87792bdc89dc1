"""The token buckets of the prefill / mixed-step CUDA graphs (kimi.worker.prefill_graph; the graphs themselves run
in tests/gpu/test_prefill_graph.py)."""

from __future__ import annotations

import pytest

from kimi.worker.prefill_graph import prefill_buckets


def test_prefill_buckets_double_up_to_the_token_budget():
    assert prefill_buckets(2048) == [64, 128, 256, 512, 1024, 2048]
    assert prefill_buckets(1000) == [64, 128, 256, 512, 1000]
    assert prefill_buckets(64) == [64]
    assert prefill_buckets(10) == [10]
    with pytest.raises(ValueError, match="max_tokens"):
        prefill_buckets(0)
