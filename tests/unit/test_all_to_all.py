"""EP all-to-all backends (kimi/backends/all_to_all.py) against a single-process reference.

The gloo test spawns real ranks (torch.multiprocessing) with a real gloo process group. Every rank builds
the same global inputs from one seed, runs its own tokens through the backend's dispatch -> local experts
-> combine, and checks the result against `fused_experts_ref` over all experts on one process, then runs a
whole `MoELayer` (router, routed experts, shared expert) on its expert shard and checks it against the
1-rank layer. Ranks with zero tokens take part in every collective (an idle DP rank).
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
    step_mode,
)
from kimi.config import ModelConfig
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
