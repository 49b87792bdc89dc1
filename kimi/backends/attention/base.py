"""The types of the attention backend interface (re-exported by kimi.backends.attention, whose docstring is the
contract): AttentionRun, PrefillRun, AttentionPlan, DecodeGraphAttention, AttentionBackend."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from kimi.model.attention import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionPlan", "AttentionRun", "DecodeGraphAttention", "PrefillRun"]


class AttentionRun(Protocol):
    """A planned MLA attention run over the flat batch (`AttentionPlan.run`; the forward of the contract above)."""

    num_rows: int

    def run(
        self, q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor: ...


class PrefillRun(Protocol):
    """A planned causal ragged attention over fresh sequences in the non-absorbed form (`AttentionPlan.prefill_run`):
    `run(q [Tp, H, Dqk], k [Tp, H, Dqk], v [Tp, H, Dv], out=None) -> o [Tp, H, Dv]`, the keys of a sequence being its
    own rows (kimi.model.attention.mha_prefill_ref's math); num_rows = Tp."""

    num_rows: int

    def run(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor: ...


@dataclass
class AttentionPlan:
    """The step's attention plan, shared by all layers (`AttentionMetadata.plan`; made by an AttentionBackend).

    run: a planned AttentionRun (FlashInferMLA eagerly, FlashInferMLADecode in CUDA graphs, TritonMLADecodeRun
    for pure decode with the Triton kernel) covering EVERY
    row of the batch in its flat order (decode rows and the causal rows of prefill / chunked-prefill sequences:
    one run per layer), or None: the torch reference (reference.reference_plan), which uses the index fields
    below. slot_mapping: [T] int64 cache slots of every row (padded rows -> slots of the null
    block 0); all_decode: every row is a decode row of its own sequence, in order.
    Reference only: decode_rows: [Bd] int64 rows of decode sequences (mixed batches; None when all_decode, where
    row b is sequence b); decode_seqs: [Bd] int64 their sequence indices; prefill: (first row, last row + 1,
    sequence index) of each query_len > 1 sequence.
    Non-absorbed prefill (FlashInfer with prefill attention "mha"): prefill_run: a planned PrefillRun over the rows of
    the fresh sequences (no cached context), or None; then `run` covers only the other rows (None when there are
    none). prefill_rows: [Tp] int64 the fresh sequences' rows in flat order, None when they are rows [0, Tp);
    run_rows: [Tr] int64 the rows `run` covers (set whenever prefill_run and run both are).
    """

    run: AttentionRun | None
    slot_mapping: torch.Tensor
    all_decode: bool
    decode_rows: torch.Tensor | None = None
    prefill: list[tuple[int, int, int]] = field(default_factory=list)
    decode_seqs: torch.Tensor | None = None  # [Bd] sequence indices of decode rows (reference, run None)
    prefill_run: PrefillRun | None = None
    prefill_rows: torch.Tensor | None = None  # [Tp] rows of the fresh sequences (None: rows [0, Tp))
    run_rows: torch.Tensor | None = None  # [Tr] rows of `run` when prefill_run is set


class DecodeGraphAttention(Protocol):
    """The capture / replay hooks of one CudaGraphRunner's attention (AttentionBackend.graph_attention).

    runs: bucket size -> the AttentionRun its graphs captured (FlashInfer's expose `ahead_hits` / `ahead_misses`).
    plans_ahead: `plan_ahead` can plan a bucket's next step while its replay runs.
    Every hook takes the batch's B real rows; rows [B, bs) of bucket bs are padding (length 1 over the null block 0).
    """

    plans_ahead: bool

    @property
    def runs(self) -> Mapping[int, AttentionRun]:
        """Bucket size -> its captured run."""
        ...

    def plan_capture(self, bs: int, seq_lens_cpu: list[int], block_tables: torch.Tensor) -> AttentionRun:
        """Plan bucket bs eagerly (outside any graph) for seq_lens_cpu [B <= bs] and block_tables [B, W] (device)."""
        ...

    def stage(self, bs: int, seq_lens: list[int], block_tables: list[list[int]]) -> None:
        """Before the replay, ahead of the runner's staging event: send what the run reads that the runner's
        static input does not carry (pinned non-blocking copies on the current stream)."""
        ...

    def plan_replay(self, bs: int, seq_lens: list[int], page_stride: int) -> None:
        """Before the replay, after the runner's input copy: host planning for these lengths (page ids at
        b * page_stride of the runner's kv_indices when graph_page_rows)."""
        ...

    def plan_ahead(self, bs: int, seq_lens: list[int], page_stride: int) -> None:
        """After the replay was launched: plan the bucket's next step for these lengths (each real row's length + 1;
        errors are the caller's to log). Only called when plans_ahead."""
        ...


class AttentionBackend(Protocol):
    """An MLA attention backend (the contract in the module docstring).

    graph_page_rows: its decode graphs read page ids from the CUDA-graph runner's static kv_indices buffer.
    """

    name: str
    graph_page_rows: bool

    def plan(self, attn: AttentionMetadata) -> AttentionPlan:
        """The step's plan for attn (host work; raises ValueError on a batch the backend cannot run)."""
        ...

    def graph_attention(
        self, buckets: list[int], block_size: int, max_blocks_per_seq: int, kv_indices: torch.Tensor | None
    ) -> DecodeGraphAttention:
        """The capture / replay hooks for decode graphs of these buckets (kv_indices: the runner's int32 page-id
        buffer when graph_page_rows, else None). Raises ValueError when the backend cannot be captured."""
        ...
