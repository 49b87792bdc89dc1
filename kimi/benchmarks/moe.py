"""Routed-expert inputs at Kimi-K2's expert shapes for the MoE kernel benchmarks and the humming tuner.

The experts of one EP rank of 8: E = 48 local of E_TOTAL = 384 (experts [OFFSET, OFFSET + 48), i.e. rank 2),
hidden H = 7168, expert width I = 2048, top-8 routing. Weights are random pack-quantized INT4 words with bf16 group
scales (group 32); each routing set is T tokens of random activations routed to the top-8 of random scores (distinct
experts per token). `Humming` holds humming-kernels' two indexed GEMMs over the same compressed-tensors tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

H, I, E, E_TOTAL, TOPK, OFFSET = 7168, 2048, 48, 384, 8, 96
NSETS = 4  # distinct (x, routing) sets a timed call cycles through


def do_bench(fn: Callable[[], Any], rep: int = 300) -> float:
    """triton.testing.do_bench's median in ms (50 ms of warm-up, `rep` ms of repetitions, the L2 cleared before
    every call)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=50, rep=rep, return_mode="median")


def make_weights(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w13 packed [E, 2I, H/8] int32, w13 scales [E, 2I, H/32] bf16, w2 packed [E, H, I/8], w2 scales) on the GPU."""
    w13p = torch.randint(-(2**31), 2**31 - 1, (E, 2 * I, H // 8), dtype=torch.int32, device="cuda", generator=gen)
    w2p = torch.randint(-(2**31), 2**31 - 1, (E, H, I // 8), dtype=torch.int32, device="cuda", generator=gen)
    w13s = ((torch.rand(E, 2 * I, H // 32, device="cuda", generator=gen) + 0.5) * (0.02 / 7.5)).to(torch.bfloat16)
    w2s = ((torch.rand(E, H, I // 32, device="cuda", generator=gen) + 0.5) * (0.03 / 7.5)).to(torch.bfloat16)
    return w13p, w13s, w2p, w2s


def make_sets(T: int, gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """NSETS routing sets of T tokens: (x [T, H] bf16, weights [T, 8] float32 summing to 2.827, ids [T, 8] int64)."""
    sets = []
    for _ in range(NSETS):
        x = (torch.randn(T, H, device="cuda", generator=gen)).to(torch.bfloat16)
        scores = torch.rand(T, E_TOTAL, device="cuda", generator=gen)
        w, ids = scores.topk(TOPK, dim=1)
        w = (w / w.sum(1, keepdim=True) * 2.827).float()
        sets.append((x, w, ids.to(torch.int64)))
    return sets


def touched(ids: torch.Tensor) -> tuple[int, int]:
    """(distinct local experts hit, local (token, expert) pairs) of a routing."""
    loc = ids.flatten() - OFFSET
    loc = loc[(loc >= 0) & (loc < E)]
    return int(torch.unique(loc).numel()), int(loc.numel())


def cycle(fn: Callable[..., Any], sets: list) -> Callable[[], Any]:
    """A no-arg callable that calls fn(*set) with the next set each call."""
    it = [0]

    def f() -> Any:
        s = sets[it[0] % len(sets)]
        it[0] += 1
        return fn(*s)

    return f


class Humming:
    """humming-kernels indexed MoE GEMMs over the same compressed-tensors tensors (l1: gate_up, l2: down)."""

    def __init__(self, w13p: torch.Tensor, w13s: torch.Tensor, w2p: torch.Tensor, w2s: torch.Tensor):
        from humming.layer import HummingLayer

        wcfg = dict(
            quant_method="compressed-tensors",
            format="pack-quantized",
            type="int",
            num_bits=4,
            strategy="group",
            group_size=32,
            symmetric=True,
        )
        self.l1 = HummingLayer(
            shape_n=2 * I, shape_k=H, weight_config=dict(wcfg), num_experts=E, torch_dtype=torch.bfloat16
        ).cuda()
        self.l2 = HummingLayer(
            shape_n=H, shape_k=I, weight_config=dict(wcfg), num_experts=E, torch_dtype=torch.bfloat16
        ).cuda()
        shp13 = torch.tensor([[2 * I, H]] * E, dtype=torch.int64)
        shp2 = torch.tensor([[H, I]] * E, dtype=torch.int64)
        self.l1.load_from_tensors({"weight_packed": w13p.clone(), "weight_scale": w13s.clone(), "weight_shape": shp13})
        self.l2.load_from_tensors({"weight_packed": w2p.clone(), "weight_scale": w2s.clone(), "weight_shape": shp2})
        self.l1.transform()
        self.l2.transform()
