"""kimi.model.sampling against the formulas written out by hand (HF / vLLM / OpenAI semantics), and the batched
sampler (`sample`, `process_logits`, `filter_logits`, `exponential_race`) against the per-row reference
(`sample_ref`, `process_logits_ref`): exact equality on CPU, chi-square / total-variation for the draws."""

from __future__ import annotations

import math

import pytest
import torch

from kimi.model.sampling import (
    _filter_min_p,
    _filter_top_k_top_p,
    exponential_race,
    filter_logits,
    process_logits,
    process_logits_ref,
    prompt_logprobs,
    sample,
    sample_ref,
)
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


# ---- the batched sampler against the per-row reference (kimi.model.sampling.sample_ref) ---------------------


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit over the tokens with probs > 0; p-value = Q(df/2, chi2/2)."""
    n = float(counts.sum())
    m = probs > 0
    exp = probs[m].double() * n
    chi2 = float(((counts[m].double() - exp) ** 2 / exp).sum())
    df = int(m.sum()) - 1
    return float(
        torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(chi2 / 2, dtype=torch.float64))
    )


def _mixed_params() -> list[SamplingParams]:
    """One row per feature (and combinations), greedy and random, with and without logprobs."""
    return [
        SamplingParams(temperature=0.0, num_logprobs=3),
        SamplingParams(temperature=0.7, top_k=5, num_logprobs=0),
        SamplingParams(temperature=1.3, top_p=0.6),
        SamplingParams(temperature=1.0, min_p=0.05, num_logprobs=5),
        SamplingParams(temperature=0.0, repetition_penalty=1.4, presence_penalty=0.3, frequency_penalty=0.2),
        SamplingParams(temperature=0.9, top_k=10, top_p=0.8, min_p=0.02, repetition_penalty=0.8, num_logprobs=1),
        SamplingParams(temperature=0.0, logit_bias_ids=[3, 7, 3], logit_bias_values=[5.0, -2.0, 1.5], num_logprobs=2),
        SamplingParams(temperature=1.0, min_tokens=4, min_tokens_block_ids=[0, 1, 2, 999]),
        SamplingParams(temperature=0.0, min_tokens=2, min_tokens_block_ids=[4]),
        SamplingParams(temperature=2.0, top_k=1),
        SamplingParams(temperature=1.0, top_k=V, top_p=1.0, frequency_penalty=-0.5),
        SamplingParams(
            temperature=0.5,
            top_k=V + 7,
            top_p=0.999,
            presence_penalty=2.0,
            logit_bias_ids=[11],
            logit_bias_values=[-100.0],
        ),
    ]


def _history(B: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(seed)
    toks, n_prompt = [], []
    for b in range(B):
        n_p = int(torch.randint(1, 12, (1,), generator=g))
        n_o = b % 4  # 0..3 generated: min_tokens rows see both sides of their threshold
        toks.append(
            torch.randint(0, V, (n_p + n_o,), generator=g).tolist() + [V + 3] * (b == 5)
        )  # an id >= V is ignored
        n_prompt.append(n_p)
    return toks, n_prompt


def _gens(params, seed: int):
    return [torch.Generator().manual_seed(seed + b) if p.temperature > 0 else None for b, p in enumerate(params)]


def test_process_logits_batched_equals_reference():
    params = _mixed_params()
    x = _logits(len(params), seed=11)
    toks, n_prompt = _history(len(params))
    got = process_logits(x, params, toks, n_prompt)
    want = process_logits_ref(x, params, toks, n_prompt)
    assert torch.equal(got, want)
    assert torch.isinf(got[7, :3]).all() and bool(torch.isinf(got[8, 4])) == (len(toks[8]) - n_prompt[8] < 2)
    assert bool(torch.isinf(got[9, 4])) is False or bool(torch.isinf(x[9, 4]))  # min_tokens rows only
    plain = [SamplingParams(temperature=0.0)] * 3
    assert process_logits(x[:3], plain) is x[:3] or torch.equal(process_logits(x[:3], plain), x[:3])


def test_process_logits_errors_match_reference():
    x = _logits(2)
    with pytest.raises(ValueError):
        process_logits(x, [SamplingParams(), SamplingParams(presence_penalty=1.0)])
    with pytest.raises(IndexError):
        process_logits(x, [SamplingParams(logit_bias_ids=[V], logit_bias_values=[1.0]), SamplingParams()])


def test_sample_batched_equals_reference_tokens_and_raw_logprobs():
    params = _mixed_params()
    x = _logits(len(params), seed=3)
    toks, n_prompt = _history(len(params), seed=1)
    for seed in range(5):  # seeded random rows: the same exponentials in both, so the same tokens
        got = sample(x, params, _gens(params, 100 * seed), toks, n_prompt)
        want = sample_ref(x, params, _gens(params, 100 * seed), toks, n_prompt)
        assert got.token_ids == want.token_ids
        assert got.logprobs == want.logprobs  # raw (before bias / penalties / temperature), bit for bit
        assert got.top_ids == want.top_ids and got.top_logprobs == want.top_logprobs
    raw = torch.log_softmax(x, -1)
    for b, p in enumerate(params):
        if p.num_logprobs < 0:
            assert got.logprobs[b] is None and got.top_ids[b] is None
            continue
        assert got.logprobs[b] == pytest.approx(float(raw[b, got.token_ids[b]]), abs=1e-6)
        if p.num_logprobs == 0:
            assert got.top_ids[b] is None and got.top_logprobs[b] is None
        else:
            assert got.top_ids[b] == torch.topk(raw[b], p.num_logprobs).indices.tolist()


def test_greedy_batched_equals_reference_and_ties_go_to_lowest_id():
    B = 32
    x = torch.randint(-3, 3, (B, V)).float()  # many ties
    toks, n_prompt = _history(B, seed=2)
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.0 + 0.1 * (b % 3), presence_penalty=0.5 * (b % 2))
        for b in range(B)
    ]
    got = sample(x, params, [None] * B, toks, n_prompt).token_ids
    assert got == sample_ref(x, params, [None] * B, toks, n_prompt).token_ids
    proc = process_logits_ref(x, params, toks, n_prompt)
    for b in range(B):
        assert got[b] == int(torch.nonzero(proc[b] == proc[b].max())[0])


def test_filter_logits_masks_equal_reference():
    g = torch.Generator().manual_seed(9)
    R = 64
    x = torch.randn(R, V, generator=g) * torch.rand(R, 1, generator=g) * 4
    x[0::4, :10] = 50.0  # ties at the top-k / top-p boundary (top-p keeps the lower ids of a tie)
    x[1, 5:] = float("-inf")  # fewer finite tokens than k
    ks = [0, 1, 2, 5, 17, V - 1, V, V + 1, 3, 10] * 7
    ps = [1.0, 1e-6, 0.05, 0.5, 0.9, 0.99, 1.0, 0.3] * 8
    mps = [0.0, 0.0, 0.1, 0.5, 1.0, 0.01, 0.2, 0.0, 0.03] * 8
    temps = torch.rand(R, generator=g) + 0.25
    ks, ps, mps = ks[:R], ps[:R], mps[:R]
    xt = x / temps.unsqueeze(1)
    got = filter_logits(
        xt,
        torch.tensor(mps),
        torch.tensor([k if 0 < k < V else V for k in ks]),
        torch.tensor([p if p < 1 else float("inf") for p in ps]),
    )
    for r in range(R):
        want = _filter_top_k_top_p(_filter_min_p(x[r] / float(temps[r]), mps[r]), ks[r], ps[r])
        assert torch.equal(torch.isfinite(got[r]), torch.isfinite(want)), r
        assert torch.equal(got[r], want), r
        assert torch.isfinite(got[r]).any()  # the top token always survives
    only_k = filter_logits(xt, None, torch.tensor([2] * R), None)
    assert (torch.isfinite(only_k).sum(-1) >= 2).all() and torch.isfinite(
        only_k[0]
    ).sum() == 10  # ties with the 2nd kept


def test_top_k_1_equals_greedy():
    B = 40
    x = _logits(B, seed=4)
    greedy = sample(x, [SamplingParams(temperature=0.0)] * B, [None] * B).token_ids
    for t in (0.3, 1.0, 5.0):
        assert sample(x, [SamplingParams(temperature=t, top_k=1)] * B, [None] * B).token_ids == greedy
        assert sample(x, [SamplingParams(temperature=t, top_p=1e-9)] * B, [None] * B).token_ids == greedy


def test_exponential_race_draws_from_probs():
    torch.manual_seed(1234)
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02, 0.0])
    N = 20000
    ids = exponential_race(probs.expand(N, -1).contiguous(), [None] * N)
    counts = torch.bincount(ids, minlength=probs.numel()).double()
    assert counts[-1] == 0  # a zero-probability token is never drawn
    assert _chi2_pvalue(counts, probs) > 1e-4
    assert float((counts / N - probs).abs().sum() / 2) < 0.015  # total variation; sd of each count ~ 0.35%
    # the test has power: the same counts are far from a wrong distribution (p^2, flattened)
    wrong = probs**2 / (probs**2).sum()
    assert _chi2_pvalue(counts, wrong) < 1e-12 and float((counts / N - wrong).abs().sum() / 2) > 0.05


def test_sample_distribution_after_temperature_and_top_k_top_p():
    torch.manual_seed(99)
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    N = 20000
    p = SamplingParams(temperature=0.8, top_k=6, top_p=0.9)
    ids = torch.tensor(sample(logits.expand(N, -1), [p] * N, [None] * N).token_ids)
    target = torch.softmax(_filter_top_k_top_p(logits / 0.8, 6, 0.9), -1)
    counts = torch.bincount(ids, minlength=8).double()
    assert set(ids.unique().tolist()) == set(torch.nonzero(target).flatten().tolist())
    assert _chi2_pvalue(counts, target) > 1e-4


def test_seeded_rows_reproducible_across_batch_compositions_and_with_reference():
    x = _logits(6, seed=8)
    toks, n_prompt = _history(6, seed=8)
    mixes = [[2], [0, 2, 5], [5, 4, 3, 2, 1, 0], [2, 2, 1]]  # row 2 seeded (temperature 1, top_p), others vary
    params_of = {
        0: SamplingParams(temperature=0.0),
        1: SamplingParams(temperature=1.0),
        2: SamplingParams(top_p=0.95),
        3: SamplingParams(temperature=0.5, top_k=3, presence_penalty=1.0),
        4: SamplingParams(min_p=0.1, num_logprobs=2),
        5: SamplingParams(temperature=1.0),
    }
    seqs = []
    for rows in mixes:
        out = []
        for pos in range(15):
            gens = [
                torch.Generator().manual_seed(1000 + pos)
                if r == 2
                else (torch.Generator().manual_seed(7 + pos) if r == 1 else None)
                for r in rows
            ]
            res = sample(
                x[rows], [params_of[r] for r in rows], gens, [toks[r] for r in rows], [n_prompt[r] for r in rows]
            )
            out.append(res.token_ids[rows.index(2)])
        seqs.append(out)
    assert all(s == seqs[0] for s in seqs) and len(set(seqs[0])) > 1
    ref = [
        sample_ref(x[[2]], [params_of[2]], [torch.Generator().manual_seed(1000 + pos)]).token_ids[0]
        for pos in range(15)
    ]
    assert ref == seqs[0]


@pytest.mark.parametrize("temp", [0.0, 1e-300, 1e-44, 1e-38, 1e-6, 9.9e-6])
def test_temperatures_below_1e_5_are_greedy(temp):
    """Below kimi.protocol.GREEDY_TEMPERATURE (1e-5) a row samples by argmax, in both samplers, unseeded and seeded:
    dividing the fp32 logits by 1e-38 used to overflow to inf and every token came out as id 0. The two top logits
    differ by one fp32 ulp at 1.0 (1.2e-7), so at 1e-6 or 9.9e-6 a sampler that divided would draw the second one in
    roughly half of the 16 rows."""
    B = 16
    ulp = float(torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))) - 1.0
    x = torch.full((B, V), -50.0)
    x[:, 3] = 1.0
    x[:, 7] = 1.0
    x[0::2, 7] += ulp  # even rows: 7 is the argmax
    x[1::2, 3] += ulp  # odd rows: 3
    greedy = sample(x, [SamplingParams(temperature=0.0)] * B, [None] * B).token_ids
    assert greedy == [7 if b % 2 == 0 else 3 for b in range(B)]
    for seed in (None, 5):
        params = [SamplingParams(temperature=temp, seed=seed)] * B
        gens = [None if seed is None else torch.Generator().manual_seed(seed) for _ in range(B)]
        assert sample(x, params, gens).token_ids == greedy
        assert sample_ref(x, params, [None] * B).token_ids == greedy
    assert SamplingParams(temperature=temp).greedy
    assert not SamplingParams(temperature=1e-5).greedy


@pytest.mark.parametrize("top_p", [1e-300, 1e-46, 1e-45, 1e-9])
def test_tiny_top_p_keeps_the_most_likely_token(top_p):
    """top_p so small it rounds to 0 in fp32 (1e-46) used to drop every token (then id 0 came out); the most
    likely token always stays, so the draw is the argmax at any temperature, in both samplers."""
    B = 16
    x = _logits(B, seed=13)
    greedy = sample(x, [SamplingParams(temperature=0.0)] * B, [None] * B).token_ids
    for t in (1e-5, 0.5, 2.0):
        params = [SamplingParams(temperature=t, top_p=top_p)] * B
        assert sample(x, params, [None] * B).token_ids == greedy
        assert sample_ref(x, params, [None] * B).token_ids == greedy
    kept = filter_logits(x, None, None, torch.full((B,), top_p, dtype=torch.float32))
    assert torch.equal(torch.isfinite(kept).sum(-1), torch.ones(B, dtype=torch.long))
