"""One speculative step of a rank's ModelRunner (EAGLE3 drafts, docs/speculative.md): verify, accept, propose.

The step, for a runner with a draft (`ModelRunner.draft`):

1. the plan's diff is applied; a continuing request with `num_draft_tokens` k > 0 computes its last token and the
   first k tokens of its draft proposal (q_len = k + 1 through the paged cache, kimi.worker.inputs);
2. one target forward over the flat batch keeps the aux hidden states of the draft's layers
   (KimiForCausalLM.last_aux);
3. rows that reach their request's end without drafts are sampled as always (ModelRunner.sample); verify rows go
   through kimi.model.rejection.verify (greedy acceptance, or rejection sampling on the target's processed
   distribution with the request's seeded generator reseeded per drawn position); the emitted tokens are appended
   and `num_computed_tokens` is set to the tokens whose KV is valid (the rejected positions' KV is overwritten by
   later steps: nothing reads past num_computed_tokens);
4. the draft runs over this step's positions whose next token is now known (the target's aux states fused by `fc`,
   the next tokens' embeddings), writing its per-request KV (kimi.model.eagle3.DraftKV, truncated first to the
   step's first position, which drops the last step's speculative and rejected entries); for every request that
   emitted a token it then proposes k tokens greedily, feeding its own pre-norm output back (steps 2 .. k), and keeps
   them as `WorkerRequest.draft_ids` for the next step.

Guided-decoding requests never speculate (their drafts would need the grammar advanced and rolled back): the draft
does not run for them and the controller sends them no draft tokens. The step is synchronous: a previous step is
finished before this one starts (no overlap of launches), and the returned StepHandle is already finished.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kimi import protocol
from kimi.errors import ProtocolError
from kimi.model.rejection import verify
from kimi.worker.inputs import ScheduledRow, StepInputs, WorkerRequest, prepare_inputs
from kimi.worker.runner_base import StepHandle

if TYPE_CHECKING:
    from kimi.model.eagle3 import Eagle3Draft
    from kimi.worker.runner import ModelRunner


def speculative_step(
    runner: ModelRunner,
    plan: protocol.StepPlan,
    prev: StepHandle | None,
    on_prev: Callable[[StepHandle], None] | None,
    position_seed: Callable[[int, int], int],
) -> StepHandle:
    """Run `plan` on `runner` (module docstring); returns a finished StepHandle. position_seed(seed, position): the
    generator seed of a seeded request's draw at a position (kimi.worker.runner.position_seed). Raises ProtocolError
    when a plan verifies more draft tokens than the request's proposal holds, or asks for tokens it does not have."""
    runner._finish_prev(prev, on_prev)
    batch = runner.update_states(plan)
    done = StepHandle(plan.step, [], None, [], {}, outputs=[])
    if not batch:
        if runner.world_size > 1:
            runner._idle_step()
        return done
    draft = runner.draft
    assert draft is not None, "only a runner with a draft runs speculative steps"
    nv_of = {c.rid: c.num_draft_tokens for c in plan.cont if c.num_draft_tokens}
    for rid, wr, _ in batch:
        nv = nv_of.get(rid, 0)
        if nv > len(wr.draft_ids):
            raise ProtocolError(f"step {plan.step}: rid {rid} verifies {nv} draft tokens of {len(wr.draft_ids)}")
        wr.num_verify = nv
    starts = [wr.num_computed_tokens for _, wr, _ in batch]
    try:
        inputs = prepare_inputs(batch, runner.block_size, {})
    finally:
        for _, wr, _ in batch:
            wr.num_verify = 0
    hidden = runner.execute_model(inputs, None)  # [T, D]
    aux = runner.model.last_aux  # [T, 3 * D]
    assert aux is not None, "the target keeps the draft's aux layers (ModelRunner sets aux_layer_ids)"
    for _, wr, n in batch:
        wr.num_computed_tokens += n
    runner._gather_prompt_logprobs(batch, inputs.plp_rows, hidden)
    outputs: list[protocol.TokenOutput] = []
    if inputs.sample_rows:
        outputs = list(runner.finish(runner.sample(plan.step, batch, inputs, hidden)))
    emitted = set(inputs.sample_idx)
    for i, row0, nv in inputs.verify_rows:
        outputs.append(_verify_row(runner, batch[i], hidden[row0 : row0 + nv + 1], nv, position_seed))
        emitted.add(i)
    _run_draft(draft, runner.num_speculative_tokens, batch, starts, inputs, aux, emitted)
    done.outputs = outputs
    return done


