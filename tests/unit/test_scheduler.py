"""Scheduler: prefix-cache admission, decodes before chunked prefills, preemption under KV pressure.

The engine's part of a step is simulated by `step()`: it applies each scheduled chunk, appends a token
when a request reaches the end of its known tokens (token = a function of the context, like a greedy model),
commits full blocks to the prefix cache and finishes requests at max_tokens; it also checks that no
computed position lands in a block that is registered in the cache (cached blocks are read-only).
"""

from __future__ import annotations

import pytest

from kimi.config import SchedulerConfig
from kimi.controller.block_pool import BlockPool
from kimi.controller.request import Request, RequestStatus, StopParams
from kimi.controller.scheduler import Scheduler, SchedulerOutput
from kimi.errors import ProtocolError
from kimi.protocol import SamplingParams, TokenOutput

BS = 4


def make(rid: int, prompt: list[int], max_tokens: int = 4) -> Request:
    return Request(rid, f"r{rid}", list(prompt), len(prompt), SamplingParams(temperature=0.0), StopParams(max_tokens))


def sched(num_blocks: int, budget: int = 64, max_num_seqs: int = 64, caching: bool = True) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, token_budget=budget, max_model_len=4096)
    return Scheduler(cfg, BlockPool(num_blocks, BS, enable_caching=caching))


