"""Multi-head Latent Attention (MLA) over a paged latent KV cache: the layer, its metadata, and the plain PyTorch
reference math (the reference attention backend, kimi.backends.attention.reference).

Math: DeepSeek-V2/V3 papers (MLA) and docs/model-format.md, Math. Per token and layer the cache holds
`[rmsnorm(ckv) (kv_lora_rank) | roped k_pe (qk_rope_head_dim)]` (576 values for Kimi) at
`slot = block_tables[b, p // block_size] * block_size + p % block_size`.

- Decode rows (a sequence with query_len 1) use the ABSORBED form over the paged latents
  (`mla_decode_ref`): `q_lat[h] = q_nope[h] @ W_UK[h]`, score = `q_lat . ckv + q_pe . k_pe`, `o_lat = p @ ckv`,
  `o[h] = o_lat[h] @ W_UV[h]^T`. GPU kernels (FlashInfer MLA) are tested against `mla_decode_ref`.
- Prefill / chunked-prefill rows (query_len > 1) use the NAIVE form (`mla_prefill_ref`): the sequence's
  whole cached context is gathered, expanded with kv_b into k_nope / v, causal w.r.t. positions.
- Fresh prompt chunks (no cached context) in the non-absorbed ("MHA") form, the math of the GPU's MHA prefill path
  (kimi.backends.attention.flashinfer.set_prefill_attention("mha")): `mha_prefill_inputs` builds q / k
  ([T, H, N + R]) and v ([T, H, V]) from the step's own latents, `mha_prefill_ref` is the causal attention over
  them; `mla_prefill_absorbed_ref` is the same rows in the absorbed form (what FlashInfer's MLA kernel computes),
  equal up to rounding.

Both forms compute in float32 and can share one forward (mixed batches). A layer of a fused model (kimi/model/model.py)
runs its `planned_forward` (kimi.model.gpu_forward.mla_forward: the GPU kernels) instead whenever the step has a plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kimi.backends.attention.reference import reference_plan
from kimi.config import ModelConfig
from kimi.model.norm import LATENT_NORM_EPS, rms_norm
from kimi.model.rope import RotaryEmbedding

if TYPE_CHECKING:
    from kimi.backends.attention import AttentionPlan


@dataclass
class AttentionMetadata:
    """Where the rows of one flat batch live (docs/architecture.md, Interfaces).

    query_start_loc: [B+1] int64, rows of sequence b are [qsl[b], qsl[b+1]).
    seq_lens: [B] int64, context length after this step (cached + new).
    block_tables: [B, max_blocks] int64, padded with 0 (the null block).
    slot_mapping: [T] int64, `block_tables[b, p // block_size] * block_size + p % block_size`.
    The tokens of sequence b sit at positions `seq_len - query_len .. seq_len - 1`.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    block_size: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # the step's attention plan (kimi.backends.attention): set by KimiForCausalLM.plan_eager before the layers run,
    # or by the CUDA-graph runner for a captured bucket; None: not planned yet
    plan: AttentionPlan | None = None

    @property
    def num_seqs(self) -> int:
        """B, the number of sequences in the batch."""
        return len(self.query_lens_cpu)

    @property
    def num_tokens(self) -> int:
        """T, the number of (unpadded) rows in the batch."""
        return sum(self.query_lens_cpu)


