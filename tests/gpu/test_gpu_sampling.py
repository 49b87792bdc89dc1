"""The batched sampler (kimi.model.sampling.sample) on CUDA against the per-row CPU reference (sample_ref).

- greedy: identical token ids (penalties, logit_bias, min_tokens included), raw logprobs within 1e-5;
- masks (min_p, top-k, top-p on the GPU vs per row on the CPU): identical, except for tokens whose
  reference margin to the threshold is below 1e-5 (float rounding in the GPU softmax / cumsum; top-k is
  compared exactly);
- random draws: 20000 rows of a 16-token distribution in one call, global RNG and per-row CUDA generators;
  Pearson chi-square p-value > 1e-4 and total variation < 0.015 (the sd of the TV estimate is ~0.003),
  and the same counts must reject a wrong distribution (p^2 renormalised) at p < 1e-12;
- seeded rows: the same token whatever else is in the batch, and the same as sample_ref with the same
  CUDA generator;
- host syncs: under torch.cuda.set_sync_debug_mode("error") a whole `sample_launch` call (penalties, bias,
  min_tokens, seeded rows, logprobs) runs with no synchronising op and starts exactly one device->host copy
  (`start_host_copy`, counted); the old per-row sampler (sample_ref, one .item() a row) raises there.

Run on a CUDA machine: python -m pytest -q tests/gpu/test_gpu_sampling.py
"""

from __future__ import annotations

import pytest
import torch

import kimi.model.sampling as S
from kimi.protocol import SamplingParams
from tests.unit.test_sampling import _chi2_pvalue

pytestmark = pytest.mark.gpu

DEV = "cuda"
MARGIN = 1e-5


def _history(B: int, V: int, seed: int) -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(seed)
    toks, n_prompt = [], []
    for b in range(B):
        n_p = int(torch.randint(1, 200, (1,), generator=g))
        toks.append(torch.randint(0, V, (n_p + b % 5,), generator=g).tolist())
        n_prompt.append(n_p)
    return toks, n_prompt


def _mixed(B: int, V: int) -> list[SamplingParams]:
    kinds = [
        SamplingParams(temperature=0.0, num_logprobs=5),
        SamplingParams(temperature=0.8, top_k=50, top_p=0.9, num_logprobs=0),
        SamplingParams(temperature=1.0, min_p=0.05, repetition_penalty=1.2),
        SamplingParams(
            temperature=0.0,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            logit_bias_ids=[1, 2],
            logit_bias_values=[3.0, -3.0],
        ),
        SamplingParams(temperature=1.2, min_tokens=3, min_tokens_block_ids=[0, V - 1], num_logprobs=20),
        SamplingParams(temperature=0.6, top_p=0.5, seed=1),
    ]
    return [kinds[b % len(kinds)] for b in range(B)]


def test_greedy_identical_to_cpu_reference():
    B, V = 48, 32000
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, V, generator=g) * 4
    toks, n_prompt = _history(B, V, 1)
    params = [
        SamplingParams(
            temperature=0.0,
            num_logprobs=3 if b % 2 else -1,
            repetition_penalty=1.0 + 0.1 * (b % 3),
            presence_penalty=0.4 * (b % 2),
            frequency_penalty=0.2 * (b % 4),
            logit_bias_ids=[b, b + 100],
            logit_bias_values=[2.0, -1.0],
            min_tokens=4 * (b % 2),
            min_tokens_block_ids=[int(x[b].argmax())],
        )
        for b in range(B)
    ]
    proc_gpu = S.process_logits(x.to(DEV), params, toks, n_prompt).cpu()
    proc_cpu = S.process_logits_ref(x, params, toks, n_prompt)
    assert torch.equal(proc_gpu, proc_cpu)  # divisions, products and distinct-index adds are exact on both
    got = S.sample(x.to(DEV), params, [None] * B, toks, n_prompt)
    want = S.sample_ref(x, params, [None] * B, toks, n_prompt)
    assert got.token_ids == want.token_ids
    for b in range(B):
        if want.logprobs[b] is None:
            assert got.logprobs[b] is None
            continue
        assert got.logprobs[b] == pytest.approx(want.logprobs[b], abs=1e-5)
        assert got.top_ids[b] == want.top_ids[b]
        assert got.top_logprobs[b] == pytest.approx(want.top_logprobs[b], abs=1e-5)