def step(s: Scheduler, kv: dict[int, int] | None = None):
    """One simulated step; returns the SchedulerOutput. kv maps slot -> token written (content check)."""
    out = s.schedule()
    pool = s.block_pool
    for sr in out.scheduled:
        req = sr.request
        start = req.num_computed_tokens
        for p in range(start, start + sr.num_new_tokens):
            blk = req.block_table[p // BS]
            assert not pool.is_cached(blk), f"rid {req.rid} writes position {p} into cached block {blk}"
            if kv is not None:
                kv[blk * BS + p % BS] = req.token_ids[p]
        if sr.is_new and kv is not None:  # a prefix hit must hold exactly this request's tokens
            for p in range(start):
                assert kv[req.block_table[p // BS] * BS + p % BS] == req.token_ids[p]
    tokens = {  # the workers' sampled token of every request whose step reaches its end
        sr.request.rid: TokenOutput(sr.request.rid, (sum(sr.request.token_ids) * 31 + len(sr.request.token_ids)) % 1000)
        for sr in out.scheduled
        if sr.request.num_computed_tokens + sr.num_new_tokens == len(sr.request.token_ids)
    }
    for req, tok in s.update_from_output(out, tokens, 0):
        assert req.token_ids[-1] == tok.token_id
        if req.num_output_tokens >= req.stop.max_tokens:
            s.remove(req)
    return out


def run_all(s: Scheduler, kv=None, limit: int = 1000) -> list:
    outs = []
    while s.has_work():
        outs.append(step(s, kv))
        assert len(outs) < limit
    return outs


def test_second_request_reuses_a_three_block_prefix():
    s = sched(32)
    prefix = list(range(100, 100 + 3 * BS))
    a = make(1, prefix + [1, 2], max_tokens=3)
    s.add(a)
    kv: dict[int, int] = {}
    run_all(s, kv)
    b = make(2, prefix + [7], max_tokens=3)
    s.add(b)
    out = step(s, kv)
    (sr,) = out.scheduled
    assert sr.is_new and sr.num_new_tokens == 1  # only the suffix is computed
    assert b.num_cached_tokens == 3 * BS and b.num_cached_blocks == 3
    st = s.block_pool.stats
    assert st.hits == 3 * BS and st.queries == len(a.token_ids[: a.num_prompt_tokens]) + len(b.token_ids) - 1
    run_all(s, kv)
    # Nothing leaks: every block is free again (cached ones stay findable).
    assert s.block_pool.num_free_blocks == s.block_pool.num_usable_blocks


def test_prompt_logprobs_request_skips_the_cache_and_is_not_a_query():
    """A request asking for prompt logprobs (HTTP echo + logprobs) computes its whole prompt and is not counted in
    the prefix-cache stats (kimi:prefix_cache_queries / hits); the next plain request is counted as before."""
    s = sched(32)
    prefix = list(range(100, 100 + 3 * BS))
    s.add(make(1, prefix + [1], max_tokens=1))
    run_all(s)
    st = s.block_pool.stats
    q0, h0 = st.queries, st.hits
    assert q0 == len(prefix) + 1
    b = make(2, prefix + [2], max_tokens=1)
    b.sampling = SamplingParams(temperature=0.0, prompt_logprobs=1)
    s.add(b)
    (sr,) = step(s).scheduled
    assert sr.num_new_tokens == len(prefix) + 1 and b.num_cached_tokens == 0
    assert (st.queries, st.hits) == (q0, h0)
    run_all(s)
    s.add(make(3, prefix + [3], max_tokens=1))
    step(s)
    assert (st.queries, st.hits) == (q0 + len(prefix) + 1, h0 + 3 * BS)


def test_shared_prefix_is_ref_counted_between_running_requests():
    s = sched(32)
    prefix = list(range(3 * BS))
    a = make(1, prefix + [1], max_tokens=50)
    s.add(a)
    step(s)
    step(s)  # a's full prompt blocks are committed after its first step
    b = make(2, prefix + [2], max_tokens=50)
    s.add(b)
    step(s)
    assert b.block_table[:3] == a.block_table[:3]
    assert all(s.block_pool.ref_count(x) == 2 for x in a.block_table[:3])
    assert b.block_table[3] != a.block_table[3]  # the partial block is each request's own
    s.remove(a)
    assert all(s.block_pool.ref_count(x) == 1 for x in b.block_table[:3])


def test_block_aligned_fully_cached_prompt_still_computes_its_last_block():
    s = sched(32)
    prompt = list(range(2 * BS))
    s.add(make(1, prompt, max_tokens=1))
    run_all(s)
    b = make(2, prompt, max_tokens=1)
    s.add(b)
    (sr,) = step(s).scheduled
    assert b.num_cached_tokens == BS and sr.num_new_tokens == BS  # 1 block hit; the last block recomputed


def test_caching_off_computes_everything():
    s = sched(32, caching=False)
    prompt = list(range(3 * BS + 1))
    s.add(make(1, prompt, max_tokens=1))
    run_all(s)
    b = make(2, prompt, max_tokens=1)
    s.add(b)
    (sr,) = step(s).scheduled
    assert b.num_cached_tokens == 0 and sr.num_new_tokens == len(prompt)


def test_long_prompt_never_stalls_running_decodes():
    s = sched(200, budget=8)
    decs = [make(i, [i, i + 1], max_tokens=30) for i in range(1, 4)]
    for r in decs:
        s.add(r)
    step(s)
    long = make(9, list(range(1000, 1040)), max_tokens=2)
    s.add(long)
    chunks = []
    while long.num_output_tokens == 0:
        out = step(s)
        ids = {sr.request.rid: sr.num_new_tokens for sr in out.scheduled}
        assert all(ids.get(r.rid) == 1 for r in decs), ids  # every decode every step
        chunks.append(ids.get(9, 0))
    assert chunks == [5] * 8  # 40 prompt tokens in chunks of what the decodes leave (8 - 3)


def test_kv_pressure_preempts_newest_and_everyone_finishes_with_the_same_tokens():
    prompts = [[(7 * i + j) % 50 for j in range(6 + i)] for i in range(6)]

    def alone(p):
        s = sched(64)
        r = make(1, p, max_tokens=10)
        s.add(r)
        run_all(s)
        return r.output_token_ids

    want = [alone(p) for p in prompts]
    s = sched(13, budget=16)  # 12 usable blocks of 4 tokens; each request needs up to 5
    reqs = [make(i + 1, p, max_tokens=10) for i, p in enumerate(prompts)]
    for r in reqs:
        s.add(r)
    kv: dict[int, int] = {}
    outs = run_all(s, kv)
    assert [r.output_token_ids for r in reqs] == want
    assert s.num_preemptions > 0 and sum(len(o.preempted) for o in outs) > 0
    # Preempted requests that were resumed found (part of) their earlier KV in the cache.
    assert any(r.num_preemptions and s.block_pool.stats.hits for r in reqs)
    assert s.block_pool.num_free_blocks == s.block_pool.num_usable_blocks
    # The newest is preempted first: the oldest request is never preempted.
    assert reqs[0].num_preemptions == 0


def test_request_fitting_alone_waits_instead_of_failing():
    s = sched(5, budget=64)  # 4 usable blocks = 16 tokens
    a = make(1, list(range(10)), max_tokens=5)
    b = make(2, list(range(20, 30)), max_tokens=5)
    s.add(a)
    s.add(b)
    run_all(s)
    assert a.num_output_tokens == 5 and b.num_output_tokens == 5


def test_engine_routes_a_shared_prefix_to_the_rank_that_caches_it(tmp_path):
    """Two DP ranks: a prompt whose 64-token prefix rank 1 caches goes to rank 1 although rank 1 is busier."""
    from kimi.controller.engine import Engine
    from kimi.controller.router import DPRouter
    from kimi.tokenizer import KimiTokenizer, write_tokenizer_files

    write_tokenizer_files(tmp_path)
    cfg = SchedulerConfig(max_num_seqs=64, token_budget=512, max_model_len=4096)
    from kimi.config import CacheConfig

    eng = Engine(
        KimiTokenizer.from_dir(tmp_path), frozenset(), cfg, CacheConfig(block_size=BS), transport=None, vocab_size=1000
    )
    eng.schedulers = [Scheduler(cfg, BlockPool(200, BS), dp_rank=r) for r in range(2)]
    eng.router = DPRouter(eng.schedulers)
    eng.world_size, eng.kv_capacity_tokens, eng.ready = 2, 199 * BS, True
    prefix = list(range(300, 300 + 64 * BS))
    warm = make(1, prefix + [1], max_tokens=1)
    eng.schedulers[1].add(warm)
    run_all(eng.schedulers[1])  # rank 1 now caches the prefix (free, still hashed)
    eng.schedulers[1].add(make(2, [5, 6, 7], max_tokens=50))  # and is busier than rank 0
    r_other = eng.add_request("a", [9, 8, 7, 6], SamplingParams(temperature=0.0), StopParams(4))
    assert r_other.dp_rank == 0
    r_shared = eng.add_request("b", prefix + [2, 3], SamplingParams(temperature=0.0), StopParams(4))
    assert r_shared.dp_rank == 1
    (sr,) = [x for x in step(eng.schedulers[1]).scheduled if x.request is r_shared]
    assert r_shared.num_cached_tokens == 64 * BS and sr.num_new_tokens == 2


def test_short_request_behind_a_long_prompt_starts_within_a_step():
    """A long prompt being prefilled in chunks leaves `waiting_reserve` tokens of each step to waiting requests:
    a short request arriving behind it starts (whole prompt) in the next step and finishes long before the long
    prompt does; the long prompt's chunks shrink only while something waits. With waiting_reserve 0 the short
    request waits for the whole long prompt (the former rule)."""

    def run(reserve: int) -> tuple[int, int, list[int]]:
        cfg = SchedulerConfig(max_num_seqs=8, token_budget=64, max_model_len=4096, waiting_reserve=reserve)
        s = Scheduler(cfg, BlockPool(512, BS, enable_caching=True))
        long_req = make(1, list(range(1000, 1000 + 600)), max_tokens=2)
        s.add(long_req)
        step(s)  # the long prompt's first chunk, nothing waiting: the whole budget
        short = make(2, [5, 6, 7, 8, 9], max_tokens=2)
        s.add(short)
        chunks, first_short, n = [], None, 1
        while s.has_work():
            out = step(s)
            n += 1
            for sr in out.scheduled:
                if sr.request is long_req and long_req.num_computed_tokens <= long_req.num_prompt_tokens:
                    chunks.append(sr.num_new_tokens)
                if sr.request is short and first_short is None:
                    first_short = n
            assert n < 200
        return first_short, n, chunks

    first, steps, chunks = run(16)
    assert first == 2  # the step right after it arrived
    assert chunks[0] == 64 - 16 and max(chunks[1:]) == 64  # reserve only while it waits
    old_first, old_steps, old_chunks = run(0)
    assert old_first > 8 and set(old_chunks[:-1]) == {64}  # behind the whole 600-token prompt
    assert steps - old_steps <= 1  # the long prompt lost at most one step


def test_priority_policy_starts_waiting_requests_by_priority_then_arrival():
    cfg = SchedulerConfig(max_num_seqs=1, token_budget=64, max_model_len=4096, policy="priority")
    s = Scheduler(cfg, BlockPool(64, BS))
    reqs = []
    for rid, prio in ((1, 5), (2, 0), (3, 5), (4, -1), (5, 0)):
        r = make(rid, [rid] * 3, max_tokens=1)
        r.priority = prio
        r.arrival_time = float(rid)  # arrival order = rid
        reqs.append(r)
        s.add(r)
    assert [r.rid for r in s.waiting] == [4, 2, 5, 1, 3]
    order = []
    for _ in range(20):
        out = step(s)
        order += [sr.request.rid for sr in out.scheduled if sr.is_new]
        if not s.has_work():
            break
    assert order == [4, 2, 5, 1, 3]


def test_fcfs_policy_ignores_priority_order():
    s = sched(64)
    for rid, prio in ((1, 5), (2, 0)):
        r = make(rid, [rid] * 3)
        r.priority = prio
        s.add(r)
    assert [r.rid for r in s.waiting] == [1, 2]


def test_preempted_request_goes_back_at_its_priority():
    cfg = SchedulerConfig(max_num_seqs=4, token_budget=64, max_model_len=4096, policy="priority")
    s = Scheduler(cfg, BlockPool(64, BS))
    a, b = make(1, [1] * 3, max_tokens=50), make(2, [2] * 3, max_tokens=50)
    a.priority, b.priority = 1, 1
    a.arrival_time, b.arrival_time = 1.0, 2.0
    s.add(a)
    step(s)
    late = make(3, [3] * 3)
    late.priority, late.arrival_time = 0, 3.0
    s.add(late)
    s.add(b)
    assert a.status == RequestStatus.RUNNING
    # preempted, a re-enters after `late` (priority 0) and before b (the same priority, a later arrival)
    s._preempt(a, SchedulerOutput([], []))
    assert [r.rid for r in s.waiting] == [3, 1, 2]


def test_priority_policy_preempts_the_lowest_priority_first():
    """KV pressure: under "priority" the running request of the worst priority is preempted although it started
    first; under "fcfs" the newest is."""

    def first_preempted(policy: str) -> int:
        cfg = SchedulerConfig(max_num_seqs=4, token_budget=64, max_model_len=4096, policy=policy)
        s = Scheduler(cfg, BlockPool(6, BS))  # 5 usable blocks of 4 tokens
        low = make(1, [1] * 4, max_tokens=40)
        low.priority, low.arrival_time = 9 if policy == "priority" else 0, 1.0
        s.add(low)
        step(s)
        step(s)  # low is running
        high = make(2, [2] * 4, max_tokens=40)
        high.arrival_time = 2.0
        s.add(high)
        for _ in range(20):
            out = step(s)
            if out.preempted:
                return out.preempted[0].rid
        raise AssertionError("no preemption")

    assert first_preempted("priority") == 1
    assert first_preempted("fcfs") == 2


def test_update_from_output_applies_a_step_to_the_counters():
    """The one place a step's results change the requests: computed tokens, the sampled token, in-flight samples,
    the prefix cache; an error token is not appended, a result of an older epoch or an aborted request is ignored,
    and a request that should have sampled but got no token is an error."""
    s = sched(num_blocks=16, budget=64)
    a, b, c = make(1, list(range(2 * BS + 3))), make(2, list(range(100, 105))), make(3, list(range(200, 204)))
    for r in (a, b, c):
        s.add(r)
    out = s.schedule()
    assert all(r.sent_to_workers and r.num_inflight_samples == 1 for r in (a, b, c))
    got = s.update_from_output(out, {1: TokenOutput(1, 7), 2: TokenOutput(2, 8), 3: TokenOutput(3, 9)}, 1)
    assert [(r.rid, t.token_id) for r, t in got] == [(1, 7), (2, 8), (3, 9)]
    assert a.token_ids[-1] == 7 and a.num_computed_tokens == 2 * BS + 3 and a.num_inflight_samples == 0
    assert a.num_cached_blocks == 2  # its two full blocks joined the prefix cache
    assert (b.num_output_tokens, c.num_output_tokens) == (1, 1)

    out = s.schedule()  # a decode step each; a is aborted and c preempted before the results arrive
    assert [sr.request.rid for sr in out.scheduled] == [1, 2, 3]
    s.remove(a)
    c.num_preemptions += 1
    got = s.update_from_output(
        out, {1: TokenOutput(1, 1), 2: TokenOutput(2, 5, error="grammar"), 3: TokenOutput(3, 2)}, 2
    )
    assert [(r.rid, t.error) for r, t in got] == [(2, "grammar")]
    assert b.num_output_tokens == 1 and b.num_computed_tokens == 6 and b.num_inflight_samples == 0  # not appended
    assert c.num_output_tokens == 1 and c.num_computed_tokens == 4  # the old epoch's result changed nothing

    s = sched(num_blocks=16, budget=64)
    s.add(d := make(4, [1, 2, 3]))
    with pytest.raises(RuntimeError, match="step 3: no token for request rid 4"):
        s.update_from_output(s.schedule(), {}, 3)
    assert d.num_computed_tokens == 3 and d.num_output_tokens == 0


def test_speculating_decode_verifies_drafts_within_max_tokens_and_keeps_only_accepted_tokens():
    """num_speculative_tokens 3: once a token is applied the decode computes 1 + k' tokens (k' capped so the step cannot
    pass max_tokens); a result with some drafts accepted appends them, counts only their KV as computed (the
    rejected positions are scheduled again), and the SpecDecodeStats add up. Not planned ahead while in flight."""
    cfg = SchedulerConfig(max_num_seqs=8, token_budget=64, max_model_len=4096, num_speculative_tokens=3)
    s = Scheduler(cfg, BlockPool(32, BS, enable_caching=True))
    req = make(1, list(range(1, 7)), max_tokens=6)
    s.add(req)
    out = s.schedule()  # the prompt: 6 tokens, no drafts yet
    assert [(sr.num_new_tokens, sr.num_draft_tokens) for sr in out.scheduled] == [(6, 0)]
    assert s.schedule().scheduled == []  # its sample is in flight: a speculating request is not planned ahead
    s.update_from_output(out, {1: TokenOutput(1, 100)}, 1)
    assert req.drafts_ready and req.token_ids[-1] == 100
    out = s.schedule()
    sr = out.scheduled[0]
    assert (sr.num_new_tokens, sr.num_draft_tokens) == (4, 3)
    assert len(req.block_table) * BS >= 6 + 4  # slots for the last token and the 3 drafts
    s.update_from_output(out, {1: TokenOutput(1, 101, next_token_ids=[102])}, 2)  # 1 draft accepted + correction
    assert req.token_ids[-3:] == [100, 101, 102]
    assert req.num_computed_tokens == req.num_scheduled_tokens == len(req.token_ids) - 1 == 8
    st = s.spec
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens, st.accepted_per_pos) == (1, 3, 1, [1, 0, 0])
    out = s.schedule()  # 3 outputs so far of max_tokens 6: the next token plus at most 2 drafts
    assert (out.scheduled[0].num_new_tokens, out.scheduled[0].num_draft_tokens) == (3, 2)
    s.update_from_output(out, {1: TokenOutput(1, 103, next_token_ids=[104, 105])}, 3)
    assert req.num_output_tokens == 6 and st.accepted_per_pos == [2, 1, 0]
    s.remove(req)  # the engine ends it at max_tokens
    req2 = make(2, [9, 9, 9], max_tokens=8)
    s.add(req2)
    o = s.schedule()
    s.update_from_output(o, {2: TokenOutput(2, 1)}, 4)
    o = s.schedule()
    assert o.scheduled[0].num_draft_tokens == 3
    with pytest.raises(ProtocolError, match="got 5 tokens for 3 draft tokens"):
        s.update_from_output(o, {2: TokenOutput(2, 1, next_token_ids=[2, 3, 4, 5])}, 5)


def test_guided_requests_do_not_speculate():
    from kimi.structured_output.spec import GrammarSpec

    cfg = SchedulerConfig(max_num_seqs=8, token_budget=64, max_model_len=4096, num_speculative_tokens=3)
    s = Scheduler(cfg, BlockPool(32, BS, enable_caching=True))
    sp = SamplingParams(temperature=0.0, grammar=GrammarSpec("json_object", ""))
    req = Request(1, "r1", [1, 2, 3], 3, sp, StopParams(8))
    s.add(req)
    out = s.schedule()
    s.update_from_output(out, {1: TokenOutput(1, 5)}, 1)
    assert not req.drafts_ready
    assert [sr.num_draft_tokens for sr in s.schedule().scheduled] == [0]