def build_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Build AttentionMetadata from per-sequence python lists (docs/architecture.md, Interfaces).

    query_lens[b] new tokens of sequence b, seq_lens[b] its context length after this step, block_tables[b]
    its block ids (at least ceil(seq_len / block_size) of them). Raises ValueError on inconsistent input
    (length mismatch, query_len < 1 or > seq_len, too few blocks, block_size < 1).
    """
    n = len(query_lens)
    if len(seq_lens) != n or len(block_tables) != n:
        raise ValueError(
            f"query_lens ({n}), seq_lens ({len(seq_lens)}) and block_tables ({len(block_tables)}) differ in length"
        )
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    slots: list[int] = []
    for b, (q, s, bt) in enumerate(zip(query_lens, seq_lens, block_tables)):
        if q < 1 or q > s:
            raise ValueError(f"sequence {b}: query_len {q} must be in [1, seq_len={s}]")
        if len(bt) * block_size < s:
            raise ValueError(f"sequence {b}: {len(bt)} blocks of {block_size} cannot hold seq_len {s}")
        for p in range(s - q, s):
            slots.append(bt[p // block_size] * block_size + p % block_size)
    max_blocks = max((len(bt) for bt in block_tables), default=0)
    table = torch.zeros((n, max_blocks), dtype=torch.int64)  # [B, max_blocks], 0 = null block
    for b, bt in enumerate(block_tables):
        table[b, : len(bt)] = torch.tensor(bt, dtype=torch.int64)
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    return AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int64, device=device),  # [B+1]
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),  # [B]
        block_tables=table.to(device),  # [B, max_blocks]
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),  # [T]
        block_size=block_size,
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
    )


# ---- paged latent cache ---------------------------------------------------------------------------------


def write_kv_cache(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, ckv: torch.Tensor, k_pe: torch.Tensor) -> None:
    """Store `[ckv | k_pe]` of T tokens at their slots, in place.

    kv_cache: [num_blocks, block_size, L + R]; slot_mapping: [T] int64; ckv: [T, L] (already rms-normed);
    k_pe: [T, R] (already roped, interleaved). Values are cast to the cache dtype.
    """
    flat = kv_cache.view(-1, kv_cache.shape[-1])  # [num_blocks * block_size, L + R]
    latent = torch.cat([ckv, k_pe], dim=-1).to(kv_cache.dtype)  # [T, L + R]
    flat.index_copy_(0, slot_mapping, latent)


def gather_kv_cache(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Read the first seq_len tokens of one sequence: block_table [max_blocks] int64 -> [seq_len, L + R]."""
    bs = kv_cache.shape[1]
    nblocks = -(-seq_len // bs)
    blocks = kv_cache[block_table[:nblocks]]  # [nblocks, bs, L + R]
    return blocks.reshape(nblocks * bs, -1)[:seq_len]  # [seq_len, L + R]


# ---- attention cores ------------------------------------------------------------------------------------


def mla_decode_ref(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Absorbed MLA decode: MQA of H query heads over the 576-wide latent cache (docs/model-format.md, Math).

    q_lat: [B, H, L] (= q_nope @ W_UK per head); q_pe: [B, H, R] (roped); kv_cache: [num_blocks, bs, L + R];
    block_tables: [B, max_blocks] int64; seq_lens: [B] int64 (>= 1); scale: cfg.softmax_scale (still
    qk_head_dim-based). score[b, h, s] = (q_lat . ckv_s + q_pe . k_pe_s) * scale over s < seq_lens[b];
    returns o_lat [B, H, L] = softmax(score) @ ckv, float32 (multiply by W_UV^T per head to get o).
    """
    B, _H, L = q_lat.shape
    bs = kv_cache.shape[1]
    max_blocks = block_tables.shape[1]
    kv = kv_cache[block_tables].reshape(B, max_blocks * bs, -1).float()  # [B, S, L + R]
    ckv, k_pe = kv[..., :L], kv[..., L:]  # [B, S, L], [B, S, R]
    scores = torch.einsum("bhl,bsl->bhs", q_lat.float(), ckv)  # [B, H, S]
    scores = scores + torch.einsum("bhr,bsr->bhs", q_pe.float(), k_pe)  # [B, H, S]
    valid = torch.arange(max_blocks * bs, device=kv.device)[None, :] < seq_lens[:, None]  # [B, S]
    scores = (scores * scale).masked_fill(~valid[:, None, :], float("-inf"))  # [B, H, S]
    p = torch.softmax(scores, dim=-1)  # [B, H, S]
    return torch.einsum("bhs,bsl->bhl", p, ckv)  # [B, H, L]


def mla_prefill_ref(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    kv_b_weight: torch.Tensor,
    num_heads: int,
    qk_nope_head_dim: int,
    v_head_dim: int,
    scale: float,
) -> torch.Tensor:
    """Naive MLA over one sequence's whole context, causal (DeepSeek-V3 reference, docs/model-format.md, Math).

    q_nope: [Q, H, N]; q_pe: [Q, H, R] (roped) for the LAST Q tokens of the context; latent: [S, L + R]
    (`[rmsnorm(ckv) | roped k_pe]` of all S >= Q context tokens, as gathered from the cache); kv_b_weight:
    [H * (N + V), L]. Query i sits at position S - Q + i and sees keys 0..S - Q + i.
    Returns o: [Q, H, V] float32 (before o_proj).
    """
    Q, S = q_nope.shape[0], latent.shape[0]
    L = kv_b_weight.shape[1]
    lat = latent.float()
    ckv, k_pe = lat[:, :L], lat[:, L:]  # [S, L], [S, R]
    kv = F.linear(ckv, kv_b_weight.float()).view(S, num_heads, qk_nope_head_dim + v_head_dim)  # [S, H, N + V]
    k_nope, v = kv[..., :qk_nope_head_dim], kv[..., qk_nope_head_dim:]  # [S, H, N], [S, H, V]
    scores = torch.einsum("qhn,shn->hqs", q_nope.float(), k_nope)  # [H, Q, S]
    scores = scores + torch.einsum("qhr,sr->hqs", q_pe.float(), k_pe)  # [H, Q, S]
    q_pos = torch.arange(S - Q, S, device=lat.device)  # [Q]
    causal = torch.arange(S, device=lat.device)[None, :] <= q_pos[:, None]  # [Q, S]
    scores = (scores * scale).masked_fill(~causal[None], float("-inf"))  # [H, Q, S]
    p = torch.softmax(scores, dim=-1)  # [H, Q, S]
    return torch.einsum("hqs,shv->qhv", p, v)  # [Q, H, V]


def mha_prefill_inputs(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    kv_b_weight: torch.Tensor,
    num_heads: int,
    qk_nope_head_dim: int,
    v_head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The non-absorbed ("MHA") q, k, v of T rows whose keys are the rows themselves (fresh prompt chunks: no cached
    context), in the dtype of the inputs (float32 on the CPU reference, bf16 on the GPU path).

    q_nope: [T, H, N] (any row / head strides); q_pe: [T, H, R] (roped); latent: [T, L + R] (`[rmsnorm(ckv) | roped
    k_pe]` of the same T tokens, e.g. read back from the cache at their slots); kv_b_weight: [H * (N + V), L].
    Returns q [T, H, N + R] = [q_nope | q_pe] (contiguous), k [T, H, N + R] = [k_nope | k_pe] with k_nope = the W_UK
    half of `ckv @ kv_b^T` and k_pe broadcast over the heads (contiguous), v [T, H, V] = its W_UV half (a view, row
    stride H * (N + V), head stride N + V). Math: DeepSeek-V3 MLA, naive form (docs/model-format.md, Math).
    """
    T = latent.shape[0]
    H, N, V = num_heads, qk_nope_head_dim, v_head_dim
    L = kv_b_weight.shape[1]
    R = latent.shape[1] - L
    kv = F.linear(latent[:, :L], kv_b_weight).view(T, H, N + V)  # [T, H, N + V]
    q = torch.cat([q_nope, q_pe], dim=-1)  # [T, H, N + R]
    k = torch.empty((T, H, N + R), dtype=kv.dtype, device=kv.device)  # [T, H, N + R]
    k[..., :N] = kv[..., :N]
    k[..., N:] = latent[:, None, L:]  # k_pe, shared by all heads
    return q, k, kv[..., N:]


def mha_prefill_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int], scale: float
) -> torch.Tensor:
    """Causal multi-head attention of fresh sequences (non-absorbed MLA prefill; the math of FlashInfer's ragged
    prefill with qo_indptr = kv_indptr = cu_seqlens), float32.

    q: [T, H, Dqk], k: [T, H, Dqk], v: [T, H, Dv]; cu_seqlens: [B + 1] host ints, sequence b is rows
    [cu_seqlens[b], cu_seqlens[b + 1]) of q, k and v alike (its queries are its keys); row i of a sequence sees its
    rows 0..i. scale: the softmax scale (cfg.softmax_scale). Returns o [T, H, Dv] float32; rows past cu_seqlens[-1]
    are zero. Raises ValueError when cu_seqlens is not non-decreasing from 0 or exceeds T.
    """
    T = q.shape[0]
    if not cu_seqlens or cu_seqlens[0] != 0 or cu_seqlens[-1] > T or any(a > b for a, b in pairwise(cu_seqlens)):
        raise ValueError(f"cu_seqlens {cu_seqlens} must rise from 0 to at most {T}")
    o = torch.zeros((T, q.shape[1], v.shape[2]), dtype=torch.float32, device=q.device)  # [T, H, Dv]
    for s, e in pairwise(cu_seqlens):
        if e == s:
            continue
        scores = torch.einsum("qhd,shd->hqs", q[s:e].float(), k[s:e].float()) * scale  # [H, Q, Q]
        causal = torch.ones((e - s, e - s), dtype=torch.bool, device=q.device).tril()  # [Q, Q]
        p = torch.softmax(scores.masked_fill(~causal[None], float("-inf")), dim=-1)  # [H, Q, Q]
        o[s:e] = torch.einsum("hqs,shv->qhv", p, v[s:e].float())  # [Q, H, Dv]
    return o


