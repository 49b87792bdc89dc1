"""The token buckets of the prefill / mixed-step CUDA graphs (kimi.worker.prefill_graph) and the padded attention
layout of their plans (kimi.backends.attention.flashinfer.padded_layout); the graphs themselves run in
tests/gpu/test_prefill_graph.py."""

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


def test_padded_layout_fills_the_bucket_and_the_batch():
    from kimi.backends.attention.flashinfer import padded_layout

    # two requests of 40 rows in a bucket of 64 rows and 5 requests: a padding request of 24 rows, two empty ones
    assert padded_layout([30, 10], [30, 70], 64, 5) == ([30, 10, 24, 0, 0], [30, 70, 24, 0, 0])
    # every row the step's: the padding request is empty too
    assert padded_layout([64], [64], 64, 3) == ([64, 0, 0], [64, 0, 0])
    # the capture plan: no request, all rows padding
    assert padded_layout([], [], 128, 4) == ([128, 0, 0, 0], [128, 0, 0, 0])
    bad = [([65], [65], 64, 3), ([1, 1, 1], [5, 5, 5], 64, 3), ([2], [1], 64, 3), ([1], [], 64, 3)]
    for qo, seq, rows, batch in bad:  # too many rows, too many requests, qo_len > seq_len, lengths differ
        with pytest.raises(ValueError, match="plan_padded"):
            padded_layout(qo, seq, rows, batch)
