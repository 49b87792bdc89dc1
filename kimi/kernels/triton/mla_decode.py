"""Absorbed-MLA decode over kimi's paged latent cache as a Triton split-KV kernel with NO host-side planning.

Why: FlashInfer's paged MLA (kimi.backends.attention.flashinfer) needs a host `plan()` per decode step (~0.28 ms on
the critical path) and its run time grows with B. This kernel reads seq_lens / block_tables from device
tensors; its grid depends only on (B, H, num_splits, config), so a decode step can be captured once per batch
size in a CUDA graph and replayed with new lengths / tables written into the same static buffers.

Math (docs/model-format.md, Math: the absorbed form; the same function as `kimi.model.attention.mla_decode_ref`):
MQA of H query heads over the (L + R)-wide latent cache,

    score[b, h, s] = (q_lat[b, h] . ckv_s + q_pe[b, h] . kpe_s) * scale     for s < seq_lens[b],
    o_lat[b, h]    = softmax_s(score[b, h]) @ ckv                           (float32 softmax / accumulation),

token s of request b at ``kv_cache[block_tables[b, s // block_size], s % block_size]`` with ``[..., :L]`` = ckv
and ``[..., L:]`` = k_pe. Written for this project from the split-KV ("flash-decoding") scheme: the online
softmax of FlashAttention over KV tiles, the KV range split across programs, partial results merged through
their log-sum-exp.

Algorithm:
- Stage 1, grid (head_groups * dv_chunks, num_splits, B). Program (g, s, b) loads the query tile of heads
  [g * BLOCK_H, +BLOCK_H) (q_lat [BLOCK_H, L], q_pe [BLOCK_H, R]; all heads share every KV row: MQA), then walks
  its contiguous range of KV tiles of BLOCK_N tokens: with n_tiles = cdiv(seq_len, BLOCK_N) and
  per = cdiv(n_tiles, num_splits), split s owns tiles [s * per, min((s + 1) * per, n_tiles)), computed on the
  device from seq_lens[b]. Per tile: the page of every token is gathered from block_tables (a tile may span
  several pages when BLOCK_N > block_size, or part of one page), ckv [BLOCK_N, L] and kpe [BLOCK_N, R] are
  loaded (tokens >= seq_len masked to 0), scores = q_lat @ ckv^T + q_pe @ kpe^T (tl.dot, fp32), online
  softmax in base 2 (scale * log2(e) folded in), acc [BLOCK_H, BLOCK_DV] += p @ ckv[:, dv chunk] (p rounded to
  the input dtype for the tensor-core dot, as FlashAttention does). BLOCK_DV < L splits the value dimension
  across programs (less accumulator per program) at the price of every such program recomputing the scores
  (its KV rows come again, mostly from L2). Each non-empty split writes o / l (fp32) and lse = m + log2(l)
  into a workspace; a split with no tiles writes nothing.
- Stage 2 (combine), grid (H, B): recomputes how many splits of request b are non-empty
  (cdiv(n_tiles, per)), merges their partials with weights 2^(lse_s - max lse) and writes o_lat in the q dtype.
- num_splits == 1: stage 1 writes o_lat directly (no workspace, no combine launch).
A request with seq_len 0 (not a valid decode row, but harmless for padded graph rows) gets o_lat = 0.

num_splits is a host int chosen from B, the SM count and the head grouping (`choose_num_splits`), optionally
capped by a context-length hint; it never depends on device values. No host synchronisation anywhere in
`mla_decode`; the workspace comes from torch's caching allocator (the graph's pool under capture) unless one is
passed in.

Pointer offsets into the cache are 64-bit (page id * page stride), so num_blocks * block_size * (L + R) may
exceed 2^31 elements.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kimi.errors import BackendUnavailableError
from kimi.kernels.triton.common import HAS_TRITON, INTERPRET, tl, triton

__all__ = [
    "CONFIGS",
    "DEFAULT_CONFIG",
    "HAS_TRITON",
    "MAX_SPLITS",
    "MLADecodeConfig",
    "choose_num_splits",
    "mla_decode",
    "programs_per_split",
    "workspace_numel",
]

_LOG2E = 1.4426950408889634
MAX_SPLITS = 64


@dataclass(frozen=True)
class MLADecodeConfig:
    """Launch parameters of stage 1.

    block_h: query heads per program (>= 16 for tl.dot; capped at the padded head count); heads of one
        request are split into cdiv(H, block_h) head groups, each re-reading the KV range (from L2 when the
        groups run together: they are adjacent in the grid).
    block_n: tokens per inner step (>= 16; may be smaller than, equal to or a multiple of the block size).
    block_dv: value columns per program (L or a power-of-two divisor >= 16); block_dv < L recomputes the scores
        in each of the L / block_dv programs.
    num_warps / num_stages: Triton launch parameters of stage 1 (num_stages = depth of the KV load pipeline).
    """

    block_h: int = 32
    block_n: int = 32
    block_dv: int = 512
    num_warps: int = 8
    num_stages: int = 2

    def name(self) -> str:
        return f"h{self.block_h}_n{self.block_n}_dv{self.block_dv}_w{self.num_warps}_st{self.num_stages}"


# The configs DEFAULT_CONFIG was chosen from (the GPU tests run each); each is a separate compile. Register budget per
# thread (fp32 accumulator): block_h * block_dv / (32 * num_warps), e.g. 64 * 512 / 256 = 128.
CONFIGS: tuple[MLADecodeConfig, ...] = (
    MLADecodeConfig(block_h=64, block_n=32, block_dv=512, num_warps=8, num_stages=2),
    MLADecodeConfig(block_h=64, block_n=32, block_dv=256, num_warps=8, num_stages=2),
    MLADecodeConfig(block_h=64, block_n=16, block_dv=512, num_warps=8, num_stages=3),
    MLADecodeConfig(block_h=32, block_n=32, block_dv=512, num_warps=8, num_stages=2),
    MLADecodeConfig(block_h=32, block_n=64, block_dv=512, num_warps=8, num_stages=2),
    MLADecodeConfig(block_h=16, block_n=32, block_dv=512, num_warps=4, num_stages=3),
    MLADecodeConfig(block_h=16, block_n=64, block_dv=512, num_warps=4, num_stages=2),
)
# The fastest config of a sweep on the H200 (64 heads, ctx 2048) at B = 8 and 32, with about one
# stage-1 program per SM (16 splits at B = 8: 33.9 us; 4 at B = 32: 80.4 us). FlashInfer fa3 takes 24.9 / 42.2 us
# there, so this kernel is NOT kimi's default decode attention (KimiForCausalLM.decode_attention;
# docs/performance.md).
DEFAULT_CONFIG = MLADecodeConfig(block_h=64, block_n=32, block_dv=512, num_warps=8, num_stages=2)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _block_h(cfg: MLADecodeConfig, H: int) -> int:
    """Heads per program: cfg.block_h, but not more than H padded to a power of two >= 16."""
    return min(cfg.block_h, max(16, _next_pow2(H)))


def programs_per_split(num_heads: int, kv_lora_rank: int = 512, config: MLADecodeConfig | None = None) -> int:
    """Stage-1 programs per (request, split): head groups times value chunks (choose_num_splits' num_head_groups)."""
    cfg = config or DEFAULT_CONFIG
    return -(-num_heads // _block_h(cfg, num_heads)) * max(1, kv_lora_rank // cfg.block_dv)


SMEM_BUDGET = 200 * 1024  # H100/H200 allow 227 KiB per block; leave room for layout-conversion scratch


def _num_stages(cfg: MLADecodeConfig, block_h: int, L: int, R: int, elt: int = 2) -> int:
    """cfg.num_stages, lowered (not below 1) so that the query tile plus num_stages KV tiles (ckv + kpe, and
    the separate value slice when block_dv < L) fit SMEM_BUDGET: a rough estimate of Triton's buffers."""
    fixed = block_h * (L + R) * elt
    stage = cfg.block_n * (L + R + (cfg.block_dv if cfg.block_dv < L else 0)) * elt
    return max(1, min(cfg.num_stages, (SMEM_BUDGET - fixed) // stage))


def choose_num_splits(
    batch: int,
    num_sms: int,
    num_head_groups: int = 1,
    max_ctx: int | None = None,
    programs_per_sm: int = 1,
    max_splits: int = MAX_SPLITS,
    min_tokens_per_split: int = 256,
) -> int:
    """KV splits per request: enough stage-1 programs for ~programs_per_sm per SM, in [1, max_splits].

    batch * num_head_groups programs exist per split (num_head_groups: cdiv(H, block_h) times L / block_dv). With
    max_ctx (a host-side hint, e.g. the longest context a captured graph serves) the count is also capped at
    cdiv(max_ctx, min_tokens_per_split), so no split is shorter than ~min_tokens_per_split tokens (each split
    writes and re-reads a [H, L] fp32 partial). Depends on host ints only (CUDA-graph safe). Raises ValueError
    on batch / num_sms / num_head_groups < 1.
    """
    if batch < 1 or num_sms < 1 or num_head_groups < 1:
        raise ValueError(
            f"choose_num_splits: batch {batch}, num_sms {num_sms}, head groups {num_head_groups} must be >= 1"
        )
    s = -(-(programs_per_sm * num_sms) // (batch * num_head_groups))
    if max_ctx is not None:
        s = min(s, max(1, -(-max_ctx // max(1, min_tokens_per_split))))
    return max(1, min(s, max_splits))


def workspace_numel(batch: int, num_heads: int, kv_lora_rank: int, num_splits: int) -> int:
    """float32 elements of the stage-1 workspace: partial o [B, S, H, L] then lse [B, S, H]."""
    return batch * num_splits * num_heads * (kv_lora_rank + 1)


_num_sms_cache: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter on CPU: few programs
    idx = device.index if device.index is not None else torch.cuda.current_device()
    n = _num_sms_cache.get(idx)
    if n is None:
        n = _num_sms_cache[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return n


if HAS_TRITON:

    @triton.jit(do_not_specialize=["NUM_SPLITS"])
    def _mla_decode_stage1(
        q_lat_ptr,
        q_pe_ptr,
        kv_ptr,
        bt_ptr,
        seq_ptr,
        o_part_ptr,
        lse_ptr,
        out_ptr,
        H,
        NUM_SPLITS,
        qk_scale,
        stride_qlb,
        stride_qlh,
        stride_qpb,
        stride_qph,
        stride_kvb,
        stride_kvt,
        stride_btb,
        stride_ob,
        stride_oh,
        PAGE: tl.constexpr,
        L: tl.constexpr,
        R: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_DV: tl.constexpr,
        DIRECT: tl.constexpr,
    ):
        """One (head group x dv chunk, split, request) program; see the module docstring."""
        DV_CHUNKS: tl.constexpr = L // BLOCK_DV
        pid_hd = tl.program_id(0)
        split = tl.program_id(1)
        b = tl.program_id(2)
        hg = pid_hd // DV_CHUNKS
        dvc = pid_hd % DV_CHUNKS
        b64 = b.to(tl.int64)
        seq_len = tl.load(seq_ptr + b).to(tl.int32)
        n_tiles = tl.cdiv(seq_len, BLOCK_N)
        per = tl.maximum(tl.cdiv(n_tiles, NUM_SPLITS), 1)
        t0 = split * per
        t1 = tl.minimum(t0 + per, n_tiles)
        heads = hg * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = heads < H
        offs_dv = dvc * BLOCK_DV + tl.arange(0, BLOCK_DV)
        if t1 > t0:
            offs_l = tl.arange(0, L)
            offs_r = tl.arange(0, R)
            offs_n = tl.arange(0, BLOCK_N)
            q_lat = tl.load(
                q_lat_ptr + b64 * stride_qlb + heads[:, None] * stride_qlh + offs_l[None, :],
                mask=hmask[:, None],
                other=0.0,
            )  # [BLOCK_H, L]
            q_pe = tl.load(
                q_pe_ptr + b64 * stride_qpb + heads[:, None] * stride_qph + offs_r[None, :],
                mask=hmask[:, None],
                other=0.0,
            )  # [BLOCK_H, R]
            bt_row = bt_ptr + b64 * stride_btb
            m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
            l_i = tl.zeros((BLOCK_H,), tl.float32)
            acc = tl.zeros((BLOCK_H, BLOCK_DV), tl.float32)
            for t in range(t0, t1):
                toks = t * BLOCK_N + offs_n  # [BLOCK_N] token positions
                tmask = toks < seq_len
                page = tl.load(bt_row + toks // PAGE, mask=tmask, other=0).to(tl.int64)
                rows = kv_ptr + page * stride_kvb + (toks % PAGE).to(tl.int64) * stride_kvt  # [BLOCK_N] ptrs
                ckv = tl.load(rows[:, None] + offs_l[None, :], mask=tmask[:, None], other=0.0)  # [BLOCK_N, L]
                kpe = tl.load(rows[:, None] + L + offs_r[None, :], mask=tmask[:, None], other=0.0)  # [BLOCK_N, R]
                s = tl.dot(q_lat, tl.trans(ckv))
                s = tl.dot(q_pe, tl.trans(kpe), s)  # [BLOCK_H, BLOCK_N] fp32
                s = tl.where(tmask[None, :], s * qk_scale, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                if BLOCK_DV == L:
                    v = ckv
                else:
                    v = tl.load(rows[:, None] + offs_dv[None, :], mask=tmask[:, None], other=0.0)
                acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])  # [BLOCK_H, BLOCK_DV]
                m_i = m_new
            o = acc / l_i[:, None]
            if DIRECT:
                tl.store(
                    out_ptr + b64 * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :],
                    o.to(out_ptr.dtype.element_ty),
                    mask=hmask[:, None],
                )
            else:
                row = (b64 * NUM_SPLITS + split) * H + heads  # [BLOCK_H] index into [B, S, H]
                tl.store(o_part_ptr + row[:, None] * L + offs_dv[None, :], o, mask=hmask[:, None])
                if dvc == 0:
                    tl.store(lse_ptr + row, m_i + tl.log2(l_i), mask=hmask)
        else:
            if DIRECT:  # seq_len 0: zeros (nothing to attend to)
                tl.store(
                    out_ptr + b64 * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :],
                    tl.zeros((BLOCK_H, BLOCK_DV), tl.float32).to(out_ptr.dtype.element_ty),
                    mask=hmask[:, None],
                )

    @triton.jit(do_not_specialize=["NUM_SPLITS"])
    def _mla_decode_combine(
        o_part_ptr,
        lse_ptr,
        seq_ptr,
        out_ptr,
        H,
        NUM_SPLITS,
        stride_ob,
        stride_oh,
        L: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_S: tl.constexpr,
    ):
        """Merge the non-empty splits of (request b, head h): o = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M)."""
        h = tl.program_id(0)
        b = tl.program_id(1)
        b64 = b.to(tl.int64)
        seq_len = tl.load(seq_ptr + b).to(tl.int32)
        n_tiles = tl.cdiv(seq_len, BLOCK_N)
        per = tl.maximum(tl.cdiv(n_tiles, NUM_SPLITS), 1)
        n_valid = tl.cdiv(n_tiles, per)  # splits with at least one tile (same formula as stage 1)
        offs_s = tl.arange(0, BLOCK_S)
        smask = offs_s < n_valid
        base = b64 * NUM_SPLITS * H + h  # index of (b, split 0, h) in [B, S, H]
        lse = tl.load(lse_ptr + base + offs_s * H, mask=smask, other=float("-inf"))  # [BLOCK_S]
        m = tl.max(lse, 0)
        w = tl.where(smask, tl.exp2(lse - m), 0.0)
        denom = tl.sum(w, 0)
        offs_l = tl.arange(0, L)
        acc = tl.zeros((L,), tl.float32)
        for s in range(n_valid):
            ws = tl.exp2(tl.load(lse_ptr + base + s * H) - m)
            acc += ws * tl.load(o_part_ptr + (base + s * H) * L + offs_l)
        o = tl.where(denom > 0, acc / tl.maximum(denom, 1e-30), 0.0)
        tl.store(out_ptr + b64 * stride_ob + h * stride_oh + offs_l, o.to(out_ptr.dtype.element_ty))


def _is_pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def _check(q_lat, q_pe, kv_cache, block_tables, seq_lens, out, cfg: MLADecodeConfig, num_splits) -> None:
    if q_lat.dim() != 3 or q_pe.dim() != 3 or kv_cache.dim() != 3:
        raise ValueError(
            f"expected q_lat [B, H, L], q_pe [B, H, R], kv_cache [num_blocks, block_size, L+R]; got "
            f"{tuple(q_lat.shape)}, {tuple(q_pe.shape)}, {tuple(kv_cache.shape)}"
        )
    B, H, L = q_lat.shape
    R = q_pe.shape[2]
    if q_pe.shape[:2] != (B, H):
        raise ValueError(f"q_pe {tuple(q_pe.shape)} does not match q_lat {tuple(q_lat.shape)} in [B, H]")
    if B < 1 or H < 1:
        raise ValueError(f"empty batch or no heads: q_lat {tuple(q_lat.shape)}")
    if kv_cache.shape[2] != L + R:
        raise ValueError(f"kv_cache last dim {kv_cache.shape[2]} != L + R = {L} + {R}")
    if kv_cache.shape[0] < 1 or kv_cache.shape[1] < 1:
        raise ValueError(f"empty kv_cache {tuple(kv_cache.shape)}")
    if not (_is_pow2(L) and L >= 16 and _is_pow2(R) and R >= 16):
        raise ValueError(f"L ({L}) and R ({R}) must be powers of two >= 16")
    if q_lat.dtype not in (torch.bfloat16, torch.float16) or q_pe.dtype != q_lat.dtype or kv_cache.dtype != q_lat.dtype:
        raise ValueError(
            f"q_lat, q_pe, kv_cache must share one dtype, bf16 or fp16; got {q_lat.dtype}, "
            f"{q_pe.dtype}, {kv_cache.dtype}"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != B or block_tables.shape[1] < 1:
        raise ValueError(f"block_tables must be [B={B}, max_blocks >= 1], got {tuple(block_tables.shape)}")
    if seq_lens.dim() != 1 or seq_lens.shape[0] != B:
        raise ValueError(f"seq_lens must be [B={B}], got {tuple(seq_lens.shape)}")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    dev = q_lat.device
    if not (dev.type == "cuda" or INTERPRET):
        raise ValueError(f"tensors must be on a CUDA device, got {dev}")
    for name, t in (("q_pe", q_pe), ("kv_cache", kv_cache), ("block_tables", block_tables), ("seq_lens", seq_lens)):
        if t.device != dev:
            raise ValueError(f"{name} is on {t.device}, q_lat on {dev}: all tensors must be on one device")
    if q_lat.stride(2) != 1 or q_pe.stride(2) != 1 or kv_cache.stride(2) != 1:
        raise ValueError(
            f"q_lat, q_pe and kv_cache need unit stride on the last dim; strides {q_lat.stride()}, "
            f"{q_pe.stride()}, {kv_cache.stride()}"
        )
    if block_tables.stride(1) != 1 or (B > 1 and seq_lens.stride(0) != 1):
        raise ValueError(
            f"block_tables needs unit stride on its last dim and seq_lens unit stride; got "
            f"{block_tables.stride()}, {seq_lens.stride()}"
        )
    if out is not None and (
        out.shape != (B, H, L) or out.dtype != q_lat.dtype or out.device != dev or out.stride(2) != 1
    ):
        raise ValueError(
            f"out must be [{B}, {H}, {L}] {q_lat.dtype} on {dev} with unit stride on the last "
            f"dim, got {tuple(out.shape)} {out.dtype} {out.device} strides {out.stride()}"
        )
    if cfg.block_n < 16 or not _is_pow2(cfg.block_n) or cfg.block_h < 16 or not _is_pow2(cfg.block_h):
        raise ValueError(f"config {cfg}: block_n and block_h must be powers of two >= 16")
    if not (_is_pow2(cfg.block_dv) and 16 <= cfg.block_dv <= L):
        raise ValueError(f"config {cfg}: block_dv must be a power of two in [16, L={L}]")
    if num_splits is not None and not 1 <= num_splits <= 1024:
        raise ValueError(f"num_splits must be in [1, 1024], got {num_splits}")


def mla_decode(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    config: MLADecodeConfig | None = None,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode (one query row per request) over the paged latent cache; no planning, graph-capturable.

    Args:
        q_lat: [B, H, L] bf16 (or fp16), q_nope absorbed with W_UK; unit stride on L (row strides free).
        q_pe: [B, H, R] same dtype, roped; unit stride on R (may be a view of a wider tensor).
        kv_cache: [num_blocks, block_size, L + R] same dtype; [..., :L] = ckv, [..., L:] = k_pe; unit stride on
            the last dim (block / token strides free). L, R powers of two >= 16 (Kimi: 512, 64).
        block_tables: [B, max_blocks] int32 or int64, on the device: block ids of each request, at least
            ceil(seq_lens[b] / block_size) valid entries (the rest is never read).
        seq_lens: [B] int32 or int64 on the device, context length including the new token (>= 1; a 0 gives
            o_lat = 0).
        scale: softmax scale (cfg.softmax_scale).
        out: optional [B, H, L] output, q dtype, unit stride on L; written and returned.
        num_splits: KV splits per request (host int); default `choose_num_splits(B, num_SMs, head groups)`.
            Must not depend on device values when the call is captured in a CUDA graph (it never does here).
        config: stage-1 launch config (default DEFAULT_CONFIG).
        workspace: optional float32 tensor of >= workspace_numel(B, H, L, num_splits) contiguous elements (only
            used when num_splits > 1); default torch.empty per call (caching allocator, graph pool under capture).

    Returns:
        o_lat [B, H, L] in the q dtype: softmax(score) @ ckv with fp32 softmax and accumulation.

    Raises:
        RuntimeError if Triton is not installed; ValueError for wrong shapes, dtypes, devices, strides, a bad
        config / num_splits or a too small workspace. Never synchronises with the device.
    """
    if not HAS_TRITON:
        raise BackendUnavailableError("mla_decode needs Triton (not installed)")
    cfg = config or DEFAULT_CONFIG
    _check(q_lat, q_pe, kv_cache, block_tables, seq_lens, out, cfg, num_splits)
    B, H, L = q_lat.shape
    R = q_pe.shape[2]
    page = kv_cache.shape[1]
    block_h = _block_h(cfg, H)
    head_groups = -(-H // block_h)
    dv_chunks = L // cfg.block_dv
    if num_splits is None:
        num_splits = choose_num_splits(B, _num_sms(q_lat.device), programs_per_split(H, L, cfg))
    o = out if out is not None else torch.empty((B, H, L), dtype=q_lat.dtype, device=q_lat.device)
    direct = num_splits == 1
    if direct:
        o_part = lse = o  # unused by the kernel; any pointer
    else:
        n = workspace_numel(B, H, L, num_splits)
        if workspace is None:
            workspace = torch.empty(n, dtype=torch.float32, device=q_lat.device)
        elif (
            workspace.dtype != torch.float32
            or workspace.device != q_lat.device
            or workspace.numel() < n
            or not workspace.is_contiguous()
        ):
            raise ValueError(
                f"workspace must be a contiguous float32 tensor of >= {n} elements on {q_lat.device}, "
                f"got {workspace.dtype} {tuple(workspace.shape)} on {workspace.device}"
            )
        workspace = workspace.view(-1)
        o_part = workspace[: B * num_splits * H * L]  # [B, S, H, L]
        lse = workspace[B * num_splits * H * L : n]  # [B, S, H]
    _mla_decode_stage1[(head_groups * dv_chunks, num_splits, B)](
        q_lat,
        q_pe,
        kv_cache,
        block_tables,
        seq_lens,
        o_part,
        lse,
        o,
        H,
        num_splits,
        float(scale) * _LOG2E,
        q_lat.stride(0),
        q_lat.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        block_tables.stride(0),
        o.stride(0),
        o.stride(1),
        PAGE=page,
        L=L,
        R=R,
        BLOCK_H=block_h,
        BLOCK_N=cfg.block_n,
        BLOCK_DV=cfg.block_dv,
        DIRECT=direct,
        num_warps=cfg.num_warps,
        num_stages=_num_stages(cfg, block_h, L, R, q_lat.element_size()),
    )
    if not direct:
        _mla_decode_combine[(H, B)](
            o_part,
            lse,
            seq_lens,
            o,
            H,
            num_splits,
            o.stride(0),
            o.stride(1),
            L=L,
            BLOCK_N=cfg.block_n,
            BLOCK_S=_next_pow2(num_splits),
            num_warps=4,
        )
    return o
