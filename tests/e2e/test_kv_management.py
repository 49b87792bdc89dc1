"""KV management end to end: prefix cache, chunked prefill mixed with decode, preemption, bounded queue.

Part 1 drives a real `Engine` in this process against a real torchrun worker running the tiny K2.6 model,
and records every step plan the engine broadcasts (the real messages, as sent), so the tests can check what
the workers were told to compute. Part 2 runs `kimi serve --fake-workers` over HTTP (real server, real
torchrun workers without a model) for the bounded waiting queue (503 + Retry-After) and a many-request
prefix-sharing run whose tokens are checked against the fake model's formula.
"""

from __future__ import annotations

import asyncio
import importlib.util
import random
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from kimi import protocol
from kimi.config import CacheConfig, ModelConfig, SchedulerConfig
from kimi.controller.engine import Engine
from kimi.controller.request import StopParams
from kimi.ipc import ControllerTransport, free_tcp_port
from kimi.protocol import SamplingParams
from kimi.server import ServeArgs, WorkerProcess, worker_command
from kimi.tokenizer import KimiTokenizer
from kimi.worker.fake import fake_token

_spec = importlib.util.spec_from_file_location("kimi_e2e_conftest", Path(__file__).with_name("conftest.py"))
_conftest = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _conftest
_spec.loader.exec_module(_conftest)
start_server, stop_server = _conftest.start_server, _conftest.stop_server

BS = 16
NUM_BLOCKS = 20  # 19 usable blocks = 304 tokens: a handful of requests exhaust it


