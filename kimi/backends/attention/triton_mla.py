"""The Triton MLA decode backend: kimi.kernels.triton.mla_decode over device-side lengths and block tables (no host
plan; CUDA-graph capturable), for pure decode batches (`decode_attention` "triton"): `TritonMLAAttention` (the
AttentionBackend), `TritonMLADecodeRun` (its planned run), `TritonDecodeGraphs` (its CUDA-graph hooks)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kimi.backends.attention.base import AttentionPlan

if TYPE_CHECKING:
    from kimi.config import ModelConfig
    from kimi.model.attention import AttentionMetadata

__all__ = ["TritonDecodeGraphs", "TritonMLAAttention", "TritonMLADecodeRun", "triton_mla_config", "triton_mla_splits"]


class TritonMLADecodeRun:
    """The AttentionRun (`AttentionPlan.run`) of a pure decode batch run by kimi.kernels.triton.mla_decode: no
    host plan, the kernel reads the lengths and tables from device tensors (the CUDA-graph runner's static buffers, or
    an eager step's AttentionMetadata).

    seq_lens: [B] int32 / int64 device tensor (>= 1); block_tables: [B, W] int32 / int64 device tensor; scale:
    softmax scale; num_splits: KV splits per request (host int); config: a MLADecodeConfig or None (default).
    """

    def __init__(self, seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, num_splits: int, config=None):
        self.seq_lens = seq_lens
        self.block_tables = block_tables
        self.scale = float(scale)
        self.num_splits = num_splits
        self.config = config if config is not None else triton_mla_config()
        self.num_rows = seq_lens.shape[0]

    def run(self, q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor | None = None):
        """q_lat [B, H, L], q_pe [B, H, R] -> o_lat [B, H, L] (see mla_decode; ValueError on mismatched shapes)."""
        from kimi.kernels.triton.mla_decode import mla_decode

        return mla_decode(
            q_lat,
            q_pe,
            kv_cache,
            self.block_tables,
            self.seq_lens,
            self.scale,
            out=out,
            num_splits=self.num_splits,
            config=self.config,
        )


def triton_mla_config():
    """The launch config of the Triton decode attention: kimi.kernels.triton.mla_decode.DEFAULT_CONFIG (the fastest
    measured, from kimi/kernels/tuning/mla_decode.json); a TritonMLADecodeRun takes another as its `config`."""
    from kimi.kernels.triton import mla_decode as mdt

    return mdt.DEFAULT_CONFIG


def triton_mla_splits(batch: int, num_heads: int, kv_lora_rank: int, device, max_ctx: int | None = None) -> int:
    """KV splits for mla_decode of `batch` requests (kimi.kernels.triton.mla_decode.choose_num_splits with the
    default config's programs per split), capped by the longest context max_ctx when given."""
    from kimi.kernels.triton import mla_decode as mdt

    idx = device.index if device.index is not None else torch.cuda.current_device()
    sms = torch.cuda.get_device_properties(idx).multi_processor_count
    return mdt.choose_num_splits(
        batch, sms, mdt.programs_per_split(num_heads, kv_lora_rank, triton_mla_config()), max_ctx=max_ctx
    )


class TritonMLAAttention:
    """The AttentionBackend of kimi.kernels.triton.mla_decode: pure decode batches only (every query_len 1).

    cfg: the model's ModelConfig (heads, latent size, softmax scale); device: the model's CUDA device.
    """

    name = "triton"
    graph_page_rows = False  # the graphs read the tables from this backend's own static buffer

    def __init__(self, cfg: ModelConfig, device: torch.device):
        self.cfg = cfg
        self.device = device

    def plan(self, attn: AttentionMetadata) -> AttentionPlan:
        """A TritonMLADecodeRun over attn's device lengths / tables (no host plan). Raises ValueError when a
        sequence has query_len > 1."""
        qlens = attn.query_lens_cpu
        if not all(q == 1 for q in qlens):
            raise ValueError("the Triton MLA backend runs pure decode batches only (query_len 1 per sequence)")
        cfg = self.cfg
        dev = attn.slot_mapping.device
        splits = triton_mla_splits(
            len(qlens), cfg.num_attention_heads, cfg.kv_lora_rank, dev, max_ctx=max(attn.seq_lens_cpu)
        )
        run = TritonMLADecodeRun(attn.seq_lens, attn.block_tables, cfg.softmax_scale, splits)
        return AttentionPlan(run, attn.slot_mapping, True)

    def graph_attention(
        self, buckets: list[int], block_size: int, max_blocks_per_seq: int, kv_indices: torch.Tensor | None
    ) -> TritonDecodeGraphs:
        """The CUDA-graph hooks (kv_indices unused: graph_page_rows is False)."""
        return TritonDecodeGraphs(self.cfg, self.device, buckets, block_size, max_blocks_per_seq)


class TritonDecodeGraphs:
    """DecodeGraphAttention of the Triton kernel: no planning. Context lengths and block tables live in one static
    int32 device buffer the captured kernels read ([max_batch] lengths, then [max_batch, max_blocks_per_seq] tables),
    filled before each replay by two pinned non-blocking copies of the bucket's rows (`stage`)."""

    plans_ahead = False

    def __init__(
        self, cfg: ModelConfig, device: torch.device, buckets: list[int], block_size: int, max_blocks_per_seq: int
    ):
        self.block_size = block_size
        self.max_batch = max(buckets)
        self.max_blocks_per_seq = mb = max_blocks_per_seq
        n = self.max_batch * (1 + max_blocks_per_seq)
        self.attn_in = torch.zeros(n, dtype=torch.int32, device=device)  # [max_batch] seq_lens, then tables
        self.attn_host = torch.zeros(n, dtype=torch.int32, pin_memory=True)  # staging
        self.seq_lens = self.attn_in[: self.max_batch]  # [max_batch]
        self.block_tables = self.attn_in[self.max_batch :].view(self.max_batch, mb)  # [max_batch, mb]
        self.runs = {
            bs: TritonMLADecodeRun(
                self.seq_lens[:bs],
                self.block_tables[:bs],
                cfg.softmax_scale,
                triton_mla_splits(bs, cfg.num_attention_heads, cfg.kv_lora_rank, device, max_ctx=mb * block_size),
            )
            for bs in buckets
        }

    def plan_capture(self, bs: int, seq_lens_cpu: list[int], block_tables: torch.Tensor) -> TritonMLADecodeRun:
        """Device writes into the static buffers (eager, outside any graph)."""
        B = len(seq_lens_cpu)
        self.seq_lens[:bs] = torch.tensor(list(seq_lens_cpu) + [1] * (bs - B), dtype=torch.int32)
        self.block_tables[:bs].zero_()
        if B:
            self.block_tables[:B, : block_tables.shape[1]] = block_tables
        return self.runs[bs]

    def stage(self, bs: int, seq_lens: list[int], block_tables: list[list[int]]) -> None:
        """Lengths and tables (padded rows: length 1 over the null block 0) by two pinned non-blocking copies."""
        B, blk = len(seq_lens), self.block_size
        mb, mx = self.max_blocks_per_seq, self.max_batch
        a = self.attn_host.numpy()
        a[:B] = seq_lens
        a[B:bs] = 1
        tab = a[mx:].reshape(mx, mb)
        for b, (t, n) in enumerate(zip(block_tables, seq_lens)):
            k = -(-n // blk)
            tab[b, :k] = t[:k]
        tab[B:bs, 0] = 0
        self.attn_in[:bs].copy_(self.attn_host[:bs], non_blocking=True)
        self.attn_in[mx : mx + bs * mb].copy_(self.attn_host[mx : mx + bs * mb], non_blocking=True)

    def plan_replay(self, bs: int, seq_lens: list[int], page_stride: int) -> None:
        """Nothing: the kernel reads the lengths `stage` sent."""

    def plan_ahead(self, bs: int, seq_lens: list[int], page_stride: int) -> None:
        """Nothing (plans_ahead is False)."""
