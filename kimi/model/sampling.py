"""Token sampling: logit processing, greedy / random sampling, logprobs (batched, GPU-friendly, + reference).

Per row b of a batch, in this order (the order vLLM's V1 sampler uses):

0. guided decoding (`bitmask`, kimi.structured_output): the tokens the row's grammar does not allow are set to -inf
   first, as vLLM applies its grammar bitmask to the logits before its sampler; so everything below, the reported
   logprobs included, sees only the allowed tokens.
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
5. temperature below 1e-5, 0 included (`SamplingParams.greedy`, kimi.protocol.GREEDY_TEMPERATURE):
   argmax of the processed logits (ties: lowest id). Otherwise divide by the temperature,
   then min_p (drop tokens whose probability is below `min_p * max probability`), top-k (keep the tokens
   whose logit is >= the k-th largest, so ties with the k-th are kept), top-p (keep the smallest set, in
   descending probability with ties in ascending id, whose mass reaches top_p; the most likely token is
   always kept), and draw from the softmax of what is left with the exponential race (below), using the
   row's generator (seeded requests are reproducible whatever else is in the batch) or the global RNG.

Drawing (`exponential_race`): token = argmax_i p_i / E_i with E_i ~ Exp(1) i.i.d. Proof that this samples
p: E_i / p_i ~ Exp(rate p_i) independently, and the minimum of independent exponentials is attained at i
with probability p_i / sum_j p_j = p_i (memorylessness), so P(argmin_i E_i/p_i = i) = p_i. A token with
p_i = 0 scores 0 and never wins (E is clamped away from 0, and the top token's score is > 0).

Two implementations of the same semantics:

- `sample` / `process_logits`: batched tensor ops over the rows, for the GPU. No device->host
  synchronisation per row: the only device->host copy is one packed float64 tensor at the end (token ids, chosen
  logprobs, top-k ids and logprobs), started by `sample_launch` (`start_host_copy`: non-blocking, into pinned memory)
  and waited for by `SampleLaunch.result()`, so a caller can queue more device work before it waits. Host->device inputs
  (row indices, per-row parameters, token-history index pairs) are built from Python lists once per step and sent with
  non-blocking copies from pinned memory (`_h2d`), which do not make the host wait either.
- `sample_ref` / `process_logits_ref`: one row at a time in plain PyTorch, the reference the batched path
  is tested against (tests/unit/test_sampling.py on CPU, tests/gpu/test_gpu_sampling.py on CUDA). With the
  same generators both draw the same exponentials, so seeded rows sample the same token in both.

Shapes: logits [B, V] float32 (any float dtype is upcast). Token-history inputs are Python lists. A bitmask is
`(rows, bitmask)`: the batch rows it constrains and an int32 [B, ceil(V / 32)] CPU tensor (xgrammar's layout: token t
of row b is allowed when bit t % 32 of bitmask[b, t // 32] is set; rows not listed are not read).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kimi.protocol import SamplingParams

_NEG_INF = float("-inf")
Bitmask = tuple[Sequence[int], torch.Tensor]
"""(batch rows constrained, int32 [B, ceil(V / 32)] CPU bitmask): see the module docstring."""


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [R, W] packed bitmask -> bool [R, vocab_size], True = allowed (bit t % 32 of word t // 32), on the
    bitmask's device. Needs W * 32 >= vocab_size."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, W, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, bitmask: Bitmask) -> None:
    """Set to -inf, in place, the logits [B, V] float32 of the tokens the bitmask's rows do not allow.

    On the CPU xgrammar's kernel (`xgrammar.apply_token_bitmask_inplace` over the listed rows); on another device
    the listed rows of the bitmask are copied there (pinned, non-blocking) and unpacked with torch ops
    (`unpack_bitmask` + `masked_fill`): no host synchronisation, and nothing that a CUDA graph would need to capture.
    """
    rows, bm = bitmask
    if not rows:
        return
    B, V = logits.shape
    if logits.device.type == "cpu":
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, bm[:B], vocab_size=V, indices=list(rows))
        return
    dev = logits.device
    everyone = len(rows) == B and list(rows) == list(range(B))
    host = bm[:B] if everyone else bm.index_select(0, torch.tensor(list(rows), dtype=torch.long))
    if dev.type == "cuda":
        host = host.pin_memory()
    allowed = unpack_bitmask(host.to(dev, non_blocking=True), V)  # [R, V]
    if everyone:
        logits.masked_fill_(~allowed, _NEG_INF)
    else:
        ri = _h2d(list(rows), torch.long, dev)
        logits.index_copy_(0, ri, logits.index_select(0, ri).masked_fill_(~allowed, _NEG_INF))


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: Bitmask) -> None:
    """Per-row reference of `apply_token_bitmask` (plain torch, any device)."""
    rows, bm = bitmask
    V = logits.shape[1]
    for r in rows:
        allowed = unpack_bitmask(bm[r : r + 1], V)[0].to(logits.device)
        logits[r] = logits[r].masked_fill(~allowed, _NEG_INF)


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


def _any_processing(params: Sequence[SamplingParams]) -> bool:
    return any(
        p.logit_bias_ids
        or p.min_tokens > 0
        or p.repetition_penalty != 1.0
        or p.presence_penalty != 0.0
        or p.frequency_penalty != 0.0
        for p in params
    )


def _needs_history(p: SamplingParams) -> bool:
    return p.min_tokens > 0 or p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _draw_exponential(n: int, device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
    """[n] float32 Exp(1) draws from `generator` (or the global RNG), on `device`.

    The draw is made on the generator's device (a CUDA generator needs a CUDA tensor) and moved to `device`
    (a no-op when it is already there; a blocking copy from a CPU generator to a CUDA `device`, which the
    runner avoids by keeping generators on the model's device). Depends only on the generator's state and
    n, never on the rest of the batch.
    """
    gdev = generator.device if generator is not None else device
    e = torch.empty(n, dtype=torch.float32, device=gdev).exponential_(generator=generator)
    return e.to(device)


def exponential_race(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Draw one token per row of `probs` [R, V] (rows sum to 1, float32): argmax_i probs_i / E_i.

    E ~ Exp(1) i.i.d. per (row, token) (proof in the module docstring); row j's E comes from
    generators[j] when not None (one launch per seeded row, no sync), the other rows' from the global RNG in
    one batched call. E is clamped to >= the smallest normal float so a zero-probability token scores
    exactly 0. Returns [R] int64 on probs' device. Ties in the score (float rounding) go to the lowest id.
    """
    R, V = probs.shape
    if len(generators) != R:
        raise ValueError(f"{len(generators)} generators for {R} rows")
    q = torch.empty(R, V, dtype=torch.float32, device=probs.device)
    seeded = [(j, g) for j, g in enumerate(generators) if g is not None]
    if len(seeded) < R:
        q.exponential_()
    for j, g in seeded:
        q[j] = _draw_exponential(V, probs.device, g)
    q.clamp_min_(torch.finfo(torch.float32).tiny)
    return torch.argmax(probs.float() / q, dim=-1)


# ---- reference: one row at a time ---------------------------------------------------------------------


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens outside the top-k and outside the smallest set with cumulative p >= top_p.

    logits: [V] float32 (already divided by the temperature). Returns a new tensor. Reference for
    `filter_logits`.
    """
    out = logits.clone()
    if top_k > 0 and top_k < out.numel():
        kth = torch.topk(out, top_k).values[-1]
        out[out < kth] = _NEG_INF
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(out, descending=True, stable=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        cum = torch.cumsum(probs, dim=-1)
        # keep a token if the mass before it is < top_p; the first is always kept (top_p may round to 0 in fp32)
        remove = (cum - probs) >= top_p
        remove[0] = False
        sorted_logits[remove] = _NEG_INF
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
    return logits.masked_fill(~keep, _NEG_INF)


def process_logits_ref(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    token_ids: Sequence[Sequence[int]] | None = None,
    num_prompt_tokens: Sequence[int] | None = None,
) -> torch.Tensor:
    """Per-row reference of `process_logits` (same arguments and result; IndexError for logit_bias ids outside
    [0, V))."""
    if not _any_processing(params):
        return logits.float()
    out = logits.float().clone()
    _B, V = out.shape
    pen_rows = [b for b, p in enumerate(params) if _needs_history(p)]
    if pen_rows and (token_ids is None or num_prompt_tokens is None):
        raise ValueError("min_tokens / penalties need token_ids and num_prompt_tokens")
    history: Sequence[Sequence[int]] = token_ids if token_ids is not None else ()  # read for pen_rows only
    n_prompts: Sequence[int] = num_prompt_tokens if num_prompt_tokens is not None else ()
    for b, p in enumerate(params):
        if p.min_tokens > 0 and p.min_tokens_block_ids:
            n_out = len(history[b]) - n_prompts[b]
            if n_out < p.min_tokens:
                ids = torch.tensor([i for i in p.min_tokens_block_ids if 0 <= i < V], dtype=torch.long)
                out[b, ids.to(out.device)] = _NEG_INF
        if p.logit_bias_ids:
            ids = torch.tensor(p.logit_bias_ids, dtype=torch.long, device=out.device)
            vals = torch.tensor(p.logit_bias_values, dtype=out.dtype, device=out.device)
            out[b].index_add_(0, ids, vals)
    for b in pen_rows:
        p = params[b]
        if p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0:
            continue
        toks = [t for t in history[b] if 0 <= t < V]
        n_prompt = n_prompts[b]
        row = out[b]
        if p.repetition_penalty != 1.0 and toks:
            seen = torch.zeros(V, dtype=torch.bool, device=out.device)
            seen[torch.tensor(toks, dtype=torch.long, device=out.device)] = True
            r = p.repetition_penalty
            penalised = torch.where(row > 0, row / r, row * r)
            row = torch.where(seen, penalised, row)
        gen = [t for t in history[b][n_prompt:] if 0 <= t < V]
        if gen and (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0):
            counts = torch.zeros(V, dtype=out.dtype, device=out.device)
            counts.index_add_(
                0,
                torch.tensor(gen, dtype=torch.long, device=out.device),
                torch.ones(len(gen), dtype=out.dtype, device=out.device),
            )
            row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(out.dtype)
        out[b] = row
    return out


def sample_ref(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    token_ids: Sequence[Sequence[int]] | None = None,
    num_prompt_tokens: Sequence[int] | None = None,
    bitmask: Bitmask | None = None,
) -> SampleOutput:
    """Per-row reference of `sample` (same arguments and result). Syncs with the device once per row.

    Each random row draws its exponentials with `_draw_exponential(V, device, generators[b])`, exactly as
    `sample` does, so a seeded row samples the same token in both.
    """
    B, _V = logits.shape
    logits = logits.float()
    if bitmask is not None:
        logits = logits.clone()
        apply_token_bitmask_ref(logits, bitmask)
    processed = process_logits_ref(logits, params, token_ids, num_prompt_tokens)
    ids = torch.empty(B, dtype=torch.long)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        ids[greedy] = torch.argmax(processed[greedy], dim=-1).cpu()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = processed[i] / p.temperature
        row = _filter_min_p(row, p.min_p)
        row = _filter_top_k_top_p(row, p.top_k, p.top_p)
        probs = torch.softmax(row, dim=-1)
        ids[i] = exponential_race(probs.unsqueeze(0), [generators[i]]).item()
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


# ---- batched: no per-row host synchronisation -------------------------------------------------------


def _h2d(values: list[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device`. On CUDA: staged in pinned memory and copied non-blocking.

    The pinned block is not reused before the copy has run (PyTorch's caching host allocator records the
    copy's stream), so the host never waits for the device here.
    """
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def process_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    token_ids: Sequence[Sequence[int]] | None = None,
    num_prompt_tokens: Sequence[int] | None = None,
) -> torch.Tensor:
    """Steps 2-4 of the module docstring (min_tokens, logit_bias, penalties) -> [B, V] float32, batched.

    Returns a new tensor, or `logits` itself (as float32) when no row asks for any of these.

    logits: [B, V] float32. token_ids[b]: the row's prompt followed by its generated tokens so far;
    num_prompt_tokens[b]: how many of them are the prompt. Both may be None when no row uses min_tokens or
    penalties (a ValueError is raised if one does). Ids outside [0, V) in logit_bias raise IndexError
    (the controller validates them against the vocabulary first); logit_bias_ids and logit_bias_values of
    different lengths raise ValueError. Each kind of edit is one batched op over (row, token) index pairs
    gathered on the host from the lists; nothing is read back from the device.
    """
    if not _any_processing(params):
        return logits.float()  # nothing to do: the common case costs no copy
    out = logits.float().clone()
    pen_rows = [b for b, p in enumerate(params) if _needs_history(p)]
    if pen_rows and (token_ids is None or num_prompt_tokens is None):
        raise ValueError("min_tokens / penalties need token_ids and num_prompt_tokens")
    history: Sequence[Sequence[int]] = token_ids if token_ids is not None else ()  # read for pen_rows only
    n_prompts: Sequence[int] = num_prompt_tokens if num_prompt_tokens is not None else ()
    _ban_and_bias(out, params, history, n_prompts)
    rep_rows = [b for b in pen_rows if params[b].repetition_penalty != 1.0]
    if rep_rows:
        out = _repetition_penalty(out, params, history, rep_rows)
    fp_rows = [b for b in pen_rows if params[b].frequency_penalty != 0.0 or params[b].presence_penalty != 0.0]
    if fp_rows:
        out = _frequency_presence_penalty(out, params, history, n_prompts, fp_rows)
    return out


