"""Mixture of experts: noaux_tc routing, the grouped SwiGLU expert reference, and the MoE layer.

Math: DeepSeek-V3 paper (section 2.1.2, auxiliary-loss-free balancing: the correction bias only affects
selection) and docs/model-format.md, Math (router). Routing weights (normalised, times routed_scaling_factor)
are applied exactly once, inside `fused_experts_ref`.

Expert parallelism: rank `ep_rank` of `ep_size` holds experts [ep_rank * E / ep_size, (ep_rank + 1) * E /
ep_size). `MoELayer` routes, hands (tokens, weights, ids) to an all-to-all backend (`dispatch`), runs its
local experts on what it received, and `combine`s the partial outputs back to the tokens' home rank, where
the shared expert is added. `LocalAllToAll` is the single-rank identity backend; the gloo / nccl / DeepEP
backends are in kimi/backends/all_to_all.py. The expert computation must accept what any backend hands it:
global expert ids with pairs of other ranks' experts (and ids of -1) ignored; in DeepEP's low-latency mode
that is one (weight 1.0, expert id or -1) pair per row over an expert-major padded buffer, the routing
weights being applied by that backend's combine instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kimi.config import ModelConfig
from kimi.errors import ProtocolError


def select_experts(
    hidden: torch.Tensor,
    gate_weight: torch.Tensor,
    e_score_correction_bias: torch.Tensor,
    top_k: int,
    routed_scaling_factor: float,
    norm_topk_prob: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """noaux_tc routing with sigmoid scores (docs/model-format.md, Math; DeepSeek-V3 reference `Gate`).

    hidden: [T, D]; gate_weight: [E, D]; e_score_correction_bias: [E] float32.
    `s = sigmoid(hidden.float() @ gate_weight.float().T)`; the top_k experts of `s + bias` are chosen (bias for
    selection only; n_group = 1 so group-limited top-k is a no-op); their weights are the unbiased `s`,
    normalised to sum 1 when norm_topk_prob, then multiplied by routed_scaling_factor.
    Returns (topk_weights [T, k] float32, topk_ids [T, k] int64).
    """
    scores = torch.sigmoid(F.linear(hidden.float(), gate_weight.float()))  # [T, E]
    choice = scores + e_score_correction_bias.float()  # [T, E]
    topk_ids = torch.topk(choice, top_k, dim=-1).indices  # [T, k]
    topk_weights = scores.gather(1, topk_ids)  # [T, k]
    if norm_topk_prob:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)  # [T, k]
    return topk_weights * routed_scaling_factor, topk_ids.to(torch.int64)


def fused_experts_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_offset: int = 0,
) -> torch.Tensor:
    """Weighted sum of SwiGLU experts, grouped by expert (docs/architecture.md, Interfaces).

    x: [T, D]; w13: [E_local, 2I, D] = cat(gate, up) rows; w2: [E_local, D, I]; topk_weights: [T, k] float32;
    topk_ids: [T, k] int64 global expert ids. Only (token, slot) pairs whose id is in
    [expert_offset, expert_offset + E_local) contribute: `out[t] = sum w[t, j] * down(silu(gate x_t) * up x_t)`.
    Accumulates in float32; returns [T, D] in x.dtype (zeros where no pair is local).
    """
    T, D = x.shape
    E_local, two_i, _ = w13.shape
    inter = two_i // 2
    out = torch.zeros(T, D, dtype=torch.float32, device=x.device)  # [T, D]
    flat_ids = topk_ids.reshape(-1) - expert_offset  # [T * k] local ids
    local = (flat_ids >= 0) & (flat_ids < E_local)  # [T * k]
    pair = torch.nonzero(local).squeeze(1)  # [P] flat (token, slot) pair indices
    if pair.numel() == 0:
        return out.to(x.dtype)
    eid = flat_ids[pair]  # [P]
    order = torch.argsort(eid, stable=True)  # group by expert
    pair, eid = pair[order], eid[order]  # [P], [P]
    tok = pair // topk_ids.shape[1]  # [P]
    wts = topk_weights.reshape(-1)[pair].float()  # [P]
    counts = torch.bincount(eid, minlength=E_local).tolist()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        t = tok[start : start + n]  # [n]
        xe = x[t]  # [n, D]
        gu = F.linear(xe, w13[e])  # [n, 2I]
        h = F.silu(gu[:, :inter]) * gu[:, inter:]  # [n, I]
        y = F.linear(h, w2[e]).float()  # [n, D]
        out.index_add_(0, t, y * wts[start : start + n, None])
        start += n
    return out.to(x.dtype)


# ---- expert-parallel dispatch / combine -----------------------------------------------------------------


@dataclass
class DispatchResult:
    """What a rank's local experts must process after dispatch.

    hidden: [T_recv, D]; topk_weights: [T_recv, k] float32; topk_ids: [T_recv, k] int64 (global ids; pairs
    for other ranks' experts are ignored by the local expert computation); handle: backend state for combine.

    expert_major (DeepEP's low-latency layout): k == 1, every weight is 1 and must not be applied (the combine
    applies the routing weights), and the combine never reads a row without a local expert (id -1), so the
    expert computation may leave those rows unset. max_pairs: an upper bound on the rows with a local expert
    (known on the host; None: T_recv * k), which sizes the expert GEMMs' grids; expected_pairs: their expected
    number (None: from T_recv, k and uniform routing), which picks the GEMM schedules. See `run_experts`.
    """

    hidden: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    handle: Any = None
    expert_major: bool = False
    max_pairs: int | None = None
    expected_pairs: int | None = None


def run_experts(experts_impl: Callable[..., torch.Tensor], recv: DispatchResult) -> torch.Tensor:
    """The local routed experts over what dispatch delivered -> [T_recv, D] for the combine.

    An expert-major DispatchResult goes to backends that declare `expert_major_ok` with those hints (they skip
    the weighted sum over k, leave rows without a local expert unset, and compute nothing at max_pairs 0: an
    idle step); every other backend, and every other dispatch, gets the plain call, whose rows without a local
    expert are 0.
    """
    if recv.expert_major and getattr(experts_impl, "expert_major_ok", False):
        return experts_impl(
            recv.hidden,
            recv.topk_weights,
            recv.topk_ids,
            expert_major=True,
            max_pairs=recv.max_pairs,
            expected_pairs=recv.expected_pairs,
        )
    return experts_impl(recv.hidden, recv.topk_weights, recv.topk_ids)


class AllToAllBackend(Protocol):
    """Moves tokens to the ranks owning their experts (dispatch) and the expert outputs back (combine)."""

    def dispatch(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> DispatchResult:
        """hidden [T, D], topk_weights [T, k] f32, topk_ids [T, k] int64 -> what this rank's experts see."""
        ...

    def combine(self, expert_out: torch.Tensor, dispatched: DispatchResult) -> torch.Tensor:
        """expert_out [T_recv, D] (already routing-weighted) -> [T, D] summed over ranks for this rank's tokens."""
        ...


class LocalAllToAll:
    """Single-rank backend (ep_size 1): dispatch and combine are identities."""

    def dispatch(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> DispatchResult:
        """Returns the inputs unchanged."""
        return DispatchResult(hidden, topk_weights, topk_ids)

    def combine(self, expert_out: torch.Tensor, dispatched: DispatchResult) -> torch.Tensor:
        """Returns expert_out unchanged ([T, D])."""
        return expert_out


# ---- layers ---------------------------------------------------------------------------------------------


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class DenseMLP(nn.Module):
    """SwiGLU MLP `down(silu(gate x) * up x)`: the dense layers' `mlp` and the MoE `shared_experts`.

    gate_proj, up_proj: [I, D]; down_proj: [D, I].
    """

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.gate_proj = _param((inter, hidden), dtype, device)
        self.up_proj = _param((inter, hidden), dtype, device)
        self.down_proj = _param((hidden, inter), dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, D]."""
        return F.linear(F.silu(F.linear(x, self.gate_proj)) * F.linear(x, self.up_proj), self.down_proj)


class MoELayer(nn.Module):
    """DeepSeek-V3 MoE block: router (`gate`), local routed experts, shared experts (docs/model-format.md, Math).

    Parameters: gate [E, D] (router weight, used in float32), e_score_correction_bias [E] float32,
    w13 [E_local, 2I, D] (gate rows then up rows per expert), w2 [E_local, D, I], shared_experts (DenseMLP with
    I * n_shared_experts). Local experts are [ep_rank * E_local, (ep_rank + 1) * E_local).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        ep_rank: int = 0,
        ep_size: int = 1,
        a2a: AllToAllBackend | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        super().__init__()
        E, D, inter = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        if E % ep_size != 0:
            raise ValueError(f"n_routed_experts {E} is not divisible by ep_size {ep_size}")
        if not 0 <= ep_rank < ep_size:
            raise ValueError(f"ep_rank {ep_rank} out of range for ep_size {ep_size}")
        self.top_k = cfg.num_experts_per_tok
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.norm_topk_prob = cfg.norm_topk_prob
        self.num_local_experts = E // ep_size
        self.expert_offset = ep_rank * self.num_local_experts
        self.ep_size = ep_size
        self.a2a = a2a
        self.gate = _param((E, D), dtype, device)
        self.e_score_correction_bias = _param((E,), torch.float32, device)
        self.w13 = _param((self.num_local_experts, 2 * inter, D), dtype, device)
        self.w2 = _param((self.num_local_experts, D, inter), dtype, device)
        self.shared_experts = (
            DenseMLP(D, inter * cfg.n_shared_experts, dtype, device) if cfg.n_shared_experts > 0 else None
        )
        # GPU path (kimi/model/gpu_forward.py): a kimi.backends.experts module that replaces w13 / w2 (packed INT4
        # kernels); None = the reference over w13 / w2.
        self.experts_impl: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] (post-attention-layernormed) -> [T, D] = routed experts + shared experts.

        Raises RuntimeError when ep_size > 1 and no all-to-all backend was given (the local one would
        silently drop the other ranks' experts).
        """
        a2a = self.a2a
        if a2a is None:
            if self.ep_size != 1:
                raise ProtocolError("MoELayer with ep_size > 1 needs an all-to-all backend")
            a2a = LocalAllToAll()
        topk_weights, topk_ids = select_experts(
            x, self.gate, self.e_score_correction_bias, self.top_k, self.routed_scaling_factor, self.norm_topk_prob
        )  # [T, k] f32, [T, k] int64
        recv = a2a.dispatch(x, topk_weights, topk_ids)
        if self.experts_impl is not None:
            y = run_experts(self.experts_impl, recv)  # [T_recv, D]
        else:
            y = fused_experts_ref(
                recv.hidden, self.w13, self.w2, recv.topk_weights, recv.topk_ids, self.expert_offset
            )  # [T_recv, D]
        out = a2a.combine(y, recv)  # [T, D]
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
