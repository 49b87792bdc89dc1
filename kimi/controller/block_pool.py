"""BlockPool: the controller's bookkeeping of the paged KV cache (no tensors).

Blocks are ids in [1, num_blocks); block 0 is the null block that padded rows write into and is never
handed out. Free blocks wait in a queue in eviction (LRU) order; every block in use has a reference count.
"""

from __future__ import annotations

from collections import OrderedDict


class NoFreeBlocks(RuntimeError):
    """Raised by `allocate` when fewer blocks are free than asked for (nothing is allocated then)."""


class BlockPool:
    """Reference-counted pool of KV-cache block ids.

    num_blocks: total blocks on each worker, including the null block 0.
    Raises ValueError if num_blocks < 2.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref: list[int] = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks (least recently freed first), each with ref count 1. Raises NoFreeBlocks."""
        if n > len(self._free):
            raise NoFreeBlocks(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            self._ref[b] = 1
            out.append(b)
        return out

    def free(self, blocks: list[int]) -> None:
        """Drop one reference from each block; blocks reaching zero go to the back of the free queue.

        Freed in reverse so that a request's tail blocks are evicted before its head blocks.
        Raises ValueError on the null block or a block that is not in use.
        """
        for b in reversed(blocks):
            if b <= 0 or b >= self.num_blocks or self._ref[b] <= 0:
                raise ValueError(f"block {b} is not in use")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None

    def ref_count(self, block: int) -> int:
        return self._ref[block]
