"""MLA attention backends for the GPU path: an interface, a registry of the decode choice, and the step's plan.

Contract (`AttentionBackend`), every backend: built once per model (eager) or per CUDA-graph bucket, then
- plan (host work, once per step for all layers, outside any graph): from the step's AttentionMetadata
  (`FlashInferMLA.plan_from_metadata(attn, causal)`), or, in a decode graph, from the bucket's host lists before each
  replay (`FlashInferMLADecode.plan` / `plan_decode_schedule` / `plan_ahead`); a plan-free backend
  (`TritonMLADecodeRun`) reads the lengths and block tables from device tensors instead;
- forward (`run(q_lat [T, H, L], q_pe [T, H, R], kv_cache [num_blocks, bs, L + R], out=None) -> o_lat [T, H, L]`,
  bf16, float32 softmax inside): ONE call per layer over every planned row of the flat batch -- decode rows and
  the causal rows of prefill / chunked-prefill sequences alike (bottom-right aligned: a sequence's query rows are
  the last query_len tokens of its context); `num_rows` rows, the batch's first ones;
- capture / replay: a backend a CUDA graph captures reads only static device buffers during `run` (the graph
  runner's, kimi/worker/cuda_graph.py), and its host planning writes into those buffers before each replay.
The torch reference (`AttentionPlan.run` None: kimi.model.attention's float32 math) runs latent sizes no kernel has.

Registry: DECODE_BACKENDS, what pure decode batches run ("flashinfer", the default, or "triton"); prefill and
mixed batches always run FlashInfer. Modules: flashinfer (FlashInferMLA, FlashInferMLADecode), triton_mla
(TritonMLADecodeRun over kimi.kernels.triton.mla_decode).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

__all__ = ["DECODE_BACKENDS", "AttentionBackend", "AttentionPlan"]

DECODE_BACKENDS = ("flashinfer", "triton")


class AttentionBackend(Protocol):
    """A planned MLA attention run over the flat batch (the contract in the module docstring)."""

    num_rows: int

    def run(
        self, q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor: ...


@dataclass
class AttentionPlan:
    """The step's attention plan, shared by all layers (`AttentionMetadata.plan`; set by the GPU model).

    run: a planned AttentionBackend (FlashInferMLA eagerly, FlashInferMLADecode in CUDA graphs, TritonMLADecodeRun
    for pure decode with the Triton kernel) covering EVERY
    row of the batch in its flat order (decode rows and the causal rows of prefill / chunked-prefill sequences:
    one run per layer), or None: the torch fallback (no FlashInfer kernel for the latent size), which uses the
    fallback fields below. slot_mapping: [T] int64 cache slots of every row (padded rows -> slots of the null
    block 0); all_decode: every row is a decode row of its own sequence, in order.
    Fallback only: decode_rows: [Bd] int64 rows of decode sequences (mixed batches); decode_seqs: [Bd] int64 their
    sequence indices; prefill: (first row, last row + 1, sequence index) of each query_len > 1 sequence.
    """

    run: AttentionBackend | None
    slot_mapping: torch.Tensor
    all_decode: bool
    decode_rows: torch.Tensor | None = None
    prefill: list[tuple[int, int, int]] = field(default_factory=list)
    decode_seqs: torch.Tensor | None = None  # [Bd] sequence indices of decode rows (torch fallback, run None)
