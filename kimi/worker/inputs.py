"""A worker's per-request state and the flat batch of one step built from it (prefill chunks and decodes mixed)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kimi import protocol
from kimi.errors import ProtocolError

if TYPE_CHECKING:
    import torch

    from kimi.structured_output.bitmask import GuidedRow


@dataclass
class WorkerRequest:
    """A request as one worker sees it: its tokens, how many have KV in the cache, and its block table."""

    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    sampling: protocol.SamplingParams
    generator: torch.Generator | None
    num_prompt_tokens: int = 0
    # prompt logprobs gathered over the prompt's chunks (SamplingParams.prompt_logprobs >= 0); entry i is
    # about token i; None where not computed here (entry 0, prefix-cache hits). Sent with the next token.
    prompt_lp: list[float | None] | None = None
    prompt_top_ids: list[list[int] | None] | None = None
    prompt_top_lps: list[list[float] | None] | None = None
    # a step launched and not finished sampled this request's next token: it is on the device (that step's
    # StepHandle.launch.ids), not in token_ids yet
    pending: bool = False
    # guided decoding: the request's matcher (SamplingParams.grammar), fed each token this object's step samples
    guide: GuidedRow | None = None
    # speculative decoding (kimi.worker.speculative): the draft's proposal after the last token, its per-request KV
    # (kimi.model.eagle3.DraftKV), and how many of the proposal this step verifies (ContinueRequest.num_draft_tokens)
    draft_ids: list[int] = field(default_factory=list)
    draft_kv: Any = None
    num_verify: int = 0


ScheduledRow = tuple[int, WorkerRequest, int]
"""(rid, request, number of tokens this step computes for it): one entry of a step's batch, in batch order."""


@dataclass
class StepInputs:
    """The host side of one step's flat batch of T tokens over B requests (batch order).

    input_ids, positions: [T] (a pending token's input id is 0 until `fills` puts prev's sampled id there);
    query_lens, seq_lens, tables: per request, tokens this step, context length after it, block table;
    sample_rows: the flat rows whose logits are sampled (a request's last row when it reaches its known tokens'
    end), sample_idx: their batch indices; fills: (input row, row of prev's sampled ids) for tokens still on the
    device; plp_rows: (batch index, first flat row, prompt position of that row) of requests gathering prompt
    logprobs; verify_rows: see the field."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    sample_idx: list[int] = field(default_factory=list)
    fills: list[tuple[int, int]] = field(default_factory=list)
    plp_rows: list[tuple[int, int, int]] = field(default_factory=list)
    # speculative decoding: (batch index, first flat row, k) of the requests verifying k draft tokens; their k + 1
    # rows are verified (kimi.worker.speculative), not sampled
    verify_rows: list[tuple[int, int, int]] = field(default_factory=list)


def prepare_inputs(batch: list[ScheduledRow], block_size: int, prev_rows: dict[int, int]) -> StepInputs:
    """The flat batch computing tokens [num_computed_tokens, num_computed_tokens + n) of each request.

    prev_rows: rid -> row of the previous, unfinished step's sampled ids (for a request whose input token is
    pending). Raises ProtocolError when the plan asks for tokens a request does not have or its blocks cannot
    hold."""
    s = StepInputs()
    # local names for the lists (the loop runs once per request of the step)
    input_ids, positions, query_lens, seq_lens, tables = s.input_ids, s.positions, s.query_lens, s.seq_lens, s.tables
    sample_rows, sample_idx = s.sample_rows, s.sample_idx
    row = 0
    for i, (rid, wr, n) in enumerate(batch):
        start = wr.num_computed_tokens
        end = start + n
        nv = wr.num_verify
        known = len(wr.token_ids) + wr.pending + nv
        if n <= 0 or end > known or (nv and end != known):
            raise ProtocolError(f"plan asks rid {rid} for tokens [{start}, {end}) of {known}")
        if len(wr.block_table) * block_size < end:
            raise ProtocolError(f"rid {rid}: {len(wr.block_table)} blocks cannot hold {end} tokens")
        if wr.pending:  # its input is the token prev sampled (start == len(token_ids), n == 1)
            s.fills.append((row, prev_rows[rid]))
            input_ids.append(0)
        elif nv:  # the known tokens from start, then the k draft tokens the step verifies
            input_ids.extend(wr.token_ids[start:])
            input_ids.extend(wr.draft_ids[:nv])
        else:
            input_ids.extend(wr.token_ids[start:end])
        positions.extend(range(start, end))
        query_lens.append(n)
        seq_lens.append(end)
        tables.append(wr.block_table)
        if wr.prompt_lp is not None and start < wr.num_prompt_tokens - 1:
            # rows predicting prompt tokens start+1 .. min(end, n_prompt - 1)
            s.plp_rows.append((i, row, start))
        row += n
        if nv:
            s.verify_rows.append((i, row - nv - 1, nv))
        elif end == known:
            sample_rows.append(row - 1)
            sample_idx.append(i)
    return s
