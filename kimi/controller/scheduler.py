"""Continuous batching for one DP rank: decodes first, then chunked prefills, under a per-step token budget.

Each step (`schedule`):
1. Running requests get their next tokens as long as the token budget lasts: first every decode (one
   token each, oldest first), then partially prefilled / resumed requests (the next prompt chunk, at most
   the budget left). So a long prompt arriving mid-decode never stalls the running decodes: each step
   still carries one token for every running decode, and the long prompt gets what is left (one chunk).
   A request whose new tokens need a KV block when none is free preempts the newest running request not
   yet scheduled this step (its blocks are freed but stay in the prefix cache; it goes back to the front of
   the waiting queue and is recomputed later from its prompt and outputs so far, which then mostly hits
   the cache). Under policy "priority" the running requests are kept in (priority, arrival) order instead of
   arrival order, so higher priorities are scheduled first and the lowest priority is preempted first (vLLM's
   rule), and the waiting queue is sorted the same way.
   While requests wait (and one could start: `max_num_seqs` not reached, the head of the queue not waiting for
   its leader), those prompt chunks leave `waiting_reserve` tokens of the budget to the waiting requests, so a
   short request that arrives behind a long prompt starts within a step rather than after the whole prompt.
   Decodes are never held back.
2. Waiting requests, first come first served, start while budget, `max_num_seqs` and free blocks allow; a
   new request first takes the longest cached prefix of its tokens (BlockPool.lookup; whole blocks, never
   its last token, so at least one token is computed and the last position yields logits), then a chunk
   of the rest that fits the remaining budget.
After each step the engine calls `update_from_output`, the one place a step's results change the requests: it
advances their computed tokens, appends their sampled tokens, and registers their newly completed full blocks in the
prefix cache (`commit`: only then is their KV known to be written).

Async scheduling (the engine plans step N+1 while step N runs): `schedule` counts what earlier, unapplied steps
will do. A request's known tokens are `len(token_ids) + num_inflight_samples` (the in-flight steps' sampled tokens
exist on the workers, which run plans in order, though not here yet) and its tokens still to compute start at
`num_scheduled_tokens`; scheduling advances both counters, applying a step (`update_from_output`) advances
num_computed_tokens and appends the sampled token. A request whose in-flight tokens already reach max_tokens or
max_model_len is not scheduled ahead (it ends when they are applied); one that ends on a stop condition only the
applied token shows (EOS, a stop string) has one extra token computed, which is dropped. Preemption resets the
counters and bumps `num_preemptions`, the epoch that `ScheduledRequest.epoch` records, so the results of steps sent
before it are ignored. Without async scheduling the counters equal num_computed_tokens / 0 between steps and
everything above reduces to the synchronous rules.
Speculative decoding (SchedulerConfig.num_speculative_tokens k > 0, docs/speculative.md): a decode of a request whose
workers hold a draft proposal (`Request.drafts_ready`) computes 1 + k' tokens, k' = min(k, what max_tokens and
max_model_len leave after the next token, budget - 1): its last token and k' draft tokens, whose KV slots it gets like
any tokens. The result carries 1 .. k' + 1 tokens; only the accepted ones count as computed (`_apply_drafts`), so
prefix-cache hashes cover accepted tokens only. A speculating request is never scheduled ahead of its in-flight step
(how many tokens that step accepts is not known yet): under async scheduling it runs every other step.
The controller never schedules work for a request it cannot hold: admission (`engine`) rejects requests
whose prompt + max_tokens exceed what the whole cache holds.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

from kimi.config import SchedulerConfig
from kimi.controller.block_pool import BlockPool, block_hashes
from kimi.controller.request import Request, RequestStatus
from kimi.errors import ProtocolError
from kimi.protocol import TokenOutput

_NO_BLOCKS: list[int] = []  # shared, never mutated: new_blocks of a step that appends none


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: compute `num_new_tokens` tokens; `new_blocks` were appended for them.

    is_new: the workers do not hold this request yet (first schedule, or after preemption); its
    `num_computed_tokens` then counts the prefix-cache hit the workers must not recompute.
    epoch: the request's num_preemptions when scheduled (a result for an older epoch is ignored).
    num_draft_tokens: k > 0 for a speculating decode: it computes its last token and k tokens of the workers' draft
    proposal (num_new_tokens = k + 1), and 1 .. k + 1 tokens come back.
    """

    request: Request
    num_new_tokens: int
    new_blocks: list[int]
    is_new: bool
    epoch: int = 0
    num_draft_tokens: int = 0  # speculative decoding: of num_new_tokens, the last this many are verified drafts


