"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds; logprobs of the model distribution.

Plain PyTorch (the reference path). Logprobs are the log-softmax of the model's raw fp32 logits (before
temperature / top-k / top-p), as OpenAI-compatible servers report them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kimi.protocol import SamplingParams


@dataclass
class SampleOutput:
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


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> SampleOutput:
    """Sample one token per row.

    logits: [B, V] float32. params[b].temperature == 0 means argmax (ties: lowest id). Rows with a
    generator use it (seeded requests are reproducible); others use the global RNG.
    Returns token ids and, where params[b].num_logprobs >= 0, the sampled token's logprob and the top
    num_logprobs alternatives (ids, logprobs), highest first.
    """
    B = logits.shape[0]
    logits = logits.float()
    ids = torch.empty(B, dtype=torch.long)
    greedy = [i for i, p in enumerate(params) if p.temperature == 0.0]
    if greedy:
        ids[greedy] = torch.argmax(logits[greedy], dim=-1).cpu()
    for i, p in enumerate(params):
        if p.temperature == 0.0:
            continue
        row = _filter_top_k_top_p(logits[i] / p.temperature, p.top_k, p.top_p)
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
