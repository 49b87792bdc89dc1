"""The start-up warm-up (kimi.worker.warmup): its plans cover every prefill size and decode bucket, are consistent for
every rank, and running them leaves a runner exactly as it found it (no request, zeroed counters, the same tokens for
the requests that follow)."""

from __future__ import annotations

import pytest

from kimi import protocol
from kimi.config import CacheConfig, ModelConfig
from kimi.tiny_checkpoint import make_tiny_checkpoint
from kimi.worker.cuda_graph import bucket_sizes
from kimi.worker.fake import FakeRunner
from kimi.worker.runner import ModelRunner
from kimi.worker.warmup import WarmupConfig, WarmupPlanner, decode_sizes, prefill_sizes, warm_up

BS = 16


def _cfg(**kw) -> WarmupConfig:
    base = dict(
        world_size=1,
        token_budget=2048,
        max_num_seqs=256,
        max_model_len=8192,
        block_size=64,
        num_blocks=4000,
        vocab_size=1000,
        device_type="cuda",
    )
    return WarmupConfig(**{**base, **kw})


def test_prefill_sizes_cover_every_power_of_two_and_its_successor():
    sizes = prefill_sizes(2048, 8192, "cuda")
    for k in range(12):
        assert 2**k in sizes and min(2**k + 1, 2048) in sizes, k
    assert max(sizes) == 2048 and 2049 not in sizes
    assert any(s % 16 for s in sizes if s > 16)  # sizes off the 16-multiple: Triton's other specialization
    assert prefill_sizes(3000, 8192, "cuda")[-1] == 3000  # a budget that is no power of two is warmed itself
    assert max(prefill_sizes(2048, 300, "cuda")) <= 300  # never longer than the model / KV cache takes
    assert prefill_sizes(2048, 8192, "cpu") == [1, 17, 64]


def test_decode_sizes_are_the_graph_buckets():
    assert decode_sizes(256, "cuda") == bucket_sizes(256)
    assert decode_sizes(5, "cuda") == bucket_sizes(5)
    assert decode_sizes(256, "cpu") == [1, 4]
    assert decode_sizes(1, "cpu") == [1]


def _check_plans(cfg: WarmupConfig) -> dict[str, list[list[int]]]:
    """Replay the planner's plans as a runner would see them; returns phase -> per step the tokens of each DP rank.
    Fails on a plan a runner would refuse or mis-run."""
    planner = WarmupPlanner(cfg)
    known: dict[int, tuple[int, int, int]] = {}  # rid -> (dp rank, tokens computed, tokens its blocks hold)
    prompt_len: dict[int, int] = {}
    out: dict[str, list[list[int]]] = {}
    for name, groups in planner.phases():
        for group in groups:
            for plan in group:
                per_rank = [0] * cfg.world_size
                for nr in plan.new:
                    assert nr.rid < 0 and nr.rid not in known, nr.rid
                    assert all(0 < b < cfg.num_blocks for b in nr.block_ids)
                    assert all(0 <= t < cfg.vocab_size for t in nr.token_ids)
                    assert 1 <= nr.num_new_tokens <= len(nr.token_ids)
                    known[nr.rid] = (nr.dp_rank, nr.num_new_tokens, len(nr.block_ids) * cfg.block_size)
                    prompt_len[nr.rid] = len(nr.token_ids)
                    per_rank[nr.dp_rank] += nr.num_new_tokens
                for c in plan.cont:
                    assert c.rid in known, c.rid
                    rank, done, room = known[c.rid]
                    done += c.num_new_tokens
                    assert done <= room, (c.rid, done, room)  # the blocks given at the start hold every token
                    known[c.rid] = (rank, done, room)
                    per_rank[rank] += c.num_new_tokens
                assert len(set(per_rank)) == 1, per_rank  # every rank runs the same shapes
                # never a step the scheduler would not send: its token budget, its running-sequence limit
                assert per_rank[0] <= cfg.token_budget, (name, per_rank)
                seqs = len(plan.new) + len(plan.cont)
                assert seqs <= cfg.max_num_seqs * cfg.world_size, (name, seqs)
                out.setdefault(name, []).append(per_rank)
    assert set(planner.rids) == set(known) and len(planner.rids) == len(known)
    assert all(done <= cfg.max_model_len for _, done, _ in known.values())
    return out


