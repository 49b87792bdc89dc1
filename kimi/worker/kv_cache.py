"""The paged MLA latent KV cache buffers (docs/contracts.md; DESIGN.md "KV cache").

One buffer per layer `[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]` (576 for Kimi): the
rms-normed ckv (512) then the roped, interleaved k_pe (64). Block 0 is the null block padded rows write into.
"""

from __future__ import annotations

import torch

from kimi.config import ModelConfig


def kv_cache_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes over all layers: num_layers * block_size * (L + R) * itemsize.

    Kimi, bf16, block_size 64: 61 * 64 * 576 * 2 = 4,497,408 bytes.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    return cfg.num_hidden_layers * block_size * cfg.kv_cache_dim * itemsize


def allocate_kv_caches(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str
) -> list[torch.Tensor]:
    """Zero-filled caches, one [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim] tensor per layer.

    Raises ValueError when num_blocks or block_size < 1.
    """
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
    return [
        torch.zeros((num_blocks, block_size, cfg.kv_cache_dim), dtype=dtype, device=device)
        for _ in range(cfg.num_hidden_layers)
    ]