def test_masks_identical_to_cpu_reference():
    R, V = 64, 4096
    g = torch.Generator().manual_seed(2)
    x = torch.randn(R, V, generator=g) * (torch.rand(R, 1, generator=g) * 6 + 0.5)
    x[0::5, :8] = x[0::5].max() + 1.0  # ties at the top
    temps = (torch.rand(R, generator=g) + 0.3).tolist()
    ks = [[0, 1, 2, 7, 40, 500, V - 1, V, V + 3][r % 9] for r in range(R)]
    ps = [[1.0, 0.01, 0.3, 0.6, 0.9, 0.95, 0.999][r % 7] for r in range(R)]
    mps = [[0.0, 0.0, 0.01, 0.1, 0.3, 0.001][r % 6] for r in range(R)]
    xt = x / torch.tensor(temps).unsqueeze(1)
    only_k = S.filter_logits(
        xt.to(DEV), None, torch.tensor([k if 0 < k < V else V for k in ks], device=DEV), None
    ).cpu()
    got = S.filter_logits(
        xt.to(DEV),
        torch.tensor(mps, device=DEV),
        torch.tensor([k if 0 < k < V else V for k in ks], device=DEV),
        torch.tensor([p if p < 1 else float("inf") for p in ps], device=DEV),
    ).cpu()
    n_ambiguous = 0
    for r in range(R):
        row = x[r] / temps[r]
        assert torch.equal(torch.isfinite(only_k[r]), torch.isfinite(S._filter_top_k_top_p(row, ks[r], 1.0))), r
        after_min_p = S._filter_min_p(row, mps[r])
        want = torch.isfinite(S._filter_top_k_top_p(after_min_p, ks[r], ps[r]))
        diff = torch.isfinite(got[r]) != want
        if diff.any():  # only where the reference sits on a threshold, in float64
            p64 = torch.softmax(row.double(), -1)
            near = (
                ((p64 - mps[r] * p64.max()).abs() < MARGIN * p64.max())
                if mps[r] > 0
                else torch.zeros(V, dtype=torch.bool)
            )
            k_row = S._filter_top_k_top_p(after_min_p, ks[r], 1.0).double()
            sv, si = torch.sort(k_row, descending=True, stable=True)
            sp = torch.softmax(sv, -1)
            before = torch.cumsum(sp, -1) - sp
            near_p = torch.zeros(V, dtype=torch.bool)
            near_p[si] = (before - ps[r]).abs() < MARGIN
            assert (~(near | near_p) & diff).sum() == 0, r
            n_ambiguous += int(diff.sum())
        assert torch.isfinite(got[r]).any()
    assert n_ambiguous <= 5


@pytest.mark.parametrize("seeded", [False, True])
def test_draw_distribution(seeded):
    torch.manual_seed(7)
    V, N = 16, 20000
    logits = torch.linspace(2.0, -3.0, V)
    logits[-2:] = float("-inf")  # zero-probability tokens
    p = SamplingParams(temperature=0.9, top_k=12, top_p=0.97)
    target = torch.softmax(S._filter_top_k_top_p(logits / 0.9, 12, 0.97), -1)
    gens = [torch.Generator(device=DEV).manual_seed(10_000 + i) for i in range(N)] if seeded else [None] * N
    ids = torch.tensor(S.sample(logits.to(DEV).expand(N, -1), [p] * N, gens).token_ids)
    counts = torch.bincount(ids, minlength=V).double()
    assert set(ids.unique().tolist()) <= set(torch.nonzero(target).flatten().tolist())
    assert _chi2_pvalue(counts, target) > 1e-4
    assert float((counts / N - target).abs().sum() / 2) < 0.015
    wrong = target**2 / (target**2).sum()
    assert _chi2_pvalue(counts, wrong) < 1e-12


def test_seeded_rows_reproducible_across_batches_and_equal_to_reference():
    B, V = 12, 32000
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(B, V, generator=g) * 2).to(DEV)
    toks, n_prompt = _history(B, V, 4)
    params = _mixed(B, V)
    target = 5  # temperature 0.6, top_p 0.5: several candidates
    out = []
    for rows in ([target], [0, 1, 2, 3, 4, 5], list(range(B))[::-1], [5, 5, 7, 8]):
        seq = []
        for pos in range(10):
            gens = [
                torch.Generator(device=DEV).manual_seed(77 + pos)
                if r == target
                else (torch.Generator(device=DEV).manual_seed(r) if params[r].temperature > 0 and r % 2 else None)
                for r in rows
            ]
            res = S.sample(
                x[rows], [params[r] for r in rows], gens, [toks[r] for r in rows], [n_prompt[r] for r in rows]
            )
            seq.append(res.token_ids[rows.index(target)])
        out.append(seq)
    assert all(s == out[0] for s in out) and len(set(out[0])) > 1
    ref = [
        S.sample_ref(
            x[[target]],
            [params[target]],
            [torch.Generator(device=DEV).manual_seed(77 + pos)],
            [toks[target]],
            [n_prompt[target]],
        ).token_ids[0]
        for pos in range(10)
    ]
    assert ref == out[0]


