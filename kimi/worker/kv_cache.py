"""The paged MLA latent KV cache buffers (docs/architecture.md, Interfaces; docs/design.md, KV cache).

One buffer per layer `[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]` (576 for Kimi): the
rms-normed ckv (512) then the roped, interleaved k_pe (64). Block 0 is the null block padded rows write into.
"""

from __future__ import annotations

import torch

from kimi.config import ModelConfig
from kimi.errors import KVCacheSizeError


def kv_cache_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes over all layers: num_layers * block_size * (L + R) * itemsize.

    Kimi, bf16, block_size 64: 61 * 64 * 576 * 2 = 4,497,408 bytes.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    return cfg.num_hidden_layers * block_size * cfg.kv_cache_dim * itemsize


def available_bytes(device: torch.device | str) -> int | None:
    """Bytes free for new allocations on `device`: cuda: `torch.cuda.mem_get_info`'s free bytes; cpu: MemAvailable
    from /proc/meminfo (Linux); None where unknown (the check that uses it is then skipped)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return None


def check_kv_cache_fits(
    cfg: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    flag: str,
    available: int | None = None,
) -> None:
    """Raise KVCacheSizeError when num_blocks blocks (kv_cache_bytes_per_block each) exceed `available` bytes
    (default: available_bytes(device), which ModelRunner reads before it loads the weights, so a cache that can
    never fit fails at once instead of after a long load). flag: the option the size came from, for the message.
    No check when the available memory is unknown."""
    avail = available_bytes(device) if available is None else available
    if avail is None:
        return
    per_block = kv_cache_bytes_per_block(cfg, block_size, dtype)
    need = num_blocks * per_block
    if need > avail:
        raise KVCacheSizeError(
            f"{flag}: the KV cache of {num_blocks} blocks needs {need / 2**30:.1f} GiB ({per_block} bytes per block "
            f"of {block_size} tokens over {cfg.num_hidden_layers} layers), more than the {avail / 2**30:.1f} GiB free "
            f"on {torch.device(device)} before the weights load; give a smaller {flag}, or leave it out to size the "
            "cache from the memory left after the weights"
        )


def allocate_kv_caches(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str
) -> list[torch.Tensor]:
    """Zero-filled caches, one [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim] tensor per layer.

    Raises ValueError when num_blocks or block_size < 1, KVCacheSizeError when the device cannot hold them
    (the allocator's out-of-memory error, with the size in the message).
    """
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
    try:
        return [
            torch.zeros((num_blocks, block_size, cfg.kv_cache_dim), dtype=dtype, device=device)
            for _ in range(cfg.num_hidden_layers)
        ]
    except (torch.OutOfMemoryError, RuntimeError, MemoryError) as e:
        if isinstance(e, RuntimeError) and not isinstance(e, torch.OutOfMemoryError) and "allocate" not in str(e):
            raise
        need = num_blocks * kv_cache_bytes_per_block(cfg, block_size, dtype)
        raise KVCacheSizeError(
            f"cannot allocate the KV cache of {num_blocks} blocks ({need / 2**30:.1f} GiB) on {torch.device(device)} "
            f"after the weights: {str(e).splitlines()[0][:200]}"
        ) from None
