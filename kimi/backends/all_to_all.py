"""Expert-parallel all-to-all backends behind `kimi.model.moe.AllToAllBackend` (dispatch / combine).

Rank r of N owns routed experts [r * E / N, (r + 1) * E / N). Every MoE layer of every rank calls
`dispatch` then `combine` once per step, also with zero local tokens (an idle DP rank), so that all ranks
issue the same sequence of collectives (docs/design.md, Parallelism).

Backends (`kimi serve --a2a-backend`):

- `local`  (N = 1): identities (`LocalBackend`).
- `gloo`   (CPU) and `nccl` (CUDA): `TorchAllToAll`, built on `torch.distributed.all_to_all_single` with
  variable splits. gloo implements `all_to_all_single` with uneven splits for CPU tensors (checked on torch
  2.13: uneven and zero-sized splits both work), so both use the same code: one all-to-all of the per-rank
  token counts, then one of the token rows and one of their routing metadata (dispatch), and one of the
  expert outputs (combine). With static capacities (`kimi serve --a2a-static-decode`) its decode steps use the
  static layout instead (`TorchAllToAll`, Static layout): equal splits of a capacity fixed by the step plan,
  no counts exchanged and nothing read on the host.
- `deepep` (CUDA, needs DeepEP's `deep_ep` package): `DeepEPAllToAll`, normal dispatch/combine for prefill
  steps and low-latency dispatch/combine (fixed-size buffers, no CPU sync, CUDA-graph capturable) for
  decode steps. The mode is chosen per step from the step plan, identically on every rank (`step_mode`).

Routing weights (already normalised and multiplied by routed_scaling_factor in `select_experts`) are
applied exactly once: by the expert computation in `local` / `gloo` / `nccl` / DeepEP normal mode (the
combine is a plain sum), and by DeepEP's low-latency combine in low-latency mode (the dispatched rows carry
weight 1 there). The shared expert is computed locally by `MoELayer`, never dispatched.

A token is sent once to each rank that owns at least one of its top-k experts (as DeepEP does), with all of
its k (weight, expert id) pairs; the receiver's expert computation ignores pairs of other ranks' experts.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Iterable, Sequence
from typing import Any, TypeAlias

import torch
import torch.distributed as dist

from kimi import envs
from kimi.errors import PeerFailure, ProtocolError
from kimi.model.moe import DispatchResult, LocalAllToAll

log = logging.getLogger(__name__)

BACKENDS = ("local", "gloo", "nccl", "deepep")
PREFILL, DECODE = "prefill", "decode"


def _collective(fn, *args, **kwargs):
    """Run a torch.distributed collective; its failure becomes PeerFailure with the backend's message."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError as e:
        raise PeerFailure(f"all-to-all with the other ranks failed (a peer rank died or stopped?): {e}") from e


def default_backend(world_size: int, device_type: str) -> str:
    """The backend used when none is asked for: local for one rank, gloo on CPU, nccl on CUDA."""
    if world_size == 1:
        return "local"
    return "nccl" if device_type == "cuda" else "gloo"


# DeepEP's normal-mode dispatch (intranode.cu, notify_dispatch) counts the tokens of each local expert with one
# thread of a 128-thread block and asserts num_experts / num_ranks <= 128 at the first prefill step. Kimi-K2's
# 384 experts therefore need at least 3 ranks (seen on 2 H200s: the assertion, on K2.6's config).
DEEPEP_MAX_LOCAL_EXPERTS = 128


