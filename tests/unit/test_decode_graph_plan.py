"""The host side of decode CUDA graphs with many ranks (kimi.worker.cuda_graph.DecodeGraphPlan / decode_graph_plan,
ModelRunner.update_states): which buckets a rank captures for its all-to-all backend, which bucket every rank replays
in a step (the bucket of the largest local decode batch over all ranks, an idle rank included), and that the static
all-to-all's capacity in that step is the bucket, not the smallest static capacity holding the busiest rank.

Real objects throughout: TorchAllToAll without a process group (set_mode runs no collective), ModelRunner on the CPU
over a tiny checkpoint with world_size 2; the graphs themselves need CUDA (tests/gpu/test_graphs_static_a2a_gpu.py).
"""

from __future__ import annotations

import pytest

from kimi import protocol
from kimi.backends.all_to_all import DECODE, PREFILL, LocalBackend, TorchAllToAll
from kimi.config import CacheConfig, ModelConfig
from kimi.tiny_checkpoint import make_tiny_checkpoint
from kimi.worker.cuda_graph import DecodeGraphPlan, bucket_sizes, decode_graph_plan
from kimi.worker.main import static_decode
from kimi.worker.runner import ModelRunner

LL_MAX = 128
STATIC = tuple(bucket_sizes(LL_MAX))  # the worker's static capacities: [..., 64, 96, 128]


def _static_a2a(rank: int = 0, world: int = 2, capacities=STATIC) -> TorchAllToAll:
    return TorchAllToAll(None, 16, rank, world, static_capacities=capacities)


def test_bucket_is_that_of_the_busiest_rank():
    plan = DecodeGraphPlan(tuple(bucket_sizes(100)), lockstep=True)  # [1, 2, 4, ..., 64, 96, 100]
    assert plan.bucket([1, 0], True) == 1
    assert plan.bucket([3, 1], True) == 4  # between buckets: the next one up, on both ranks
    assert plan.bucket([1, 3], True) == 4
    assert plan.bucket([0, 0, 17, 2], True) == 24
    assert plan.bucket([97, 5], True) == 100  # the graph's own bucket, not the static capacity 128
    assert plan.bucket([100, 100], True) == 100
    assert plan.bucket([101, 0], True) is None  # larger than the largest bucket: eager on every rank
    assert plan.bucket([0, 0], True) is None  # nobody decodes
    assert plan.bucket([], True) is None
    assert plan.bucket([4, 4], False) is None  # not a decode step of static shapes


def test_buckets_a_rank_captures_for_its_backend():
    local, why = decode_graph_plan(256, 1, LocalBackend(), LL_MAX)
    assert why == "" and local == DecodeGraphPlan(tuple(bucket_sizes(256)), lockstep=False)  # one rank, as before
    assert decode_graph_plan(256, 1, None, LL_MAX)[0] == local
    static, why = decode_graph_plan(256, 2, _static_a2a(), LL_MAX)
    assert why == "" and static == DecodeGraphPlan(tuple(bucket_sizes(LL_MAX)), lockstep=True)  # capped at DECODE's
    assert decode_graph_plan(48, 2, _static_a2a(), LL_MAX)[0] == DecodeGraphPlan(tuple(bucket_sizes(48)), True)
    one_rank = decode_graph_plan(16, 1, _static_a2a(0, 1), LL_MAX)[0]  # nccl with one rank, static layout
    assert one_rank == DecodeGraphPlan((1, 2, 4, 8, 16), lockstep=True)
    none, why = decode_graph_plan(256, 2, _static_a2a(capacities=()), LL_MAX)
    assert none is None and "variable splits" in why and "--a2a-static-decode" in why
    assert decode_graph_plan(256, 2, LocalBackend(), LL_MAX)[0] is None
    assert decode_graph_plan(0, 1, LocalBackend(), LL_MAX)[0] is None


def test_static_capacity_of_a_graph_step_is_its_bucket():
    a2a = _static_a2a()
    a2a.set_mode(DECODE, 102, 97)
    assert a2a.capacity == 128  # eager: the smallest static capacity holding the busiest rank
    a2a.set_mode(DECODE, 102, 97, capacity=100)
    assert a2a.capacity == 100  # a graph step: the bucket its collectives were captured with
    assert (a2a.num_static_steps, a2a.num_variable_steps) == (2, 0)
    with pytest.raises(ValueError, match="below the busiest rank's 5 tokens"):
        a2a.set_mode(DECODE, 5, 5, capacity=4)
    with pytest.raises(ValueError, match="for DECODE steps"):
        a2a.set_mode(PREFILL, 5, 5, capacity=8)
    with pytest.raises(ValueError, match="for DECODE steps"):
        _static_a2a(capacities=()).set_mode(DECODE, 5, 5, capacity=8)
    assert _static_a2a().graph_capturable and not _static_a2a(capacities=()).graph_capturable
    LocalBackend().set_mode(DECODE, 3, 3, capacity=4)  # nothing to switch


