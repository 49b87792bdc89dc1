"""The fused GPU forward of KimiForCausalLM (a model built with `fused=True`, by kimi/model/weights.py): the
functions the one model class and its MLAAttention layers call on CUDA, with GPU kernels put in.

- Weights on the GPU in the model dtype (bf16), built on the `meta` device first so the stacked bf16 expert
  parameters `w13` / `w2` are never allocated: each MoE layer's routed experts stay PACKED (INT4 compressed-tensors
  `weight_packed` / `weight_scale`, from `load_checkpoint(..., dequantize=False)`) and run through a
  kimi.backends.experts module (`auto` default, `humming`, `cuda`, `triton`, `ref`) set as `MoELayer.experts_impl`. FP8
  (K2-Instruct) tensors: the routed experts stay FP8 under the auto and humming backends
  (kimi.backends.experts.HummingFp8Experts) when I is a multiple of the scale tile; on CUDA the dense projections (q_a +
  kv_a, q_b, o_proj, the gate/up/down of the shared experts and layer 0; `fp8_dense_names`) stay FP8 as
  kimi.kernels.triton.linear_fp8.Fp8Linear layers with fp8_dense "triton" or "humming" (FP8_DENSE_CHOICES; default
  "off": dequantised); the rest is dequantised to the model dtype.
- Attention (`mla_forward`, a fused MLAAttention's `planned_forward`): the same projections as the reference, then the
  absorbed form for EVERY row, decode, prefill and chunked prefill alike: q_lat = q_nope @ W_UK (bf16), ONE FlashInfer
  paged MLA run per layer over the one [num_blocks, bs, 576] cache buffer with a causal plan (a sequence's query rows
  are the last query_len tokens of its context; kimi.backends.attention.flashinfer), o = o_lat @ W_UV^T (bf16). No
  per-sequence loop. With prefill attention "mha" (kimi.backends.attention.flashinfer.set_prefill_attention) the rows
  of fresh sequences (no cached context) run non-absorbed instead: their latents (read back from the cache) up-projected
  with kv_b_proj to k_nope / v, q = [q_nope | q_pe] and k = [k_nope | k_pe] of 192, v of 128, one FlashInfer causal
  ragged prefill (`_mha_prefill`); the other rows keep the absorbed run and each row's output goes back to its row.
  Latent sizes FlashInfer has no kernel for (tiny 64-wide test models) use the float32 references instead
  (`mla_decode_ref` for decode rows, `mla_prefill_ref` per prefill sequence).
- `KimiForCausalLM.forward`: pure-decode batches that fit a captured bucket replay a CUDA graph
  (kimi/worker/cuda_graph.py); anything else runs eagerly (`forward_fused`), with one attention plan per step for all
  layers (the model's attention backend, kimi.backends.attention; planned on the host, outside any graph).
- Fused Triton kernels (kimi/kernels/triton/fused.py) on CUDA: residual add + RMSNorm (across layers), merged q_a + kv_a
  GEMM (`w_qkv_a`, the two parameters are views of it), rope + latent norm + paged KV write in one kernel, merged
  gate/up weights (`w13` of each DenseMLP) + SiLU*up, the Triton router; the CPU path keeps the references.
- `--load-format dummy`: random weights of the real shapes generated on the GPU (kimi/model/weights.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kimi.backends.linear import dense_linear, prologue_config_for
from kimi.errors import ProtocolError
from kimi.kernels.triton.bmm_small_m import bmm_heads
from kimi.kernels.triton.linear_fp8 import Fp8Linear
from kimi.kernels.triton.linear_small_m import linear_small_m
from kimi.model.attention import (
    AttentionMetadata,
    MLAAttention,
    gather_kv_cache,
    mha_prefill_inputs,
    mla_decode_ref,
    mla_prefill_ref,
)
from kimi.model.moe import DenseMLP, LocalAllToAll, MoELayer, run_experts
from kimi.model.norm import LATENT_NORM_EPS, rms_norm
from kimi.model.rope import RotaryEmbedding

if TYPE_CHECKING:
    from kimi.backends.attention import AttentionPlan, AttentionRun, PrefillRun
    from kimi.model.model import KimiForCausalLM

try:  # Triton: the fused GPU kernels (absent on CPU-only installs, where the fused path is never run)
    from kimi.kernels.triton import fused
except ImportError:  # pragma: no cover
    fused = None  # type: ignore[assignment]  # a module or None; every use is on CUDA, where it imported

log = logging.getLogger(__name__)


__all__ = [
    "compute_logits",
    "embed_fused",
    "forward_fused",
    "layers_fused",
    "mla_forward",
    "prepare_attention",
]


# ---- attention ------------------------------------------------------------------------------------------


def prepare_attention(layer: MLAAttention) -> None:
    """Once after the weights are loaded: W_UK [H, L, N] (`w_uk_t`) and W_UV [H, V, L] (`w_uv`) as contiguous copies of
    kv_b_proj, and q_a_proj and kv_a_proj_with_mqa merged into one [q_lora + L + R, D] weight `w_qkv_a` (the two
    parameters become views of it, no extra memory) so the GPU forward runs one GEMM for both (CUDA only); FP8 layers
    (Fp8Linear) merge into one Fp8Linear `w_qkv_a` and the two attributes become None."""
    if isinstance(layer.q_a_proj, Fp8Linear):  # FP8 (load_gpu_model keeps both FP8 or neither): one FP8 layer
        # zero rows up to a whole scale tile (humming takes whole tiles only); forward slices the real columns
        layer.w_qkv_a = Fp8Linear.cat([layer.q_a_proj, layer.kv_a_proj_with_mqa], pad_rows_to=layer.q_a_proj.block[0])
        layer.q_a_proj = layer.kv_a_proj_with_mqa = None
    elif layer.cfg.q_lora_rank is not None and layer.q_a_proj.is_cuda:
        ql = layer.cfg.q_lora_rank
        w = torch.cat([layer.q_a_proj.detach(), layer.kv_a_proj_with_mqa.detach()], 0)
        layer.q_a_proj = nn.Parameter(w[:ql], requires_grad=False)
        layer.kv_a_proj_with_mqa = nn.Parameter(w[ql:], requires_grad=False)
        layer.w_qkv_a = w
    H, N, V, L = layer.num_heads, layer.nope, layer.v_dim, layer.kv_lora
    w = layer.kv_b_proj.detach().view(H, N + V, L)  # [H, N + V, L]
    layer.w_uk_t = w[:, :N, :].transpose(1, 2).contiguous()  # [H, L, N]: q_lat[h] = q_nope[h] @ w_uk_t[h]^T
    layer.w_uv = w[:, N:, :].contiguous()  # [H, V, L]: o[h] = o_lat[h] @ w_uv[h]^T


def _absorbed(
    layer: MLAAttention, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, fi: AttentionRun
) -> torch.Tensor:
    """Every row through the planned run: q_nope [T, H, N] (any row / head strides), q_pe [T, H, R] (model dtype,
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
    q_lat = bmm_heads(q_nope, layer.w_uk_t)  # [T, H, L] contiguous
    q_pe = q_pe if q_pe.is_contiguous() else q_pe.contiguous()  # [T, H, R]
    if n == T:
        o_lat = fi.run(q_lat, q_pe, kv_cache)  # [T, H, L]
    else:
        o_lat = torch.zeros_like(q_lat)  # [T, H, L]
        fi.run(q_lat[:n], q_pe[:n], kv_cache, out=o_lat[:n])
    V = layer.w_uv.shape[1]
    o = torch.empty((T, H * V), dtype=o_lat.dtype, device=o_lat.device)  # [T, H * V]
    bmm_heads(o_lat, layer.w_uv, out=o.view(T, H, V))
    return o


def _mha_prefill(
    layer: MLAAttention,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    run: PrefillRun,
) -> torch.Tensor:
    """The rows of fresh sequences in the non-absorbed form: q_nope [Tp, H, N] (any strides), q_pe [Tp, H, R] (roped),
    slots [Tp] int64 their cache slots (already written this step) -> o [Tp, H * V] (model dtype, contiguous).

    The rows' latents are read back from the cache (so both forms see the same bf16 `[rmsnorm(ckv) | roped k_pe]`),
    up-projected with kv_b_proj in one GEMM (mha_prefill_inputs: k = [k_nope | k_pe], v = the W_UV half, a view) and
    run through the planned causal ragged prefill (FlashInferMHAPrefill), written straight into the o_proj input."""
    H, N, V, L, R = layer.num_heads, layer.nope, layer.v_dim, layer.kv_lora, layer.rope
    latent = kv_cache.view(-1, L + R).index_select(0, slots)  # [Tp, L + R]
    q, k, v = mha_prefill_inputs(q_nope, q_pe, latent, layer.kv_b_proj, H, N, V)
    Tp = q.shape[0]
    o = torch.empty((Tp, H * V), dtype=q.dtype, device=q.device)  # [Tp, H * V]
    run.run(q, k, v, out=o.view(Tp, H, V))
    return o


def _split(
    layer: MLAAttention, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, plan: AttentionPlan
) -> torch.Tensor:
    """A plan with a prefill_run (prefill attention "mha"): the fresh sequences' rows through `_mha_prefill`, the
    others (plan.run_rows) through `_absorbed`, each row's output put back at its row. q_nope [T, H, N], q_pe
    [T, H, R] -> o [T, H * V] (model dtype); rows neither run covers (padding) are zero."""
    pr = plan.prefill_run
    assert pr is not None, "_split runs plans with a prefill_run"
    T, H = q_nope.shape[:2]
    HV = H * layer.v_dim
    rows = plan.prefill_rows
    if rows is None:  # every sequence fresh: rows [0, Tp)
        n = pr.num_rows
        if n > T:
            raise ValueError(f"MHA prefill plan has {n} rows, the batch {T}")
        o_p = _mha_prefill(layer, q_nope[:n], q_pe[:n], kv_cache, plan.slot_mapping[:n], pr)  # [n, H * V]
        if n == T:
            return o_p
        o = torch.zeros((T, HV), dtype=o_p.dtype, device=o_p.device)  # [T, H * V]
        o[:n] = o_p
        return o
    o = torch.zeros((T, HV), dtype=q_nope.dtype, device=q_nope.device)  # [T, H * V]
    o[rows] = _mha_prefill(layer, q_nope[rows], q_pe[rows], kv_cache, plan.slot_mapping[rows], pr)
    if plan.run is not None:
        r = plan.run_rows
        assert r is not None, "a split plan with a run names its rows"
        o[r] = _absorbed(layer, q_nope[r], q_pe[r], kv_cache, plan.run)
    return o


def _decode_ref(
    layer: MLAAttention,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    attn: AttentionMetadata,
    plan: AttentionPlan,
) -> torch.Tensor:
    """Torch fallback for decode rows (latent sizes FlashInfer has no kernel for, e.g. tiny models): q_nope
    [Bd, H, N], q_pe [Bd, H, R] of the sequences plan.decode_seqs -> o [Bd, H, V] float32 (`mla_decode_ref`)."""
    sel = plan.decode_seqs
    q_lat = torch.bmm(q_nope.transpose(0, 1).float(), layer.w_uk_t.float().transpose(1, 2)).transpose(
        0, 1
    )  # [Bd, H, L]
    o_lat = mla_decode_ref(q_lat, q_pe, kv_cache, attn.block_tables[sel], attn.seq_lens[sel], layer.scale)
    return torch.bmm(o_lat.transpose(0, 1), layer.w_uv.float().transpose(1, 2)).transpose(0, 1)  # [Bd, H, V]


def _projections(layer: MLAAttention, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [T, D] -> (q [T, H * (N + R)], kv_a [T, L + R] before its norm / rope): one merged q_a + kv_a GEMM
    (`w_qkv_a`) with the q_a norm fused where it can be, else the reference's three GEMMs."""
    L, R = layer.kv_lora, layer.rope
    w_qkv_a = getattr(layer, "w_qkv_a", None)
    if w_qkv_a is not None:  # merged q_a + kv_a projection (one GEMM), fused norms / rope / cache write
        ql = layer.cfg.q_lora_rank
        assert ql is not None, "prepare_attention merges q_a_proj only with a q_lora_rank"
        qkv_a = dense_linear(hidden, w_qkv_a)  # [T, q_lora + L + R]
        q_a = qkv_a[:, :ql]  # [T, q_lora]
        cfg = prologue_config_for(q_a, layer.q_b_proj, fuse=layer.fuse_prologue)
        if cfg is not None:  # q_a_layernorm fused into the q_b GEMM's x loads
            q = linear_small_m(q_a, layer.q_b_proj, config=cfg, norm_weight=layer.q_a_layernorm, eps=LATENT_NORM_EPS)
        else:
            q = dense_linear(fused.rms_norm(q_a, layer.q_a_layernorm, LATENT_NORM_EPS), layer.q_b_proj)
        kv_a = qkv_a[:, ql : ql + L + R]  # [T, L + R] (an FP8 merge has zero columns after them)
    elif layer.cfg.q_lora_rank is not None:
        q_lat_in = rms_norm(F.linear(hidden, layer.q_a_proj), layer.q_a_layernorm, LATENT_NORM_EPS)  # [T, q_lora]
        q = F.linear(q_lat_in, layer.q_b_proj)  # [T, H * (N + R)]
        kv_a = F.linear(hidden, layer.kv_a_proj_with_mqa)  # [T, L + R]
    else:
        q = F.linear(hidden, layer.q_proj)  # [T, H * (N + R)]
        kv_a = F.linear(hidden, layer.kv_a_proj_with_mqa)  # [T, L + R]
    return q, kv_a


def mla_forward(
    layer: MLAAttention,
    hidden: torch.Tensor,
    positions: torch.Tensor,
    attn: AttentionMetadata,
    kv_cache: torch.Tensor,
    rope: RotaryEmbedding,
) -> torch.Tensor:
    """MLAAttention.forward of a fused model with the step's plan (attn.plan set): hidden [T, D] (input-layernormed),
    positions [T] int64 -> [T, D] after o_proj. Writes the T rows' latents at plan.slot_mapping (fused rope + norm +
    cache write on CUDA); then plan.run over every row (`_absorbed`), or, with a plan.prefill_run (prefill attention
    "mha"), the fresh sequences' rows non-absorbed and the rest through plan.run (`_split`), or the float32 references
    over the plan's indices when both are None."""
    plan = attn.plan
    assert plan is not None, "MLAAttention.forward calls the planned forward only with a plan"
    T = hidden.shape[0]
    H, N, R, V, L = layer.num_heads, layer.nope, layer.rope, layer.v_dim, layer.kv_lora
    q, kv_a = _projections(layer, hidden)
    q = q.view(T, H, N + R)
    q_nope = q[..., :N]  # [T, H, N]
    if hidden.is_cuda:
        q_pe = fused.mla_rope_kv_write(
            q,
            kv_a,
            layer.kv_a_layernorm,
            LATENT_NORM_EPS,
            rope.cos_cache,
            rope.sin_cache,
            positions,
            plan.slot_mapping,
            kv_cache,
            N,
        )  # [T, H, R]
    else:
        ckv = rms_norm(kv_a[:, :L], layer.kv_a_layernorm, LATENT_NORM_EPS)  # [T, L]
        q_pe, k_pe = rope(positions, q[..., N:], kv_a[:, L:])  # [T, H, R], [T, R]
        flat = kv_cache.view(-1, L + R)  # [num_blocks * bs, L + R]
        flat.index_copy_(0, plan.slot_mapping, torch.cat([ckv, k_pe], dim=-1).to(kv_cache.dtype))
    if plan.prefill_run is not None:  # fresh sequences non-absorbed, the other rows absorbed
        return dense_linear(_split(layer, q_nope, q_pe, kv_cache, plan), layer.o_proj)  # [T, D]
    if plan.run is not None:  # decode + prefill rows: one causal run
        return dense_linear(_absorbed(layer, q_nope, q_pe, kv_cache, plan.run), layer.o_proj)  # [T, D]
    if plan.all_decode:
        o = _decode_ref(layer, q_nope, q_pe, kv_cache, attn, plan)  # [T, H, V] float32
    else:
        o = torch.zeros(T, H, V, dtype=torch.float32, device=hidden.device)  # [T, H, V]
        if plan.decode_rows is not None:
            r = plan.decode_rows
            o[r] = _decode_ref(layer, q_nope[r], q_pe[r], kv_cache, attn, plan)
        for s, e, b in plan.prefill:
            latent = gather_kv_cache(kv_cache, attn.block_tables[b], attn.seq_lens_cpu[b])  # [S, L + R]
            o[s:e] = mla_prefill_ref(q_nope[s:e], q_pe[s:e], latent, layer.kv_b_proj, H, N, V, layer.scale)
    return dense_linear(o.to(hidden.dtype).reshape(T, H * V), layer.o_proj)  # [T, D]


# ---- the model ------------------------------------------------------------------------------------------


def compute_logits(model: KimiForCausalLM, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [N, D] -> logits [N, vocab] float32, the lm_head GEMM through kimi.backends.linear.dense_linear."""
    w = model.lm_head if model.lm_head is not None else model.embed_tokens
    return dense_linear(hidden, w).float()  # [N, V]


def _side_stream(model: KimiForCausalLM) -> torch.cuda.Stream | None:
    """The side CUDA stream for the shared expert (created on first use, kept as model._side; None off CUDA)."""
    if model._side is None and torch.cuda.is_available() and model.norm.is_cuda:
        model._side = torch.cuda.Stream(device=model.norm.device)
    return model._side


def forward_fused(
    model: KimiForCausalLM,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    attn: AttentionMetadata,
    kv_caches: list[torch.Tensor],
) -> torch.Tensor:
    """KimiForCausalLM.forward with fused kernels (kimi/kernels/triton/fused.py; attn.plan set): each residual add is
    fused with the RMSNorm that follows it (across layers: the MLP output of layer i is added in the kernel that
    computes layer i + 1's input norm, or the final norm), merged gate/up GEMMs, the Triton router. -> [T, D]."""
    if len(kv_caches) != len(model.layers):
        raise ValueError(f"got {len(kv_caches)} kv caches for {len(model.layers)} layers")
    h, x = embed_fused(model, input_ids)
    h, x = layers_fused(model, h, x, positions, attn, kv_caches, 0, len(model.layers))
    return x  # [T, D] after the final norm


def embed_fused(model: KimiForCausalLM, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [T] -> (residual h [T, D], layer 0's input norm of it x [T, D]); the start of forward_fused."""
    h = model.embed_tokens[input_ids]  # [T, D]
    x = fused.rms_norm(h, model.layers[0].input_layernorm, model.cfg.rms_norm_eps) if model.layers else h
    return h, x


def layers_fused(
    model: KimiForCausalLM,
    h: torch.Tensor,
    x: torch.Tensor,
    positions: torch.Tensor,
    attn: AttentionMetadata,
    kv_caches: list[torch.Tensor],
    start: int,
    end: int,
    row_valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layers [start, end) of forward_fused: (h, x) in -> (h, x) out, x being the next layer's input norm of h
    (the final norm after the last layer). The CUDA-graph runner captures the layers in segments with it.
    row_valid: None, or [T] int64 on the device; the MoE router gives rows where it is 0 no expert
    (kimi.kernels.triton.fused.router_topk), so padding rows of a decode graph cost no expert work."""
    eps = model.cfg.rms_norm_eps
    n = len(model.layers)
    # the side stream only inside CUDA-graph capture, where it is faster (docs/performance.md); eager steps
    # (prefill, mixed) keep the inline shared expert: with the side stream eager decode is slower and noisier
    # (70.8 -> 121-132 ms median at 8 seqs, cause not isolated)
    side = _side_stream(model) if model.overlap_shared and torch.cuda.is_current_stream_capturing() else None
    for i in range(start, end):
        layer = model.layers[i]
        a = layer.self_attn(x, positions, attn, kv_caches[i], model.rope)  # [T, D]
        h, x = fused.add_rms_norm(h, a, None, layer.post_attention_layernorm, eps)
        d1, d2 = _mlp_fused(layer.mlp, x, side, row_valid, model.fuse_prologue)
        nxt = model.layers[i + 1].input_layernorm if i + 1 < n else model.norm
        h, x = fused.add_rms_norm(h, d1, d2, nxt, eps)
    return h, x


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

    row_valid: see layers_fused (rows where it is 0 are routed to no expert; their routed output
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