def mla_prefill_absorbed_ref(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    kv_b_weight: torch.Tensor,
    cu_seqlens: list[int],
    num_heads: int,
    qk_nope_head_dim: int,
    v_head_dim: int,
    scale: float,
) -> torch.Tensor:
    """Causal prefill of fresh sequences in the ABSORBED form (the math FlashInfer's paged MLA kernel runs for them),
    float32: q_lat[h] = q_nope[h] @ W_UK[h], score = (q_lat . ckv + q_pe . k_pe) * scale, o_lat = p @ ckv,
    o[h] = o_lat[h] @ W_UV[h]^T.

    Shapes as mha_prefill_inputs (q_nope [T, H, N], q_pe [T, H, R], latent [T, L + R] of the same rows, kv_b_weight
    [H * (N + V), L]) and cu_seqlens as mha_prefill_ref. Returns o [T, H, V] float32, equal to mha_prefill_ref of
    mha_prefill_inputs up to float rounding (the absorption is an identity).
    """
    H, N, V = num_heads, qk_nope_head_dim, v_head_dim
    L = kv_b_weight.shape[1]
    w = kv_b_weight.float().view(H, N + V, L)  # [H, N + V, L]
    w_uk, w_uv = w[:, :N, :], w[:, N:, :]  # [H, N, L], [H, V, L]
    lat = latent.float()
    ckv, k_pe = lat[:, :L], lat[:, L:]  # [T, L], [T, R]
    q_lat = torch.einsum("thn,hnl->thl", q_nope.float(), w_uk)  # [T, H, L]
    o_lat = torch.zeros_like(q_lat)  # [T, H, L]
    for s, e in pairwise(cu_seqlens):
        if e == s:
            continue
        scores = torch.einsum("qhl,sl->hqs", q_lat[s:e], ckv[s:e])  # [H, Q, Q]
        scores = (scores + torch.einsum("qhr,sr->hqs", q_pe[s:e].float(), k_pe[s:e])) * scale
        causal = torch.ones((e - s, e - s), dtype=torch.bool, device=lat.device).tril()  # [Q, Q]
        p = torch.softmax(scores.masked_fill(~causal[None], float("-inf")), dim=-1)  # [H, Q, Q]
        o_lat[s:e] = torch.einsum("hqs,sl->qhl", p, ckv[s:e])  # [Q, H, L]
    return torch.einsum("thl,hvl->thv", o_lat, w_uv)  # [T, H, V]


