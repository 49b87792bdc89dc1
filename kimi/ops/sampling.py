"""Token sampling (plain PyTorch reference): logit processing, greedy / random sampling, logprobs.

Per row b of a batch, in this order (the order vLLM's V1 sampler uses):

1. raw logprobs: `log_softmax(logits)` of the model's fp32 logits. These are what is *reported*
   (`logprobs`, `top_logprobs`), as vLLM reports by default (`raw_logprobs`): before bias, penalties,
   temperature and truncation.
2. min_tokens: while fewer than `min_tokens` tokens have been generated, the ids in
   `min_tokens_block_ids` (EOS ids and stop_token_ids) are set to -inf.
3. logit_bias: `logit[id] += bias` (OpenAI `logit_bias`).
4. penalties (vLLM / HF semantics):
   - repetition (CTRL, Keskar et al. 2019, as in HF `RepetitionPenaltyLogitsProcessor` and vLLM): for every
     token present in the prompt or the output, `logit / r` if `logit > 0` else `logit * r`;
   - frequency (OpenAI): `logit -= frequency_penalty * count_in_output(token)`;
   - presence (OpenAI): `logit -= presence_penalty * (count_in_output(token) > 0)`.
5. temperature 0: argmax of the processed logits (ties: lowest id). Otherwise divide by the temperature,
   then min_p (drop tokens whose probability is below `min_p * max probability`), top-k, top-p (keep the
   smallest set, in descending probability, whose mass reaches top_p; the most likely token is always
   kept), and draw with `torch.multinomial` from the row's generator (seeded requests are reproducible
   whatever else is in the batch) or the global RNG.

Shapes: logits [B, V] float32 (any float dtype is upcast). Token-history inputs are Python lists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kimi.protocol import SamplingParams


@dataclass
class SampleOutput:
    """One sampled token per row, and (where asked) its raw logprob and the top-k alternatives.

    token_ids[b]: int; logprobs[b]: float or None; top_ids[b] / top_logprobs[b]: lists of length
    params[b].num_logprobs (highest first) or None.
    """

    token_ids: list[int]
    logprobs: list[float | None]
    top_ids: list[list[int] | None]
    top_logprobs: list[list[float] | None]


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens outside the top-k and outside the smallest set with cumulative p >= top_p.

    logits: [V] float32 (already divided by the temperature). Returns a new tensor.
    """
    out = logits.clone()
    if top_k > 0 and top_k < out.numel():
        kth = torch.topk(out, top_k).values[-1]
        out[out < kth] = float("-inf")
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(out, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        cum = torch.cumsum(probs, dim=-1)
        # keep a token if the mass before it is < top_p (so the first token is always kept)
        remove = (cum - probs) >= top_p
        sorted_logits[remove] = float("-inf")
        out = torch.empty_like(out).scatter_(0, idx, sorted_logits)
    return out


def _filter_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Mask tokens with prob < min_p * max prob. logits: [V] float32 (after temperature). New tensor.

    Source: Nguyen et al. 2024, "Min P Sampling"; the same rule as vLLM / HF `MinPLogitsWarper`.
    """
    if min_p <= 0.0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    keep = probs >= min_p * probs.max()
    return logits.masked_fill(~keep, float("-inf"))


def process_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    token_ids: Sequence[Sequence[int]] | None = None,
    num_prompt_tokens: Sequence[int] | None = None,
) -> torch.Tensor:
    """Steps 2-4 of the module docstring (min_tokens, logit_bias, penalties) -> [B, V] float32.

    Returns a new tensor, or `logits` itself (as float32) when no row asks for any of these.

    logits: [B, V] float32. token_ids[b]: the row's prompt followed by its generated tokens so far;
    num_prompt_tokens[b]: how many of them are the prompt. Both may be None when no row uses min_tokens or
    penalties (a ValueError is raised if one does). Ids outside [0, V) in logit_bias raise IndexError
    (the controller validates them against the vocabulary first).
    """
    if not any(p.logit_bias_ids or p.min_tokens > 0 or p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
               or p.frequency_penalty != 0.0 for p in params):
        return logits.float()  # nothing to do: the common case costs no copy
    out = logits.float().clone()
    B, V = out.shape
    pen_rows = [
        b for b, p in enumerate(params)
        if p.min_tokens > 0 or p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
    ]
    if pen_rows and (token_ids is None or num_prompt_tokens is None):
        raise ValueError("min_tokens / penalties need token_ids and num_prompt_tokens")
    for b, p in enumerate(params):
        if p.min_tokens > 0 and p.min_tokens_block_ids:
            n_out = len(token_ids[b]) - num_prompt_tokens[b]  # type: ignore[index]
            if n_out < p.min_tokens:
                ids = torch.tensor([i for i in p.min_tokens_block_ids if 0 <= i < V], dtype=torch.long)
                out[b, ids.to(out.device)] = float("-inf")
        if p.logit_bias_ids:
            ids = torch.tensor(p.logit_bias_ids, dtype=torch.long, device=out.device)
            vals = torch.tensor(p.logit_bias_values, dtype=out.dtype, device=out.device)
            out[b].index_add_(0, ids, vals)
    for b in pen_rows:
        p = params[b]
        if p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0:
            continue
        toks = [t for t in token_ids[b] if 0 <= t < V]  # type: ignore[index]
        n_prompt = num_prompt_tokens[b]  # type: ignore[index]
        row = out[b]
        if p.repetition_penalty != 1.0 and toks:
            seen = torch.zeros(V, dtype=torch.bool, device=out.device)
            seen[torch.tensor(toks, dtype=torch.long, device=out.device)] = True
            r = p.repetition_penalty
            penalised = torch.where(row > 0, row / r, row * r)
            row = torch.where(seen, penalised, row)
        gen = [t for t in token_ids[b][n_prompt:] if 0 <= t < V]  # type: ignore[index]
        if gen and (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0):
            counts = torch.zeros(V, dtype=out.dtype, device=out.device)
            counts.index_add_(0, torch.tensor(gen, dtype=torch.long, device=out.device), torch.ones(len(gen), dtype=out.dtype, device=out.device))
            row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(out.dtype)
        out[b] = row
    return out


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    token_ids: Sequence[Sequence[int]] | None = None,
    num_prompt_tokens: Sequence[int] | None = None,
) -> SampleOutput:
    """Sample one token per row (module docstring for the steps and their order).

    logits: [B, V] float32. params[b].temperature == 0 means argmax of the processed logits. token_ids /
    num_prompt_tokens: see `process_logits` (needed only for min_tokens and penalties). Returns token ids
    and, where params[b].num_logprobs >= 0, the sampled token's raw logprob and the top num_logprobs
    alternatives (ids, raw logprobs), highest first. The controller keeps at least one token
    sampleable (min_tokens bans at most the EOS and stop ids; biases are finite).
    """
    B = logits.shape[0]
    logits = logits.float()
    processed = process_logits(logits, params, token_ids, num_prompt_tokens)
    ids = torch.empty(B, dtype=torch.long)
    greedy = [i for i, p in enumerate(params) if p.temperature == 0.0]
    if greedy:
        ids[greedy] = torch.argmax(processed[greedy], dim=-1).cpu()
    for i, p in enumerate(params):
        if p.temperature == 0.0:
            continue
        row = processed[i] / p.temperature
        row = _filter_min_p(row, p.min_p)
        row = _filter_top_k_top_p(row, p.top_k, p.top_p)
        probs = torch.softmax(row, dim=-1)
        gen = generators[i]
        if gen is not None and gen.device != probs.device:
            probs = probs.to(gen.device)
        ids[i] = torch.multinomial(probs, 1, generator=gen).item()
    want = [i for i, p in enumerate(params) if p.num_logprobs >= 0]
    lps: list[float | None] = [None] * B
    tids: list[list[int] | None] = [None] * B
    tlps: list[list[float] | None] = [None] * B
    if want:
        logp = torch.log_softmax(logits[want], dim=-1)
        chosen = logp.gather(1, ids[want].to(logp.device).unsqueeze(1)).squeeze(1).tolist()
        for j, i in enumerate(want):
            lps[i] = chosen[j]
            k = params[i].num_logprobs
            if k > 0:
                v, t = torch.topk(logp[j], k)
                tids[i] = t.tolist()
                tlps[i] = v.tolist()
    return SampleOutput(ids.tolist(), lps, tids, tlps)


def prompt_logprobs(
    logits: torch.Tensor, next_ids: Sequence[int], k: int
) -> tuple[list[float], list[list[int]] | None, list[list[float]] | None]:
    """Raw logprobs of the tokens that follow each position (prompt logprobs, completions `echo`).

    logits: [N, V] float32, row i the model's prediction after token i; next_ids: the N tokens that
    actually follow. Returns (logprob of next_ids[i] per row, top-k ids per row, top-k logprobs per row);
    the top lists are None when k == 0.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    nxt = torch.tensor(list(next_ids), dtype=torch.long, device=logp.device)
    chosen = logp.gather(1, nxt.unsqueeze(1)).squeeze(1).tolist()
    if k <= 0:
        return chosen, None, None
    v, t = torch.topk(logp, k, dim=-1)
    return chosen, t.tolist(), v.tolist()
