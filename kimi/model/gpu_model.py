"""The GPU path of KimiForCausalLM: the reference model (kimi/model/model.py) with GPU kernels put in.

- Weights on the GPU in the model dtype (bf16), built on the `meta` device first so the stacked bf16 expert
  parameters `w13` / `w2` are never allocated: each MoE layer's routed experts stay PACKED (INT4 compressed-tensors
  `weight_packed` / `weight_scale`, from `load_checkpoint(..., dequantize=False)`) and run through a
  kimi.backends.experts module (`auto` default, `humming`, `cuda`, `triton`, `ref`) set as `MoELayer.experts_impl`. FP8
  (K2-Instruct) tensors: the routed experts stay FP8 under the auto and humming backends
  (kimi.backends.experts.HummingFp8Experts) when I is a multiple of the scale tile; on CUDA the dense projections (q_a +
  kv_a, q_b, o_proj, the gate/up/down of the shared experts and layer 0; `fp8_dense_names`) stay FP8 as
  kimi.kernels.triton.linear_fp8.Fp8Linear layers with fp8_dense "triton" or "humming" (FP8_DENSE_CHOICES; default
  "off": dequantised); the rest is dequantised to the model dtype.
- Attention (`GPUMLAAttention`): the same projections as the reference, then the absorbed form for EVERY row,
  decode, prefill and chunked prefill alike: q_lat = q_nope @ W_UK (bf16), ONE FlashInfer paged MLA run per layer
  over the one [num_blocks, bs, 576] cache buffer with a causal plan (a sequence's query rows are the last
  query_len tokens of its context; kimi.backends.attention.flashinfer), o = o_lat @ W_UV^T (bf16). No per-sequence
  loop. Latent sizes FlashInfer has no kernel for (tiny 64-wide test models) use the float32 references instead
  (`mla_decode_ref` for decode rows, `mla_prefill_ref` per prefill sequence).
- `GPUKimiForCausalLM.forward`: pure-decode batches that fit a captured bucket replay a CUDA graph
  (kimi/worker/cuda_graph.py); anything else runs eagerly, with one FlashInfer plan per step for all layers (planned on
  the host, outside any graph).
- Fused Triton kernels (kimi/kernels/triton/fused.py) on CUDA: residual add + RMSNorm (across layers), merged q_a + kv_a
  GEMM (`w_qkv_a`, the two parameters are views of it), rope + latent norm + paged KV write in one kernel, merged
  gate/up weights (`w13` of each DenseMLP) + SiLU*up, the Triton router; the CPU path keeps the references.
- `--load-format dummy`: random weights of the real shapes generated on the GPU (kimi/model/weights.py).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kimi.backends.attention import AttentionPlan
from kimi.backends.attention.triton_mla import TritonMLADecodeRun, triton_mla_splits
from kimi.backends.linear import dense_linear, prologue_config_for
from kimi.errors import ProtocolError
from kimi.kernels.triton.bmm_small_m import bmm_heads
from kimi.kernels.triton.linear_fp8 import Fp8Linear
from kimi.kernels.triton.linear_small_m import linear_small_m
from kimi.model.attention import AttentionMetadata, MLAAttention, gather_kv_cache, mla_decode_ref, mla_prefill_ref
from kimi.model.model import KimiForCausalLM
from kimi.model.moe import DenseMLP, LocalAllToAll, MoELayer, run_experts
from kimi.model.norm import LATENT_NORM_EPS, rms_norm

if TYPE_CHECKING:
    from kimi.backends.attention.flashinfer import FlashInferMLA
    from kimi.worker.cuda_graph import CudaGraphRunner

try:  # Triton: the fused GPU kernels (absent on CPU-only installs, where the GPU model is never run)
    from kimi.kernels.triton import fused
except ImportError:  # pragma: no cover
    fused = None  # type: ignore[assignment]  # a module or None; every use is on CUDA, where it imported

log = logging.getLogger(__name__)


__all__ = ["GPUKimiForCausalLM", "GPUMLAAttention"]


class GPUMLAAttention(MLAAttention):
    """MLAAttention with FlashInfer's absorbed paged MLA for decode and (chunked) prefill rows (instances of
    MLAAttention get this class in build_gpu_model).

    Uses `attn.plan` (an AttentionPlan) when present, else the reference forward. Call `prepare()` once after
    the weights are loaded (W_UK [H, N, L] and W_UV^T [H, L, V] as contiguous bf16 copies of kv_b_proj).
    """

    w_qkv_a: torch.Tensor | Fp8Linear  # set by `prepare` when the two projections merge
    fuse_prologue = False  # q_a_layernorm fused into the q_b GEMM (kimi.backends.linear.prologue_config_for)

    def prepare(self) -> None:
        """Also merges q_a_proj and kv_a_proj_with_mqa into one [q_lora + L + R, D] weight `w_qkv_a` (the two
        parameters become views of it, no extra memory) so the GPU forward runs one GEMM for both; FP8 layers
        (Fp8Linear) merge into one Fp8Linear `w_qkv_a` and the two attributes become None."""
        if isinstance(self.q_a_proj, Fp8Linear):  # FP8 (load_gpu_model keeps both FP8 or neither): one FP8 layer
            # zero rows up to a whole scale tile (humming takes whole tiles only); forward slices the real columns
            self.w_qkv_a = Fp8Linear.cat([self.q_a_proj, self.kv_a_proj_with_mqa], pad_rows_to=self.q_a_proj.block[0])
            self.q_a_proj = self.kv_a_proj_with_mqa = None
        elif self.cfg.q_lora_rank is not None and self.q_a_proj.is_cuda:
            ql = self.cfg.q_lora_rank
            w = torch.cat([self.q_a_proj.detach(), self.kv_a_proj_with_mqa.detach()], 0)
            self.q_a_proj = nn.Parameter(w[:ql], requires_grad=False)
            self.kv_a_proj_with_mqa = nn.Parameter(w[ql:], requires_grad=False)
            self.w_qkv_a = w
        H, N, V, L = self.num_heads, self.nope, self.v_dim, self.kv_lora
        w = self.kv_b_proj.detach().view(H, N + V, L)  # [H, N + V, L]
        self.w_uk_t = w[:, :N, :].transpose(1, 2).contiguous()  # [H, L, N]: q_lat[h] = q_nope[h] @ w_uk_t[h]^T
        self.w_uv = w[:, N:, :].contiguous()  # [H, V, L]: o[h] = o_lat[h] @ w_uv[h]^T

    def _absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, fi) -> torch.Tensor:
        """Every row through FlashInfer: q_nope [T, H, N] (any row / head strides), q_pe [T, H, R] (model dtype,
        bf16) -> o [T, H * V] (bf16, contiguous: o_proj's input).

        q_lat = q_nope @ W_UK per head (kimi.kernels.triton.bmm_small_m.bmm_heads: bf16 in, fp32 accumulation), one
        `fi.run` over all planned rows (decode rows and the causal rows of prefill / chunked-prefill sequences alike;
        o_lat [T, H, L] bf16, float32 softmax inside the kernel), o = o_lat @ W_UV^T per head written straight into the
        [T, H * V] buffer. Rows past fi.num_rows (padding) get zeros. Raises ValueError when the plan has more
        rows than the batch."""
        T, H = q_nope.shape[:2]
        n = fi.num_rows
        if n > T:
            raise ValueError(f"FlashInfer plan has {n} rows, the batch {T}")
        q_lat = bmm_heads(q_nope, self.w_uk_t)  # [T, H, L] contiguous
        q_pe = q_pe if q_pe.is_contiguous() else q_pe.contiguous()  # [T, H, R]
        if n == T:
            o_lat = fi.run(q_lat, q_pe, kv_cache)  # [T, H, L]
        else:
            o_lat = torch.zeros_like(q_lat)  # [T, H, L]
            fi.run(q_lat[:n], q_pe[:n], kv_cache, out=o_lat[:n])
        V = self.w_uv.shape[1]
        o = torch.empty((T, H * V), dtype=o_lat.dtype, device=o_lat.device)  # [T, H * V]
        bmm_heads(o_lat, self.w_uv, out=o.view(T, H, V))
        return o

    def _decode_ref(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, attn, plan) -> torch.Tensor:
        """Torch fallback for decode rows (latent sizes FlashInfer has no kernel for, e.g. tiny models): q_nope
        [Bd, H, N], q_pe [Bd, H, R] of the sequences plan.decode_seqs -> o [Bd, H, V] float32 (`mla_decode_ref`)."""
        sel = plan.decode_seqs
        q_lat = torch.bmm(q_nope.transpose(0, 1).float(), self.w_uk_t.float().transpose(1, 2)).transpose(
            0, 1
        )  # [Bd, H, L]
        o_lat = mla_decode_ref(q_lat, q_pe, kv_cache, attn.block_tables[sel], attn.seq_lens[sel], self.scale)
        return torch.bmm(o_lat.transpose(0, 1), self.w_uv.float().transpose(1, 2)).transpose(0, 1)  # [Bd, H, V]

    def forward(self, hidden, positions, attn: AttentionMetadata, kv_cache, rope):
        plan = attn.plan
        if plan is None:
            return super().forward(hidden, positions, attn, kv_cache, rope)
        T = hidden.shape[0]
        H, N, R, V, L = self.num_heads, self.nope, self.rope, self.v_dim, self.kv_lora
        w_qkv_a = getattr(self, "w_qkv_a", None)
        if w_qkv_a is not None:  # merged q_a + kv_a projection (one GEMM), fused norms / rope / cache write
            ql = self.cfg.q_lora_rank
            assert ql is not None, "prepare merges q_a_proj only with a q_lora_rank"
            qkv_a = dense_linear(hidden, w_qkv_a)  # [T, q_lora + L + R]
            q_a = qkv_a[:, :ql]  # [T, q_lora]
            cfg = prologue_config_for(q_a, self.q_b_proj, fuse=self.fuse_prologue)
            if cfg is not None:  # q_a_layernorm fused into the q_b GEMM's x loads
                q = linear_small_m(q_a, self.q_b_proj, config=cfg, norm_weight=self.q_a_layernorm, eps=LATENT_NORM_EPS)
            else:
                q = dense_linear(fused.rms_norm(q_a, self.q_a_layernorm, LATENT_NORM_EPS), self.q_b_proj)
            kv_a = qkv_a[:, ql : ql + L + R]  # [T, L + R] (an FP8 merge has zero columns after them)
        elif self.cfg.q_lora_rank is not None:
            q_lat_in = rms_norm(F.linear(hidden, self.q_a_proj), self.q_a_layernorm, LATENT_NORM_EPS)  # [T, q_lora]
            q = F.linear(q_lat_in, self.q_b_proj)  # [T, H * (N + R)]
            kv_a = F.linear(hidden, self.kv_a_proj_with_mqa)  # [T, L + R]
        else:
            q = F.linear(hidden, self.q_proj)  # [T, H * (N + R)]
            kv_a = F.linear(hidden, self.kv_a_proj_with_mqa)  # [T, L + R]
        q = q.view(T, H, N + R)
        q_nope = q[..., :N]  # [T, H, N]
        if hidden.is_cuda:
            q_pe = fused.mla_rope_kv_write(
                q,
                kv_a,
                self.kv_a_layernorm,
                LATENT_NORM_EPS,
                rope.cos_cache,
                rope.sin_cache,
                positions,
                plan.slot_mapping,
                kv_cache,
                N,
            )  # [T, H, R]
        else:
            ckv = rms_norm(kv_a[:, :L], self.kv_a_layernorm, LATENT_NORM_EPS)  # [T, L]
            q_pe, k_pe = rope(positions, q[..., N:], kv_a[:, L:])  # [T, H, R], [T, R]
            flat = kv_cache.view(-1, L + R)  # [num_blocks * bs, L + R]
            flat.index_copy_(0, plan.slot_mapping, torch.cat([ckv, k_pe], dim=-1).to(kv_cache.dtype))
        if plan.run is not None:  # decode + prefill rows: one causal FlashInfer run
            return dense_linear(self._absorbed(q_nope, q_pe, kv_cache, plan.run), self.o_proj)  # [T, D]
        if plan.all_decode:
            o = self._decode_ref(q_nope, q_pe, kv_cache, attn, plan)  # [T, H, V] float32
        else:
            o = torch.zeros(T, H, V, dtype=torch.float32, device=hidden.device)  # [T, H, V]
            if plan.decode_rows is not None:
                r = plan.decode_rows
                o[r] = self._decode_ref(q_nope[r], q_pe[r], kv_cache, attn, plan)
            for s, e, b in plan.prefill:
                latent = gather_kv_cache(kv_cache, attn.block_tables[b], attn.seq_lens_cpu[b])  # [S, L + R]
                o[s:e] = mla_prefill_ref(q_nope[s:e], q_pe[s:e], latent, self.kv_b_proj, H, N, V, self.scale)
        return dense_linear(o.to(hidden.dtype).reshape(T, H * V), self.o_proj)  # [T, D]


class GPUKimiForCausalLM(KimiForCausalLM):
    """KimiForCausalLM whose forward plans FlashInfer per step and replays CUDA graphs for decode batches.

    Built by `build_gpu_model` (never directly). `graphs`: a kimi.worker.cuda_graph.CudaGraphRunner or None.
    """

    attention_class = GPUMLAAttention
    fi_eager: FlashInferMLA | None = None
    graphs: CudaGraphRunner | None = None
    # pure decode attention: "triton" (kimi.kernels.triton.mla_decode, no host plan) or "flashinfer"; prefill and mixed
    # batches always run FlashInfer
    decode_attention = "flashinfer"
    overlap_shared = (
        True  # in captured graphs, run the shared expert on a side stream, concurrently with the routed experts
    )
    # GEMM prologues: the q_a norm / SiLU * up fused into the following GEMM's loads (kimi.backends.linear.
    # prologue_config_for; off, the measured-faster choice). Set it with set_fuse_prologue (the attention layers too)
    fuse_prologue = False
    # plan FlashInfer's next decode step during a replay (kimi.worker.cuda_graph.CudaGraphRunner's plan_ahead); read
    # when the graphs are captured
    plan_ahead = True
    _side = None

    def set_fuse_prologue(self, flag: bool) -> None:
        """Turn the fused GEMM prologues on or off in this model's layers (benchmarks A/B them)."""
        self.fuse_prologue = bool(flag)
        for layer in self.layers:
            attn = layer.self_attn
            assert isinstance(attn, GPUMLAAttention), "build_gpu_model made every MLAAttention a GPUMLAAttention"
            attn.fuse_prologue = bool(flag)

    def _side_stream(self):
        """The side CUDA stream for the shared expert (created on first use; None off CUDA)."""
        if self._side is None and torch.cuda.is_available() and self.norm.is_cuda:
            self._side = torch.cuda.Stream(device=self.norm.device)
        return self._side

    @property
    def flashinfer_ok(self) -> bool:
        """FlashInfer's MLA kernels exist for a 512 latent + 64 rope (Kimi / DeepSeek-V3); tiny test models use
        the torch decode fallback and run without CUDA graphs."""
        return self.cfg.kv_lora_rank == 512 and self.cfg.qk_rope_head_dim == 64

    def plan_eager(self, attn: AttentionMetadata) -> AttentionPlan:
        """Attach a AttentionPlan for an unpadded batch (host work, once per step for all layers).

        Pure decode with decode_attention "triton" (flashinfer_ok shapes, CUDA tensors): the plan-free Triton kernel
        over attn's device lengths / tables. Else with FlashInfer (flashinfer_ok, CUDA tensors): ONE plan over every
        sequence, qo_len = query_len (decode rows are qo_len-1 requests), causal unless the batch is pure decode
        (where causal == non-causal). Otherwise the torch fallback's row / sequence indices."""
        qlens = attn.query_lens_cpu
        all_decode = all(q == 1 for q in qlens)
        dev = attn.slot_mapping.device
        if self.flashinfer_ok and attn.slot_mapping.is_cuda and all_decode and self.decode_attention == "triton":
            splits = triton_mla_splits(
                len(qlens), self.cfg.num_attention_heads, self.cfg.kv_lora_rank, dev, max_ctx=max(attn.seq_lens_cpu)
            )
            run = TritonMLADecodeRun(attn.seq_lens, attn.block_tables, self.cfg.softmax_scale, splits)
            plan = AttentionPlan(run, attn.slot_mapping, True)
        elif self.flashinfer_ok and attn.slot_mapping.is_cuda:
            from kimi.backends.attention.flashinfer import FlashInferMLA

            if self.fi_eager is None:
                self.fi_eager = FlashInferMLA(
                    self.cfg.num_attention_heads,
                    self.cfg.softmax_scale,
                    dev,
                    self.cfg.kv_lora_rank,
                    self.cfg.qk_rope_head_dim,
                    dtype=self.dtype,
                )
            self.fi_eager.plan_from_metadata(attn, causal=not all_decode)
            plan = AttentionPlan(self.fi_eager, attn.slot_mapping, all_decode)
        else:
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
        attn.plan = plan
        return plan

    def forward(self, input_ids, positions, attn: AttentionMetadata, kv_caches):
        if attn.plan is None:
            if self.graphs is not None and self.graphs.can_run(attn):
                return self.graphs.run(input_ids, positions, attn)
            self.plan_eager(attn)
        if not input_ids.is_cuda:
            return super().forward(input_ids, positions, attn, kv_caches)
        return self._forward_fused(input_ids, positions, attn, kv_caches)

    def forward_decode(
        self,
        input_ids: list[int],
        positions: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        kv_caches,
        fill=None,
    ) -> torch.Tensor:
        """One decode step from host lists (one new token per sequence: positions[b] = seq_lens[b] - 1) ->
        hidden [B, D] after the final norm. Replays a CUDA graph through `CudaGraphRunner.run_host` when one
        fits (no AttentionMetadata is built), else builds the metadata and runs `forward`.

        fill: None, or (rows [P] int64, values [M] int64, value rows [P] int64) on the device: input_ids[rows[i]]
        is replaced by values[value rows[i]] on the device before the forward reads it (tokens the previous step
        sampled that the host does not have yet: ModelRunner.launch)."""
        g = self.graphs
        if g is not None and g.can_run_host(seq_lens, block_size):
            return g.run_host(input_ids, positions, seq_lens, block_tables, fill=fill)
        from kimi.model.attention import build_attention_metadata

        dev = self.norm.device
        attn = build_attention_metadata([1] * len(input_ids), seq_lens, block_tables, block_size, dev)
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        if fill is not None:
            ids.index_copy_(0, fill[0], fill[1].index_select(0, fill[2]))
        return self(ids, torch.tensor(positions, dtype=torch.int64, device=dev), attn, kv_caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, D] -> logits [N, vocab] float32, the lm_head GEMM through
        kimi.kernels.triton.linear_small_m.linear."""
        w = self.lm_head if self.lm_head is not None else self.embed_tokens
        return dense_linear(hidden, w).float()  # [N, V]

    def _forward_fused(self, input_ids, positions, attn: AttentionMetadata, kv_caches):
        """KimiForCausalLM.forward with fused kernels (kimi/kernels/triton/fused.py): each residual add is fused with
        the
        RMSNorm that follows it (across layers: the MLP output of layer i is added in the kernel that computes
        layer i + 1's input norm, or the final norm), merged gate/up GEMMs, the Triton router."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} kv caches for {len(self.layers)} layers")
        h, x = self.embed_fused(input_ids)
        h, x = self.layers_fused(h, x, positions, attn, kv_caches, 0, len(self.layers))
        return x  # [T, D] after the final norm

    def embed_fused(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [T] -> (residual h [T, D], layer 0's input norm of it x [T, D]); the start of _forward_fused."""
        h = self.embed_tokens[input_ids]  # [T, D]
        x = fused.rms_norm(h, self.layers[0].input_layernorm, self.cfg.rms_norm_eps) if self.layers else h
        return h, x

    def layers_fused(
        self,
        h: torch.Tensor,
        x: torch.Tensor,
        positions,
        attn: AttentionMetadata,
        kv_caches,
        start: int,
        end: int,
        row_valid: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layers [start, end) of _forward_fused: (h, x) in -> (h, x) out, x being the next layer's input norm of h
        (the final norm after the last layer). The CUDA-graph runner captures the layers in segments with it.
        row_valid: None, or [T] int64 on the device; the MoE router gives rows where it is 0 no expert
        (kimi.kernels.triton.fused.router_topk), so padding rows of a decode graph cost no expert work."""
        eps = self.cfg.rms_norm_eps
        n = len(self.layers)
        # the side stream only inside CUDA-graph capture, where it is faster (docs/performance.md); eager steps
        # (prefill, mixed) keep the inline shared expert: with the side stream eager decode is slower and noisier
        # (70.8 -> 121-132 ms median at 8 seqs, cause not isolated)
        side = self._side_stream() if self.overlap_shared and torch.cuda.is_current_stream_capturing() else None
        for i in range(start, end):
            layer = self.layers[i]
            a = layer.self_attn(x, positions, attn, kv_caches[i], self.rope)  # [T, D]
            h, x = fused.add_rms_norm(h, a, None, layer.post_attention_layernorm, eps)
            d1, d2 = _mlp_fused(layer.mlp, x, side, row_valid, self.fuse_prologue)
            nxt = self.layers[i + 1].input_layernorm if i + 1 < n else self.norm
            h, x = fused.add_rms_norm(h, d1, d2, nxt, eps)
        return h, x

    def capture_cuda_graphs(
        self, kv_caches, block_size: int, max_batch: int, max_blocks_per_seq: int, layers_per_graph: int | None = None
    ) -> None:
        """Capture decode graphs for every bucket up to max_batch (kimi/worker/cuda_graph.py); layers_per_graph:
        layers per graph segment (default cuda_graph.LAYERS_PER_GRAPH; 0: one graph)."""
        from kimi.worker.cuda_graph import LAYERS_PER_GRAPH, CudaGraphRunner

        if not self.flashinfer_ok:
            log.warning(
                "CUDA graphs off: no FlashInfer MLA kernel for kv_lora_rank %d / rope %d",
                self.cfg.kv_lora_rank,
                self.cfg.qk_rope_head_dim,
            )
            return
        bad = [
            type(layer.mlp.experts_impl).__name__
            for layer in self.layers
            if isinstance(layer.mlp, MoELayer) and not getattr(layer.mlp.experts_impl, "graph_safe", False)
        ]
        if bad:
            log.warning("CUDA graphs off: MoE backend %s cannot be captured", bad[0])
            return
        t0 = time.monotonic()
        runner = CudaGraphRunner(
            self,
            kv_caches,
            block_size,
            max_batch,
            max_blocks_per_seq,
            layers_per_graph=LAYERS_PER_GRAPH if layers_per_graph is None else layers_per_graph,
            plan_ahead=self.plan_ahead,
        )
        runner.capture()
        self.graphs = runner
        log.info(
            "captured %d decode CUDA graphs (buckets %s) in %.1f s",
            len(runner.buckets),
            runner.buckets,
            time.monotonic() - t0,
        )


def _dense_mlp_fused(m: DenseMLP, x: torch.Tensor, fuse_prologue: bool = False) -> torch.Tensor:
    """DenseMLP.forward with the merged gate/up weight `w13` (set by _finish) and, with fuse_prologue, SiLU * up
    fused into the down GEMM where kimi.backends.linear.prologue_config_for allows (else the fused.silu_mul
    kernel)."""
    w13 = getattr(m, "w13", None)
    if w13 is None:
        return m(x)
    y13 = dense_linear(x, w13)  # [T, 2I]
    cfg = prologue_config_for(y13, m.down_proj, silu_mul=True, fuse=fuse_prologue)
    if cfg is not None:  # SiLU * up fused into the down GEMM's x loads
        return linear_small_m(y13, m.down_proj, config=cfg, silu_mul=True)
    return dense_linear(fused.silu_mul(y13), m.down_proj)


def _mlp_fused(
    mlp: MoELayer | DenseMLP,
    x: torch.Tensor,
    side=None,
    row_valid: torch.Tensor | None = None,
    fuse_prologue: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The MLP of a layer on the GPU -> (routed or dense output, shared-expert output or None); the caller
    adds both to the residual in one kernel. MoE: Triton router, then the same dispatch / experts / combine as
    MoELayer.forward.

    side: a torch.cuda.Stream or None. When given, the shared expert runs on it, forked after x is ready and joined
    before returning, so its three bandwidth-bound kernels overlap the router / all-to-all / routed expert GEMMs (also
    inside CUDA graph capture, where the fork / join become graph edges). Memory safety: x is produced on the main
    stream before the fork; the shared output is read on the main stream only after the join, and the side stream's next
    use of freed blocks comes after the next fork, i.e. after the main stream's reads were enqueued.

    row_valid: see GPUKimiForCausalLM.layers_fused (rows where it is 0 are routed to no expert; their routed output
    is 0). fuse_prologue: see _dense_mlp_fused."""
    if not isinstance(mlp, MoELayer):
        return _dense_mlp_fused(mlp, x, fuse_prologue), None
    a2a = mlp.a2a
    if a2a is None:
        if mlp.ep_size != 1:
            raise ProtocolError("MoELayer with ep_size > 1 needs an all-to-all backend")
        a2a = LocalAllToAll()
    if mlp.experts_impl is None:
        return mlp(x), None  # the reference MoE (no Triton router): padding rows stay routed
    shared = None
    if side is not None and mlp.shared_experts is not None:
        main = torch.cuda.current_stream(x.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            shared = _dense_mlp_fused(mlp.shared_experts, x, fuse_prologue)
    topk_weights, topk_ids = fused.router_topk(
        x, mlp.gate, mlp.e_score_correction_bias, mlp.top_k, mlp.routed_scaling_factor, mlp.norm_topk_prob, row_valid
    )
    recv = a2a.dispatch(x, topk_weights, topk_ids)
    y = run_experts(mlp.experts_impl, recv)  # [T_recv, D]
    out = a2a.combine(y, recv)  # [T, D]
    if shared is not None:
        main.wait_stream(side)
    elif mlp.shared_experts is not None:
        shared = _dense_mlp_fused(mlp.shared_experts, x, fuse_prologue)
    return out, shared