@pytest.mark.parametrize("world_size", [1, 2])
def test_plans_cover_each_prefill_size_and_decode_bucket(world_size):
    cfg = _cfg(world_size=world_size)
    steps = _check_plans(cfg)
    assert [r[0] for r in steps["prefill"]] == prefill_sizes(2048, 8191, "cuda")
    decode = [r[0] for r in steps["decode"]]
    assert decode == [b for b in bucket_sizes(256) for _ in range(2)]  # two steps per bucket: greedy, then mixed
    assert list(steps) == ["guided compile", "prefill", "decode prompts", "mixed", "decode", "guided decode"]
    assert max(r[0] for r in steps["decode prompts"]) <= cfg.token_budget


def test_plans_fit_a_small_cache_and_a_short_model():
    _check_plans(_cfg(num_blocks=3, block_size=16, max_model_len=40, token_budget=48, max_num_seqs=8))
    _check_plans(_cfg(token_budget=10, max_num_seqs=3))
    _check_plans(_cfg(device_type="cpu", num_blocks=40, block_size=16, max_model_len=512, token_budget=48))
    fake = _check_plans(_cfg(model=False))
    assert list(fake) == ["guided compile", "guided decode"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "k2.6", "k2.6", seed=0, tokenizer_source=None)


def _plans() -> list[protocol.StepPlan]:
    """Two requests, greedy and seeded: a chunked prompt, a second prompt joining, six decode steps, the drop."""
    greedy = protocol.SamplingParams(temperature=0.0)
    seeded = protocol.SamplingParams(temperature=1.0, seed=7, num_logprobs=2)
    p1, p2 = list(range(3, 23)), list(range(40, 47))
    plans = [
        protocol.StepPlan(1, [protocol.NewRequest(1, 0, p1, 0, 12, [1, 2], greedy)], [], []),
        protocol.StepPlan(
            2, [protocol.NewRequest(2, 0, p2, 0, len(p2), [3], seeded)], [protocol.ContinueRequest(1, 8, [])], []
        ),
    ]
    for step in range(3, 9):
        plans.append(
            protocol.StepPlan(step, [], [protocol.ContinueRequest(1, 1, []), protocol.ContinueRequest(2, 1, [])], [])
        )
    plans.append(protocol.StepPlan(9, [], [], [1, 2]))
    return plans


def _tokens(runner) -> list[tuple[int, int, float | None]]:
    return [(o.rid, o.token_id, o.logprob) for plan in _plans() for o in runner.execute(plan)]


def test_warm_up_leaves_the_model_runner_as_it_found_it(ckpt):
    cfg = ModelConfig.from_dir(ckpt)
    cache = CacheConfig(block_size=BS, num_blocks=40)
    fresh = ModelRunner(str(ckpt), cfg, cache, progress=False)
    want = _tokens(fresh)
    runner = ModelRunner(str(ckpt), cfg, cache, progress=False)
    try:
        wcfg = WarmupConfig(1, 48, 8, 512, BS, runner.num_blocks, cfg.vocab_size, "cpu")
        report = warm_up(runner, wcfg)
        names = [name for name, _, _ in report]
        assert names == ["guided compile", "prefill", "decode prompts", "mixed", "decode", "guided decode"]
        assert all(n >= 1 for _, _, n in report)
        assert runner.requests == {} and runner.rank_of == {}
        assert (runner.num_requests, runner.num_sampled, runner.num_idle_steps, runner.num_overlapped) == (0, 0, 0, 0)
        assert runner.guided.num_held == 0 and runner.guided.num_requests == 0
        assert runner.guided.backend().num_compiled == 1  # the JSON-object grammar, compiled before any request
        assert _tokens(runner) == want  # what the warm-up left in the KV cache is never read
    finally:
        runner.close()
        fresh.close()


def test_warm_up_of_the_fake_runner_is_its_guided_path(ckpt):
    cfg = ModelConfig.from_dir(ckpt)
    runner = FakeRunner(cfg, CacheConfig(block_size=BS, num_blocks=40), model=str(ckpt))
    try:
        report = warm_up(runner, WarmupConfig(1, 48, 8, 512, BS, runner.num_blocks, cfg.vocab_size, "cpu", model=False))
        assert [name for name, _, _ in report] == ["guided compile", "guided decode"]
        assert runner.requests == {} and runner.step_times == []
        assert (runner.num_requests, runner.num_sampled) == (0, 0)
        assert runner.guided.backend().num_compiled == 1
    finally:
        runner.close()


def test_kernel_variant_sizes_join_the_prefill_sizes():
    steps = _check_plans(_cfg(extra_prefill=(3, 100, 2047, 5000)))
    prefill = [r[0] for r in steps["prefill"]]
    assert {3, 100, 2047} <= set(prefill) and 5000 not in prefill  # never past the token budget
    assert prefill == sorted(set(prefill))
