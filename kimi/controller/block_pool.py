"""BlockPool: the controller's bookkeeping of the paged KV cache (no tensors), with a prefix cache.

Blocks are ids in [1, num_blocks); block 0 is the null block that padded rows write into and is never
handed out. Every block in use has a reference count. Free blocks (ref count 0) wait in a queue in eviction
(LRU) order.

Prefix cache (on unless `enable_caching=False`): a block whose `block_size` tokens have all been computed
is registered under the hash of its content chained with its parent's hash,

    h_0 = H(b"" + ids(block 0)),  h_i = H(h_{i-1} + ids(block i)),  H = blake2b, 16-byte digest,

where ids(...) are the token ids as little-endian int64 bytes (`block_hashes`). The chain makes a hash
name the whole prefix up to and including its block, so equal hashes mean equal prefixes (up to a 2^-128
collision chance; Python's 64-bit `hash` of tuples is not collision resistant, so it is not used).
A cached block is read-only: it is never written again while it holds its hash (the scheduler only hands out
cached blocks for positions strictly before the tokens it computes, and a request's last, partial block
is always its own). When its last user frees it, a cached block keeps its hash and goes to the back of the
free queue; `allocate` takes blocks from the front and drops a taken block's hash then (eviction in LRU
order). `touch` revives a cached free block for a new user without copying anything.

Same idea as vLLM's automatic prefix caching (docs.vllm.ai, "Automatic Prefix Caching"); the code is ours.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kimi.errors import KimiError


class NoFreeBlocks(KimiError, RuntimeError):
    """Raised by `allocate` when fewer blocks are free than asked for (nothing is allocated then)."""


def salt_root(cache_salt: str | None) -> bytes:
    """The parent hash of a request's first block: b"" without a salt; with one, a 16-byte blake2b digest of the
    salt (its own `person`, so it is no block's hash), which every later block's hash chains from: requests with
    different salts never share a cached block (vLLM's `cache_salt`)."""
    if not cache_salt:
        return b""
    return hashlib.blake2b(cache_salt.encode("utf-8", "surrogatepass"), digest_size=16, person=b"kimi-salt").digest()


def block_hashes(
    token_ids: Sequence[int], block_size: int, start: int = 0, parent: bytes = b"", cache_salt: str | None = None
) -> list[bytes]:
    """Chained hashes of the full blocks of `token_ids`, beginning with block index `start`.

    token_ids: the whole token sequence (ints in [0, 2^63)); only blocks that are completely filled are
    hashed. `parent` must be the hash of block `start - 1` (ignored when start == 0: the first block's parent is
    `salt_root(cache_salt)`).
    Returns one 16-byte blake2b digest per full block from `start` on. Raises OverflowError on ids >= 2^63.
    """
    if start == 0:
        parent = salt_root(cache_salt)
    out: list[bytes] = []
    n_full = len(token_ids) // block_size
    for i in range(start, n_full):
        chunk = array("q", token_ids[i * block_size : (i + 1) * block_size]).tobytes()
        parent = hashlib.blake2b(parent + chunk, digest_size=16).digest()
        out.append(parent)
    return out


@dataclass
class PrefixCacheStats:
    """Counters for /metrics (monotonic since start).

    queries: prompt tokens looked up (one lookup per request admission, recomputes included);
    hits: of those, tokens found cached; requests / hit_requests: lookups and lookups with >= 1 hit block;
    evictions: cached blocks whose hash was dropped to reuse the block.
    """

    requests: int = 0
    hit_requests: int = 0
    queries: int = 0
    hits: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        """hits / queries (token level); 0.0 before any query."""
        return self.hits / self.queries if self.queries else 0.0


class BlockPool:
    """Reference-counted pool of KV-cache block ids with an LRU free queue and a prefix-cache hash map.

    num_blocks: total blocks on each worker, including the null block 0. block_size: tokens per block.
    enable_caching: keep full computed blocks findable by `lookup` (kimi serve --no-prefix-cache turns it off).
    Raises ValueError if num_blocks < 2 or block_size < 1.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._ref: list[int] = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self._hash_of: dict[int, bytes] = {}  # block -> its hash (cached blocks only)
        self._block_of: dict[bytes, int] = {}  # hash -> block
        self.stats = PrefixCacheStats()

    # ---- sizes --------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` can hand out now (free ones, cached or not)."""
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that currently hold a prefix-cache hash (in use or free)."""
        return len(self._block_of)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    # ---- allocation ---------------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks (least recently freed first), each with ref count 1. Raises NoFreeBlocks.

        A taken block that was cached loses its hash (evicted).
        """
        if n > len(self._free):
            raise NoFreeBlocks(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            h = self._hash_of.pop(b, None)
            if h is not None:
                del self._block_of[h]
                self.stats.evictions += 1
            self._ref[b] = 1
            out.append(b)
        return out

    def free(self, blocks: list[int]) -> None:
        """Drop one reference from each block; blocks reaching zero go to the back of the free queue.

        Freed in reverse so that a request's tail blocks are evicted before its head blocks (a cached
        prefix's head is what other requests share). Cached blocks keep their hash while free.
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

    # ---- prefix cache -------------------------------------------------------------------------------------
    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes` (stops at the first miss); no refs taken.

        Returns [] when caching is off. Does not count in `stats` (see `record_query`), so a request that
        waits for free blocks and looks up again is counted once, when it is admitted.
        """
        if not self.enable_caching:
            return []
        out: list[int] = []
        for h in hashes:
            b = self._block_of.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def record_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one admission's prefix lookup in `stats`: tokens looked up and tokens found cached. Without
        prefix caching nothing is looked up, and nothing is counted (a 0% hit rate would mislead)."""
        if not self.enable_caching:
            return
        self.stats.requests += 1
        self.stats.queries += num_query_tokens
        if num_hit_tokens:
            self.stats.hit_requests += 1
            self.stats.hits += num_hit_tokens

    def num_free_among(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` have ref count 0 (touching them takes them out of the free queue)."""
        return sum(1 for b in blocks if self._ref[b] == 0)

    def touch(self, blocks: Sequence[int]) -> None:
        """Take one more reference on each (cached) block; a free one leaves the free queue.

        Raises ValueError if a block is neither in use nor cached (its content would be unknown).
        """
        for b in blocks:
            if self._ref[b] == 0:
                if b not in self._hash_of:
                    raise ValueError(f"block {b} is free and not cached; it cannot be shared")
                del self._free[b]
            self._ref[b] += 1

    def cache(self, block: int, h: bytes) -> bool:
        """Register an in-use, fully computed block under hash `h`. Returns True if it was registered.

        No-op (False) when caching is off, when the block already has a hash, or when another block already
        holds `h` (the same prefix computed twice concurrently: the first stays the cached copy and this one
        is freed normally). Raises ValueError if the block is not in use.
        """
        if self._ref[block] <= 0:
            raise ValueError(f"block {block} is not in use")
        if not self.enable_caching or block in self._hash_of or h in self._block_of:
            return False
        self._hash_of[block] = h
        self._block_of[h] = block
        return True

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of