@dataclass
class SchedulerOutput:
    """A step's work for one DP rank: the scheduled requests and those preempted while planning it."""

    scheduled: list[ScheduledRequest]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Waiting queue, running list and BlockPool of one DP rank.

    Not thread-safe; the engine's event loop owns it. Invariants: a running request's block table holds
    exactly blocks_needed(num_scheduled_tokens) blocks between steps (at least that many after a verify step that
    rejected draft tokens: the blocks of the rejected positions stay, the next steps fill them); its first
    `num_cached_blocks` blocks are registered in the prefix cache; waiting requests hold no blocks.
    """

    def __init__(self, config: SchedulerConfig, block_pool: BlockPool, dp_rank: int = 0) -> None:
        self.config = config
        self.block_pool = block_pool
        self.dp_rank = dp_rank
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.spec = SpecDecodeStats([0] * config.num_speculative_tokens)

    # ---- queue management ---------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Queue a new request: at the end (policy "fcfs"), or (policy "priority") after every waiting request of
        a lower or equal (priority, arrival)."""
        req.dp_rank = self.dp_rank
        req.status = RequestStatus.WAITING
        if self.config.policy == "priority":
            self._insert_by_priority(req)
        else:
            self.waiting.append(req)

    def _insert_by_priority(self, req: Request) -> None:
        """Insert into the waiting queue, which policy "priority" keeps sorted by (priority, arrival)."""
        i = bisect.bisect_right(self.waiting, (req.priority, req.arrival_time), key=_priority_key)
        self.waiting.insert(i, req)

    def remove(self, req: Request) -> bool:
        """Take a request out (finished or aborted) and free its blocks. Returns True if the workers hold it."""
        held = req.sent_to_workers
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self._release(req)
        req.status = RequestStatus.FINISHED
        return held

    def _release(self, req: Request) -> None:
        if req.block_table:
            self.block_pool.free(req.block_table)
        req.block_table = []
        req.num_cached_blocks = 0
        req.num_sent_blocks = 0
        req.sent_to_workers = False
        req.num_scheduled_tokens = req.num_computed_tokens
        req.num_inflight_samples = 0
        req.drafts_ready = False

    def speculates(self, req: Request) -> bool:
        """Whether req's decode steps verify draft tokens: speculative decoding is on and it has no grammar (guided
        requests never speculate, docs/speculative.md)."""
        return self.config.num_speculative_tokens > 0 and getattr(req.sampling, "grammar", None) is None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- prefix cache ---------------------------------------------------------------------------------
    def _update_hashes(self, req: Request) -> None:
        """Extend req.block_hashes to cover every full block of req.token_ids (token_ids only grows)."""
        bs = self.block_pool.block_size
        have = len(req.block_hashes)
        if have < len(req.token_ids) // bs:
            parent = req.block_hashes[-1] if have else b""
            req.block_hashes.extend(block_hashes(req.token_ids, bs, have, parent, req.cache_salt))

    def commit(self, req: Request) -> None:
        """Register req's full blocks whose KV is now computed (call after a step's tokens are applied)."""
        pool = self.block_pool
        if not pool.enable_caching:
            return
        n_full = min(req.num_computed_tokens // pool.block_size, len(req.block_table))
        if n_full <= req.num_cached_blocks:
            return
        self._update_hashes(req)
        for i in range(req.num_cached_blocks, n_full):
            pool.cache(req.block_table[i], req.block_hashes[i])
        req.num_cached_blocks = n_full

    def _looks_up(self, req: Request) -> bool:
        """Whether req's prompt is looked up in the prefix cache: caching is on and it asks for no prompt logprobs
        (those need every prompt position computed)."""
        return self.block_pool.enable_caching and getattr(req.sampling, "prompt_logprobs", -1) < 0

    def _cached_prefix(self, req: Request) -> list[int]:
        """Cached blocks of req's longest cached prefix, at most (len(token_ids) - 1) // block_size of them."""
        pool = self.block_pool
        if not self._looks_up(req):
            return []
        self._update_hashes(req)
        max_hit = (len(req.token_ids) - 1) // pool.block_size
        return pool.lookup(req.block_hashes[:max_hit])

    # ---- one step -------------------------------------------------------------------------------------
    def _grow(self, req: Request, num_new: int) -> list[int] | None:
        """Blocks to append so that req holds num_scheduled + num_new tokens; None if not enough are free."""
        need = self.block_pool.blocks_needed(req.num_scheduled_tokens + num_new) - len(req.block_table)
        if need <= 0:
            return []
        if need > self.block_pool.num_free_blocks:
            return None
        blocks = self.block_pool.allocate(need)
        req.block_table.extend(blocks)
        return blocks

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        held = victim.sent_to_workers
        victim.num_computed_tokens = 0
        self._release(victim)
        victim.num_preemptions += 1
        self.num_preemptions += 1
        victim.status = RequestStatus.WAITING
        if self.config.policy == "priority":  # back among the waiting at its (priority, arrival)
            self._insert_by_priority(victim)
        else:
            self.waiting.appendleft(victim)
        if held:
            out.preempted.append(victim)

    def _admit(self, req: Request, budget: int) -> tuple[int, list[int]] | None:
        """Give a waiting request its cached prefix and blocks for its first chunk; None if blocks lack.

        Returns (num_new_tokens, newly allocated blocks). Nothing changes when it returns None.
        """
        pool = self.block_pool
        hits = self._cached_prefix(req)
        num_computed = len(hits) * pool.block_size
        num_new = min(len(req.token_ids) - num_computed, budget)
        need = pool.blocks_needed(num_computed + num_new) - len(hits)
        if need + pool.num_free_among(hits) > pool.num_free_blocks:
            return None
        pool.touch(hits)
        blocks = pool.allocate(need)
        if self._looks_up(req):  # (a request that skips the cache is not a query: kimi:prefix_cache_queries)
            pool.record_query(len(req.token_ids), num_computed)
        req.block_table = hits + blocks
        req.num_cached_blocks = len(hits)
        req.num_computed_tokens = req.num_scheduled_tokens = num_computed
        req.num_inflight_samples = 0
        if not req.was_scheduled:
            req.num_cached_tokens = num_computed
            req.was_scheduled = True
        return num_new, blocks

    def schedule(self) -> SchedulerOutput:
        """Decide this step's work; mutates block tables (the caller turns the result into a StepPlan).

        Running requests first (`_schedule_running`), then waiting ones while budget, seats and blocks last
        (`_schedule_waiting`); every scheduled request's tokens are then counted as in flight."""
        out = SchedulerOutput(scheduled=[], preempted=[])
        budget = self.config.token_budget
        if self.running:
            budget = self._schedule_running(out, budget)
        self._schedule_waiting(out, budget)
        for sr in out.scheduled:  # the step's tokens are now in flight (see the module docstring)
            req = sr.request
            n = req.num_scheduled_tokens + sr.num_new_tokens
            req.num_scheduled_tokens = n
            if n - sr.num_draft_tokens == len(req.token_ids) + req.num_inflight_samples:
                req.num_inflight_samples += 1  # this step samples the request's next token
            if sr.is_new:
                req.sent_to_workers = True  # the plan made from this output carries it as a NewRequest
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Give the running requests their next tokens within `budget` (decodes first, then prompt chunks, which leave
        the waiting requests' reserve), growing block tables and preempting the newest when blocks run out. Returns
        the budget left."""
        scheduled_ids: set[int] = set()
        # tokens still to compute: known (applied + in-flight samples) minus scheduled (applied + in flight)
        decodes: list[Request] = []
        others: list[Request] = []
        for r in self.running:  # one pass: decodes (one token to compute) first, then the rest, each in order
            (decodes if len(r.token_ids) + r.num_inflight_samples - r.num_scheduled_tokens == 1 else others).append(r)
        order = decodes + others if others else decodes
        n_dec = len(decodes)
        # tokens the prompt chunks of running requests leave to waiting requests (see the module docstring)
        reserve, held = 0, False
        if (
            others
            and self.waiting
            and len(self.running) < self.config.max_num_seqs
            and not _waits_for_leader(self.waiting[0])
        ):
            reserve = min(self.config.waiting_reserve, self.config.token_budget // 2)
        bs = self.block_pool.block_size
        running = RequestStatus.RUNNING
        scheduled = out.scheduled
        max_len = self.config.max_model_len
        k = self.config.num_speculative_tokens
        for i, req in enumerate(order):
            if reserve and not held and i >= n_dec:
                budget -= reserve  # held back from the prompt chunks, given back before admission
                held = True
            if budget <= 0:
                break
            if req.status is not running:
                continue  # preempted earlier in this step
            inflight = req.num_inflight_samples
            if inflight and (
                len(req.token_ids) + inflight - req.num_prompt_tokens >= req.stop.max_tokens
                or len(req.token_ids) + inflight >= max_len
                or (k and self.speculates(req))  # how many tokens its in-flight step accepts is not known yet
            ):
                continue  # its in-flight token ends it ("length"): nothing more to compute
            num_new = len(req.token_ids) + inflight - req.num_scheduled_tokens
            if num_new > budget:
                num_new = budget
            if num_new <= 0:
                continue
            nv = 0
            if k and num_new == 1 and req.drafts_ready:  # verify draft tokens: as many as max_tokens / length allow
                n_tok = len(req.token_ids)
                nv = max(0, min(k, req.stop.max_tokens - (n_tok - req.num_prompt_tokens) - 1, max_len - n_tok - 1))
                nv = min(nv, budget - 1)
                num_new += nv
            if req.num_scheduled_tokens + num_new <= len(req.block_table) * bs and req.sent_to_workers:
                # fast path (most decode steps): the tokens fit the blocks it holds
                scheduled.append(ScheduledRequest(req, num_new, _NO_BLOCKS, False, req.num_preemptions, nv))
                scheduled_ids.add(req.rid)
                budget -= num_new
                continue
            blocks = self._grow(req, num_new)
            while blocks is None:
                victim = self.running[-1]
                if victim.rid in scheduled_ids or victim is req:
                    break
                self._preempt(victim, out)
                blocks = self._grow(req, num_new)
            if blocks is None:
                # Even after preempting everything newer, this request does not fit: preempt it too.
                self._preempt(req, out)
                continue
            out.scheduled.append(
                ScheduledRequest(req, num_new, blocks, not req.sent_to_workers, req.num_preemptions, nv)
            )
            scheduled_ids.add(req.rid)
            budget -= num_new

        if held:
            budget += reserve
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Start waiting requests in queue order while `budget`, `max_num_seqs` and free blocks allow (a sibling whose
        leader still computes the shared prompt waits, keeping its place)."""
        deferred: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if _waits_for_leader(req):
                deferred.append(self.waiting.popleft())  # its prompt's KV is being computed by its leader
                continue
            got = self._admit(req, budget)
            if got is None:
                break
            num_new, _ = got
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            if self.config.policy == "priority":  # running in (priority, arrival) order: the last is preempted first
                bisect.insort_right(self.running, req, key=_priority_key)
            else:
                self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new, list(req.block_table), True, req.num_preemptions))
            budget -= num_new
        self.waiting.extendleft(reversed(deferred))  # back at the front, in their order

    def update_from_output(
        self, so: SchedulerOutput, tokens: dict[int, TokenOutput], step: int
    ) -> list[tuple[Request, TokenOutput]]:
        """Apply step `step`'s results to the requests `so` scheduled: advance num_computed_tokens by what the step
        computed, register the blocks it filled in the prefix cache (`commit`), and for each request the step sampled
        for (its computed tokens reach its known tokens' end), count the sample as no longer in flight and append the
        token to token_ids, unless the worker reported an error for it (TokenOutput.error).

        tokens: the step's sampled tokens by rid (every rank's). Requests finished, or preempted after the step was
        sent (ScheduledRequest.epoch), are skipped. Returns the (request, token) pairs sampled, in schedule order, for
        the engine's output processing. Raises ProtocolError when a request that should have sampled has no token.
        """
        sampled: list[tuple[Request, TokenOutput]] = []
        finished = RequestStatus.FINISHED
        bs = self.block_pool.block_size
        for sr in so.scheduled:
            req = sr.request
            if req.status is finished:
                continue  # aborted while the step ran
            if not req.sent_to_workers or sr.epoch != req.num_preemptions:
                continue  # preempted after this step was sent: it is recomputed from its tokens later
            nv = sr.num_draft_tokens
            nct = req.num_computed_tokens + sr.num_new_tokens - nv
            req.num_computed_tokens = nct
            if nct >= (req.num_cached_blocks + 1) * bs:  # a block may have filled up: commit (cheap test)
                self.commit(req)  # full blocks just computed join the prefix cache
            if nct < len(req.token_ids):
                continue  # a prompt chunk; no token sampled yet
            tok = tokens.get(req.rid)
            if tok is None:
                raise ProtocolError(f"step {step}: no token for request rid {req.rid}")
            req.num_inflight_samples -= 1
            if tok.error is None:
                req.token_ids.append(tok.token_id)
                if nv or tok.next_token_ids:
                    self._apply_drafts(req, tok, nv, step)
                elif self.config.num_speculative_tokens:
                    req.drafts_ready = self.speculates(req)
            sampled.append((req, tok))
        return sampled

    def _apply_drafts(self, req: Request, tok: TokenOutput, nv: int, step: int) -> None:
        """A verify step's result (req's first token already appended): append the accepted tokens after it, count
        their KV as computed (the rejected positions' KV is not: later steps overwrite it), give back the scheduled
        positions that were rejected, register newly full blocks, and count the drafts (SpecDecodeStats). Raises
        ProtocolError for more tokens than nv + 1."""
        more = tok.next_token_ids or []
        if len(more) > nv:
            raise ProtocolError(f"step {step}: rid {req.rid} got {len(more) + 1} tokens for {nv} draft tokens")
        req.token_ids.extend(more)
        req.num_computed_tokens += len(more)
        req.num_scheduled_tokens -= nv - len(more)
        if req.num_computed_tokens >= (req.num_cached_blocks + 1) * self.block_pool.block_size:
            self.commit(req)
        req.drafts_ready = True
        st = self.spec
        st.num_drafts += 1
        st.num_draft_tokens += nv
        st.num_accepted_tokens += len(more)
        for i in range(len(more)):
            st.accepted_per_pos[i] += 1


@dataclass
class SpecDecodeStats:
    """Speculative decoding counts of one scheduler (kimi.controller.metrics exports their sums over DP ranks):
    verify steps of a request (num_drafts), draft tokens verified, draft tokens accepted, and per draft position
    i (0-based) how often it was accepted."""

    accepted_per_pos: list[int]
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


def _waits_for_leader(req: Request) -> bool:
    """True while `req.leader` (the first of n > 1 siblings with the same prompt) is still computing the prompt.

    Siblings start once the leader's prompt KV is committed to the prefix cache, so they reuse its full
    blocks instead of computing the same prompt n times (OpenAI `n`: the choices share the prompt's KV).
    """
    lead = req.leader
    return (
        lead is not None and lead.status != RequestStatus.FINISHED and lead.num_computed_tokens < lead.num_prompt_tokens
    )


def _priority_key(req: Request) -> tuple[int, float]:
    """The waiting order under policy "priority": lower priority first, then earlier arrival."""
    return (req.priority, req.arrival_time)
