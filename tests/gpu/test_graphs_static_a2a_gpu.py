"""Decode CUDA graphs on the static NCCL all-to-all (kimi.worker.cuda_graph.DecodeGraphPlan, lockstep): a ModelRunner
on "tiny-mla" (tests/gpu/test_gpu_model.py: Kimi's attention widths, so FlashInfer's MLA runs and graphs are captured)
with a TorchAllToAll on its static decode layout over a real NCCL process group.

Each decode step goes through the runner's own path (update_states -> step_bucket -> a replay of that bucket); then
the captured computation of the bucket is run again eagerly over the same static inputs (the graph runner's buffers:
the batch's rows and its padding rows, the bucket's attention plan, the step's static capacity), and the replay's
hidden states must equal it bit for bit, as must the greedy tokens sampled from them. Plan-ahead is off, so the
bucket's attention plan is still the step's own when the eager run reads it.

- world size 1 (in-process, TCP store on a free loopback port): every bucket, batch sizes on and between buckets;
- world size 2 (torch.multiprocessing spawn, one GPU per rank; skipped with fewer than 2 GPUs): both ranks replay the
  bucket of the busier rank, and a rank with no rows of its own replays it with padding rows only.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_gpu_model import make_ckpt

from kimi import protocol
from kimi.ipc import free_tcp_port

pytestmark = pytest.mark.gpu

BLOCK = 16
MAX_BS = 16  # graph buckets 1, 2, 4, 8, 16 (ll_max_tokens_per_rank 16 caps them as well)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_ckpt(tmp_path_factory.mktemp("graphs_a2a"), "tiny-mla")


def _runner(path: str, rank: int, world: int):
    """Rank `rank` of `world` on cuda:rank: bf16, decode graphs up to MAX_BS, TorchAllToAll on the static layout over
    the default (NCCL) group."""
    from kimi.backends.all_to_all import TorchAllToAll
    from kimi.config import CacheConfig, ModelConfig
    from kimi.worker.cuda_graph import bucket_sizes
    from kimi.worker.runner import ModelRunner

    cfg = ModelConfig.from_dir(path)
    a2a = TorchAllToAll(dist.group.WORLD, cfg.n_routed_experts, rank, world, static_capacities=bucket_sizes(MAX_BS))
    runner = ModelRunner(
        path,
        cfg,
        CacheConfig(block_size=BLOCK, num_blocks=64),
        rank=rank,
        world_size=world,
        device=f"cuda:{rank}",
        dtype=torch.bfloat16,
        progress=False,
        a2a=a2a,
        ll_max_tokens_per_rank=MAX_BS,
        gpu_options=dict(moe_backend="auto", cuda_graph_max_bs=MAX_BS),
    )
    assert runner.graph_plan is not None and runner.graph_plan.lockstep, "decode graphs on the static layout"
    assert runner.graph_plan.buckets == (1, 2, 4, 8, 16)
    assert runner.model.graphs is not None
    runner.model.graphs.plan_ahead = False  # the bucket's plan stays this step's for the eager run
    return runner


def _prefill_plan(owners: list[int]) -> protocol.StepPlan:
    """Step 1: request i (owned by DP rank owners[i]) with a prompt of 5 + 2 i tokens, three blocks of its own."""
    g = torch.Generator().manual_seed(11)
    greedy = protocol.SamplingParams(temperature=0.0)
    new = []
    for i, r in enumerate(owners):
        n = 5 + 2 * i
        toks = torch.randint(0, 160000, (n,), generator=g).tolist()
        new.append(protocol.NewRequest(i, r, toks, 0, n, [1 + 3 * i, 2 + 3 * i, 3 + 3 * i], greedy))
    return protocol.StepPlan(1, new, [], [])


def _decode_plan(step: int, rids: list[int]) -> protocol.StepPlan:
    return protocol.StepPlan(step, [], [protocol.ContinueRequest(rid, 1, []) for rid in rids], [])


@torch.inference_mode()
def _eager_bucket(runner, bucket: int) -> torch.Tensor:
    """The captured computation of `bucket` (embed_fused + layers_fused, CudaGraphRunner.capture), eagerly, over the
    static inputs and attention plan the last replay used: hidden [bucket, D] after the final norm. Collective (its
    MoE layers run the static all-to-all at the step's capacity): every rank calls it in the same step."""
    gm, g = runner.model, runner.model.graphs
    attn = g._meta(bucket, g.fi[bucket])
    h, x = gm.embed_fused(g.input_ids[:bucket])
    _, x = gm.layers_fused(
        h, x, g.positions[:bucket], attn, runner.kv_caches, 0, len(gm.layers), row_valid=g.row_valid[:bucket]
    )
    return x


def _check_step(runner, plan: protocol.StepPlan, want_bucket: int) -> list[int]:
    """Run a decode step through the runner; check it replayed `want_bucket` at static capacity want_bucket, and that
    the replay equals the eager run bit for bit (hidden states of every row, greedy tokens). Returns the tokens."""
    g = runner.model.graphs
    n0, idle0 = g.num_replays, runner.num_idle_steps
    outs = runner.execute(plan)
    assert runner.step_bucket == want_bucket
    assert runner.a2a.capacity == want_bucket
    assert g.num_replays == n0 + 1
    B = len(outs)
    assert runner.num_idle_steps == idle0 + (B == 0)
    graph = g.outputs[want_bucket].clone()  # [bucket, D]: the replay's rows (padding rows included)
    eager = _eager_bucket(runner, want_bucket)
    assert torch.isfinite(graph[:B]).all()
    assert torch.equal(graph, eager), (plan.step, want_bucket, float((graph.float() - eager.float()).abs().max()))
    tokens = [o.token_id for o in outs]
    if B:
        want = runner.model.compute_logits(eager[:B]).argmax(dim=-1).tolist()
        assert tokens == want, (plan.step, tokens, want)
    return tokens


@pytest.fixture(scope="module")
def nccl_world1():
    """A world-size-1 NCCL process group in this process (TCP store on a free loopback port)."""
    if dist.is_initialized():
        pytest.skip("a torch.distributed process group is already initialised in this process")
    torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", free_tcp_port(), 1, True, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group(
        "nccl",
        store=store,
        rank=0,
        world_size=1,
        device_id=torch.device("cuda", 0),
        timeout=datetime.timedelta(seconds=60),
    )
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_static_a2a_graphs_one_rank_equal_eager(ckpt, nccl_world1):
    """World size 1 on NCCL's static layout: every bucket replayed with batches on and between buckets."""
    runner = _runner(ckpt, 0, 1)
    try:
        runner.execute(_prefill_plan([0] * 16))  # prefill: eager, variable splits
        assert runner.step_bucket is None
        step = 2
        for B, bucket in [(16, 16), (13, 16), (8, 8), (5, 8), (4, 4), (3, 4), (2, 2), (1, 1), (9, 16), (7, 8)]:
            _check_step(runner, _decode_plan(step, list(range(B))), bucket)
            step += 1
        assert runner.a2a.num_static_steps == step - 2
    finally:
        runner.close()


