"""EP all-to-all backends (kimi/backends/all_to_all.py) against a single-process reference.

The gloo tests spawn real ranks (torch.multiprocessing) with a real gloo process group. Every rank builds
the same global inputs from one seed, runs its own tokens through the backend's dispatch -> local experts
-> combine, and checks the result against `fused_experts_ref` over all experts on one process, then runs a
whole `MoELayer` (router, routed experts, shared expert) on its expert shard and checks it against the
1-rank layer. The static decode layout is checked against the variable splits on the same inputs. Ranks with
zero tokens take part in every collective (an idle DP rank).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kimi.backends.all_to_all import (
    DECODE,
    PREFILL,
    LocalBackend,
    TorchAllToAll,
    check_backend,
    default_backend,
    make_all_to_all,
    static_capacity,
    step_mode,
)
from kimi.config import ModelConfig
from kimi.errors import ProtocolError
from kimi.ipc import free_tcp_port
from kimi.model.moe import MoELayer, fused_experts_ref, select_experts

E, K, D, INTER = 16, 4, 32, 24


def _cfg() -> ModelConfig:
    return ModelConfig.from_dict(
        dict(
            hidden_size=D,
            num_hidden_layers=2,
            first_k_dense_replace=1,
            intermediate_size=48,
            moe_intermediate_size=INTER,
            n_routed_experts=E,
            num_experts_per_tok=K,
            n_shared_experts=1,
            num_attention_heads=2,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
            max_position_embeddings=256,
            vocab_size=50,
            routed_scaling_factor=2.827,
            rope_theta=50000.0,
            rms_norm_eps=1e-5,
            rope_scaling=dict(
                type="yarn",
                factor=32.0,
                original_max_position_embeddings=64,
                beta_fast=32,
                beta_slow=1,
                mscale=1.0,
                mscale_all_dim=1.0,
            ),
        )
    )


def _full_layer(seed: int) -> MoELayer:
    g = torch.Generator().manual_seed(seed)
    layer = MoELayer(_cfg())
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return layer


def _shard(full: MoELayer, rank: int, world: int, a2a) -> MoELayer:
    layer = MoELayer(_cfg(), ep_rank=rank, ep_size=world, a2a=a2a)
    n = E // world
    with torch.no_grad():
        for name, p in layer.named_parameters():
            src = dict(full.named_parameters())[name]
            p.copy_(src[rank * n : (rank + 1) * n] if name in ("w13", "w2") else src)
    return layer


def _rank_main(rank: int, world: int, port: int, token_counts: list[list[int]]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import datetime

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        full = _full_layer(seed=7)
        a2a = make_all_to_all("gloo", num_experts=E, hidden=D, ep_rank=rank, ep_size=world, group=dist.group.WORLD)
        assert isinstance(a2a, TorchAllToAll)
        layer = _shard(full, rank, world, a2a)
        n_local = E // world
        for round_, counts in enumerate(token_counts):
            g = torch.Generator().manual_seed(100 + round_)
            xs = [torch.randn(t, D, generator=g) for t in counts]  # every rank's tokens, same on all ranks
            routed = [select_experts(x, full.gate, full.e_score_correction_bias, K, 2.827) for x in xs]
            x = xs[rank]
            tw, tid = routed[rank]
            # dispatch / combine of the routed experts alone
            recv = a2a.dispatch(x, tw, tid)
            want_rows = sum(int(((ids // n_local) == rank).any(dim=1).sum()) for _, ids in routed)
            assert recv.hidden.shape == (want_rows, D), (recv.hidden.shape, want_rows)
            y = fused_experts_ref(
                recv.hidden, layer.w13, layer.w2, recv.topk_weights, recv.topk_ids, layer.expert_offset
            )
            out = a2a.combine(y, recv)
            ref = fused_experts_ref(x, full.w13, full.w2, tw, tid)
            assert out.shape == (counts[rank], D)
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
            # the whole layer: router + routed experts across ranks + local shared expert == the 1-rank layer
            torch.testing.assert_close(layer(x), full(x), atol=1e-5, rtol=1e-5)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "world,token_counts",
    [
        (2, [[6, 0], [3, 5]]),
        (4, [[5, 0, 3, 9], [0, 0, 0, 2], [0, 0, 0, 0]]),
    ],
)
def test_gloo_dispatch_combine_matches_single_process(world, token_counts):
    mp.spawn(_rank_main, args=(world, free_tcp_port(), token_counts), nprocs=world, join=True)


CAPACITIES = (1, 2, 4, 8, 16)


def _routing(g: torch.Generator, n: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n tokens of `rank`: (weights [n, K] f32, distinct expert ids [n, K] int64), token t's experts random (t % 3 ==
    0), all on `rank` (t % 3 == 1) or all on other ranks (t % 3 == 2)."""
    n_local = E // world
    mine = torch.arange(rank * n_local, (rank + 1) * n_local)
    others = torch.tensor([e for e in range(E) if e // n_local != rank])
    ids = []
    for t in range(n):
        pool = (torch.arange(E), mine, others)[t % 3]
        ids.append(pool[torch.randperm(len(pool), generator=g)[:K]])
    w = torch.rand(n, K, generator=g) + 0.1
    return w, torch.stack(ids) if ids else torch.empty(0, K, dtype=torch.int64)


def _rowwise_experts(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, offset: int, n_local: int) -> torch.Tensor:
    """An expert stand-in computed row by row without reductions across rows, so two layouts delivering the same
    (row, local pairs) give bit-identical outputs: x * (sum of the local pairs' weights) + (sum of their ids)."""
    local = (ids >= offset) & (ids < offset + n_local)  # [R, k]
    ws = torch.where(local, w, 0.0).sum(1, keepdim=True)  # [R, 1]
    es = torch.where(local, ids, 0).sum(1, keepdim=True).float()  # [R, 1]
    return x * ws + es


def _static_rank_main(rank: int, world: int, port: int, token_counts: list[list[int]]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import datetime

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        full = _full_layer(seed=7)
        a2a = make_all_to_all(
            "gloo",
            num_experts=E,
            hidden=D,
            ep_rank=rank,
            ep_size=world,
            group=dist.group.WORLD,
            static_capacities=CAPACITIES,
        )
        assert isinstance(a2a, TorchAllToAll)
        layer = _shard(full, rank, world, a2a)
        n_local, offset = E // world, rank * (E // world)
        n_static = 0
        for round_, counts in enumerate(token_counts):
            g = torch.Generator().manual_seed(200 + round_)
            xs = [torch.randn(t, D, generator=g) for t in counts]  # every rank's tokens, same on all ranks
            routed = [_routing(g, t, r, world) for r, t in enumerate(counts)]
            x = xs[rank]
            tw, tid = routed[rank]
            a2a.set_mode(PREFILL, sum(counts), max(counts))
            assert a2a.capacity is None
            var = a2a.dispatch(x, tw, tid)
            a2a.set_mode(DECODE, sum(counts), max(counts))
            C = static_capacity(CAPACITIES, max(counts))
            assert a2a.capacity == C
            if C is None:  # more tokens than the largest capacity: variable splits
                continue
            n_static += 1
            st = a2a.dispatch(x, tw, tid)
            # the layout: N * C rows; a row holds a token iff it has an expert here; only local ids or -1 arrive
            assert st.hidden.shape == (world * C, D) and st.topk_ids.shape == (world * C, K)
            has_local = (st.topk_ids >= 0).any(1)  # [N * C]
            assert int(has_local.sum()) == var.hidden.shape[0]
            assert bool(((st.topk_ids == -1) | (st.topk_ids // n_local == rank)).all())
            assert bool((st.topk_weights[st.topk_ids == -1] == 0).all())
            for s_ in range(world):  # sender s's token t in row s * C + t, padding rows [counts[s], C) all -1
                block = slice(s_ * C, (s_ + 1) * C)
                assert bool((st.topk_ids[block][counts[s_] :] == -1).all())
                torch.testing.assert_close(st.hidden[block][: counts[s_]], xs[s_], atol=0, rtol=0)
                want = torch.where(routed[s_][1] // n_local == rank, routed[s_][1], -1)
                assert torch.equal(st.topk_ids[block][: counts[s_]], want)
            # the same outputs as the variable splits: bit-identical through a row-wise expert stand-in
            out_st = a2a.combine(_rowwise_experts(st.hidden, st.topk_weights, st.topk_ids, offset, n_local), st)
            a2a.set_mode(PREFILL, sum(counts), max(counts))
            var = a2a.dispatch(x, tw, tid)  # a fresh variable-split step (collectives in the same order everywhere)
            out_var = a2a.combine(_rowwise_experts(var.hidden, var.topk_weights, var.topk_ids, offset, n_local), var)
            assert out_st.shape == out_var.shape == (counts[rank], D)
            assert torch.equal(out_st, out_var)
            # the reference experts: the same as the 1-process reference; the whole layer: as the 1-rank layer
            a2a.set_mode(DECODE, sum(counts), max(counts))
            st = a2a.dispatch(x, tw, tid)
            y = fused_experts_ref(st.hidden, layer.w13, layer.w2, st.topk_weights, st.topk_ids, offset)
            torch.testing.assert_close(a2a.combine(y, st), fused_experts_ref(x, full.w13, full.w2, tw, tid))
            torch.testing.assert_close(layer(x), full(x), atol=1e-5, rtol=1e-5)
        assert n_static == sum(max(c) <= CAPACITIES[-1] for c in token_counts)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "world,token_counts",
    [
        (2, [[6, 0], [3, 5], [1, 1], [17, 2]]),
        (4, [[5, 0, 3, 9], [0, 0, 0, 2], [0, 0, 0, 0], [4, 4, 4, 4], [1, 0, 0, 0]]),
    ],
)
def test_gloo_static_decode_layout_matches_variable_splits(world, token_counts):
    """The static layout (capacity = the smallest of CAPACITIES holding the busiest rank's tokens) delivers each token
    to the ranks owning its experts with only their ids, pads with id -1, and combines to exactly the variable splits'
    outputs; idle ranks, tokens whose experts are all local or all remote, and a step above the largest capacity
    (variable splits) included."""
    mp.spawn(_static_rank_main, args=(world, free_tcp_port(), token_counts), nprocs=world, join=True)


def test_static_capacity_and_overflow():
    assert static_capacity(CAPACITIES, 0) == 1
    assert static_capacity(CAPACITIES, 5) == 8
    assert static_capacity(CAPACITIES, 16) == 16
    assert static_capacity(CAPACITIES, 17) is None
    assert static_capacity(CAPACITIES, None) is None
    assert static_capacity((), 1) is None
    a2a = TorchAllToAll(None, E, 0, 2, CAPACITIES)
    a2a.set_mode(DECODE, 2, 1)
    assert (a2a.capacity, a2a.num_static_steps, a2a.num_variable_steps) == (1, 1, 0)
    with pytest.raises(ProtocolError, match="exceed the step's static all-to-all capacity 1"):  # before any collective
        a2a.dispatch(torch.zeros(2, D), torch.ones(2, K), torch.zeros(2, K, dtype=torch.int64))
    a2a.set_mode(DECODE, 40, 20)
    assert (a2a.capacity, a2a.num_variable_steps) == (None, 1)
    with pytest.raises(ValueError, match="unknown all-to-all mode"):
        a2a.set_mode("mixed")
    with pytest.raises(ValueError, match=">= 1"):
        TorchAllToAll(None, E, 0, 2, (0, 4))
    with pytest.raises(ValueError, match="not deepep"):
        make_all_to_all("deepep", num_experts=384, hidden=7168, ep_rank=0, ep_size=8, static_capacities=(1,))
    with pytest.raises(ValueError, match="a2a-static-decode"):
        check_backend("deepep", 8, "cuda", 384, static_decode=True)
    check_backend("nccl", 2, "cuda", 384, static_decode=True)


def test_local_backend_is_the_single_rank_layer():
    full = _full_layer(seed=3)
    x = torch.randn(7, D)
    local = _shard(full, 0, 1, make_all_to_all("local", num_experts=E, hidden=D, ep_rank=0, ep_size=1))
    assert isinstance(local.a2a, LocalBackend)
    torch.testing.assert_close(local(x), full(x), atol=0, rtol=0)
    tw, _tid = select_experts(x, full.gate, full.e_score_correction_bias, K, 2.827)
    # the routing weights carry routed_scaling_factor exactly once
    torch.testing.assert_close(tw.sum(1), torch.full((7,), 2.827), atol=1e-5, rtol=1e-5)


def test_backend_choice_and_step_mode():
    assert default_backend(1, "cpu") == "local"
    assert default_backend(4, "cpu") == "gloo"
    assert default_backend(8, "cuda") == "nccl"
    check_backend("gloo", 4, "cpu")
    for args in (("local", 2, "cpu"), ("gloo", 2, "cuda"), ("nccl", 2, "cpu"), ("deepep", 8, "cpu"), ("mpi", 2, "cpu")):
        with pytest.raises(ValueError):
            check_backend(*args)
    with pytest.raises(ValueError):
        make_all_to_all("local", num_experts=E, hidden=D, ep_rank=0, ep_size=2)
    # DeepEP's dispatch takes at most 128 experts per rank: Kimi's 384 need 3+ ranks (2 H200s hit its assertion)
    check_backend("deepep", 8, "cuda", 384)
    check_backend("deepep", 4, "cuda", 384)
    with pytest.raises(ValueError, match=r"384 experts over 2 ranks is 192 per rank.*at least 3 ranks"):
        check_backend("deepep", 2, "cuda", 384)
    with pytest.raises(ValueError, match="do not split evenly"):
        check_backend("deepep", 5, "cuda", 384)
    check_backend("nccl", 2, "cuda", 384)  # only DeepEP has the limit
    with pytest.raises(ValueError, match="192 per rank"):  # checked before deep_ep is imported (absent on CPU)
        make_all_to_all("deepep", num_experts=384, hidden=7168, ep_rank=0, ep_size=2)
    with pytest.raises(ValueError, match="needs a process group"):  # also before deep_ep is imported
        make_all_to_all("deepep", num_experts=384, hidden=7168, ep_rank=0, ep_size=8)
    assert step_mode([3, 0, 128], True, 128) == DECODE
    assert step_mode([3, 0, 129], True, 128) == PREFILL
    assert step_mode([1, 1], False, 128) == PREFILL
    assert step_mode([], True, 128) == DECODE


def test_run_experts_passes_expert_major_only_to_backends_that_take_it():
    """DeepEP's low-latency layout (k == 1, weight 1, padding rows with id -1): a backend without
    `expert_major_ok` (here the reference) gets the plain call and returns 0 in the padding rows; a backend with it
    gets expert_major=True and the bounds. A plain DispatchResult never carries the flag."""
    from kimi.backends.experts.reference import RefExperts
    from kimi.model.moe import DispatchResult, run_experts

    g = torch.Generator().manual_seed(5)
    E_local, D, inter, offset = 2, 16, 8, 2
    ref = RefExperts(
        torch.randn(E_local, 2 * inter, D, generator=g), torch.randn(E_local, D, inter, generator=g), offset
    )
    x = torch.randn(6, D, generator=g)
    ids = torch.tensor([[2], [2], [-1], [3], [-1], [-1]])
    w = torch.ones(6, 1)
    recv = DispatchResult(x, w, ids, expert_major=True, max_pairs=4, expected_pairs=2)
    y = run_experts(ref, recv)
    assert torch.equal(y[ids[:, 0] < 0], torch.zeros(3, D)) and torch.equal(y, ref(x, w, ids))

    seen = {}

    class TakesExpertMajor(torch.nn.Module):
        expert_major_ok = True

        def forward(self, x, topk_weights, topk_ids, **kw):
            seen.update(kw)
            return x

    assert run_experts(TakesExpertMajor(), recv) is x
    assert seen == {"expert_major": True, "max_pairs": 4, "expected_pairs": 2}
    seen.clear()
    run_experts(TakesExpertMajor(), DispatchResult(x, w, ids))
    assert seen == {} and DispatchResult(x, w, ids).expert_major is False
