"""One DP x EP rank of a Kimi-K2 model on one GPU, for the decode and prefill benchmarks (tools/bench_decode.py,
tools/bench_prefill.py).

`EmulatedEP` stands in for the all-to-all seam of kimi.model.moe: the MoE of every layer sees the tokens of all ranks
(this rank's rows plus fixed random rows standing for the other ranks'), routed by fixed random routing drawn per
layer (distinct experts per token), so the bytes each step touches are known exactly; combine keeps this rank's
rows. No communication is timed. `time_ms` times a step with CUDA events; `breakdown` gives torch.profiler's CUDA
kernel time per step by kernel-name class (KERNEL_CLASSES); `bytes_per_expert` / `dense_weight_bytes` give the
weight bytes a floor counts; `capture_forward` captures a step of any rows (prefill,
verify) as one CUDA graph.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable
from typing import Any

import torch

from kimi.benchmarks.gpu import event_times
from kimi.model.moe import DispatchResult
from kimi.worker.cuda_graph import run_before_capture


class EmulatedEP:
    """All-to-all stand-in: dispatch -> all ranks' tokens with fixed routing; combine -> this rank's rows.

    per_layer: draw the routing one layer at a time (prefill chunks: the whole [layers, T, E] score tensor would not
    fit next to the model; other random draws than the default's, which the decode measurements used).
    idle_peers: the other ranks send nothing (T = batch): the MoE sees only this rank's tokens."""

    def __init__(
        self,
        num_moe_layers: int,
        batch: int,
        ep_size: int,
        hidden: int,
        n_experts: int,
        top_k: int,
        scale: float,
        device: Any,
        seed: int = 0,
        per_layer: bool = False,
        idle_peers: bool = False,
    ):
        g = torch.Generator(device=device).manual_seed(seed)
        T = batch if idle_peers else batch * ep_size
        self.batch, self.n_layers, self.i = batch, num_moe_layers, 0
        self.foreign = torch.randn((T - batch, hidden), generator=g, device=device).to(torch.bfloat16)  # [T-B, D]
        n = 1 if per_layer else num_moe_layers
        ids, wts = [], []
        for _ in range(num_moe_layers // n):
            scores = torch.rand((n, T, n_experts), generator=g, device=device)
            ids.append(scores.topk(top_k, dim=-1).indices.to(torch.int64))  # [n, T, k] distinct per token
            del scores
            w = torch.rand((n, T, top_k), generator=g, device=device) + 0.1
            wts.append((w / w.sum(-1, keepdim=True) * scale).float())
        self.ids = torch.cat(ids)  # [layers, T, k]
        self.weights = torch.cat(wts)  # [layers, T, k]

    @classmethod
    def for_model(cls, cfg: Any, batch: int, ep_size: int, device: Any, **kwargs: Any) -> EmulatedEP:
        """The stand-in for a model of config cfg (a ModelConfig: its MoE layers, hidden size, experts, top-k and
        routing scale); kwargs: seed, per_layer, idle_peers."""
        n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
        return cls(
            n_moe,
            batch,
            ep_size,
            cfg.hidden_size,
            cfg.n_routed_experts,
            cfg.num_experts_per_tok,
            cfg.routed_scaling_factor,
            device,
            **kwargs,
        )

    def install(self, model: Any) -> None:
        """Make this the all-to-all of every MoE layer of model, starting again at its first MoE layer."""
        for layer in model.layers:
            if hasattr(layer.mlp, "a2a"):
                layer.mlp.a2a = self
        self.i = 0

    def local_pairs(self, offset: int, n_local: int) -> int:
        """(token, expert) pairs on experts [offset, offset + n_local), summed over layers."""
        return int(((self.ids >= offset) & (self.ids < offset + n_local)).sum())

    def dispatch(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> DispatchResult:
        i = self.i
        self.i = (self.i + 1) % self.n_layers
        return DispatchResult(torch.cat([hidden, self.foreign], 0), self.weights[i], self.ids[i])

    def combine(self, expert_out: torch.Tensor, dispatched: DispatchResult) -> torch.Tensor:
        return expert_out[: self.batch]

    def row_blocks(self, offset: int, n_local: int, block_m: int) -> list[int]:
        """Per layer: align blocks of block_m rows over the local experts (sum of ceil(rows / block_m)); a GEMM
        that streams an expert's weights once per block reads them that many times."""
        out = []
        for l in range(self.n_layers):
            ids = self.ids[l][(self.ids[l] >= offset) & (self.ids[l] < offset + n_local)] - offset
            out.append(int(((torch.bincount(ids, minlength=n_local) + block_m - 1) // block_m).sum()))
        return out

    def experts_hit(self, offset: int, n_local: int) -> list[int]:
        loc = (self.ids >= offset) & (self.ids < offset + n_local)
        return [int(torch.unique(self.ids[l][loc[l]]).numel()) for l in range(self.n_layers)]


def time_ms(fn: Callable[[], Any], iters: int = 20, warmup: int = 3) -> dict:
    """fn's GPU time (events around it), each call after the last one's end (kimi.benchmarks.gpu.event_times)."""
    ts = event_times(fn, iters, warmup)
    return {"median_ms": statistics.median(ts), "min_ms": min(ts), "max_ms": max(ts), "iters": iters, "samples": ts}


KERNEL_CLASSES = [
    ("fused_norm", r"_rmsnorm_kernel"),
    ("fused_silu_mul", r"_silu_mul_kernel|_silu_mul_rows_kernel"),
    ("fused_rope_kv_write", r"_mla_rope_kv_kernel"),
    ("fused_router", r"_router_logits_kernel|_router_topk_kernel"),
    ("fused_align", r"_align_count_kernel|_align_scatter_kernel|_align_grid"),
    ("moe_gemm", r"humming|_gate_up_kernel|_down_kernel|w4a16_indexed"),
    ("moe_combine", r"_combine_kernel"),
    ("attention_mla", r"flashinfer|BatchMLA|mla|Mla"),
    ("dense_gemm_triton", r"_linear_small_m"),
    ("mla_head_gemm_triton", r"_bmm_small_m"),
    ("dense_gemm", r"gemm|Gemm|cutlass|nvjet|xmma|sm90|cublas"),
    ("moe_align_sort_topk", r"sort|Sort|radix|Radix|topk|TopK|scan|Scan|cumsum"),
    ("copy_cat_index", r"copy|Copy|cat|Cat|index|Index|gather|Gather|scatter|Scatter"),
    ("reduce_norm", r"reduce|Reduce|norm|Norm"),
    ("elementwise", r"elementwise|vectorized|Elementwise|unrolled"),
]


def bytes_per_expert(model: Any, n_local: int) -> int:
    """Bytes of one routed expert of a GPU model (its first MoE layer's expert module, whose n_local experts are
    stored together; humming's int32 'locks' buffer left out)."""
    impl = model.layers[model.cfg.first_k_dense_replace].mlp.experts_impl
    total = sum(
        t.numel() * t.element_size() for t in impl.state_dict().values() if t.dtype != torch.int32 or t.dim() != 1
    )
    return int(total) // n_local


def dense_weight_bytes(model: Any, exclude: tuple[str, ...] = ("embed_tokens",)) -> int:
    """Bytes of a GPU model's non-expert parameters, those named in `exclude` left out (the embedding, of which a
    step reads only its rows)."""
    return int(
        sum(
            p.numel() * p.element_size()
            for n, p in model.named_parameters()
            if not p.is_meta and ".experts_impl." not in n and n not in exclude
        )
    )


def capture_forward(
    model: Any,
    kv_caches: list[torch.Tensor],
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    attn: Any,
    row_valid: torch.Tensor | None = None,
    logit_rows: torch.Tensor | None = None,
    pool: Any = None,
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """One CUDA graph of a fused model's step over the rows input_ids [T] / positions [T] (int64, on the GPU) with
    attn (AttentionMetadata whose plan is set, its attention run planned outside the graph with fixed index buffers,
    e.g. a use_cuda_graph FlashInferMLA): the forward from the embedding to the final norm, then the lm_head and
    argmax of the rows logit_rows [N] (None: every row) -> (graph, the argmax output [N] int64). row_valid: as
    KimiForCausalLM.layers_fused's. Two eager runs first, on a side stream (Triton JIT, autotuning). pool: a graph
    memory pool to share."""
    n = len(model.layers)

    def fwd() -> torch.Tensor:
        h, x = model.embed_fused(input_ids)
        _, x = model.layers_fused(h, x, positions, attn, kv_caches, 0, n, row_valid=row_valid)
        rows = x if logit_rows is None else x.index_select(0, logit_rows)
        return model.compute_logits(rows).argmax(-1)

    run_before_capture(fwd, input_ids.device)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        out = fwd()
    torch.cuda.synchronize()
    return g, out


def breakdown(step: Callable[[], Any], steps: int = 3) -> dict:
    """CUDA kernel time per step by class, and the 15 largest kernels (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        t = float(getattr(e, "device_time", None) or getattr(e, "cuda_time", None) or 0.0)
        per_kernel[e.name] = per_kernel.get(e.name, 0.0) + t / 1000.0 / steps  # ms per step
    cls: dict[str, float] = {}
    for name, t in per_kernel.items():
        c = next((c for c, rx in KERNEL_CLASSES if re.search(rx, name)), "other")
        cls[c] = cls.get(c, 0.0) + t
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:15]
    return {
        "by_class_ms": {k: round(v, 4) for k, v in sorted(cls.items(), key=lambda kv: -kv[1])},
        "kernel_sum_ms": round(sum(per_kernel.values()), 4),
        "top_kernels_ms": [(n[:120], round(t, 4)) for n, t in top],
    }
