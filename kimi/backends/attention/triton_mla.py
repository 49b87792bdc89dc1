"""The Triton MLA decode backend: kimi.kernels.triton.mla_decode over device-side lengths and block tables (no host
plan; CUDA-graph capturable), for pure decode batches (`decode_attention` "triton")."""

from __future__ import annotations

import torch

__all__ = ["TritonMLADecodeRun", "triton_mla_config", "triton_mla_splits"]


class TritonMLADecodeRun:
    """The AttentionBackend (`AttentionPlan.run`) of a pure decode batch run by kimi.kernels.triton.mla_decode: no
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
