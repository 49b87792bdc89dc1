"""Verifying draft tokens against the target: greedy acceptance and rejection sampling (docs/speculative.md).

One request, k draft tokens d_0 .. d_{k-1} proposed after the request's last token, and the target's logits at the
k + 1 positions of the verify step (row i predicts the token after d_{i-1}; row 0 the token after the last known
token). Row i's target distribution p_i is the one `kimi.model.sampling` would sample from at that position: the
same processing (min_tokens, logit_bias, penalties over the history *including* d_0 .. d_{i-1}, then temperature,
min_p, top-k, top-p), so a speculating request's output follows exactly the distribution it has without speculation.

- greedy (temperature < 1e-5): t_i = argmax of row i's processed logits; d_i is accepted while d_i == t_i; the
  first mismatch is replaced by t_i; when all k match, t_k is the bonus token. The output equals greedy decoding
  without speculation token for token.
- sampled: the draft proposes greedily (its distribution q_i is one-hot at d_i), so the rejection rule of Leviathan
  et al. ("Fast Inference from Transformers via Speculative Decoding", ICML 2023, Algorithm 1; Chen et al. 2023)
  becomes: accept d_i with probability min(1, p_i(d_i) / q_i(d_i)) = p_i(d_i); on rejection draw from the
  residual norm(max(p_i - q_i, 0)), which is p_i with d_i removed, renormalised. Then P(emit x) = p_i(d_i) [x = d_i]
  + (1 - p_i(d_i)) p_i(x) / (1 - p_i(d_i)) [x != d_i] = p_i(x). When all k are accepted, the bonus token is drawn
  from p_k. Draws use the request's generator, reseeded per drawn position (`seed_at`), so a seeded request is
  reproducible.

Logprobs reported are the raw ones (log_softmax of the model's logits, as kimi.model.sampling reports).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kimi.model.sampling import exponential_race, filter_logits, process_logits
from kimi.protocol import SamplingParams


@dataclass
class Verified:
    """The tokens one verify step emits: `token_ids` (the accepted drafts, then the correction or bonus token;
    1 .. k + 1 of them), `num_accepted` drafts (len(token_ids) - 1), and per emitted token, when asked, its raw
    logprob and top alternatives."""

    token_ids: list[int]
    num_accepted: int
    logprobs: list[float | None]
    top_ids: list[list[int] | None]
    top_logprobs: list[list[float] | None]


def target_probs(processed: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """processed [R, V] float32 (min_tokens / bias / penalties applied) -> the sampled distribution [R, V] float32
    of a non-greedy request: temperature, min_p, top-k, top-p (kimi.model.sampling's steps 5), softmax."""
    R, V = processed.shape
    dev = processed.device
    x = processed / sp.temperature
    x = filter_logits(
        x,
        torch.full((R,), sp.min_p, device=dev) if sp.min_p > 0.0 else None,
        torch.full((R,), sp.top_k, dtype=torch.long, device=dev) if 0 < sp.top_k < V else None,
        torch.full((R,), sp.top_p, device=dev) if sp.top_p < 1.0 else None,
    )
    return torch.softmax(x, dim=-1)


def accept_drafts(
    probs: torch.Tensor,
    draft_ids: Sequence[int],
    generator: torch.Generator | None,
    seed_at: Callable[[int], None] | None = None,
) -> tuple[list[int], int]:
    """Rejection sampling of one-hot (greedy) drafts against the target distributions (module docstring).

    probs: [k + 1, V] float32, row i the target's distribution after d_0 .. d_{i-1}; draft_ids: k ids. generator:
    the draws' generator (None: the global RNG); seed_at(i), when given, reseeds it before the draws of emitted
    token i. Returns (emitted token ids, number of drafts accepted). Raises ValueError when probs has not k + 1 rows.
    """
    k = len(draft_ids)
    if probs.shape[0] != k + 1:
        raise ValueError(f"{probs.shape[0]} target rows for {k} draft tokens (want k + 1)")
    out: list[int] = []
    dev = probs.device
    for i in range(k + 1):
        if seed_at is not None:
            seed_at(i)
        gdev = generator.device if generator is not None else dev
        if i == k:  # every draft accepted: the bonus token from p_k
            out.append(int(exponential_race(probs[k : k + 1], [generator]).item()))
            return out, k
        d = draft_ids[i]
        u = float(torch.rand((), device=gdev, generator=generator))
        if u < float(probs[i, d]):
            out.append(d)
            continue
        residual = probs[i : i + 1].clone()
        residual[0, d] = 0.0
        total = float(residual.sum())
        if total <= 0.0:  # p_i(d) == 1 in float but u >= it (u < 1 always): cannot happen; keep d
            out.append(d)
            continue
        out.append(int(exponential_race(residual / total, [generator]).item()))
        return out, i
    raise AssertionError("unreachable")


def verify(
    logits: torch.Tensor,
    draft_ids: Sequence[int],
    sp: SamplingParams,
    token_ids: Sequence[int],
    num_prompt_tokens: int,
    generator: torch.Generator | None,
    seed_at: Callable[[int], None] | None = None,
) -> Verified:
    """Verify one request's k drafts: logits [k + 1, V] (the target's raw logits at the verify positions),
    token_ids the request's tokens before the drafts, sp its sampling parameters (no grammar: guided requests do
    not speculate). Greedy or rejection sampling as the module docstring says; logprobs per sp.num_logprobs.
    generator / seed_at: see `accept_drafts`."""
    k = len(draft_ids)
    logits = logits.float()
    hist = [list(token_ids) + list(draft_ids[:i]) for i in range(k + 1)]
    processed = process_logits(logits, [sp] * (k + 1), hist, [num_prompt_tokens] * (k + 1))  # [k + 1, V]
    if sp.greedy:
        best = torch.argmax(processed, dim=-1).tolist()
        n = 0
        while n < k and draft_ids[n] == best[n]:
            n += 1
        emitted = list(draft_ids[:n]) + [best[n]]
    else:
        emitted, n = accept_drafts(target_probs(processed, sp), draft_ids, generator, seed_at)
    m = len(emitted)
    lps: list[float | None] = [None] * m
    tids: list[list[int] | None] = [None] * m
    tlps: list[list[float] | None] = [None] * m
    if sp.num_logprobs >= 0:
        logp = torch.log_softmax(logits[:m], dim=-1)
        chosen = logp.gather(1, torch.tensor(emitted, device=logp.device).unsqueeze(1)).squeeze(1).tolist()
        for j in range(m):
            lps[j] = chosen[j]
        if sp.num_logprobs > 0:
            v, t = torch.topk(logp, min(sp.num_logprobs, logp.shape[1]), dim=-1)
            for j in range(m):
                tids[j] = t[j].tolist()
                tlps[j] = v[j].tolist()
    return Verified(emitted, n, lps, tids, tlps)