class LiveEngine:
    """An Engine on its own event-loop thread, with a real worker; `plans` holds every StepPlan sent."""

    def __init__(self, model_dir: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.plans: list[protocol.StepPlan] = []
        self.model_dir = model_dir
        self.workers: WorkerProcess | None = None
        self.call(self._start(), timeout=180)

    def call(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self) -> None:
        cfg = ModelConfig.from_dir(self.model_dir)
        tok = KimiTokenizer.from_dir(self.model_dir)
        plan_addr = f"tcp://127.0.0.1:{free_tcp_port()}"
        result_addr = f"tcp://127.0.0.1:{free_tcp_port()}"
        self.transport = ControllerTransport(plan_addr, result_addr)
        send = self.transport.send

        async def recording_send(msg):
            if isinstance(msg, protocol.StepPlan):
                self.plans.append(msg)
            return await send(msg)

        self.transport.send = recording_send
        self.engine = Engine(
            tok,
            frozenset(cfg.eos_token_ids) | {tok.im_end_id},
            SchedulerConfig(max_num_seqs=16, token_budget=48, max_model_len=512),
            CacheConfig(block_size=BS, num_blocks=NUM_BLOCKS),
            self.transport,
            vocab_size=cfg.vocab_size,
            step_timeout_s=120,
        )
        args = ServeArgs(model=self.model_dir, block_size=BS, num_blocks=NUM_BLOCKS)
        self.workers = WorkerProcess(worker_command(args, plan_addr, result_addr))
        self.engine.liveness.checks.append(self.workers.check)
        await self.engine.start(1, timeout_s=150)
        self.task = asyncio.create_task(self.engine.run())

    async def _gen(self, rid: str, prompt: list[int], max_tokens: int, sampling: SamplingParams) -> dict:
        stream = await self.engine.generate(rid, prompt, sampling, StopParams(max_tokens, ignore_eos=True))
        self._rids[rid] = self.engine.requests[rid].rid  # admitted synchronously inside generate
        toks, last = [], None
        async for o in stream:
            toks.extend(o.token_ids)
            last = o
        assert last.finished and last.error is None and last.finish_reason == "length", last
        return {"tokens": toks, "rid": self.engine_rid(rid)}

    def engine_rid(self, rid: str) -> int:
        return self._rids[rid]

    def generate_many(self, reqs: list[tuple[list[int], int, SamplingParams]], stagger_s: float = 0.0) -> list[dict]:
        """Run requests concurrently (the i-th starts after i * stagger_s); returns tokens + engine rid each."""
        self._rids: dict[str, int] = {}

        async def one(i, p, m, sp):
            await asyncio.sleep(i * stagger_s)
            return await self._gen(f"t{time.monotonic_ns()}-{i}", p, m, sp)

        async def all_():
            return await asyncio.gather(*[one(i, p, m, sp) for i, (p, m, sp) in enumerate(reqs)])

        return self.call(all_(), timeout=240)

    def close(self) -> None:
        async def stop():
            await self.engine.shutdown()
            self.task.cancel()

        try:
            self.call(stop(), timeout=30)
        finally:
            if self.workers is not None:
                self.workers.stop()
            self.transport.close()
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


@pytest.fixture(scope="module")
def live(tiny_k26):
    le = LiveEngine(tiny_k26)
    yield le
    le.close()
    assert le.workers.proc.poll() is not None


GREEDY = SamplingParams(temperature=0.0)


def _rand(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(0, 160000) for _ in range(n)]


def _new_entries(plans, rid: int) -> list[protocol.NewRequest]:
    return [nr for p in plans for nr in p.new if nr.rid == rid]


def test_prefix_reuse_computes_only_the_suffix_and_matches_cache_off(live):
    rng = random.Random(1)
    prefix = _rand(rng, 3 * BS)
    x = prefix + _rand(rng, 5)
    y = prefix + _rand(rng, 7)
    pool = live.engine.schedulers[0].block_pool
    pool.enable_caching = False  # the reference: y computed from scratch, nothing cached
    try:
        (ref,) = live.generate_many([(y, 6, GREEDY)])
    finally:
        pool.enable_caching = True
    assert _new_entries(live.plans, ref["rid"])[0].num_computed_tokens == 0
    (rx,) = live.generate_many([(x, 6, GREEDY)])  # computes the prefix and caches its 3 full blocks
    hits_before = pool.stats.hits
    n_plans = len(live.plans)
    (ry,) = live.generate_many([(y, 6, GREEDY)])
    (first,) = _new_entries(live.plans[n_plans:], ry["rid"])
    assert first.num_computed_tokens == 3 * BS  # the workers were told the prefix is in the cache
    assert first.num_new_tokens == len(y) - 3 * BS  # only the suffix is computed
    assert first.block_ids[:3] == _new_entries(live.plans, rx["rid"])[0].block_ids[:3]
    assert pool.stats.hits - hits_before == 3 * BS
    assert ry["tokens"] == ref["tokens"]  # same tokens as with the cache off


def test_long_prompt_mid_decode_leaves_streams_unchanged_and_never_stalls_them(live):
    rng = random.Random(2)
    shorts = [_rand(rng, 9), _rand(rng, 12)]
    long = _rand(rng, 140)  # 3 chunks at a 48-token budget
    pool = live.engine.schedulers[0].block_pool
    pool.enable_caching = False  # so that the long prompt is computed from scratch below, chunk by chunk
    try:
        alone = [live.generate_many([(p, 40, GREEDY)])[0]["tokens"] for p in shorts]
        long_alone = live.generate_many([(long, 3, GREEDY)])[0]["tokens"]
    finally:
        pool.enable_caching = True
    n0 = len(live.plans)
    # 50 ms apart: the short requests (40 decode steps each) are still running when the long prompt arrives (with
    # 0.5 s they had finished before it on an idle machine, and nothing below was checked)
    res = live.generate_many([(shorts[0], 40, GREEDY), (shorts[1], 40, GREEDY), (long, 3, GREEDY)], stagger_s=0.05)
    assert [r["tokens"] for r in res[:2]] == alone
    assert res[2]["tokens"] == long_alone
    rids = [r["rid"] for r in res]
    plans = live.plans[n0:]
    # While the long prompt is being prefilled (it appears with > 1 new token), every plan also carries one
    # decode token for each short request that is running: admitted in an earlier plan and not finished. (On a
    # loaded machine a short request's own first step can fall into one of the long prompt's steps; it is then
    # being prefilled itself, not stalled.)
    prefill_steps = checked = 0
    done_short: set[int] = set()
    started: set[int] = set()
    for p in plans:
        longs = [nr.num_new_tokens for nr in p.new if nr.rid == rids[2]] + [
            c.num_new_tokens for c in p.cont if c.rid == rids[2]
        ]
        done_short |= {r for r in rids[:2] if r in p.finished}
        if longs and longs[0] > 1:
            prefill_steps += 1
            for r in rids[:2]:
                if r in started and r not in done_short:
                    checked += 1
                    assert any(c.rid == r and c.num_new_tokens == 1 for c in p.cont), (p.step, r)
        started |= {nr.rid for nr in p.new if nr.rid in rids[:2]}
    assert prefill_steps >= 3  # the long prompt really was chunked across steps, mixed with the decodes
    assert checked >= 2  # and running short requests were there to check in those steps


def test_kv_pressure_preempts_and_everyone_finishes_with_their_alone_tokens(live):
    rng = random.Random(3)
    reqs = [
        (_rand(rng, 20 + 3 * i), 30, GREEDY if i % 2 == 0 else SamplingParams(temperature=0.9, seed=100 + i))
        for i in range(6)
    ]
    alone = [live.generate_many([r])[0]["tokens"] for r in reqs]
    pre = live.engine.schedulers[0].num_preemptions
    n0 = len(live.plans)
    together = live.generate_many(reqs)  # 6 x 4 blocks needed, 19 usable
    assert [t["tokens"] for t in together] == alone
    assert live.engine.schedulers[0].num_preemptions > pre
    from prometheus_client.parser import text_string_to_metric_families

    from kimi.controller.metrics import Metrics

    fams = {f.name: f for f in text_string_to_metric_families(Metrics(live.engine).render().decode())}
    exported = fams["kimi:num_preemptions"].samples[0].value  # /metrics shows it (kimi:num_preemptions_total)
    assert exported == live.engine.schedulers[0].num_preemptions > 0
    rids = {t["rid"] for t in together}
    dropped = [r for p in live.plans[n0:] for r in p.finished if r in rids]
    resent = [nr for p in live.plans[n0:] for nr in p.new if nr.rid in rids and len(nr.token_ids) > 0]
    assert len(resent) > len(rids)  # preempted requests were sent again (recomputed)
    assert dropped  # and dropped from the worker first
    assert live.engine.num_used_blocks == 0


# ---- part 2: the HTTP server with fake workers --------------------------------------------------------


@pytest.fixture(scope="module")
def fake_server(tiny_k26, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("log") / "fake.log")
    srv = start_server(
        tiny_k26,
        log,
        "--fake-workers",
        "--block-size",
        "16",
        "--num-blocks",
        "4000",
        "--max-model-len",
        "16384",
        "--max-num-seqs",
        "4",
        "--max-waiting",
        "8",
        "--token-budget",
        "256",
    )
    yield srv
    assert stop_server(srv) == 0, srv.log()


def _fake_expected(prompt: list[int], n: int) -> list[int]:
    toks = list(prompt)
    for _ in range(n):
        toks.append(fake_token(toks[-1], len(toks), 0))
    return toks[len(prompt) :]


def test_full_waiting_queue_answers_503_with_retry_after(fake_server):
    url = f"{fake_server.base_url}/v1/completions"

    async def go():
        async with httpx.AsyncClient(timeout=60) as c:
            streams = []
            body = {"model": "tiny", "max_tokens": 10000, "temperature": 0, "stream": True, "ignore_eos": True}
            # 4 run (max-num-seqs) and 8 wait (max-waiting): a streaming response's headers arrive once admitted.
            for i in range(12):
                cm = c.stream(
                    "POST",
                    url,
                    json={**body, "prompt": [i + 1, 2, 3]}
                    if i < 4
                    else {**body, "prompt": [i + 1, 5], "max_tokens": 5},
                )
                r = await cm.__aenter__()
                assert r.status_code == 200
                streams.append((cm, r))
            full = await c.post(url, json={"model": "tiny", "prompt": [9, 9], "max_tokens": 2})
            # free the running slots: closing the long streams aborts them; the waiting ones then finish
            for cm, _ in streams[:4]:
                await cm.__aexit__(None, None, None)
            texts = []
            for cm, r in streams[4:]:
                data = [ln async for ln in r.aiter_lines() if ln.startswith("data: ")]
                texts.append(data)
                await cm.__aexit__(None, None, None)
            return full, texts

    full, texts = asyncio.run(go())
    assert full.status_code == 503, full.text
    assert int(full.headers["retry-after"]) >= 1
    err = full.json()["error"]
    assert err["type"] == "server_error" and "waiting queue is full" in err["message"]
    assert all(t[-1] == "data: [DONE]" and '"finish_reason": "length"' in "".join(t) for t in texts)


def test_many_requests_sharing_prefixes_get_the_fake_models_tokens(fake_server):
    """64 streams, 4 shared prefixes, KV-content checked by the fake worker; 503s are retried."""
    rng = random.Random(5)
    prefixes = [_rand(rng, 40) for _ in range(4)]
    prompts = [prefixes[i % 4] + _rand(rng, 1 + i % 7) for i in range(64)]
    url = f"{fake_server.base_url}/v1/completions"

    async def one(c, p):
        while True:
            r = await c.post(
                url, json={"model": "tiny", "prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            )
            if r.status_code == 503:
                await asyncio.sleep(float(r.headers["retry-after"]) / 4)
                continue
            assert r.status_code == 200, r.text
            return r.json()

    async def go():
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(*[one(c, p) for p in prompts])

    outs = asyncio.run(go())
    from kimi.tokenizer import KimiTokenizer

    tok = KimiTokenizer.from_dir(fake_server.model_dir)
    for p, o in zip(prompts, outs):
        assert o["choices"][0]["finish_reason"] == "length"
        assert o["choices"][0]["text"] == tok.decode(_fake_expected(p, 12), skip_special_tokens=True)
    cached = [o["usage"].get("prompt_tokens_details", {}) or {} for o in outs]
    assert sum(d.get("cached_tokens", 0) for d in cached) >= 32 * 32  # most requests found their prefix