def _two_rank_main(rank: int, world: int, port: int, path: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        device_id=torch.device("cuda", rank),
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        runner = _runner(path, rank, world)
        owners = [0] * 6 + [1] * 4  # rids 0-5 on rank 0, 6-9 on rank 1
        runner.execute(_prefill_plan(owners))
        steps = [  # (rids decoding, the bucket every rank replays)
            (list(range(10)), 8),  # 6 + 4 rows
            ([0, 1, 2, 3, 4], 8),  # rank 1 idle: replays rank 0's bucket with padding rows only
            ([6, 7, 8], 4),  # rank 0 idle
            ([0, 1, 6], 2),
            ([0, 6, 7, 8, 9], 4),
        ]
        mine = {i for i, r in enumerate(owners) if r == rank}
        for k, (rids, bucket) in enumerate(steps):
            tokens = _check_step(runner, _decode_plan(2 + k, rids), bucket)
            assert len(tokens) == len(mine.intersection(rids))
        assert runner.num_idle_steps == 1  # rank 1 in the second decode step, rank 0 in the third
        assert runner.model.graphs.num_replays == len(steps)
        runner.close()
    finally:
        dist.destroy_process_group()


def test_static_a2a_graphs_two_ranks_with_an_idle_rank(ckpt):
    """Two ranks over NCCL: the bucket of the busier rank on both, an idle rank's padding-only replay, bit-equal to the
    eager run of the same shapes on both ranks."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs (one per rank), {torch.cuda.device_count()} visible")
    mp.spawn(_two_rank_main, args=(2, free_tcp_port(), ckpt), nprocs=2, join=True)
