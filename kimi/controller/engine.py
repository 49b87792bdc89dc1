"""The controller's engine loop (asyncio): admission, scheduling, step plans out, sampled tokens in.

One step: every DP rank's scheduler picks its work, the work becomes one `StepPlan` (a diff: new requests,
continuing requests, dropped rids), the plan is broadcast to all workers, the engine waits for one
`StepResult` from every rank, then applies the sampled tokens (stops, detokenization, streaming).
Steps run back to back while there is work; when idle the engine pings the workers once a second so they
know the controller is alive.

Async scheduling (`async_scheduling`, on by default; `kimi serve --no-async-scheduling` turns it off): while
step N runs, the engine already plans and sends step N+1 (kimi.controller.scheduler counts step N's tokens as
in flight), then applies N's results and plans N+2 while N+1 runs. Workers run plans in order and hold the
tokens they sampled, so a continuing request needs nothing from the controller; the workers never wait for
the controller's per-step work (applying tokens, detokenizing, streaming, scheduling). The cost: a request
that ends on a token only the applied result shows (EOS, a stop string or stop id) has one more token
computed in the step already sent, which is dropped (never streamed, never counted); its KV blocks are freed
when the stop is applied and may be reused from the plan after, which the workers run after that step.

The scheduler owns the requests' counters: `Scheduler.update_from_output` applies a step's results to them, and
the engine hands each sampled token to the OutputProcessor (stops, detokenization) and the request's stream.

Failure: a `WorkerError`, or what kimi.controller.liveness reports (a worker process that exits, a rank whose
heartbeat stops, a step that takes longer than `step_timeout_s`) makes the engine fail every in-flight request
with an error and stop (`fatal_error` is set; the server then exits non-zero).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Protocol

import msgspec

from kimi import protocol
from kimi.config import CacheConfig, SchedulerConfig
from kimi.controller.admission import AdmissionError, AdmissionReason, QueueFull
from kimi.controller.block_pool import BlockPool, block_hashes
from kimi.controller.liveness import HEARTBEAT_S, Liveness
from kimi.controller.output import OutputProcessor
from kimi.controller.request import OutputStream, Request, RequestStatus, StopParams
from kimi.controller.router import DPRouter
from kimi.controller.scheduler import Scheduler, SchedulerOutput
from kimi.errors import BackendUnavailableError, ConfigError, EngineDeadError, ProtocolError, WorkerFailedError
from kimi.ipc import ControllerTransport
from kimi.protocol import RequestOutput, SamplingParams
from kimi.structured_output.backend import GrammarBackend
from kimi.structured_output.spec import GrammarSpec
from kimi.tokenizer import KimiTokenizer

log = logging.getLogger(__name__)
LOADING = "the server is still loading the model"  # why a request is refused before every rank is ready
__all__ = ["AdmissionError", "AdmissionReason", "Engine", "EngineDead", "QueueFull"]


EngineDead = EngineDeadError  # the name before kimi.errors


def kv_cache_size_flags(devices: set[str]) -> str:
    """The ways to a larger KV cache (or a smaller need) that apply on the ranks' devices (`Ready.device`: "cpu",
    "cuda" or "cuda:N"), as a phrase for the small-cache warning: free memory and --gpu-memory-utilization size a
    CUDA rank's cache; a CPU rank's is 0.5 GiB unless --kv-cache-memory-gib or --num-blocks says otherwise."""
    if any(d.startswith("cuda") for d in devices):
        return (
            "more free GPU memory, --gpu-memory-utilization, --kv-cache-memory-gib, --num-blocks or a smaller "
            "--max-model-len"
        )
    return "--kv-cache-memory-gib (0.5 GiB by default on cpu), --num-blocks or a smaller --max-model-len"


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps_ahead: int = 0  # plans sent while another step was in flight (async scheduling)


class EngineObserver(Protocol):
    """What the engine reports per token and per finished request (kimi.controller.metrics.Metrics)."""

    def on_token(self, req: Request, now: float) -> None: ...

    def on_finish(self, req: Request, now: float) -> None: ...


class Engine:
    """Owns all requests; drives the workers through `transport`.

    Construct, `await start(world_size)` (handshake), then run `run()` as a task. Front-ends call
    `generate(...)` (an async iterator of RequestOutput deltas) and `abort(request_id)`.
    """

    def __init__(
        self,
        tokenizer: KimiTokenizer,
        eos_token_ids: frozenset[int],
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        transport: ControllerTransport,
        vocab_size: int,
        step_timeout_s: float = 600.0,
        heartbeat_s: float = HEARTBEAT_S,
        enable_prefix_caching: bool = True,
        max_waiting: int = 1024,
        async_scheduling: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.async_scheduling = async_scheduling
        self._early: dict[int, dict[int, list[protocol.TokenOutput]]] = {}  # step -> rank -> outputs, arrived early
        self.eos_token_ids = eos_token_ids
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.transport = transport
        self.vocab_size = vocab_size
        # pings, heartbeats, the step timeout, the server's checks (kimi.server sets heartbeat_timeout_s, adds checks)
        self.liveness = Liveness(transport, heartbeat_s, step_timeout_s)
        self.schedulers: list[Scheduler] = []
        self.router = DPRouter(self.schedulers)  # replaced by `start`, once the ranks are known
        self.requests: dict[str, Request] = {}
        self.by_rid: dict[int, Request] = {}
        self._rids = itertools.count(1)
        self._step = 0
        self._pending_drops: list[int] = []
        self._wake = asyncio.Event()
        self.ready = False
        self.world_size = 0
        self.max_model_len = scheduler_config.max_model_len
        # tokens one DP rank's KV cache holds; max_model_len (the bound of a default max_tokens) until `start` knows
        self.kv_capacity_tokens = self.max_model_len
        self.fatal_error: str | None = None
        self.closing: str | None = None  # set by drain(): shutting down, new requests refused
        self.stopped = asyncio.Event()
        self.stats = EngineStats()
        self.output = OutputProcessor(tokenizer, eos_token_ids, self.max_model_len)
        # metrics hook (kimi.controller.metrics.Metrics): on_token(req, now) before each output token is
        # applied, on_finish(req, now) when a request ends for any reason; None = no metrics.
        self.observer: EngineObserver | None = None
        self.enable_prefix_caching = enable_prefix_caching
        self.max_waiting = max_waiting
        # guided decoding: the front ends compile each request's grammar here first, so one xgrammar refuses is a 400
        self.grammars = GrammarBackend(tokenizer, vocab_size, eos_token_ids)

    # ---- start-up ---------------------------------------------------------------------------------------
    async def start(self, world_size: int, timeout_s: float = 600.0, warm_up: bool = True) -> None:
        """Ping until every rank reports Ready; then size one BlockPool per DP rank from the minimum. warm_up: also run
        `warm_up` meanwhile and wait for it before reporting ready.

        Raises WorkerFailedError if a rank fails, a liveness check fails, or timeout_s passes; ConfigError if the
        workers' block size is not the controller's.
        """
        # the controller's own first-use costs (xgrammar's vocabulary), built while the workers load. In the default
        # executor, not a daemon thread: a process that exits while xgrammar's C++ runs in a daemon thread aborts, so a
        # stop during start-up waits for it instead
        loop = asyncio.get_running_loop()
        warm: asyncio.Future[None] = loop.run_in_executor(None, self.warm_up) if warm_up else loop.create_future()
        if not warm_up:
            warm.set_result(None)
        ready: dict[int, protocol.Ready] = {}
        deadline = time.monotonic() + timeout_s
        seq = 0
        while len(ready) < world_size:
            if time.monotonic() > deadline:
                raise WorkerFailedError(
                    f"workers not ready after {timeout_s:g} s ({len(ready)}/{world_size} ranks; --startup-timeout)",
                    ranks=tuple(sorted(set(range(world_size)) - ready.keys())),
                )
            self.liveness.run_checks()
            await self.transport.send(protocol.Ping(seq))
            seq += 1
            try:
                msg = await asyncio.wait_for(self.transport.recv(), 0.25)
            except asyncio.TimeoutError:
                continue
            if isinstance(msg, protocol.Ready):
                ready[msg.rank] = msg
                log.info(
                    "rank %d ready: %d KV blocks of %d tokens (block 0 is the null block) on %s",
                    msg.rank,
                    msg.num_blocks,
                    msg.block_size,
                    msg.device,
                )
            elif isinstance(msg, protocol.WorkerError):
                raise WorkerFailedError(
                    f"worker rank {msg.rank} failed during start-up: {msg.message}", ranks=(msg.rank,)
                )
        num_blocks = min(r.num_blocks for r in ready.values())
        block_size = next(iter(ready.values())).block_size
        if block_size != self.cache_config.block_size:
            raise ConfigError(f"workers use block_size {block_size}, controller {self.cache_config.block_size}")
        self.world_size = world_size
        self.schedulers = [
            Scheduler(self.scheduler_config, BlockPool(num_blocks, block_size, self.enable_prefix_caching), dp_rank=r)
            for r in range(world_size)
        ]
        self.router = DPRouter(self.schedulers)
        self.kv_capacity_tokens = (num_blocks - 1) * block_size
        if self.kv_capacity_tokens < self.max_model_len:
            log.warning(
                "the KV cache holds %d tokens per DP rank, fewer than the max model length %d: a request "
                "whose prompt plus max_tokens exceeds %d tokens is refused (400), and a default max_tokens "
                "is clamped to fit (%s change this)",
                self.kv_capacity_tokens,
                self.max_model_len,
                self.kv_capacity_tokens,
                kv_cache_size_flags({r.device for r in ready.values()}),
            )
        await warm
        self.liveness.start(world_size)  # the heartbeat clock starts when every rank is ready
        self.ready = True

    def warm_up(self) -> None:
        """Build what the first request would otherwise wait for: xgrammar's view of the vocabulary and a compiled
        JSON-object grammar (guided decoding's admission check, `grammars`), and one detokenization. Without
        xgrammar, only the latter."""
        t0 = time.monotonic()
        self.output.tokenizer.decode(self.output.tokenizer.encode("warm-up"))
        try:
            self.grammars.compile(GrammarSpec("json_object", ""))
        except BackendUnavailableError:
            pass
        log.info("controller warm-up in %.1f s", time.monotonic() - t0)

    # ---- front-end API ------------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        stop: StopParams,
        skip_special_tokens: bool = True,
        leader: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> Request:
        """Admit a request or raise AdmissionError (nothing changes then). Raises EngineDeadError after a failure.

        Raises QueueFull (an AdmissionError) when `max_waiting` requests are already waiting.
        leader: request id of an earlier sibling with the same prompt (OpenAI `n` > 1): this request runs on
        the leader's DP rank and starts once the leader's prompt KV is in the prefix cache, so it is shared.
        priority: the waiting order under the scheduler's policy "priority" (lower first); under "fcfs" it must be
        0 (AdmissionError naming `priority`, as vLLM). cache_salt: requests share prefix-cache blocks only with
        requests of the same salt (None: the unsalted ones).
        """
        self._check_admission(request_id, prompt_token_ids, sampling, stop, priority)
        n = len(prompt_token_ids)
        rid = next(self._rids)
        req = Request(
            rid=rid,
            request_id=request_id,
            token_ids=list(prompt_token_ids),
            num_prompt_tokens=n,
            sampling=sampling,
            stop=stop,
            skip_special_tokens=skip_special_tokens,
            outputs=OutputStream(),
            priority=priority,
            cache_salt=cache_salt or None,
        )
        self.output.start(req)
        self.requests[request_id] = req
        self.by_rid[rid] = req
        affinity = None
        if self.enable_prefix_caching and len(self.schedulers) > 1:
            # prefix affinity: prefer the rank whose cache already holds this prompt's longest prefix
            bs = self.schedulers[0].block_pool.block_size
            req.block_hashes = block_hashes(req.token_ids, bs, cache_salt=req.cache_salt)
            affinity = lambda r: len(self.schedulers[r].block_pool.lookup(req.block_hashes)) * bs  # noqa: E731
        lead = self.requests.get(leader) if leader is not None else None
        if lead is not None and self.enable_prefix_caching:
            req.leader = lead
            dp = lead.dp_rank
        else:
            dp = self.router.choose(affinity)
        self.schedulers[dp].add(req)
        self.stats.prompt_tokens += n
        self._wake.set()
        return req

    def _check_admission(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, stop: StopParams, priority: int
    ) -> None:
        """Raise EngineDead (failed, closing or loading) or the AdmissionError (QueueFull included) that refuses this
        request; returns when it may be admitted. Nothing changes either way. While the workers load, a request
        that breaks a limit known before they are ready (the prompt, max_model_len, max_tokens, the vocabulary) gets
        that AdmissionError, as it would once ready; any other gets EngineDead (the KV cache's size is not known)."""
        if self.fatal_error is not None:
            raise EngineDeadError(self.fatal_error)
        if self.closing is not None:
            raise EngineDeadError(self.closing)
        R = AdmissionReason
        if request_id in self.requests:
            raise AdmissionError(R.DUPLICATE_ID, "request_id", request_id=request_id)
        if priority != 0 and self.scheduler_config.policy != "priority":
            raise AdmissionError(R.PRIORITY_POLICY, "priority", value=priority)
        n = len(prompt_token_ids)
        if n == 0:
            raise AdmissionError(R.EMPTY_PROMPT, "prompt", value=0)
        if n >= self.max_model_len:  # before the per-id scan below: a huge prompt is refused in O(1) (the loop waits)
            raise AdmissionError(R.PROMPT_TOO_LONG, "prompt", limit=self.max_model_len, value=n)
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise AdmissionError(R.TOKEN_OUT_OF_VOCAB, "prompt", limit=self.vocab_size, value=bad[0])
        mt = stop.max_tokens
        if mt < 1:
            raise AdmissionError(R.MAX_TOKENS_TOO_SMALL, "max_tokens", limit=1, value=mt)
        if n + mt > self.max_model_len:
            raise AdmissionError(R.CONTEXT_OVERFLOW, "max_tokens", limit=self.max_model_len, value=mt, prompt_tokens=n)
        try:  # the sampling parameters go to every worker in the next plan: they must encode
            protocol.encode(sampling)
        except (OverflowError, TypeError, msgspec.EncodeError) as e:
            raise AdmissionError(R.UNENCODABLE, None, detail=str(e)) from None
        if not self.ready:
            raise EngineDeadError(LOADING)
        if n >= self.kv_capacity_tokens:
            raise AdmissionError(R.PROMPT_FILLS_KV, "prompt", limit=self.kv_capacity_tokens, value=n)
        if n + mt > self.kv_capacity_tokens:
            raise AdmissionError(R.KV_OVERFLOW, "max_tokens", limit=self.kv_capacity_tokens, value=mt, prompt_tokens=n)
        if self.num_waiting >= self.max_waiting:
            raise QueueFull(R.QUEUE_FULL, None, limit=self.max_waiting)

    def abort(self, request_id: str) -> bool:
        """Drop a request (blocks freed, workers told in the next plan). False if it is not running."""
        req = self.requests.get(request_id)
        if req is None or req.status == RequestStatus.FINISHED:
            return False
        self._finish(req, "abort")
        return True

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        stop: StopParams,
        skip_special_tokens: bool = True,
        leader: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Admit (AdmissionError raised here, before anything is yielded) and stream the request's deltas.

        The last delta has finished=True. If the consumer stops early (client gone), the request is aborted.
        leader, priority, cache_salt: see `add_request`.
        """
        req = self.add_request(
            request_id, prompt_token_ids, sampling, stop, skip_special_tokens, leader, priority, cache_salt
        )
        return self._stream(req)

    async def generate_batches(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        stop: StopParams,
        skip_special_tokens: bool = True,
        leader: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncGenerator[list[RequestOutput], None]:
        """`generate`, but each item is a non-empty list of the deltas that arrived since the last item.

        The reader wakes once per engine step (not once per delta), which is what the HTTP streaming path
        uses. The last delta of the last list has finished=True; an early exit aborts the request.
        priority, cache_salt: see `add_request`.
        """
        req = self.add_request(
            request_id, prompt_token_ids, sampling, stop, skip_special_tokens, leader, priority, cache_salt
        )
        return self._stream_batches(req)

    async def _stream(self, req: Request) -> AsyncGenerator[RequestOutput, None]:
        async with contextlib.aclosing(self._stream_batches(req)) as batches:  # closing aborts an unfinished request
            async for batch in batches:
                for out in batch:
                    yield out

    async def _stream_batches(self, req: Request) -> AsyncGenerator[list[RequestOutput], None]:
        try:
            while True:
                batch = await req.outputs.get_batch()
                yield batch
                if batch[-1].finished:
                    return
        finally:
            if req.status != RequestStatus.FINISHED:
                self.abort(req.request_id)

    # ---- the loop -------------------------------------------------------------------------------------------
    def _finish(self, req: Request, reason: str | None, error: str | None = None, emit: bool = True) -> None:
        sched = self.schedulers[req.dp_rank]
        if sched.remove(req):
            self._pending_drops.append(req.rid)
        req.finish_reason = reason
        self.requests.pop(req.request_id, None)
        self.by_rid.pop(req.rid, None)
        if self.observer is not None:
            self.observer.on_finish(req, time.monotonic())
        if emit:
            req.outputs.put(OutputProcessor.final(req, reason, error))

    def _has_work(self) -> bool:
        return bool(self._pending_drops) or any(s.has_work() for s in self.schedulers)

    def _build_plan(self) -> tuple[protocol.StepPlan, list[SchedulerOutput]]:
        outs = [s.schedule() for s in self.schedulers]
        new: list[protocol.NewRequest] = []
        cont: list[protocol.ContinueRequest] = []
        drops = self._pending_drops
        self._pending_drops = []
        Cont = protocol.ContinueRequest
        for so in outs:
            drops.extend(r.rid for r in so.preempted)
            for sr in so.scheduled:
                req = sr.request
                if not sr.is_new:  # the common case (every decode): checked first
                    nb = sr.new_blocks
                    cont.append(Cont(req.rid, sr.num_new_tokens, list(nb) if nb else [], sr.num_draft_tokens))
                else:
                    new.append(
                        protocol.NewRequest(
                            rid=req.rid,
                            dp_rank=req.dp_rank,
                            token_ids=list(req.token_ids),
                            num_computed_tokens=req.num_computed_tokens,
                            num_new_tokens=sr.num_new_tokens,
                            block_ids=list(req.block_table),
                            sampling=req.sampling,
                            num_prompt_tokens=req.num_prompt_tokens,
                        )
                    )
        self._step += 1
        return protocol.StepPlan(step=self._step, new=new, cont=cont, finished=drops), outs

    async def _collect(self, step: int) -> dict[int, protocol.TokenOutput]:
        """Every rank's StepResult of `step` -> sampled tokens by rid. Results of the later step already sent
        (async scheduling) that arrive first are kept for its own _collect."""
        tokens: dict[int, protocol.TokenOutput] = {}
        answered: set[int] = set()
        for rank, outputs in self._early.pop(step, {}).items():
            answered.add(rank)
            for t in outputs:
                tokens[t.rid] = t
        liveness = self.liveness
        started = time.monotonic()
        while len(answered) < self.world_size:
            wait = liveness.result_wait(step, started, answered)  # raises once the step has taken too long
            try:
                msg = await asyncio.wait_for(self.transport.recv(), wait)
            except asyncio.TimeoutError:
                await liveness.tick(self._step)
                continue
            if isinstance(msg, protocol.WorkerError):
                raise WorkerFailedError(f"worker rank {msg.rank} failed: {msg.message}", ranks=(msg.rank,), step=step)
            if isinstance(msg, protocol.StepResult):
                if step < msg.step <= self._step:  # a step sent after this one, answered by a faster rank
                    early = self._early.setdefault(msg.step, {})
                    if msg.rank in early:
                        raise ProtocolError(f"rank {msg.rank} answered step {msg.step} twice")
                    early[msg.rank] = msg.outputs
                    continue
                if msg.step != step or msg.rank in answered:
                    raise ProtocolError(f"rank {msg.rank} answered step {msg.step} while step {step} ran")
                answered.add(msg.rank)
                for t in msg.outputs:
                    tokens[t.rid] = t
        return tokens

    def _apply(self, outs: list[SchedulerOutput], tokens: dict[int, protocol.TokenOutput]) -> None:
        """Apply a step's results: each scheduler updates its requests (`Scheduler.update_from_output`), then each
        sampled token is detokenized and checked for stops and its delta handed to the request's stream. Runs once
        per step over every scheduled request, so the loop body is kept lean (at 1024 decodes it is a large share of
        the controller's CPU per step)."""
        now = time.monotonic()
        observer = self.observer
        process = self.output.process
        n_out = 0
        for sched, so in zip(self.schedulers, outs):
            for req, tok in sched.update_from_output(so, tokens, self._step):
                if observer is not None:
                    observer.on_token(req, now)  # before first_token_time is set (TTFT vs ITL)
                if req.first_token_time is None:
                    req.first_token_time = now
                if tok.error is not None:  # the worker cannot go on with it (guided decoding)
                    self._finish(req, None, error=tok.error)
                    continue
                if tok.next_token_ids:  # a verify step's accepted tokens (speculative decoding)
                    n_out += self._apply_verified(req, tok, now)
                    continue
                delta = process(req, tok)
                n_out += 1
                req.outputs.put(delta)
                if delta.finished:
                    self._finish(req, delta.finish_reason, emit=False)
        self.stats.generation_tokens += n_out

    def _apply_verified(self, req: Request, tok: protocol.TokenOutput, now: float) -> int:
        """The tokens of one verify step (tok.token_id, then tok.next_token_ids; the scheduler appended them all)
        through the output processing one at a time, as if sampled one per step: stops, max_tokens and stop strings
        are checked per token, and the tokens after the one that ends the request are dropped (also from
        req.token_ids). Returns the number of tokens output."""
        more = tok.next_token_ids or []
        lps, tids, tlps = tok.next_logprobs, tok.next_top_ids, tok.next_top_logprobs
        first = len(req.token_ids) - len(more)  # tokens up to and including tok.token_id
        out = tok
        for j in range(len(more) + 1):
            if j:
                out = protocol.TokenOutput(
                    req.rid,
                    more[j - 1],
                    lps[j - 1] if lps is not None else None,
                    tids[j - 1] if tids is not None else None,
                    tlps[j - 1] if tlps is not None else None,
                )
                if self.observer is not None:
                    self.observer.on_token(req, now)
            delta = self.output.process(req, out, first + j)
            req.outputs.put(delta)
            if delta.finished:
                del req.token_ids[first + j :]
                self._finish(req, delta.finish_reason, emit=False)
                return j + 1
        return len(more) + 1

    async def run(self) -> None:
        """Step until `stop()`; on a worker failure fail every request, set fatal_error and return.

        At most two steps are in flight with async scheduling (one without): the next plan is built and sent
        before the running step's results are collected and applied."""
        inflight: collections.deque[tuple[int, list[SchedulerOutput]]] = collections.deque()
        depth = 2 if self.async_scheduling else 1
        try:
            while not self.stopped.is_set():
                if not inflight and not self._has_work():
                    self._wake.clear()
                    try:
                        await asyncio.wait_for(self._wake.wait(), self.liveness.heartbeat_s)
                    except asyncio.TimeoutError:
                        await self.liveness.tick(self._step)
                    continue
                if len(inflight) < depth and self._has_work():
                    plan, outs = self._build_plan()
                    if plan.new or plan.cont or plan.finished:
                        await self.liveness.maybe_ping()
                        await self.transport.send(plan)
                        if inflight:
                            self.stats.steps_ahead += 1
                        inflight.append((plan.step, outs))
                        if len(inflight) < depth:
                            continue  # plan the next step too, before waiting for this one
                    else:  # nothing to run (or nothing more until the step in flight is applied)
                        self._step -= 1
                        if not inflight:
                            await asyncio.sleep(0.005)
                            continue
                step, outs = inflight.popleft()
                tokens = await self._collect(step)
                self.stats.steps += 1
                self._apply(outs, tokens)
                if self.liveness.due():
                    self.liveness.check(self._step)
                await asyncio.sleep(0)  # let front-ends read outputs / add requests between steps
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a worker failure or a protocol violation: nothing may hang
            log.error("engine stopped: %s", e)
            self.fail_all(str(e))

    def drain(self, message: str) -> None:
        """Shutdown: refuse new requests and end every in-flight one with `message` as its error.

        Unlike `fail_all` the engine keeps stepping (the workers are healthy); the server exits 0.
        """
        self.closing = message
        for req in list(self.requests.values()):
            self._finish(req, None, error=message)

    def fail_all(self, message: str) -> None:
        """Fail every in-flight request with `message` and refuse new ones."""
        self.fatal_error = message
        for req in list(self.requests.values()):
            self._finish(req, None, error=message)
        self.stopped.set()

    async def shutdown(self) -> None:
        """Tell workers to exit and stop the loop."""
        self.stopped.set()
        try:
            await self.transport.send(protocol.Shutdown("controller shutting down"))
        except Exception:
            pass

    # ---- introspection -----------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return sum(len(s.running) for s in self.schedulers)

    @property
    def num_waiting(self) -> int:
        return sum(len(s.waiting) for s in self.schedulers)

    @property
    def num_used_blocks(self) -> int:
        return sum(s.block_pool.num_used_blocks for s in self.schedulers)

    @property
    def prefix_cache_stats(self) -> dict[str, int]:
        """Prefix-cache counters summed over DP ranks (BlockPool.stats): requests, hit_requests, queries
        (prompt tokens looked up), hits (tokens found cached), evictions; plus preemptions (for /metrics)."""
        out = {"requests": 0, "hit_requests": 0, "queries": 0, "hits": 0, "evictions": 0, "preemptions": 0}
        for sch in self.schedulers:
            st = sch.block_pool.stats
            for k in ("requests", "hit_requests", "queries", "hits", "evictions"):
                out[k] += getattr(st, k)
            out["preemptions"] += sch.num_preemptions
        return out