def check_deepep_experts(num_experts: int, world_size: int) -> None:
    """Raise ValueError when DeepEP cannot split `num_experts` routed experts over `world_size` ranks: they must
    divide evenly and leave at most DEEPEP_MAX_LOCAL_EXPERTS per rank."""
    if num_experts % world_size:
        raise ValueError(f"--a2a-backend deepep: {num_experts} experts do not split evenly over {world_size} ranks")
    if num_experts // world_size > DEEPEP_MAX_LOCAL_EXPERTS:
        least = -(-num_experts // DEEPEP_MAX_LOCAL_EXPERTS)
        raise ValueError(
            f"--a2a-backend deepep: {num_experts} experts over {world_size} ranks is {num_experts // world_size} per "
            f"rank, and DeepEP's dispatch takes at most {DEEPEP_MAX_LOCAL_EXPERTS} per rank; use at least {least} "
            f"ranks (a divisor of {num_experts}), or --a2a-backend nccl"
        )


def check_backend(
    backend: str, world_size: int, device_type: str, num_experts: int | None = None, static_decode: bool = False
) -> None:
    """Raise ValueError when `backend` cannot serve `world_size` ranks on `device_type` ("cpu" / "cuda"), or,
    given the model's `num_experts` (routed), when DeepEP cannot split them over the ranks (`check_deepep_experts`),
    or when `static_decode` (the static decode layout) is asked of deepep (its low-latency mode is the static one)."""
    if static_decode and backend == "deepep":
        raise ValueError("--a2a-static-decode is for the gloo / nccl backends; deepep decodes in low-latency mode")
    if backend not in BACKENDS:
        raise ValueError(f"unknown all-to-all backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "local" and world_size != 1:
        raise ValueError(f"the local all-to-all backend serves one rank, not {world_size}; use gloo, nccl or deepep")
    if backend == "gloo" and device_type != "cpu":
        raise ValueError("the gloo all-to-all backend runs on CPU tensors; use nccl or deepep with --device cuda")
    if backend in ("nccl", "deepep") and device_type != "cuda":
        raise ValueError(f"the {backend} all-to-all backend needs --device cuda")
    if backend == "deepep" and num_experts is not None:
        check_deepep_experts(num_experts, world_size)


def init_distributed(backend: str, device: torch.device, timeout_s: float = 600.0) -> dist.ProcessGroup | None:
    """Initialise torch.distributed from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

    Process-group backend: gloo for CPU (`gloo`), nccl for CUDA (`nccl`, `deepep`); nothing for `local`.
    `timeout_s` bounds every collective (a peer that vanished fails the others instead of hanging forever).
    Returns the default group (None for `local`). Raises ValueError for a bad backend / device combination.
    """
    world_size = envs.WORLD_SIZE.get()
    check_backend(backend, world_size, device.type)
    if backend == "local":
        return None
    if not dist.is_initialized():
        pg_backend = "gloo" if backend == "gloo" else "nccl"
        kw: dict[str, Any] = {}
        if pg_backend == "nccl":
            kw["device_id"] = device
        dist.init_process_group(pg_backend, timeout=datetime.timedelta(seconds=timeout_s), **kw)
    return dist.group.WORLD


def step_mode(per_rank_tokens: Iterable[int], all_single_token: bool, ll_max_tokens_per_rank: int) -> str:
    """DECODE when every scheduled request computes one token and no rank has more than
    `ll_max_tokens_per_rank` of them (DeepEP's low-latency buffers and the static layout's largest capacity are
    sized for that), else PREFILL.

    Every rank sees the whole step plan, so every rank computes the same answer: the all-to-all mode is
    collective and must agree across ranks.
    """
    return DECODE if all_single_token and max(per_rank_tokens, default=0) <= ll_max_tokens_per_rank else PREFILL


class LocalBackend(LocalAllToAll):
    """ep_size 1: dispatch and combine are identities (kimi.model.moe.LocalAllToAll) plus the `set_mode` hook.
    collective False: it exchanges nothing, so a CUDA graph of any decode batch may run on it
    (kimi.worker.cuda_graph)."""

    collective = False
    graph_capturable = True

    def set_mode(
        self,
        mode: str,
        num_tokens: int | None = None,
        max_tokens_per_rank: int | None = None,
        capacity: int | None = None,
    ) -> None:
        """Nothing to switch."""


def _rows_per_rank(topk_ids: torch.Tensor, num_local_experts: int, ep_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which token goes to which rank.

    topk_ids: [T, k] int64 global expert ids. Returns (tok [S] int64: the token index of each send row, rows
    ordered by destination rank then token; counts [ep_size] int64: rows per destination rank).
    """
    T = topk_ids.shape[0]
    in_rank = torch.zeros(T, ep_size, dtype=torch.bool, device=topk_ids.device)  # [T, N]
    in_rank.scatter_(1, topk_ids // num_local_experts, True)
    _, tok = in_rank.t().nonzero(as_tuple=True)  # [S], rank-major
    return tok, in_rank.sum(0)  # [S], [N]


def static_capacity(capacities: Sequence[int], max_tokens_per_rank: int | None) -> int | None:
    """The static layout's rows per destination rank for a step whose busiest rank has `max_tokens_per_rank`
    tokens: the smallest of `capacities` (sorted ascending) that holds them; None (the variable splits) when none
    does or the count is unknown."""
    if max_tokens_per_rank is None:
        return None
    return next((c for c in capacities if c >= max_tokens_per_rank), None)


class TorchAllToAll:
    """`gloo` / `nccl`: torch.distributed.all_to_all_single, with variable splits or, on decode steps, a static layout.

    group: the EP process group (all ranks, in rank order); num_experts: E (global); ep_rank / ep_size;
    static_capacities: the static layout's capacities, rows per destination rank (ascending; empty: variable splits
    only). A failed collective raises PeerFailure. Raises ValueError if E is not divisible by ep_size or too large
    for the float32 id encoding, or for a capacity below 1.

    Variable splits (prefill and mixed steps, and every step without static capacities): dispatch is 4 collectives
    (the per-rank row counts, the token rows, their routing metadata as float32 [S, 2k] = weights | ids: ids are exact
    in float32 below 2^24), combine 1. The counts are read on the host (`tolist`) and the row selection is a
    `nonzero`, so this path is not CUDA-graph capturable.

    Static layout (DECODE steps, `set_mode`, when a capacity holds the busiest rank's tokens): the capacity C is the
    smallest of static_capacities >= the step's most tokens on one rank, which every rank computes from the step plan,
    so all agree. Each rank sends every rank the same C rows: its T <= C tokens in token order, then C - T padding
    rows of zeros; the routing sent to rank r keeps the (weight, id) pairs of r's experts and replaces the others by
    (0, -1), so a row whose token has no expert on r, and every padding row, carries only id -1 (the padding marker:
    expert computations skip ids outside their range and return 0 for such rows). A token is thus delivered once to
    each rank that owns at least one of its experts, as with variable splits, in a fixed slot. dispatch is 2
    collectives with equal splits (the rows [N * C, D], the routing [N * C, 2k] float32 = weights | ids), combine 1
    ([N * C, D] back); then each token's N returned rows are summed in rank order in float32 (the rows of ranks it
    was not sent to are 0), the sums of the variable path. Every shape is a function of (N, C, T, D, k) and nothing is
    read on the host, so NCCL runs it inside the decode CUDA graphs, captured per bucket with the bucket as C
    (`set_mode`'s capacity; kimi.worker.cuda_graph.DecodeGraphPlan).
    Counters: num_static_steps / num_variable_steps (steps set to each layout; every layer of a step uses it).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        num_experts: int,
        ep_rank: int,
        ep_size: int,
        static_capacities: Sequence[int] = (),
    ) -> None:
        if num_experts % ep_size:
            raise ValueError(f"{num_experts} experts do not split over {ep_size} ranks")
        if num_experts >= 1 << 24:
            raise ValueError("expert ids must stay below 2^24")
        if any(c < 1 for c in static_capacities):
            raise ValueError(f"static all-to-all capacities must be >= 1, got {list(static_capacities)}")
        self.group = group
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        self.ep_rank = ep_rank
        self.ep_size = ep_size
        self.static_capacities = tuple(sorted(static_capacities))
        self.capacity: int | None = None  # this step's static rows per destination rank; None: variable splits
        self.num_static_steps = 0
        self.num_variable_steps = 0

    collective = True

    @property
    def graph_capturable(self) -> bool:
        """Whether a decode step can run inside a CUDA graph: only in the static layout (the variable splits read the
        counts on the host), so only with static capacities; the graph then runs at a fixed capacity (`set_mode`'s
        capacity)."""
        return bool(self.static_capacities)

    def set_mode(
        self,
        mode: str,
        num_tokens: int | None = None,
        max_tokens_per_rank: int | None = None,
        capacity: int | None = None,
    ) -> None:
        """Pick the step's layout, the same on every rank: static on a DECODE step when a capacity holds the busiest
        rank's tokens, else variable splits. The capacity is `capacity` when given (a decode CUDA graph's bucket, the
        fixed shape its collectives were captured with: kimi.worker.cuda_graph.DecodeGraphPlan), else
        `static_capacity(static_capacities, max_tokens_per_rank)`. num_tokens (the step's tokens over all ranks) is not
        needed. Raises ValueError for an unknown mode, a capacity outside DECODE mode, without static capacities or
        below max_tokens_per_rank."""
        if mode not in (PREFILL, DECODE):
            raise ValueError(f"unknown all-to-all mode {mode!r}")
        if capacity is not None:
            if mode != DECODE or not self.static_capacities:
                raise ValueError(f"a static capacity ({capacity}) is for DECODE steps of the static layout")
            if capacity < max(1, max_tokens_per_rank or 0):
                raise ValueError(f"static capacity {capacity} is below the busiest rank's {max_tokens_per_rank} tokens")
            self.capacity = capacity
        else:
            self.capacity = static_capacity(self.static_capacities, max_tokens_per_rank) if mode == DECODE else None
        if self.capacity is None:
            self.num_variable_steps += 1
        else:
            self.num_static_steps += 1

    def reset_counters(self) -> None:
        """Zero num_static_steps and num_variable_steps (after the start-up warm-up)."""
        self.num_static_steps = self.num_variable_steps = 0

    def dispatch(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> DispatchResult:
        """hidden [T, D], topk_weights [T, k] f32, topk_ids [T, k] int64 (global) -> rows for this rank's experts.

        Variable splits: DispatchResult(hidden [R, D], topk_weights [R, k] f32, topk_ids [R, k] int64 global ids,
        handle) where R = rows received from all ranks (rank-major, each sender's rows in token order).
        Static layout: R = N * C (sender-major, sender s's token t at row s * C + t), ids of other ranks' experts
        and of padding rows -1 with weight 0. T may be 0 (an idle rank still takes part in the collectives).
        Raises ProtocolError when T exceeds the static capacity (the ranks' step plans disagree).
        """
        if self.capacity is not None:
            return self._dispatch_static(hidden, topk_weights, topk_ids, self.capacity)
        T, k = topk_ids.shape
        D = hidden.shape[1]
        tok, send_counts = _rows_per_rank(topk_ids, self.num_local_experts, self.ep_size)  # [S], [N]
        recv_counts = torch.empty_like(send_counts)  # [N]
        _collective(dist.all_to_all_single, recv_counts, send_counts, group=self.group)
        send_splits = send_counts.tolist()
        recv_splits = recv_counts.tolist()
        R = sum(recv_splits)
        x_send = hidden[tok].contiguous()  # [S, D]
        meta_send = torch.cat([topk_weights[tok].float(), topk_ids[tok].float()], dim=1)  # [S, 2k]
        x_recv = hidden.new_empty((R, D))  # [R, D]
        meta_recv = meta_send.new_empty((R, 2 * k))  # [R, 2k]
        _collective(dist.all_to_all_single, x_recv, x_send, recv_splits, send_splits, group=self.group)
        _collective(dist.all_to_all_single, meta_recv, meta_send, recv_splits, send_splits, group=self.group)
        w = meta_recv[:, :k].contiguous()  # [R, k] f32
        ids = meta_recv[:, k:].to(torch.int64)  # [R, k]
        return DispatchResult(x_recv, w, ids, handle=(PREFILL, tok, send_splits, recv_splits, T))

    def _dispatch_static(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, C: int
    ) -> DispatchResult:
        """The static layout's dispatch (class docstring): 2 all-to-alls of N * C rows with equal splits."""
        T, k = topk_ids.shape
        D = hidden.shape[1]
        N = self.ep_size
        if T > C:
            raise ProtocolError(f"{T} tokens exceed the step's static all-to-all capacity {C}")
        dev = hidden.device
        x_pad = hidden.new_zeros((C, D))  # [C, D]
        x_pad[:T] = hidden
        ids_pad = torch.full((C, k), -1, dtype=torch.int64, device=dev)  # [C, k]
        ids_pad[:T] = topk_ids
        w_pad = torch.zeros((C, k), dtype=torch.float32, device=dev)  # [C, k]
        w_pad[:T] = topk_weights
        ranks = torch.arange(N, device=dev).view(N, 1, 1)  # [N, 1, 1]
        own = torch.div(ids_pad, self.num_local_experts, rounding_mode="floor").unsqueeze(0) == ranks  # [N, C, k]
        ids_send = torch.where(own, ids_pad.unsqueeze(0), -1)  # [N, C, k]
        w_send = torch.where(own, w_pad.unsqueeze(0), 0.0)  # [N, C, k]
        meta_send = torch.cat([w_send, ids_send.float()], dim=2).view(N * C, 2 * k)  # [N * C, 2k]
        x_send = x_pad.repeat(N, 1)  # [N * C, D]: the same C rows to every rank
        x_recv = torch.empty_like(x_send)  # [N * C, D]
        meta_recv = torch.empty_like(meta_send)  # [N * C, 2k]
        _collective(dist.all_to_all_single, x_recv, x_send, group=self.group)
        _collective(dist.all_to_all_single, meta_recv, meta_send, group=self.group)
        w = meta_recv[:, :k].contiguous()  # [N * C, k] f32
        ids = meta_recv[:, k:].to(torch.int64)  # [N * C, k]
        return DispatchResult(x_recv, w, ids, handle=(DECODE, T, C))

    def combine(self, expert_out: torch.Tensor, dispatched: DispatchResult) -> torch.Tensor:
        """expert_out [R, D] (routing-weighted partial sums) -> [T, D]: rows sent home and summed per token
        (in float32, in rank order), returned in expert_out.dtype."""
        D = expert_out.shape[1]
        if dispatched.handle[0] == DECODE:
            _, T, C = dispatched.handle
            back = torch.empty_like(expert_out)  # [N * C, D]
            _collective(dist.all_to_all_single, back, expert_out.contiguous(), group=self.group)
            rows = back.view(self.ep_size, C, D)[:, :T].float()  # [N, T, D]: rank r's outputs for this rank's tokens
            out = torch.zeros(T, D, dtype=torch.float32, device=expert_out.device)  # [T, D]
            for r in range(self.ep_size):  # rank order, as the variable path's index_add_
                out += rows[r]
            return out.to(expert_out.dtype)
        _, tok, send_splits, recv_splits, T = dispatched.handle
        back = expert_out.new_empty((len(tok), D))  # [S, D]
        _collective(dist.all_to_all_single, back, expert_out.contiguous(), send_splits, recv_splits, group=self.group)
        out = torch.zeros(T, D, dtype=torch.float32, device=expert_out.device)  # [T, D]
        out.index_add_(0, tok, back.float())
        return out.to(expert_out.dtype)


class DeepEPAllToAll:
    """`deepep`: DeepEP's `deep_ep.Buffer` (NVLink intranode, RDMA across nodes). CUDA, bfloat16 hidden states.

    PREFILL steps use normal mode (`get_dispatch_layout` + `dispatch` / `combine`): received rows carry
    their k routing weights and local expert ids (-1 for other ranks' experts), which are mapped back to
    global ids here; the expert computation applies the weights and the combine sums.
    DECODE steps use low-latency mode (`low_latency_dispatch` / `low_latency_combine`, bf16, no CPU sync):
    the received tensor is [E_local, M * N, D] expert-major with per-expert counts; it is handed to the
    expert computation as [E_local * M * N, D] rows with one (weight 1, expert id) pair each (padding rows
    get id -1 and are skipped) and the low-latency combine applies the routing weights. The result is marked
    expert-major (kimi.model.moe.DispatchResult), with the step's tokens x top-k (from `set_mode`) as the bound on
    rows with a local expert: the kimi / humming expert backends then size their grids by it, skip the weighted
    sum and leave the padding rows unwritten, where the plain path wrote all E_local * M * N rows (704 MB per
    layer at 8 ranks x 48 experts x 128 tokens x 7168).
    M = ll_max_tokens_per_rank bounds the tokens any rank may send in a decode step (`step_mode`).

    The Buffer is created with both NVLink bytes (normal mode, sized from DeepEP's config hints) and RDMA
    bytes (low-latency mode, `get_low_latency_rdma_size_hint`), `low_latency_mode=True` and
    `num_qps_per_rank = E / N` as DeepEP requires; the low-latency buffer is cleaned when switching from
    normal to low-latency mode (`clean_low_latency_buffer`), on every rank in the same step.
    Raises ImportError without deep_ep, ValueError for more than DEEPEP_MAX_LOCAL_EXPERTS experts per rank.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_experts: int,
        hidden: int,
        ep_rank: int,
        ep_size: int,
        ll_max_tokens_per_rank: int = 128,
    ) -> None:
        check_deepep_experts(num_experts, ep_size)
        import deep_ep  # the GPU extra (tokenspeed-deepep wheel); imported here so CPU installs never need it

        self._deep_ep = deep_ep
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        self.expert_offset = ep_rank * self.num_local_experts
        self.hidden = hidden
        self.ep_size = ep_size
        self.ll_max_tokens_per_rank = ll_max_tokens_per_rank
        hidden_bytes = hidden * 2  # bf16
        num_nvl_bytes = max(
            deep_ep.Buffer.get_dispatch_config(ep_size).get_nvl_buffer_size_hint(hidden_bytes, ep_size),
            deep_ep.Buffer.get_combine_config(ep_size).get_nvl_buffer_size_hint(hidden_bytes, ep_size),
        )
        num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(
            ll_max_tokens_per_rank, hidden, ep_size, num_experts
        )
        self.buffer = deep_ep.Buffer(
            group,
            num_nvl_bytes,
            num_rdma_bytes,
            low_latency_mode=True,
            num_qps_per_rank=max(1, self.num_local_experts),
            explicitly_destroy=True,
        )
        self.mode = PREFILL
        self.step_tokens: int | None = None
        self._ll_clean = False

    collective = True
    graph_capturable = True  # low-latency mode: fixed buffers, no host sync

    def set_mode(
        self,
        mode: str,
        num_tokens: int | None = None,
        max_tokens_per_rank: int | None = None,
        capacity: int | None = None,
    ) -> None:
        """Switch between PREFILL (normal) and DECODE (low-latency) before a step; the same mode on all ranks.
        num_tokens: the step's tokens over all ranks (None: unknown), which bounds the rows a low-latency dispatch
        delivers with a local expert (num_tokens x top-k) and gives their expected number (a decode CUDA graph is
        captured with num_tokens = ranks x its bucket, a bound for every replay); max_tokens_per_rank and capacity
        (a graph's bucket) are not needed: the low-latency buffers have one size."""
        if mode not in (PREFILL, DECODE):
            raise ValueError(f"unknown all-to-all mode {mode!r}")
        self.step_tokens = num_tokens
        if mode == DECODE and not self._ll_clean:
            self.buffer.clean_low_latency_buffer(self.ll_max_tokens_per_rank, self.hidden, self.num_experts)
            self._ll_clean = True
        self.mode = mode

    def dispatch(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> DispatchResult:
        """hidden [T, D] bf16, topk_weights [T, k] f32, topk_ids [T, k] int64 -> rows for the local experts.

        Raises ProtocolError in DECODE mode when T exceeds ll_max_tokens_per_rank.
        """
        buf = self.buffer
        if self.mode == DECODE:
            if hidden.shape[0] > self.ll_max_tokens_per_rank:
                raise ProtocolError(
                    f"{hidden.shape[0]} tokens exceed the low-latency limit {self.ll_max_tokens_per_rank}"
                )
            recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(
                hidden, topk_ids, self.ll_max_tokens_per_rank, self.num_experts, use_fp8=False
            )  # [E_local, M * N, D], [E_local] int32
            e_local, rows, d = recv_x.shape
            row = torch.arange(rows, device=recv_x.device)  # [M * N]
            valid = row[None, :] < recv_count[:, None].to(torch.int64)  # [E_local, M * N]
            eid = torch.arange(e_local, device=recv_x.device)[:, None] + self.expert_offset  # [E_local, 1]
            ids = torch.where(valid, eid, torch.full_like(eid, -1)).reshape(-1, 1)  # [E_local * M * N, 1]
            w = torch.ones(ids.shape, dtype=torch.float32, device=recv_x.device)  # weights applied by combine
            # expert-major: the combine reads only each expert's first recv_count rows, so the experts may skip the
            # rest; of the E_local * M * N rows at most the step's tokens x top-k hold a local expert
            n = self.step_tokens
            k = topk_ids.shape[1]
            return DispatchResult(
                recv_x.view(-1, d),
                w,
                ids,
                handle=(DECODE, handle, topk_ids, topk_weights, recv_x.shape),
                expert_major=True,
                max_pairs=None if n is None else n * k,
                expected_pairs=None if n is None else max(1, n * k * e_local // self.num_experts),
            )
        self._ll_clean = False  # normal mode dirties the low-latency buffer
        n_rank, n_rdma_rank, n_expert, in_rank, _ = buf.get_dispatch_layout(topk_ids, self.num_experts)
        recv_x, recv_ids, recv_w, _, handle, _ = buf.dispatch(
            hidden,
            topk_idx=topk_ids,
            topk_weights=topk_weights,
            num_tokens_per_rank=n_rank,
            num_tokens_per_rdma_rank=n_rdma_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=n_expert,
        )  # [R, D], [R, k] local ids or -1, [R, k] f32
        recv_ids = recv_ids.to(torch.int64)
        ids = torch.where(recv_ids >= 0, recv_ids + self.expert_offset, torch.full_like(recv_ids, -1))  # [R, k]
        return DispatchResult(recv_x, recv_w.float(), ids, handle=(PREFILL, handle))

    def combine(self, expert_out: torch.Tensor, dispatched: DispatchResult) -> torch.Tensor:
        """expert_out [R, D] bf16 -> [T, D] bf16 for this rank's tokens (see the class docstring for who weights)."""
        if dispatched.handle[0] == DECODE:
            _, handle, topk_ids, topk_weights, shape = dispatched.handle
            out, _, _ = self.buffer.low_latency_combine(expert_out.view(shape), topk_ids, topk_weights, handle)
            return out
        out, _, _ = self.buffer.combine(expert_out, dispatched.handle[1])
        return out

    def close(self) -> None:
        """Release DeepEP's buffers (collective: every rank calls it at shutdown)."""
        self.buffer.destroy()


Backend: TypeAlias = LocalBackend | TorchAllToAll | DeepEPAllToAll
"""What `make_all_to_all` builds: a kimi.model.moe.AllToAllBackend with the `set_mode` step hook."""


def make_all_to_all(
    backend: str,
    *,
    num_experts: int,
    hidden: int,
    ep_rank: int,
    ep_size: int,
    group: dist.ProcessGroup | None = None,
    ll_max_tokens_per_rank: int = 128,
    static_capacities: Sequence[int] = (),
) -> Backend:
    """The backend object for `backend` (one of BACKENDS). `torch.distributed` must be initialised for all
    but `local`. static_capacities: gloo / nccl decode steps use the static layout at these capacities
    (TorchAllToAll; empty: variable splits only; ignored by `local`, which exchanges nothing). Raises ValueError for
    an unknown name, a local backend with ep_size > 1, or static capacities with deepep."""
    if backend == "local":
        if ep_size != 1:
            raise ValueError("the local all-to-all backend serves one rank")
        return LocalBackend()
    if backend in ("gloo", "nccl"):
        return TorchAllToAll(group, num_experts, ep_rank, ep_size, static_capacities)
    if backend == "deepep":
        if static_capacities:
            raise ValueError("the static all-to-all layout is for the gloo / nccl backends, not deepep")
        check_deepep_experts(num_experts, ep_size)
        if group is None:
            raise ValueError("the deepep all-to-all backend needs a process group (init_distributed)")
        return DeepEPAllToAll(group, num_experts, hidden, ep_rank, ep_size, ll_max_tokens_per_rank)
    raise ValueError(f"unknown all-to-all backend {backend!r}; choose one of {', '.join(BACKENDS)}")
