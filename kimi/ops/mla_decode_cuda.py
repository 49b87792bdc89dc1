"""kimi's CUDA MLA decode (csrc/mla_decode.cu): absorbed-MLA decode over the paged latent cache, no host planning.

What: for each request b (one query row of H = 64 heads) over its seq_lens[b] cached tokens,

    score[b, h, s] = (q_lat[b, h] . ckv_s + q_pe[b, h] . kpe_s) * scale,   o_lat[b, h] = softmax_s(score[b, h]) @ ckv

token s at ``kv_cache[block_tables[b, s // block_size], s % block_size]`` ([..., :512] = ckv, [..., 512:] = k_pe);
the same function as `kimi.ops.attention.mla_decode_ref` (KIMI.md section 3, absorbed form), with fp32 scores,
softmax and accumulation and p rounded to bf16 for the P @ V product.

Why: FlashInfer's MLA kernel (kimi.ops.attention_flashinfer, fa3) needs a host `plan()` per step and costs ~20 us
per call beyond its KV read at decode sizes (25 us for 8 requests x 2k tokens, 42-47 us for 32:
bench/mla_flashinfer_2026-11-29.json and the decode breakdowns); 61 layers pay it every step. This kernel reads
the lengths and page tables from device tensors (a CUDA graph captures it once per batch bucket), loads the KV
tiles that cannot hold the step's new token before waiting on the preceding kernel (PDL), and the last split of a
request to finish merges the split partials (no second kernel).

How (csrc/mla_decode.cu's header has the detail): grid (num_splits, B) CTAs of two consumer warpgroups and one
producer warpgroup; 64-token KV tiles arrive by TMA (128-byte swizzle) into a 2-deep ring next to the query
[64 x 576]; each consumer warpgroup computes the scores of 32 of the tile's tokens with wgmma, the two exchange
row maxima, write p into one shared tile, and each accumulates half of the 512 output dims (P @ V by wgmma with
the cache rows as the MN-major operand). Written for this project from the split-KV ("flash-decoding") scheme and
the PTX ISA's wgmma / TMA / mbarrier sections.

Supported shapes: H = 64, L = 512, R = 64 (Kimi-K2 under DP attention), bf16, block_size a multiple of 64;
`supports()` says whether a model's shapes qualify. Built with torch's extension loader at first use
(kimi.ops.cuda_ext, sm_90a).
"""

from __future__ import annotations

import os

import torch

__all__ = ["mla_decode", "supports", "choose_num_splits", "workspace_numel", "load_extension", "HEADS", "TILE"]

HEADS, LATENT, ROPE = 64, 512, 64
TILE = 64  # tokens per KV tile (csrc/mla_decode.cu kTN)
MAX_BATCH = 65535  # requests per call (grid y; the split counters below)
_done: dict[torch.device, torch.Tensor] = {}  # per device: [MAX_BATCH] int32 split counters, zero between calls
MAX_SPLITS = 32
MIN_SPLIT_TOKENS = 128  # with a context hint: splits of at least 128 tokens


def supports(num_heads: int, kv_lora_rank: int, rope_dim: int, block_size: int, dtype: torch.dtype) -> bool:
    """Whether the kernel runs this attention: 64 heads, a 512 + 64 latent, bf16, block_size % 64 == 0."""
    return ((num_heads, kv_lora_rank, rope_dim) == (HEADS, LATENT, ROPE) and dtype == torch.bfloat16
            and block_size % TILE == 0)


