"""The rejection sampler of speculative decoding (kimi.model.rejection): emitted tokens follow the target's
distribution (chi-square on a small vocabulary), greedy acceptance is argmax decoding, seeded draws reproduce."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from kimi.model.rejection import accept_drafts, target_probs, verify
from kimi.protocol import SamplingParams

V = 6


def _chi2(counts: list[float], probs: torch.Tensor) -> float:
    """p-value of counts against probs (float64, expected counts summing exactly to the observed total)."""
    p = probs.double() / probs.double().sum()
    return float(chisquare(counts, (p * sum(counts)).tolist()).pvalue)


def _probs(seed: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(2.0 * torch.randn(rows, V, generator=g), dim=-1)


@pytest.mark.parametrize("draft", [0, 3, 5])
def test_first_token_follows_target(draft: int) -> None:
    """Whatever the (one-hot) draft proposes, the first emitted token is distributed as p_0."""
    torch.manual_seed(1)
    p = _probs(7, 2)
    n = 6000
    counts = torch.zeros(V)
    for _ in range(n):
        out, _ = accept_drafts(p, [draft], None)
        counts[out[0]] += 1
    pval = _chi2(counts.tolist(), p[0])
    assert pval > 1e-3, (counts.tolist(), (p[0] * n).tolist())


def test_second_token_follows_target_given_first() -> None:
    """With two drafts, the token emitted after an accepted d_0 follows p_1 (rejection or bonus path alike)."""
    torch.manual_seed(2)
    p = _probs(11, 3)
    d = [int(torch.argmax(p[0])), 2]
    n = 6000
    counts = torch.zeros(V)
    got = 0
    for _ in range(n):
        out, _ = accept_drafts(p, d, None)
        if out[0] == d[0]:
            counts[out[1]] += 1
            got += 1
    assert got > 500
    pval = _chi2(counts.tolist(), p[1])
    assert pval > 1e-3, (counts.tolist(), (p[1] * got).tolist())


def test_chi_square_detects_a_biased_sampler() -> None:
    """The test above can fail: always accepting the draft is far from p_0."""
    p = _probs(7, 2)
    n = 6000
    counts = [0.0] * V
    counts[3] = n
    assert _chi2(counts, p[0]) < 1e-3


def test_verify_sampled_with_processing_matches_target_distribution() -> None:
    """verify() applies logit_bias / temperature / top-k to the target rows before accepting: the first emitted
    token follows that processed distribution (bias pushes token 1 up, top_k 3 removes the rest)."""
    torch.manual_seed(3)
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, V, generator=g)
    sp = SamplingParams(temperature=0.8, top_k=3, logit_bias_ids=[1], logit_bias_values=[1.5])
    from kimi.model.sampling import process_logits

    p0 = target_probs(process_logits(logits[:1], [sp], [[0]], [1]), sp)[0]
    assert int((p0 > 0).sum()) == 3
    n = 6000
    counts = torch.zeros(V)
    for _ in range(n):
        counts[verify(logits, [4], sp, [0], 1, None).token_ids[0]] += 1
    keep = p0 > 0
    assert float(counts[~keep].sum()) == 0.0
    pval = _chi2(counts[keep].tolist(), p0[keep])
    assert pval > 1e-3, (counts.tolist(), (p0 * n).tolist())


def test_greedy_accepts_the_argmax_prefix() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    sp = SamplingParams(temperature=0.0, num_logprobs=1)
    v = verify(logits, [1, 0], sp, [2], 1, None)
    assert v.token_ids == [1, 0, 2] and v.num_accepted == 2
    v = verify(logits, [1, 2], sp, [2], 1, None)
    assert v.token_ids == [1, 0] and v.num_accepted == 1
    assert v.logprobs[0] == pytest.approx(float(torch.log_softmax(logits[0], -1)[1]))
    assert v.top_ids[1] == [0]
    # penalties see the drafts before each row: a presence penalty on the accepted draft changes row 1's argmax
    sp_pen = SamplingParams(temperature=0.0, presence_penalty=2.0)
    logits2 = torch.tensor([[0.0, 3.0, 1.0], [0.0, 2.0, 1.5], [0.0, 0.0, 5.0]])
    assert verify(logits2, [1, 1], sp_pen, [0], 1, None).token_ids == [1, 2]


def test_seeded_draws_reproduce() -> None:
    p = _probs(13, 4)
    outs = []
    for _ in range(2):
        gen = torch.Generator()
        outs.append(accept_drafts(p, [0, 1, 2], gen, lambda i, gen=gen: gen.manual_seed(1234 + i)))
    assert outs[0] == outs[1]