# ---- the layer ------------------------------------------------------------------------------------------


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class MLAAttention(nn.Module):
    """One DeepSeek-V3 MLA layer (inference only). Parameter names follow the checkpoint's `self_attn.*`.

    Weights (out, in): q_a_proj [q_lora, D], q_a_layernorm [q_lora], q_b_proj [H * (N + R), q_lora]
    (or q_proj [H * (N + R), D] when q_lora_rank is None), kv_a_proj_with_mqa [L + R, D], kv_a_layernorm [L],
    kv_b_proj [H * (N + V), L], o_proj [D, H * V]. Kimi: D 7168, H 64, N 128, R 64, V 128, L 512, q_lora 1536.

    planned_forward: None (the reference forward), or the forward of a fused model (kimi.model.gpu_forward.mla_forward,
    called as planned_forward(layer, hidden, positions, attn, kv_cache, rope) when attn.plan is set; set by
    KimiForCausalLM(fused=True)). fuse_prologue: that forward fuses the q_a norm into the q_b GEMM where it can.
    """

    planned_forward: Callable[..., torch.Tensor] | None = None
    fuse_prologue = False
    # set by kimi.model.gpu_forward.prepare_attention (fused models): W_UK^T [H, L, N], W_UV [H, V, L]
    w_uk_t: torch.Tensor
    w_uv: torch.Tensor

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__()
        self.cfg = cfg
        D, H = cfg.hidden_size, cfg.num_attention_heads
        N, R, V, L = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        self.num_heads, self.nope, self.rope, self.v_dim, self.kv_lora = H, N, R, V, L
        self.scale = cfg.softmax_scale
        if cfg.q_lora_rank is not None:
            self.q_a_proj = _param((cfg.q_lora_rank, D), dtype, device)
            self.q_a_layernorm = _param((cfg.q_lora_rank,), dtype, device)
            self.q_b_proj = _param((H * (N + R), cfg.q_lora_rank), dtype, device)
        else:
            self.q_proj = _param((H * (N + R), D), dtype, device)
        self.kv_a_proj_with_mqa = _param((L + R, D), dtype, device)
        self.kv_a_layernorm = _param((L,), dtype, device)
        self.kv_b_proj = _param((H * (N + V), L), dtype, device)
        self.o_proj = _param((D, H * V), dtype, device)

    def weight_names(self) -> list[str]:
        """Checkpoint-relative names (`q_a_proj.weight`, ...) of this layer's tensors."""
        return [f"{n}.weight" for n, _ in self.named_parameters(recurse=False)]

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,
        rope: RotaryEmbedding,
    ) -> torch.Tensor:
        """hidden [T, D] (already input-layernormed), positions [T] int64 -> [T, D] (after o_proj).

        Writes the T tokens' `[rmsnorm(ckv) | roped k_pe]` into kv_cache [num_blocks, bs, L + R] at
        attn.slot_mapping, then attends: query_len-1 sequences with the absorbed form, the rest naive.
        Rows past attn.num_tokens (padding) get zero attention output. With a planned_forward and attn.plan set,
        that forward runs instead (see the class docstring).
        """
        if self.planned_forward is not None and attn.plan is not None:
            return self.planned_forward(self, hidden, positions, attn, kv_cache, rope)
        return self.forward_reference(hidden, positions, attn, kv_cache, rope)

    def forward_reference(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,
        rope: RotaryEmbedding,
    ) -> torch.Tensor:
        """The reference forward (see `forward`), float32 attention over the reference plan's indices (attn.plan
        when it is a reference plan, else kimi.backends.attention.reference.reference_plan(attn))."""
        T = hidden.shape[0]
        H, N, R, V, L = self.num_heads, self.nope, self.rope, self.v_dim, self.kv_lora
        if self.cfg.q_lora_rank is not None:
            q_lat_in = rms_norm(F.linear(hidden, self.q_a_proj), self.q_a_layernorm, LATENT_NORM_EPS)  # [T, q_lora]
            q = F.linear(q_lat_in, self.q_b_proj)  # [T, H * (N + R)]
        else:
            q = F.linear(hidden, self.q_proj)  # [T, H * (N + R)]
        q = q.view(T, H, N + R)
        q_nope, q_pe = q[..., :N], q[..., N:]  # [T, H, N], [T, H, R]
        kv_a = F.linear(hidden, self.kv_a_proj_with_mqa)  # [T, L + R]
        ckv = rms_norm(kv_a[:, :L], self.kv_a_layernorm, LATENT_NORM_EPS)  # [T, L]
        q_pe, k_pe = rope(positions, q_pe, kv_a[:, L:])  # [T, H, R], [T, R]

        n_real = attn.num_tokens
        write_kv_cache(kv_cache, attn.slot_mapping, ckv[:n_real], k_pe[:n_real])

        o = torch.zeros(T, H, V, dtype=torch.float32, device=hidden.device)  # [T, H, V]
        own = attn.plan is not None and attn.plan.run is None and attn.plan.prefill_run is None
        plan = attn.plan if own and attn.plan is not None else reference_plan(attn)
        sel = plan.decode_seqs  # [Bd] decode sequences
        if sel is not None:
            w_kv_b = self.kv_b_proj.float().view(H, N + V, L)  # [H, N + V, L]
            w_uk, w_uv = w_kv_b[:, :N, :], w_kv_b[:, N:, :]  # [H, N, L], [H, V, L]
            rows = plan.decode_rows if plan.decode_rows is not None else sel  # [Bd] their rows (all decode: b)
            q_lat = torch.einsum("bhn,hnl->bhl", q_nope[rows].float(), w_uk)  # [Bd, H, L]
            o_lat = mla_decode_ref(
                q_lat, q_pe[rows], kv_cache, attn.block_tables[sel], attn.seq_lens[sel], self.scale
            )  # [Bd, H, L]
            o[rows] = torch.einsum("bhl,hvl->bhv", o_lat, w_uv)  # [Bd, H, V]
        for s, e, b in plan.prefill:
            latent = gather_kv_cache(kv_cache, attn.block_tables[b], attn.seq_lens_cpu[b])  # [S, L + R]
            o[s:e] = mla_prefill_ref(q_nope[s:e], q_pe[s:e], latent, self.kv_b_proj, H, N, V, self.scale)  # [Q, H, V]
        return F.linear(o.to(hidden.dtype).reshape(T, H * V), self.o_proj)  # [T, D]