def test_one_device_to_host_copy_per_call(monkeypatch):
    """sample_launch queues everything without one host synchronisation (CUDA sync debug mode "error" raises on
    any) and starts exactly one device->host copy; SampleLaunch.result then waits for it."""
    B, V = 32, 163840
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(B, V, generator=g) * 3).to(DEV)
    toks, n_prompt = _history(B, V, 6)
    params = _mixed(B, V)

    def gens():
        return [
            torch.Generator(device=DEV).manual_seed(b) if p.seed is not None else None for b, p in enumerate(params)
        ]

    S.sample(x, params, gens(), toks, n_prompt)  # warm-up (allocator, pinned host blocks)
    copies: list[int] = []
    real = S.start_host_copy

    def counted(t):
        copies.append(t.numel())
        return real(t)

    monkeypatch.setattr(S, "start_host_copy", counted)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        launch = S.sample_launch(x, params, gens(), toks, n_prompt)
        with pytest.raises(RuntimeError):  # the check has teeth: a per-row .item() is caught
            S.sample_ref(x, params, gens(), toks, n_prompt)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    res = launch.result()
    assert len(copies) == 1
    assert len(res.token_ids) == B and all(0 <= t < V for t in res.token_ids)
    assert res.top_ids[4] is not None and len(res.top_ids[4]) == 20
    # the sampled ids are on the device too, equal to what the host got
    assert launch.ids.is_cuda and launch.ids.tolist() == res.token_ids


def test_tiny_temperature_and_top_p_sample_the_argmax_on_the_gpu():
    """temperature below 1e-5 (1e-38, 1e-300) is greedy and top_p that rounds to 0 in fp32 (1e-46, 1e-300) keeps the
    most likely token, on the device as in the reference: every row draws the argmax (they gave token id 0)."""
    B, V = 32, 32000
    g = torch.Generator().manual_seed(4)
    x = torch.randn(B, V, generator=g) * 4
    x[:, 0] = -50.0  # id 0 is never the argmax
    kinds = [
        dict(temperature=1e-38),
        dict(temperature=1e-300, seed=3),
        dict(temperature=1.0, top_p=1e-46),
        dict(temperature=0.5, top_p=1e-300, seed=11),
    ]
    params = [SamplingParams(**kinds[b % len(kinds)]) for b in range(B)]
    gens = [torch.Generator(device=DEV).manual_seed(p.seed) if p.seed is not None else None for p in params]
    got = S.sample(x.to(DEV), params, gens).token_ids
    assert got == x.argmax(-1).tolist()
    assert S.sample_ref(x, params, [None] * B).token_ids == got


# ---- guided decoding: the bitmask on CUDA --------------------------------------------------------------------------
def _random_bitmask(B: int, V: int, g: torch.Generator) -> torch.Tensor:
    """int32 [B, ceil(V / 32)]: about a third of the tokens allowed, every row at least one."""
    W = -(-V // 32)
    bits = torch.rand(B, W * 32, generator=g) < 0.33
    bits[:, 7] = True
    words = (bits.view(B, W, 32).long() << torch.arange(32)).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


@pytest.mark.parametrize("B,V,rows", [(8, 163840, [0, 3, 7]), (64, 163840, list(range(64))), (5, 1000, [4])])
def test_cuda_bitmask_equals_the_reference_and_sampling_keeps_to_it(B, V, rows):
    """apply_token_bitmask on CUDA (pinned copy + torch unpack) sets exactly the reference's -inf, on fresh random
    logits and masks, some rows or all; sample() on CUDA with the mask draws only allowed tokens and its greedy rows
    equal sample_ref's on the CPU; the launch does no synchronising op."""
    g = torch.Generator().manual_seed(B * 7 + V)
    logits = torch.randn(B, V, generator=g)
    bm = _random_bitmask(B, V, g)
    ref = logits.clone()
    S.apply_token_bitmask_ref(ref, (rows, bm))
    got = logits.to(DEV)
    S.apply_token_bitmask(got, (rows, bm))
    assert torch.equal(got.cpu(), ref)  # exact: the same values kept, the rest -inf
    allowed = S.unpack_bitmask(bm, V)
    params = [SamplingParams(temperature=0.0 if b % 2 else 1.0, seed=b) for b in range(B)]
    gens = [torch.Generator(device=DEV).manual_seed(b) for b in range(B)]
    on_dev = logits.to(DEV)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        launch = S.sample_launch(on_dev, params, gens, bitmask=(rows, bm))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out = launch.result()
    cpu = S.sample_ref(logits.clone(), params, [None] * B, bitmask=(rows, bm))
    for b in range(B):
        if b in rows:
            assert allowed[b, out.token_ids[b]], (b, out.token_ids[b])
        if params[b].temperature == 0.0:
            assert out.token_ids[b] == cpu.token_ids[b], b