def test_nccl_graphs_imply_the_static_decode_layout():
    """`kimi serve --nproc 2 --device cuda` (nccl by default) asks its workers for graphs, which turn the static layout
    on; --enforce-eager keeps the variable splits; deepep and gloo are unchanged."""
    from kimi.server import ServeArgs, worker_config

    serve = worker_config(ServeArgs(model="/x", nproc=2, device="cuda"), "tcp://a:1", "tcp://a:2")
    eager = worker_config(ServeArgs(model="/x", nproc=2, device="cuda", enforce_eager=True), "tcp://a:1", "tcp://a:2")
    cpu = worker_config(ServeArgs(model="/x", nproc=2), "tcp://a:1", "tcp://a:2")
    assert serve.cuda_graph_max_bs == 256 and not serve.a2a_static_decode
    assert static_decode(serve, "nccl")
    assert not static_decode(eager, "nccl")
    assert not static_decode(serve, "deepep")  # its low-latency mode is its static layout
    assert not static_decode(cpu, "gloo")
    flag = worker_config(ServeArgs(model="/x", nproc=2, a2a_static_decode=True), "tcp://a:1", "tcp://a:2")
    assert static_decode(flag, "gloo")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "k2.6", "k2.6", seed=0, tokenizer_source=None)


def _runner(ckpt, rank: int, buckets: tuple[int, ...]) -> ModelRunner:
    """Rank `rank` of 2 on the CPU with a static TorchAllToAll and the graph plan a capture of `buckets` leaves (the
    CPU captures none: graph_plan is set as capture_graphs sets it)."""
    cfg = ModelConfig.from_dir(ckpt)
    r = ModelRunner(
        str(ckpt),
        cfg,
        CacheConfig(block_size=16, num_blocks=400),
        rank=rank,
        world_size=2,
        a2a=_static_a2a(rank),
        ll_max_tokens_per_rank=LL_MAX,
        progress=False,
    )
    r.graph_plan = DecodeGraphPlan(buckets, lockstep=True)
    return r


def _new(rid: int, dp_rank: int, n_tokens: int = 1) -> protocol.NewRequest:
    greedy = protocol.SamplingParams(temperature=0.0)
    return protocol.NewRequest(rid, dp_rank, [5] * 4, 4 - n_tokens, n_tokens, [1 + rid % 300], greedy)


def test_every_rank_replays_the_bucket_of_the_busiest_rank(ckpt):
    runners = [_runner(ckpt, r, tuple(bucket_sizes(100))) for r in range(2)]
    try:
        # step 1: 97 decode rows on rank 0, 2 on rank 1 -> bucket 100 on both, static capacity 100 (not 128)
        plan = protocol.StepPlan(1, [_new(i, 0) for i in range(97)] + [_new(200, 1), _new(201, 1)], [], [])
        sizes = [len(r.update_states(plan)) for r in runners]
        assert sizes == [97, 2]
        assert [r.step_bucket for r in runners] == [100, 100]
        assert [r.a2a.capacity for r in runners] == [100, 100]
        # step 2: rank 0's requests finish; rank 1 decodes 2 -> bucket 2; then rank 1's finish and 3 start on rank 0:
        # rank 1 is idle and replays rank 0's bucket 4 with no valid row
        cont = [protocol.ContinueRequest(200, 1, []), protocol.ContinueRequest(201, 1, [])]
        plan = protocol.StepPlan(2, [], cont, list(range(97)))
        assert [len(r.update_states(plan)) for r in runners] == [0, 2]
        assert [r.step_bucket for r in runners] == [2, 2]
        plan = protocol.StepPlan(3, [_new(300, 0), _new(301, 0), _new(302, 0)], [], [200, 201])
        assert [len(r.update_states(plan)) for r in runners] == [3, 0]
        assert [r.step_bucket for r in runners] == [4, 4]
        assert [r.a2a.capacity for r in runners] == [4, 4]
        # a prefill chunk anywhere: every rank eager, variable splits
        plan = protocol.StepPlan(4, [_new(400, 1, n_tokens=3)], [protocol.ContinueRequest(300, 1, [])], [])
        for r in runners:
            r.update_states(plan)
        assert [r.step_bucket for r in runners] == [None, None]
        assert [r.a2a.capacity for r in runners] == [None, None]
        # more rows on one rank than the largest bucket (still a DECODE step): eager static, capacity by lookup
        plan = protocol.StepPlan(5, [_new(500 + i, 1) for i in range(101)], [], [300, 301, 302, 400])
        for r in runners:
            r.update_states(plan)
        assert [r.step_bucket for r in runners] == [None, None]
        assert [r.a2a.capacity for r in runners] == [128, 128]
    finally:
        for r in runners:
            r.close()


def test_an_idle_rank_replays_instead_of_the_eager_idle_step(ckpt):
    """Rank 1 has no rows in a decode step of rank 0: its launch asks for the replay of rank 0's bucket (the CPU model
    has no graphs, so the request is refused by name) instead of running `_idle_step`."""
    runner = _runner(ckpt, 1, (1, 2, 4, 8))
    try:
        with pytest.raises(ValueError, match="bucket 4 asked of a model without CUDA graphs"):
            runner.launch(protocol.StepPlan(1, [_new(i, 0) for i in range(3)], [], []))
        assert runner.num_idle_steps == 0
        runner.graph_plan = None  # no graphs captured: no bucket, the idle rank runs `_idle_step`
        runner.update_states(protocol.StepPlan(2, [_new(i, 0) for i in range(3, 6)], [], [0, 1, 2]))
        assert runner.step_bucket is None and runner.a2a.capacity == 4
    finally:
        runner.close()