def _ban_and_bias(
    out: torch.Tensor, params: Sequence[SamplingParams], history: Sequence[Sequence[int]], n_prompts: Sequence[int]
) -> None:
    """Steps 2 (min_tokens: the block ids to -inf while a row has fewer outputs) and 3 (logit_bias, added) of
    process_logits, in place on out [B, V] float32; raises as process_logits does for bad logit_bias lists."""
    V = out.shape[1]
    dev = out.device
    ban_r: list[int] = []
    ban_c: list[int] = []
    bias_r: list[int] = []
    bias_c: list[int] = []
    bias_v: list[float] = []
    for b, p in enumerate(params):
        if p.min_tokens > 0 and p.min_tokens_block_ids and len(history[b]) - n_prompts[b] < p.min_tokens:
            ids = [i for i in p.min_tokens_block_ids if 0 <= i < V]
            ban_r += [b] * len(ids)
            ban_c += ids
        if p.logit_bias_ids:
            if len(p.logit_bias_ids) != len(p.logit_bias_values):
                raise ValueError(f"row {b}: {len(p.logit_bias_ids)} logit_bias ids, {len(p.logit_bias_values)} values")
            bad = [i for i in p.logit_bias_ids if not 0 <= i < V]
            if bad:
                raise IndexError(f"row {b}: logit_bias ids {bad[:5]} outside [0, {V})")
            bias_r += [b] * len(p.logit_bias_ids)
            bias_c += p.logit_bias_ids
            bias_v += p.logit_bias_values
    if ban_c:  # step 2, before the bias (a banned token stays banned: -inf + bias = -inf)
        out.index_put_(
            (_h2d(ban_r, torch.long, dev), _h2d(ban_c, torch.long, dev)),
            torch.full((), _NEG_INF, dtype=out.dtype, device=dev),
        )  # a fill, not a host copy
    if bias_c:  # step 3; repeated ids add up, as index_add_ does
        out.index_put_(
            (_h2d(bias_r, torch.long, dev), _h2d(bias_c, torch.long, dev)),
            _h2d(bias_v, out.dtype, dev),
            accumulate=True,
        )


