"""The controller's view of one request: tokens, KV blocks, sampling and stop settings, and its output stream."""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kimi.protocol import SamplingParams

if TYPE_CHECKING:
    from kimi.controller.output import FastDetokenizer
    from kimi.controller.stops import StopChecker

log = logging.getLogger(__name__)


class OutputStream:
    """One request's outputs, from the engine (`put`, synchronous) to its one reader (`get_batch`, async).

    Replaces an asyncio.Queue per request: `put` appends to a list and wakes the reader only if it is
    waiting (one future resolved, once), and `get_batch` takes every output queued so far. So the reader
    wakes at most once per engine step however many outputs that step produced for it (a token and the
    terminal output, say), and a reader that fell behind catches up with one wake-up.

    `sink`: an optional synchronous consumer, `sink(output) -> bool`. While the reader is waiting (it has
    handled everything before), `put` first offers the output to the sink; True means the sink delivered it
    (the HTTP layer wrote the SSE chunk to the connection) and the reader is not woken at all; False, or
    an exception (logged; the sink is then dropped), queues it for the reader as usual. So outputs reach the
    client in order whichever way each one goes. At 1024 streaming requests this saves a task wake-up and
    the async hops per request per step (docs/benchmarks.md).
    """

    __slots__ = ("_buf", "_waiter", "sink")

    def __init__(self) -> None:
        self._buf: list[Any] = []
        self._waiter: asyncio.Future[None] | None = None
        self.sink: Callable[[Any], bool] | None = None

    def put(self, out: Any) -> None:
        """Hand one output to the sink or queue it for the reader (never blocks, never raises)."""
        w = self._waiter
        if w is not None:
            sink = self.sink
            if sink is not None and not w.done():
                try:
                    if sink(out):
                        return
                except Exception:
                    log.exception("output sink failed; falling back to the queue")
                    self.sink = None
            self._waiter = None
            if not w.done():
                w.set_result(None)
        self._buf.append(out)

    async def get_batch(self) -> list[Any]:
        """Every output queued since the last call, oldest first; waits while there is none (cancel-safe)."""
        while not self._buf:
            w = asyncio.get_running_loop().create_future()
            self._waiter = w
            try:
                await w
            finally:
                self._waiter = None
        buf = self._buf
        self._buf = []
        return buf

    def qsize(self) -> int:
        """Outputs queued and not read yet."""
        return len(self._buf)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class StopParams:
    """When generation ends. max_tokens counts generated tokens; eos ids are ignored with ignore_eos."""

    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    # appended (issue #5): stop strings (at most 4, kimi.controller.stops) checked on the detokenized text
    # once min_tokens tokens exist; min_tokens also keeps EOS / stop ids from being sampled (worker side).
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    min_tokens: int = 0


@dataclass
class Request:
    """One generation request inside the controller.

    `token_ids` is the prompt followed by the generated tokens. `num_computed_tokens` counts tokens whose KV
    the workers hold (as of the last applied step); `num_scheduled_tokens` also counts the tokens of steps sent
    and not applied yet (async scheduling: the next plan goes out while a step runs), and
    `num_inflight_samples` the tokens those steps will sample (both equal num_computed_tokens / 0 between steps without
    async scheduling); `block_table` lists the KV blocks (append-only while the request runs). `outputs` is the stream
    of `RequestOutput` deltas that front-ends (HTTP, ZeroMQ) read.
    """

    rid: int
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    stop: StopParams
    skip_special_tokens: bool = True
    dp_rank: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_scheduled_tokens: int = 0
    num_inflight_samples: int = 0
    block_table: list[int] = field(default_factory=list)
    sent_to_workers: bool = False
    num_sent_blocks: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_reason: str | None = None
    outputs: OutputStream = field(default_factory=OutputStream)
    detokenizer: FastDetokenizer | None = None  # set by OutputProcessor.start
    leader: Request | None = None  # n > 1: the first sibling; this one starts after the leader's prompt is cached
    stop_checker: StopChecker | None = None  # set by OutputProcessor.start when there are stop strings
    # with a stop checker: after each generated token, the characters of generated text it holds back (output.py;
    # after the token that completes a stop string: the characters that string cut);
    # the chat front-end attributes released text to the tokens that produced it (parsers.ReleasedTextFeeder)
    stop_held: list[int] | None = None
    prompt_logprobs_sent: bool = False  # output.py: prompt logprobs go out once (a preempted request resends them)
    # prefix cache (scheduler / block_pool): chained hashes of the full blocks of token_ids, how many of
    # block_table's blocks are registered in the cache, and the prompt tokens the first schedule found
    # cached (usage.prompt_tokens_details.cached_tokens); preemptions so far.
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0
    num_cached_tokens: int = 0
    was_scheduled: bool = False
    num_preemptions: int = 0
    priority: int = 0  # the scheduler's order under policy "priority" (lower first)
    cache_salt: str | None = None  # folded into the first block's hash: only requests with this salt share blocks
    # speculative decoding: the workers hold a draft proposal for this request (it has had a token applied since it
    # was last sent to them); the scheduler then verifies draft tokens in its decode steps
    drafts_ready: bool = False

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens_to_compute(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]
