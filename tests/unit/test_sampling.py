"""kimi.ops.sampling against the formulas written out by hand (HF / vLLM / OpenAI semantics)."""

from __future__ import annotations

import math

import pytest
import torch

from kimi.ops.sampling import _filter_min_p, process_logits, prompt_logprobs, sample
from kimi.protocol import SamplingParams

V = 50


def _logits(b: int = 1, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, V, generator=g) * 3


def test_logit_bias_forces_token_but_reported_logprob_is_raw():
    x = _logits()
    target = int(torch.argmin(x[0]))
    p = SamplingParams(temperature=0.0, num_logprobs=2, logit_bias_ids=[target], logit_bias_values=[100.0])
    out = sample(x, [p], [None])
    assert out.token_ids == [target]
    raw = torch.log_softmax(x[0], -1)
    assert out.logprobs[0] == pytest.approx(float(raw[target]), abs=1e-6)
    assert out.top_ids[0] == torch.topk(raw, 2).indices.tolist()  # alternatives from the raw distribution


def test_min_tokens_blocks_stop_ids_until_reached():
    x = _logits()
    eos = int(torch.argmax(x[0]))
    p = SamplingParams(temperature=0.0, min_tokens=3, min_tokens_block_ids=[eos])
    prompt = [1, 2, 3]
    assert sample(x, [p], [None], [prompt + [7, 8]], [3]).token_ids[0] != eos  # 2 generated < 3
    assert sample(x, [p], [None], [prompt + [7, 8, 9]], [3]).token_ids[0] == eos  # 3 generated


def test_repetition_penalty_formula_over_prompt_and_output():
    x = _logits()
    r = 1.7
    toks = [3, 4, 4, 10]  # prompt [3, 4], output [4, 10]
    p = SamplingParams(repetition_penalty=r)
    got = process_logits(x, [p], [toks], [2])[0]
    want = x[0].clone()
    for t in set(toks):
        want[t] = want[t] / r if want[t] > 0 else want[t] * r
    assert torch.allclose(got, want)


def test_frequency_and_presence_count_output_tokens_only():
    x = _logits()
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    toks = [9, 9, 1, 1, 1, 2]  # prompt [9, 9]; output 1 x3, 2 x1
    got = process_logits(x, [p], [toks], [2])[0]
    want = x[0].clone()
    want[1] -= 0.5 * 3 + 0.25
    want[2] -= 0.5 * 1 + 0.25
    assert torch.allclose(got, want)  # token 9 (prompt only) untouched


def test_min_p_keeps_exactly_tokens_above_threshold():
    x = _logits()[0]
    probs = torch.softmax(x, -1)
    kept = torch.isfinite(_filter_min_p(x, 0.1))
    assert torch.equal(kept, probs >= 0.1 * probs.max())
    assert 0 < int(kept.sum()) < V


def test_min_p_and_top_k_restrict_the_support_of_random_sampling():
    x = _logits() / 3  # a flatter distribution: several tokens above the min_p threshold
    probs = torch.softmax(x[0], -1)
    allowed = set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist())
    gen = torch.Generator().manual_seed(1)
    seen = {sample(x, [SamplingParams(temperature=1.0, min_p=0.2)], [gen]).token_ids[0] for _ in range(200)}
    assert seen <= allowed and len(seen) > 1
    top2 = set(torch.topk(x[0], 2).indices.tolist())
    seen = {sample(x, [SamplingParams(temperature=1.5, top_k=2)], [gen]).token_ids[0] for _ in range(100)}
    assert seen == top2


def test_seeded_rows_reproducible_whatever_the_batch():
    x = _logits(3, seed=5)
    p = SamplingParams(temperature=1.0)

    def run(rows):
        gens = [torch.Generator().manual_seed(42) if r == 1 else None for r in rows]
        outs = []
        for _ in range(20):
            outs.append(sample(x[rows], [p] * len(rows), gens).token_ids[rows.index(1)])
        return outs

    assert run([1]) == run([0, 1, 2]) == run([2, 1])


def test_greedy_ties_and_temperature_zero_after_penalties():
    x = torch.zeros(1, V)
    x[0, 5] = x[0, 7] = 2.0
    assert sample(x, [SamplingParams(temperature=0.0)], [None]).token_ids == [5]  # lowest id on ties
    # penalising 5 (already generated) makes 7 the argmax
    p = SamplingParams(temperature=0.0, presence_penalty=1.0)
    assert sample(x, [p], [None], [[1, 5]], [1]).token_ids == [7]


def test_prompt_logprobs_match_log_softmax():
    x = _logits(4)
    nxt = [3, 0, 49, 7]
    lp, tids, tlps = prompt_logprobs(x, nxt, 3)
    ref = torch.log_softmax(x, -1)
    for i, t in enumerate(nxt):
        assert lp[i] == pytest.approx(float(ref[i, t]), abs=1e-6)
        assert tids[i] == torch.topk(ref[i], 3).indices.tolist()
        assert all(math.isfinite(v) for v in tlps[i])
    lp0, none_ids, none_lps = prompt_logprobs(x, nxt, 0)
    assert none_ids is None and none_lps is None and lp0 == lp
