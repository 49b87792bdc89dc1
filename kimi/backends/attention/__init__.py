"""MLA attention backends: the interface, the registry, and the step's plan.

Contract (`AttentionBackend`), every backend: built once per model (`make_attention_backend`, on first use), then
- plan (host work, once per step for all layers, outside any graph): `plan(attn)` from the step's AttentionMetadata
  returns the step's AttentionPlan (the model stores it as `AttentionMetadata.plan`);
- forward (decode / prefill / mixed): the plan's `run` (an `AttentionRun`: `run(q_lat [T, H, L], q_pe [T, H, R],
  kv_cache [num_blocks, bs, L + R], out=None) -> o_lat [T, H, L]`, bf16, float32 softmax inside) is ONE call per
  layer over every planned row of the flat batch -- decode rows and the causal rows of prefill / chunked-prefill
  sequences alike (bottom-right aligned: a sequence's query rows are the last query_len tokens of its context);
  `num_rows` rows, the batch's first ones. A plan whose `run` is None is the torch reference's
  (kimi.model.attention's float32 math over the plan's row / sequence indices);
- capture / replay (`graph_attention(...) -> DecodeGraphAttention`, the hooks kimi/worker/cuda_graph.py calls): per
  bucket one run whose `run` reads only static device buffers during capture and replay; `plan_capture` plans a
  bucket eagerly (capture, or a replay by hand); `stage` and `plan_replay` make a bucket's next replay read a new
  step's lengths / tables (pinned non-blocking copies or host planning, no device sync beyond waits on the backend's
  own staging buffers); `plan_ahead` may plan the bucket's following step while the replay runs. A backend whose
  `graph_page_rows` is True reads the page ids from the runner's static kv_indices buffer, which the runner fills
  (row b's pages at b * page_stride, `CudaGraphRunner._stage_pages`).

Registry (`ATTENTION_BACKENDS`, `make_attention_backend`): "reference" (reference.ReferenceAttention: CPU, and latent
sizes no kernel has), "flashinfer" (flashinfer.FlashInferAttention: every batch on CUDA, the default), "triton"
(triton_mla.TritonMLAAttention: pure decode batches only, over kimi.kernels.triton.mla_decode). DECODE_BACKENDS: what
pure decode batches may run (the model's `decode_attention`); prefill and mixed batches always run FlashInfer.

Prefill attention (flashinfer.PREFILL_ATTENTION, set with flashinfer.set_prefill_attention): "mla" (the default) runs
every prefill row in the absorbed form above; "mha" runs the rows of fresh sequences (no cached context: a prompt's
first chunk) as a non-absorbed causal ragged prefill (`AttentionPlan.prefill_run`, q / k of 192 and v of 128 from the
step's own latents up-projected with kv_b) and the other rows through `run` as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kimi.backends.attention.base import (
    AttentionBackend,
    AttentionPlan,
    AttentionRun,
    DecodeGraphAttention,
    PrefillRun,
)

if TYPE_CHECKING:
    from kimi.config import ModelConfig

__all__ = [
    "ATTENTION_BACKENDS",
    "DECODE_BACKENDS",
    "AttentionBackend",
    "AttentionPlan",
    "AttentionRun",
    "DecodeGraphAttention",
    "PrefillRun",
    "make_attention_backend",
]

ATTENTION_BACKENDS = ("reference", "flashinfer", "triton")
DECODE_BACKENDS = ("flashinfer", "triton")


def make_attention_backend(
    name: str, cfg: ModelConfig, device: torch.device, dtype: torch.dtype = torch.bfloat16
) -> AttentionBackend:
    """The backend `name` (ATTENTION_BACKENDS) for a model of cfg on device (dtype: q / kv / o of the kernels).
    Raises ValueError on an unknown name; the GPU backends import their kernel libraries here."""
    if name == "reference":
        from kimi.backends.attention.reference import ReferenceAttention

        return ReferenceAttention()
    if name == "flashinfer":
        from kimi.backends.attention.flashinfer import FlashInferAttention

        return FlashInferAttention(cfg, device, dtype)
    if name == "triton":
        from kimi.backends.attention.triton_mla import TritonMLAAttention

        return TritonMLAAttention(cfg, device)
    raise ValueError(f"unknown attention backend {name!r} ({', '.join(ATTENTION_BACKENDS)})")