def choose_num_splits(batch: int, num_sms: int, max_ctx: int | None = None) -> int:
    """KV splits per request: the most that keep batch * splits CTAs within one wave of num_sms (one CTA per SM:
    it takes ~225 KB of shared memory), in [1, MAX_SPLITS]; with max_ctx (a host-side hint, e.g. the longest context
    a captured graph serves) also at most cdiv(max_ctx, MIN_SPLIT_TOKENS), so no split is shorter than 128
    tokens. Host ints only (CUDA-graph safe). Raises ValueError on batch or num_sms < 1."""
    if batch < 1 or num_sms < 1:
        raise ValueError(f"choose_num_splits: batch {batch} and num_sms {num_sms} must be >= 1")
    s = max(1, num_sms // batch)
    if max_ctx is not None:
        s = min(s, max(1, -(-max_ctx // MIN_SPLIT_TOKENS)))
    return min(s, MAX_SPLITS)


def workspace_numel(batch: int, num_splits: int) -> int:
    """float32 elements of the workspace when num_splits > 1: partial o [B, S, 64, 512]
    then lse [B, S, 64]."""
    return batch * num_splits * HEADS * (LATENT + 1) if num_splits > 1 else 0


def load_extension():
    """Build (first use) and import the extension (kimi.ops.cuda_ext.load: csrc/mla_decode_binding.cpp and
    csrc/mla_decode.cu). Raises what torch's extension loader raises when it cannot build here."""
    from kimi.ops.cuda_ext import load

    return load("mla_decode", ["mla_decode_binding.cpp", "mla_decode.cu"])


def _aligned(t: torch.Tensor) -> bool:
    """Rows start at 16-byte boundaries (16-byte async copies / stores): data pointer and row strides."""
    return t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in t.stride()[:-1])


def mla_decode(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    workspace: torch.Tensor | None = None,
    pdl: bool | None = None,

) -> torch.Tensor:
    """Absorbed MLA decode (one query row per request) over the paged latent cache; no planning, graph-capturable.

    Args:
        q_lat: [B, 64, 512] bf16, q_nope absorbed with W_UK; unit stride on the last dim, 16-byte aligned rows.
        q_pe: [B, 64, 64] bf16, roped; same stride rules (may be a view of a wider tensor).
        kv_cache: [num_blocks, block_size, 576] bf16; [..., :512] = ckv, [..., 512:] = k_pe; unit last stride,
            16-byte aligned base and strides, block_size a multiple of 64.
        block_tables: [B, max_blocks] int32 (int64 is converted: one copy) on the device, unit last stride: block
            ids of each request, at least cdiv(seq_lens[b], block_size) valid entries (the rest is never read).
        seq_lens: [B] int32 (int64 converted) on the device: context length including the new token (0 gives
            o_lat = 0).
        scale: softmax scale (cfg.softmax_scale).
        out: optional [B, 64, 512] bf16 output (unit last stride, 16-byte aligned rows); written and returned.
        num_splits: KV splits per request (host int, never read from the device); default
            `choose_num_splits(B, SMs)`.
        workspace: optional contiguous float32 tensor of >= workspace_numel(B, num_splits) elements; default
            torch.empty per call (caching allocator, the graph's pool under capture).
        pdl: programmatic dependent launch (default: kimi.ops.pdl.enabled for the device).

    Returns:
        o_lat [B, 64, 512] bf16.

    Raises:
        ValueError for shapes, dtypes, devices, strides or alignments the kernel does not take, num_splits
        outside [1, 65535], a too small workspace; RuntimeError (from the extension) if the launch fails.
        Never synchronises with the device.
    """
    if q_lat.dim() != 3 or q_pe.dim() != 3 or kv_cache.dim() != 3:
        raise ValueError(f"expected q_lat [B, H, L], q_pe [B, H, R], kv_cache [num_blocks, block_size, L+R]; got "
                         f"{tuple(q_lat.shape)}, {tuple(q_pe.shape)}, {tuple(kv_cache.shape)}")
    B = q_lat.shape[0]
    if tuple(q_lat.shape) != (B, HEADS, LATENT) or tuple(q_pe.shape) != (B, HEADS, ROPE) or not 1 <= B <= MAX_BATCH:
        raise ValueError(f"q_lat {tuple(q_lat.shape)} / q_pe {tuple(q_pe.shape)}: want [B >= 1, {HEADS}, {LATENT}] / "
                         f"[B, {HEADS}, {ROPE}]")
    if kv_cache.shape[2] != LATENT + ROPE or kv_cache.shape[1] % TILE or kv_cache.shape[0] < 1:
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)}: want [num_blocks, block_size % {TILE} == 0, "
                         f"{LATENT + ROPE}]")
    for name, t in (("q_lat", q_lat), ("q_pe", q_pe), ("kv_cache", kv_cache)):
        if t.dtype != torch.bfloat16 or not t.is_cuda or t.device != q_lat.device:
            raise ValueError(f"{name}: want a bf16 tensor on {q_lat.device} (CUDA), got {t.dtype} on {t.device}")
        if t.stride(-1) != 1 or not _aligned(t):
            raise ValueError(f"{name}: want unit last stride and 16-byte aligned rows, got strides {t.stride()}")
    if block_tables.dim() != 2 or block_tables.shape[0] != B or block_tables.shape[1] < 1:
        raise ValueError(f"block_tables must be [B={B}, max_blocks >= 1], got {tuple(block_tables.shape)}")
    if seq_lens.dim() != 1 or seq_lens.shape[0] != B:
        raise ValueError(f"seq_lens must be [B={B}], got {tuple(seq_lens.shape)}")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if t.dtype not in (torch.int32, torch.int64) or t.device != q_lat.device:
            raise ValueError(f"{name}: want int32 / int64 on {q_lat.device}, got {t.dtype} on {t.device}")
    if block_tables.dtype != torch.int32 or block_tables.stride(1) != 1:
        block_tables = block_tables.to(torch.int32).contiguous()
    if seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous():
        seq_lens = seq_lens.to(torch.int32).contiguous()
    if out is None:
        out = torch.empty((B, HEADS, LATENT), dtype=torch.bfloat16, device=q_lat.device)
    elif (tuple(out.shape) != (B, HEADS, LATENT) or out.dtype != torch.bfloat16 or out.device != q_lat.device
          or out.stride(-1) != 1 or not _aligned(out)):
        raise ValueError(f"out: want [{B}, {HEADS}, {LATENT}] bf16 on {q_lat.device} with unit last stride and "
                         f"16-byte aligned rows, got {tuple(out.shape)} {out.dtype} strides {out.stride()}")
    if num_splits is None:
        idx = q_lat.device.index if q_lat.device.index is not None else torch.cuda.current_device()
        num_splits = choose_num_splits(B, torch.cuda.get_device_properties(idx).multi_processor_count)
    if not 1 <= int(num_splits) <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    need = workspace_numel(B, num_splits)
    if workspace is None:
        workspace = torch.empty(need, dtype=torch.float32, device=q_lat.device)
    elif (workspace.dtype != torch.float32 or workspace.device != q_lat.device or workspace.numel() < need
          or not workspace.is_contiguous()):
        raise ValueError(f"workspace must be a contiguous float32 tensor of >= {need} elements on {q_lat.device}, "
                         f"got {workspace.dtype} {tuple(workspace.shape)} on {workspace.device}")
    if pdl is None:
        from kimi.ops.pdl import enabled

        pdl = enabled(q_lat.device)
    done = _done.get(q_lat.device)
    if done is None:  # once per device, by an eager call (a graph's pool must not own it)
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("mla_decode: call it once eagerly on this device before capturing it in a CUDA graph")
        done = _done[q_lat.device] = torch.zeros(MAX_BATCH, dtype=torch.int32, device=q_lat.device)
    load_extension().mla_decode(q_lat, q_pe, kv_cache, block_tables, seq_lens, out, workspace.view(-1), done,
                                int(num_splits), float(scale), int(bool(pdl)))
    return out