def _repetition_penalty(
    out: torch.Tensor, params: Sequence[SamplingParams], history: Sequence[Sequence[int]], rep_rows: list[int]
) -> torch.Tensor:
    """Step 4a of process_logits: out [B, V] float32 with the repetition penalty of rows rep_rows applied to every
    token of their histories (positive logits divided by it, the others multiplied) -> a new tensor, or out."""
    B, V = out.shape
    dev = out.device
    rr: list[int] = []
    rc: list[int] = []
    for b in rep_rows:
        toks = [t for t in history[b] if 0 <= t < V]
        rr += [b] * len(toks)
        rc += toks
    if not rc:
        return out
    seen = torch.zeros(B, V, dtype=torch.bool, device=dev)
    seen.index_put_(
        (_h2d(rr, torch.long, dev), _h2d(rc, torch.long, dev)), torch.ones((), dtype=torch.bool, device=dev)
    )  # not `= True`: that copies from the host
    r = _h2d([p.repetition_penalty for p in params], out.dtype, dev).unsqueeze(1)
    return torch.where(seen, torch.where(out > 0, out / r, out * r), out)


def _frequency_presence_penalty(
    out: torch.Tensor,
    params: Sequence[SamplingParams],
    history: Sequence[Sequence[int]],
    n_prompts: Sequence[int],
    fp_rows: list[int],
) -> torch.Tensor:
    """Step 4b of process_logits: out [B, V] float32 minus, for rows fp_rows, frequency_penalty * count + presence
    penalty * (count > 0) of each token among the row's generated tokens -> a new tensor, or out."""
    B, V = out.shape
    dev = out.device
    cr: list[int] = []
    cc: list[int] = []
    for b in fp_rows:
        gen = [t for t in history[b][n_prompts[b] :] if 0 <= t < V]
        cr += [b] * len(gen)
        cc += gen
    if not cc:
        return out
    counts = torch.zeros(B, V, dtype=out.dtype, device=dev)
    counts.index_put_(
        (_h2d(cr, torch.long, dev), _h2d(cc, torch.long, dev)),
        torch.ones((), dtype=out.dtype, device=dev).expand(len(cc)),
        accumulate=True,
    )
    fp = _h2d([[p.frequency_penalty, p.presence_penalty] for p in params], out.dtype, dev)
    return out - fp[:, 0:1] * counts - fp[:, 1:2] * (counts > 0).to(out.dtype)