def _verify_row(
    runner: ModelRunner, row: ScheduledRow, hidden: torch.Tensor, nv: int, position_seed: Callable[[int, int], int]
) -> protocol.TokenOutput:
    """Verify one request's nv drafts from its nv + 1 hidden rows; append the emitted tokens, set its computed tokens
    to those with valid KV; its TokenOutput (first token, then next_token_ids)."""
    rid, wr, _ = row
    sp = wr.sampling
    g = wr.generator
    seed_at = None
    if g is not None:
        assert sp.seed is not None, "only a seeded request has a generator"
        base, seed, gen = len(wr.token_ids), sp.seed, g

        def seed_at(i: int) -> None:
            gen.manual_seed(position_seed(seed, base + i))

    v = verify(
        runner.model.compute_logits(hidden), wr.draft_ids[:nv], sp, wr.token_ids, wr.num_prompt_tokens, g, seed_at
    )
    wr.token_ids.extend(v.token_ids)
    wr.num_computed_tokens = len(wr.token_ids) - 1  # the last emitted token's KV is computed next step
    runner.num_sampled += len(v.token_ids)
    runner.num_draft_tokens += nv
    runner.num_accepted_tokens += v.num_accepted
    more = len(v.token_ids) > 1
    return protocol.TokenOutput(
        rid,
        v.token_ids[0],
        v.logprobs[0],
        v.top_ids[0],
        v.top_logprobs[0],
        next_token_ids=v.token_ids[1:] if more else None,
        next_logprobs=v.logprobs[1:] if more and sp.num_logprobs >= 0 else None,
        next_top_ids=v.top_ids[1:] if more and sp.num_logprobs > 0 else None,
        next_top_logprobs=v.top_logprobs[1:] if more and sp.num_logprobs > 0 else None,
    )


def _run_draft(
    draft: Eagle3Draft,
    k: int,
    batch: list[ScheduledRow],
    starts: list[int],
    inputs: StepInputs,
    aux: torch.Tensor,
    emitted: set[int],
) -> None:
    """Step 4 of the module docstring for every non-guided request of the batch: the draft over the step's positions
    whose next token is known, then (for the requests in `emitted`) k proposed tokens."""
    dev = aux.device
    row = 0
    for i, (_rid, wr, n) in enumerate(batch):
        first_row, row = row, row + n
        if wr.guide is not None or wr.sampling.grammar is not None:
            continue
        start = starts[i]
        m = min(n, len(wr.token_ids) - 1 - start)  # positions whose next token is known
        if m <= 0:
            continue
        kv = wr.draft_kv
        if kv is None or (kv.length and kv.base + kv.length < start):
            kv = wr.draft_kv = draft.new_kv()  # nothing usable (a gap): start over at this step's positions
        kv.truncate(start)
        ids = torch.tensor(wr.token_ids[start + 1 : start + m + 1], dtype=torch.long, device=dev)
        pos = torch.arange(start, start + m, dtype=torch.long, device=dev)
        logits, h = draft(ids, draft.fuse(aux[first_row : first_row + m]), pos, kv)
        if i not in emitted:
            continue
        _propose(draft, wr, k, logits[m - 1 : m], h[m - 1 : m], start + m)


def _propose(draft: Eagle3Draft, wr: WorkerRequest, k: int, logits: torch.Tensor, h: torch.Tensor, pos: int) -> None:
    """k greedy draft tokens after wr's last token: the first from `logits` [1, Vd] (the draft at the last known
    position), then one draft position at a time from `pos` on, each fed the previous token and pre-norm output."""
    kv = wr.draft_kv
    proposal = [int(draft.to_target(logits.argmax(dim=-1))[0])]
    for j in range(1, k):
        ids = torch.tensor([proposal[-1]], dtype=torch.long, device=h.device)
        logits, h = draft(ids, h, torch.tensor([pos + j - 1], dtype=torch.long, device=h.device), kv)
        proposal.append(int(draft.to_target(logits.argmax(dim=-1))[0]))
    wr.draft_ids = proposal
