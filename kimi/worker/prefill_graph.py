"""CUDA graphs for prefill and mixed steps on one rank (docs/design.md, Forward on the GPU).

An eager prefill step of Kimi-K2 is bound by the host's kernel launches (about 1,500 per step at 61 layers: a
128-token step takes 85 ms eagerly and 27 ms as a graph on an H200, docs/performance.md). So a step that is not pure
decode replays the graph of the smallest token bucket (`prefill_buckets`: powers of two from 64 up to the token
budget, and the budget) holding its rows:

- rows [0, T) are the step's, in its flat order; rows [T, bucket) are padding: token 0 at position 0, cache slot 0 of
  the null block 0, `row_valid` 0, so the MoE router gives them no expert (as the decode graphs' padding rows);
- attention: one causal FlashInfer plan per step (host work before the replay, as an eager step plans), made by
  `FlashInferMLA.plan_padded` into the bucket's fixed-shape wrapper: the step's sequences, one padding request
  holding the padding rows over the null block, and empty requests up to max_seqs + 1; every plan of a bucket then
  has the same schedule shape, so the graph captured with one plan replays them all;
- with `fresh_mha` (off by default, FRESH_MHA_GRAPHS), a step of fresh sequences only (no cached context, no decode
  rows: a quiet server's prompts) replays instead its bucket's "fresh" graph (from MHA_MIN_BUCKET rows): attention
  in the non-absorbed form, FlashInfer's causal ragged prefill over the rows' up-projected latents
  (`FlashInferMHAPrefill.plan_padded`: the sequences, one padding sequence, empty ones up to max_seqs + 1), a third
  of the latent-space kernel's FLOPs (head dims 192 / 128 against 576 / 512); the two forms agree within bf16
  rounding;
- the graph holds the forward from the embedding to the final norm; the logits and sampling run eagerly after it on
  the rows in use (the worker's `sample`), as after a decode graph.

Only one rank: the all-to-all of many ranks has step-dependent splits in prefill (lockstep steps plan eagerly before
they reach the model, kimi/worker/runner.py). The graphs share the decode graphs' memory pool; at most one graph runs
at a time and each step's outputs are read (on the stream) before the next replay.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING

import torch

from kimi.backends.attention import flashinfer
from kimi.backends.attention.base import AttentionPlan
from kimi.model.attention import AttentionMetadata
from kimi.worker.cuda_graph import run_before_capture

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

    from kimi.backends.attention.flashinfer import FlashInferMHAPrefill, FlashInferMLA

__all__ = ["PrefillGraphRunner", "prefill_buckets"]

log = logging.getLogger(__name__)

SMALLEST_BUCKET = 64
# The fresh-step (MHA) graphs: captured from MHA_MIN_BUCKET rows on (the size measured: a lone 1024-token prompt on an
# emulated EP8 rank, 70.0 against 74.3 ms with the MLA graph, docs/performance.md "Prefill of one rank"; smaller
# buckets' fresh steps replay the MLA graph). Off by default (FRESH_MHA_GRAPHS) until tests/gpu/test_prefill_graph.py,
# which compares their replays with the eager forward, has passed on a GPU.
MHA_MIN_BUCKET = 1024
FRESH_MHA_GRAPHS = False


def prefill_buckets(max_tokens: int) -> list[int]:
    """Token buckets of the prefill graphs: 64, 128, 256, ... below max_tokens, then max_tokens. Raises ValueError when
    max_tokens < 1."""
    if max_tokens < 1:
        raise ValueError(f"prefill_buckets: max_tokens must be >= 1, got {max_tokens}")
    out, b = [], SMALLEST_BUCKET
    while b < max_tokens:
        out.append(b)
        b *= 2
    return [*out, max_tokens]


class PrefillGraphRunner:
    """Captures and replays the prefill / mixed-step graphs of a fused KimiForCausalLM (module docstring).

    model: the fused model on CUDA with FlashInfer's MLA (`flashinfer_ok`); kv_caches: the per-layer cache buffers the
    graphs bind to; block_size: tokens per block; max_tokens: the largest bucket (the token budget); max_seqs: the
    most sequences a step may hold (the server's max_num_seqs); max_blocks_per_seq: the widest block table a step
    may have; buckets: these token buckets instead of prefill_buckets(max_tokens); pool: a CUDA graph memory pool to
    share (the decode graphs'); fresh_mha: also capture the fresh-step graphs of the buckets >= mha_min_bucket (when
    the model's head dims have FlashInfer's ragged kernel, flashinfer.MHA_HEAD_DIMS).
    """

    def __init__(
        self,
        model,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_tokens: int,
        max_seqs: int,
        max_blocks_per_seq: int,
        buckets: list[int] | None = None,
        pool: _POOL_HANDLE | None = None,
        fresh_mha: bool = FRESH_MHA_GRAPHS,
        mha_min_bucket: int = MHA_MIN_BUCKET,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_seqs = max_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.buckets = sorted(buckets) if buckets else prefill_buckets(max_tokens)
        self.max_tokens = self.buckets[-1]
        self.device = model.embed_tokens.device
        cfg = model.cfg
        n = self.max_tokens
        self.static = torch.zeros((4, n), dtype=torch.int64, device=self.device)
        self.input_ids, self.positions, self.slot_mapping, self.row_valid = self.static  # [max_tokens] each
        # per bucket a CUDA-graph wrapper of max_seqs + 1 requests (the step's, a padding one, empty ones); every
        # sequence may hold max_blocks_per_seq pages, the padding request those of its rows
        self.fi: dict[int, FlashInferMLA] = {
            b: flashinfer.FlashInferMLA.for_model(
                cfg,
                self.device,
                use_cuda_graph=True,
                max_batch=max_seqs + 1,
                max_pages=max_seqs * max_blocks_per_seq + -(-b // block_size),
            )
            for b in self.buckets
        }
        heads_ok = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim) == flashinfer.MHA_HEAD_DIMS
        # the fresh-step wrappers share their bucket's MLA workspace (the two graphs of a bucket never run at once)
        self.fi_mha: dict[int, FlashInferMHAPrefill] = {
            b: flashinfer.FlashInferMHAPrefill(
                cfg.num_attention_heads,
                cfg.softmax_scale,
                self.fi[b].workspace,
                cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
                cfg.v_head_dim,
                dtype=model.embed_tokens.dtype,
                use_cuda_graph=True,
                max_batch=max_seqs + 1,
            )
            for b in self.buckets
            if fresh_mha and heads_ok and b >= mha_min_bucket
        }
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.graphs_mha: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs_mha: dict[int, torch.Tensor] = {}
        self.pool = pool
        self.num_replays = 0
        self.num_replays_mha = 0  # of those, fresh-step graphs

    def bucket_for(self, tokens: int) -> int | None:
        """The smallest bucket holding `tokens` rows, or None."""
        return next((b for b in self.buckets if b >= tokens), None)

    def can_run(self, attn: AttentionMetadata) -> bool:
        """A step of at most max_seqs sequences and max_tokens rows, with narrow enough tables and this block size."""
        return (
            0 < attn.num_seqs <= self.max_seqs
            and sum(attn.query_lens_cpu) <= self.max_tokens
            and attn.block_tables.shape[1] <= self.max_blocks_per_seq
            and attn.block_size == self.block_size
            and flashinfer.PREFILL_ATTENTION == "mla"  # the non-absorbed split of fresh prompts is not captured
        )

    def _meta(self, bucket: int, mha: bool = False) -> AttentionMetadata:
        """The metadata the graph of `bucket` is captured with: every row the bucket's, the plan its wrapper's (mha:
        the fresh-step wrapper's)."""
        dev = self.device
        attn = AttentionMetadata(
            query_start_loc=torch.tensor([0, bucket], dtype=torch.int64, device=dev),
            seq_lens=torch.tensor([bucket], dtype=torch.int64, device=dev),
            block_tables=torch.zeros((1, 1), dtype=torch.int64, device=dev),
            slot_mapping=self.slot_mapping[:bucket],
            block_size=self.block_size,
            query_lens_cpu=[bucket],
            seq_lens_cpu=[bucket],
        )
        if mha:
            attn.plan = AttentionPlan(None, self.slot_mapping[:bucket], False, prefill_run=self.fi_mha[bucket])
        else:
            attn.plan = AttentionPlan(self.fi[bucket], self.slot_mapping[:bucket], False)
        return attn

    def _forward(self, bs: int, attn: AttentionMetadata) -> torch.Tensor:
        """The forward of bucket bs over the static inputs (what its graph holds) -> hidden [bs, D]."""
        n = len(self.model.layers)
        h, x = self.model.embed_fused(self.input_ids[:bs])
        _, x = self.model.layers_fused(
            h, x, self.positions[:bs], attn, self.kv_caches, 0, n, row_valid=self.row_valid[:bs]
        )
        return x

    def capture(self) -> None:
        """Capture every bucket, largest first, into one memory pool (two eager runs of each first: JIT, autotune).
        The capture plan: all rows in the padding request."""
        t0 = time.monotonic()
        self.static.zero_()
        empty = torch.zeros((0, 1), dtype=torch.int64, device=self.device)
        for bs in sorted(self.buckets, reverse=True):
            self.fi[bs].plan_padded([], [], empty, self.block_size, bs)
            self.graphs[bs], self.outputs[bs] = self._capture(bs, self._meta(bs))
            if bs in self.fi_mha:
                self.fi_mha[bs].plan_padded([], bs)
                self.graphs_mha[bs], self.outputs_mha[bs] = self._capture(bs, self._meta(bs, mha=True))
        torch.cuda.synchronize(self.device)
        log.info(
            "captured %d prefill CUDA graphs (token buckets %s, up to %d sequences; fresh-step graphs of %s) in %.1f s",
            len(self.graphs) + len(self.graphs_mha),
            self.buckets,
            self.max_seqs,
            sorted(self.graphs_mha) or "none",
            time.monotonic() - t0,
        )

    def _capture(self, bs: int, attn: AttentionMetadata) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """One graph of bucket bs with attn's plan, in the pool -> (graph, its output [bs, D])."""
        run_before_capture(functools.partial(self._forward, bs, attn), self.device)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            x = self._forward(bs, attn)  # [bs, D]
        if self.pool is None:
            self.pool = g.pool()
        return g, x

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        """Replay the step (input_ids / positions [T] int64 on the device, attn without a plan; `can_run` true) ->
        hidden [T, D] after the final norm (a view of the bucket's output buffer, valid until the next replay)."""
        T = input_ids.shape[0]
        bs = self.bucket_for(T)
        assert bs is not None, "can_run bounds the rows"
        self.input_ids[:T].copy_(input_ids)
        self.positions[:T].copy_(positions)
        self.slot_mapping[:T].copy_(attn.slot_mapping)
        self.row_valid[:T].fill_(1)
        if bs > T:
            self.static[:, T:bs].zero_()
        qlens, slens = list(attn.query_lens_cpu), list(attn.seq_lens_cpu)
        self.num_replays += 1
        if bs in self.fi_mha and qlens == slens:  # fresh sequences only
            self.fi_mha[bs].plan_padded(qlens, bs)
            self.graphs_mha[bs].replay()
            self.num_replays_mha += 1
            return self.outputs_mha[bs][:T]
        self.fi[bs].plan_padded(qlens, slens, attn.block_tables, self.block_size, bs)
        self.graphs[bs].replay()
        return self.outputs[bs][:T]
