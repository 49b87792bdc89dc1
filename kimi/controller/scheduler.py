"""Continuous batching for one DP rank: decodes first, then chunked prefills, under a per-step token budget.

Each step (`schedule`):
1. Running requests, oldest first, get their next tokens (1 for a decode, the next prompt chunk for a
   partially prefilled one), as long as the token budget lasts. A request whose new tokens need a KV block
   when none is free preempts the newest running request (its blocks are freed; it goes back to the front
   of the waiting queue and is recomputed later from its prompt and outputs so far).
2. Waiting requests, first come first served, start while budget, `max_num_seqs` and free blocks allow; a
   long prompt is chunked so that it never takes more than the remaining budget.
The controller never schedules work for a request it cannot hold: admission (`engine`) rejects requests
whose prompt + max_tokens exceed what the whole cache holds.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kimi.config import SchedulerConfig
from kimi.controller.block_pool import BlockPool
from kimi.controller.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    """One request's share of a step: compute `num_new_tokens` tokens; `new_blocks` were appended for them.

    is_new: the workers do not hold this request yet (first schedule, or after preemption).
    """

    request: Request
    num_new_tokens: int
    new_blocks: list[int]
    is_new: bool


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Waiting queue, running list and BlockPool of one DP rank."""

    def __init__(self, config: SchedulerConfig, block_pool: BlockPool, dp_rank: int = 0) -> None:
        self.config = config
        self.block_pool = block_pool
        self.dp_rank = dp_rank
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    # ---- queue management ---------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.dp_rank = self.dp_rank
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def remove(self, req: Request) -> bool:
        """Take a request out (finished or aborted) and free its blocks. Returns True if the workers hold it."""
        held = req.sent_to_workers
        if req in self.running:
            self.running.remove(req)
        else:
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
        req.num_sent_blocks = 0
        req.sent_to_workers = False

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -------------------------------------------------------------------------------------
    def _grow(self, req: Request, num_new: int) -> list[int] | None:
        """Blocks to append so that req holds num_computed + num_new tokens; None if not enough are free."""
        need = self.block_pool.blocks_needed(req.num_computed_tokens + num_new) - len(req.block_table)
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
        self._release(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.WAITING
        self.waiting.appendleft(victim)
        if held:
            out.preempted.append(victim)

    def schedule(self) -> SchedulerOutput:
        """Decide this step's work; mutates block tables (the caller turns the result into a StepPlan)."""
        out = SchedulerOutput(scheduled=[], preempted=[])
        budget = self.config.token_budget
        scheduled_ids: set[int] = set()

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens_to_compute, budget)
            if num_new <= 0:
                i += 1
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
            is_new = not req.sent_to_workers
            out.scheduled.append(ScheduledRequest(req, num_new, blocks, is_new))
            scheduled_ids.add(req.rid)
            budget -= num_new
            i += 1

        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            num_new = min(req.num_tokens_to_compute, budget)
            blocks = self._grow(req, num_new)
            if blocks is None:
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new, blocks, True))
            budget -= num_new
        return out
