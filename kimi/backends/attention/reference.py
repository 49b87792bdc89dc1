"""The reference attention backend: the torch float32 MLA of kimi.model.attention (absorbed form for decode rows,
naive form per prefill sequence). Runs on any device and latent size; the CPU path, and the GPU path for latent sizes
FlashInfer has no kernel for. Its plan carries row / sequence indices only (`AttentionPlan.run` None); it has no
decode graphs."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kimi.backends.attention.base import AttentionPlan, DecodeGraphAttention

if TYPE_CHECKING:
    from kimi.model.attention import AttentionMetadata

__all__ = ["ReferenceAttention", "reference_plan"]


def reference_plan(attn: AttentionMetadata) -> AttentionPlan:
    """The reference plan of attn: decode_seqs [Bd] int64 (the query_len-1 sequences), decode_rows [Bd] int64 their
    rows (mixed batches only), prefill (first row, last row + 1, sequence) of the others; tensors on attn's device."""
    qlens = attn.query_lens_cpu
    all_decode = all(q == 1 for q in qlens)
    dev = attn.slot_mapping.device
    decode = [b for b, q in enumerate(qlens) if q == 1]
    qsl = [0]
    for q in qlens:
        qsl.append(qsl[-1] + q)
    plan = AttentionPlan(None, attn.slot_mapping, all_decode)
    if decode:
        plan.decode_seqs = torch.tensor(decode, dtype=torch.int64, device=dev)
    if not all_decode:
        if decode:
            plan.decode_rows = torch.tensor([qsl[b] for b in decode], dtype=torch.int64, device=dev)
        plan.prefill = [(qsl[b], qsl[b + 1], b) for b, q in enumerate(qlens) if q != 1]
    return plan


class ReferenceAttention:
    """The AttentionBackend of the torch reference (see the module docstring)."""

    name = "reference"
    graph_page_rows = False

    def plan(self, attn: AttentionMetadata) -> AttentionPlan:
        """reference_plan(attn)."""
        return reference_plan(attn)

    def graph_attention(
        self, buckets: list[int], block_size: int, max_blocks_per_seq: int, kv_indices: torch.Tensor | None
    ) -> DecodeGraphAttention:
        """Always raises ValueError: the reference's host-side indexing cannot be captured in a CUDA graph."""
        raise ValueError("the reference attention has no CUDA-graph decode path")