def filter_logits(
    logits: torch.Tensor,
    min_p: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """min_p, then top-k, then top-p over the rows of `logits` [R, V] float32 (already divided by the temperature).

    min_p: [R] float32, 0 = off; top_k: [R] int64 in [1, V], V = off; top_p: [R] float32, +inf = off
    (`sample` maps the request's k <= 0 or >= V, and p >= 1, to these). None skips that filter for every row.
    Dropped tokens become -inf; returns a new tensor (or `logits` itself when all three are None).
    top-k and top-p share ONE stable descending sort of each row: top-k keeps the sorted values >= the k-th
    (ties with it kept), top-p then drops a sorted position when the mass before it is >= p, except the first
    (always kept), and ties go to the lower id. Same result as `_filter_min_p` + `_filter_top_k_top_p` per row.
    """
    x = logits
    if min_p is not None:
        probs = torch.softmax(x, dim=-1)
        keep = probs >= min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        x = x.masked_fill(~keep, _NEG_INF)
    if top_k is None and top_p is None:
        return x
    sv, si = torch.sort(x, dim=-1, descending=True, stable=True)
    if top_k is not None:
        kth = sv.gather(1, (top_k - 1).unsqueeze(1))
        sv = sv.masked_fill(sv < kth, _NEG_INF)
    if top_p is not None:
        sp = torch.softmax(sv, dim=-1)
        drop = (torch.cumsum(sp, dim=-1) - sp) >= top_p.unsqueeze(1)
        drop[:, 0] = False  # the most likely token stays, also where top_p rounded to 0 in fp32 (1e-46)
        sv = sv.masked_fill(drop, _NEG_INF)
    return torch.empty_like(x).scatter_(1, si, sv)


def sample_launch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    token_ids: Sequence[Sequence[int]] | None = None,
    num_prompt_tokens: Sequence[int] | None = None,
    bitmask: Bitmask | None = None,
) -> SampleLaunch:
    """Sample one token per row (module docstring for the steps and their order), batched.

    logits: [B, V] float32 (other float dtypes are upcast), on any device. params[b].greedy (temperature < 1e-5) means
    argmax of the processed logits (lowest id on ties). generators[b]: a torch.Generator for a seeded row
    (best on logits' device; see `_draw_exponential`) or None for the global RNG. token_ids /
    num_prompt_tokens: see `process_logits` (needed only for min_tokens and penalties; ValueError /
    IndexError as there). bitmask: the guided rows' allowed tokens (module docstring), applied first; float32 logits
    are masked in place. Returns a SampleLaunch: the sampled ids on the device now, and from `result()` the
    token ids and, where params[b].num_logprobs >= 0, the sampled token's raw logprob and the top
    num_logprobs alternatives (ids, raw logprobs), highest first. The controller keeps
    at least one token sampleable (min_tokens bans at most the EOS and stop ids; biases are finite).

    Device work: one argmax over the greedy rows; for the random rows one temperature division, one
    min_p mask, one sort for top-k / top-p, one softmax and one exponential race; one log_softmax and one
    topk (with the largest requested k) over the rows that want logprobs. Everything the host needs is
    packed into one float64 tensor (ids and top ids are exact below 2**53) and copied back once.
    """
    B, V = logits.shape
    dev = logits.device
    if len(params) != B or len(generators) != B:
        raise ValueError(f"{B} rows, {len(params)} params, {len(generators)} generators")
    logits = logits.float()
    if bitmask is not None:
        apply_token_bitmask(logits, bitmask)
    processed = process_logits(logits, params, token_ids, num_prompt_tokens)
    greedy = [b for b, p in enumerate(params) if p.greedy]
    rand = [b for b, p in enumerate(params) if not p.greedy]
    if not rand:
        ids = torch.argmax(processed, dim=-1)
    else:
        ids = torch.empty(B, dtype=torch.long, device=dev)
        if greedy:
            gi = _h2d(greedy, torch.long, dev)
            ids.index_copy_(0, gi, torch.argmax(processed.index_select(0, gi), dim=-1))
        ri = _h2d(rand, torch.long, dev) if greedy else None
        ps = [params[b] for b in rand]
        # per random row: temperature, min_p (0 = off), top_p (inf = off); top_k (V = off)
        rp = _h2d(
            [[p.temperature, p.min_p, p.top_p if p.top_p < 1.0 else float("inf")] for p in ps], torch.float32, dev
        )
        use_k = any(0 < p.top_k < V for p in ps)
        x = processed if ri is None else processed.index_select(0, ri)
        x = x / rp[:, 0:1]
        x = filter_logits(
            x,
            rp[:, 1] if any(p.min_p > 0.0 for p in ps) else None,
            _h2d([p.top_k if 0 < p.top_k < V else V for p in ps], torch.long, dev) if use_k else None,
            rp[:, 2] if any(p.top_p < 1.0 for p in ps) else None,
        )
        drawn = exponential_race(torch.softmax(x, dim=-1), [generators[b] for b in rand])
        if ri is None:
            ids = drawn
        else:
            ids.index_copy_(0, ri, drawn)
    want = [b for b, p in enumerate(params) if p.num_logprobs >= 0]
    parts = [ids.to(torch.float64)]
    K = 0
    if want:
        wi = _h2d(want, torch.long, dev) if len(want) < B else None
        logp = torch.log_softmax(logits if wi is None else logits.index_select(0, wi), dim=-1)
        chosen = logp.gather(1, (ids if wi is None else ids.index_select(0, wi)).unsqueeze(1)).squeeze(1)
        parts.append(chosen.to(torch.float64))
        K = min(max(params[b].num_logprobs for b in want), V)
        if K > 0:
            tv, ti = torch.topk(logp, K, dim=-1)
            parts += [ti.to(torch.float64).flatten(), tv.to(torch.float64).flatten()]
    host, event = start_host_copy(torch.cat(parts) if len(parts) > 1 else parts[0])
    return SampleLaunch(ids, host, event, B, want, K, [p.num_logprobs for p in params], V)


