"""Async scheduling (kimi.controller.engine: the next plan is sent while a step runs) gives exactly the outputs
of synchronous scheduling, and leaks nothing.

In-process: the real Engine and Schedulers, fed by `LoopbackTransport`, whose ranks are kimi.worker.fake
FakeRunners run in this process (each executes the plans in order, after a per-rank delay, so a fast rank's
result for step N+1 can arrive before a slow rank's for step N). The fake model's tokens are pure functions of
(previous token, position) for greedy and seeded requests, and the FakeRunner fails a step whose KV slots do
not hold the tokens the plan implies (prefix hits, overwritten blocks). EOS is a set of fake token ids, so
requests end on EOS in the middle of a step pipeline; a small cache forces preemptions while steps are in
flight; a small token budget chunks the prompts.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from kimi import protocol
from kimi.config import CacheConfig, ModelConfig, SchedulerConfig
from kimi.controller.engine import Engine
from kimi.controller.request import StopParams
from kimi.presets import load_preset
from kimi.tokenizer import KimiTokenizer, write_tokenizer_files
from kimi.worker.fake import FAKE_VOCAB, FakeRunner

BS = 16
EOS = frozenset(t for t in range(FAKE_VOCAB) if t % 41 == 0)  # ~2.4% of the fake tokens end a request


class LoopbackTransport:
    """ControllerTransport stand-in: `send` hands every message to each rank's queue; each rank's task answers
    Pings (Ready first, then Pong) and runs StepPlans in order on its FakeRunner after `delays[rank]` seconds."""

    def __init__(self, runners: list[FakeRunner], delays: list[float]) -> None:
        self.runners, self.delays = runners, delays
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.queues = [asyncio.Queue() for _ in runners]
        self.tasks = [asyncio.create_task(self._rank(r)) for r in range(len(runners))]

    async def _rank(self, r: int) -> None:
        ready, last = False, 0
        while True:
            msg = await self.queues[r].get()
            if isinstance(msg, protocol.Ping):
                if not ready:
                    ready = True
                    await self.inbox.put(protocol.Ready(r, len(self.runners), self.runners[r].num_blocks, BS, "cpu"))
                else:
                    await self.inbox.put(protocol.Pong(r, msg.seq, last))
            elif isinstance(msg, protocol.StepPlan):
                assert msg.step == last + 1, f"rank {r}: step gap {last} -> {msg.step}"
                last = msg.step
                await asyncio.sleep(self.delays[r])
                outputs = self.runners[r].execute(msg)
                await self.inbox.put(protocol.StepResult(msg.step, r, outputs))

    async def send(self, msg) -> None:
        for q in self.queues:
            q.put_nowait(msg)

    async def recv(self):
        return await self.inbox.get()

    def close(self) -> None:
        for t in self.tasks:
            t.cancel()


def _workload(seed: int):
    rng = random.Random(seed)
    shared = [rng.randrange(1, FAKE_VOCAB) for _ in range(3 * BS)]
    reqs = []
    for i in range(40):
        n = rng.randrange(1, 5 * BS)
        prompt = (shared[: rng.randrange(0, 3 * BS)] if i % 3 == 0 else []) + [
            rng.randrange(1, FAKE_VOCAB) for _ in range(n)
        ]
        sampling = (
            protocol.SamplingParams(temperature=0.0) if i % 2 else protocol.SamplingParams(temperature=0.8, seed=i)
        )
        stop_ids = frozenset({rng.randrange(FAKE_VOCAB) for _ in range(50)}) if i % 5 == 0 else frozenset()
        stop = StopParams(
            max_tokens=rng.randrange(1, 60),
            stop_token_ids=stop_ids,
            ignore_eos=i % 7 == 0,
            min_tokens=3 if i % 4 == 0 else 0,
        )
        reqs.append((f"r{i}", prompt, sampling, stop))
    return reqs


async def _serve(tok, async_scheduling: bool, num_blocks: int, delays: list[float], workload, abort_after=None):
    world = len(delays)
    cfg = ModelConfig.from_dict(load_preset("kimi-k2.6"))  # the fake runner only sizes blocks with it
    runners = [
        FakeRunner(cfg, CacheConfig(block_size=BS, num_blocks=num_blocks), rank=r, world_size=world)
        for r in range(world)
    ]
    transport = LoopbackTransport(runners, delays)
    engine = Engine(
        tok,
        EOS,
        SchedulerConfig(max_num_seqs=8, token_budget=40, max_model_len=4096),
        CacheConfig(block_size=BS, num_blocks=num_blocks),
        transport,
        vocab_size=163840,
        step_timeout_s=30.0,
        async_scheduling=async_scheduling,
    )
    await engine.start(world, timeout_s=10)
    loop = asyncio.create_task(engine.run())

    async def one(rid, prompt, sampling, stop):
        toks, text, last = [], "", None
        async for out in await engine.generate(rid, prompt, sampling, stop):
            toks += out.token_ids
            text += out.text
            last = out
            if abort_after and rid in abort_after and len(toks) >= abort_after[rid] and not out.finished:
                engine.abort(rid)
        return rid, toks, text, last.finish_reason, last.stop_reason, last.num_output_tokens

    try:
        results = await asyncio.wait_for(asyncio.gather(*(one(*w) for w in workload)), 60)
    finally:
        engine.stopped.set()
        await asyncio.wait_for(loop, 5)
        transport.close()
    assert engine.fatal_error is None
    assert engine.num_used_blocks == 0, "KV blocks leaked"
    assert not engine.requests and not engine.by_rid
    return {r[0]: r[1:] for r in results}, engine


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(d)
    return KimiTokenizer.from_dir(d)


@pytest.mark.parametrize(
    "num_blocks,delays",
    [(400, [0.0]), (40, [0.0]), (60, [0.0, 0.003]), (30, [0.002, 0.0])],
    ids=["roomy-1rank", "preempting-1rank", "2ranks-slow1", "preempting-2ranks-slow0"],
)
def test_async_outputs_equal_sync_outputs(tok, num_blocks, delays):
    work = _workload(num_blocks)
    sync, e_sync = asyncio.run(_serve(tok, False, num_blocks, delays, work))
    asyn, e_async = asyncio.run(_serve(tok, True, num_blocks, delays, work))
    assert e_sync.stats.steps_ahead == 0 and e_async.stats.steps_ahead > 0
    for rid, _, _, stop in work:
        assert asyn[rid] == sync[rid], rid
        toks, _, reason, _, n_out = sync[rid]
        assert n_out == len(toks) <= stop.max_tokens and reason in ("stop", "length")
    reasons = {sync[r][2] for r in sync}
    assert reasons == {"stop", "length"}  # both kinds of ending happened inside the pipeline
    if num_blocks <= 40:
        pre_sync = sum(s.num_preemptions for s in e_sync.schedulers)
        pre_async = sum(s.num_preemptions for s in e_async.schedulers)
        assert pre_sync > 0 and pre_async > 0, (pre_sync, pre_async)


def test_aborts_while_steps_are_in_flight(tok):
    work = _workload(7)
    ref, _ = asyncio.run(_serve(tok, False, 400, [0.0, 0.001], work))
    aborts = {rid: 2 for rid, _, _, stop in work[::3] if stop.max_tokens > 4}
    got, engine = asyncio.run(_serve(tok, True, 400, [0.0, 0.001], work, abort_after=aborts))
    assert engine.stats.steps_ahead > 0
    for rid in ref:
        if rid in aborts and ref[rid][2] == "length" and len(ref[rid][0]) > 2:
            toks, _, reason, _, _ = got[rid]
            assert reason == "abort" and toks == ref[rid][0][: len(toks)]
        elif rid not in aborts:
            assert got[rid] == ref[rid], rid