def start_host_copy(packed: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """The one device->host copy of a `sample_launch` (also the decode benchmark's): on CUDA started non-blocking into
    pinned memory, with an event recorded after it (SampleLaunch.result waits for that event); on the CPU the tensor
    itself, no event."""
    if packed.device.type != "cuda":
        return packed, None
    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
    host.copy_(packed, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(packed.device))
    return host, event


@dataclass
class SampleLaunch:
    """A `sample_launch` in flight: every device op is queued and the packed results are being copied to the host.

    ids: [B] int64 on the logits' device, the sampled token ids (a later step may read them on the device before
    the host has them). `result()` waits for the copy (an event, not a device-wide sync) and unpacks it."""

    ids: torch.Tensor
    _host: torch.Tensor
    _event: torch.cuda.Event | None
    _B: int
    _want: list[int]
    _K: int
    _num_logprobs: list[int]
    _V: int

    def done(self) -> bool:
        """Whether the copy to the host has finished (never blocks)."""
        return self._event is None or self._event.query()

    def result(self) -> SampleOutput:
        """The SampleOutput (waits for the copy)."""
        if self._event is not None:
            self._event.synchronize()
        host = self._host.tolist()
        B, want, K, V = self._B, self._want, self._K, self._V
        token_out = [int(v) for v in host[:B]]
        lps: list[float | None] = [None] * B
        tids: list[list[int] | None] = [None] * B
        tlps: list[list[float] | None] = [None] * B
        W = len(want)
        for j, b in enumerate(want):
            lps[b] = host[B + j]
            k = min(self._num_logprobs[b], V)
            if k > 0:
                o = B + W + j * K
                tids[b] = [int(v) for v in host[o : o + k]]
                tlps[b] = host[o + W * K : o + W * K + k]
        return SampleOutput(token_out, lps, tids, tlps)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    token_ids: Sequence[Sequence[int]] | None = None,
    num_prompt_tokens: Sequence[int] | None = None,
    bitmask: Bitmask | None = None,
) -> SampleOutput:
    """`sample_launch(...).result()`: one token per row (module docstring for the steps and their order),
    batched; see sample_launch for the arguments and errors."""
    return sample_launch(logits, params, generators, token_ids, num_prompt_tokens, bitmask).result()


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
