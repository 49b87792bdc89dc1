"""BlockPool: ref counts, LRU free queue, prefix-cache hashing, lookup, eviction, stats."""

from __future__ import annotations

import pytest

from kimi.controller.block_pool import BlockPool, NoFreeBlocks, block_hashes


def test_block_hashes_are_chained_and_stable():
    a = block_hashes(list(range(10)), 4)
    assert len(a) == 2 and all(len(h) == 16 for h in a)  # the partial third block is not hashed
    assert block_hashes(list(range(10)), 4) == a  # stable across calls (no per-process salt)
    # The same block content after a different prefix hashes differently (the hash names the prefix).
    b = block_hashes([9, 9, 9, 9, 4, 5, 6, 7], 4)
    assert b[1] != a[1]
    # Resuming from block 1 with the parent's hash gives the same chain.
    assert block_hashes(list(range(12)), 4, start=1, parent=a[0]) == block_hashes(list(range(12)), 4)[1:]
    # Token ids that collide as 32-bit values do not collide here (int64 bytes).
    assert block_hashes([1, 2, 3, 2**32 + 4], 4) != block_hashes([1, 2, 3, 4], 4)


def test_allocate_free_ref_counts_and_errors():
    pool = BlockPool(5, 4)
    assert pool.num_free_blocks == 4 and pool.num_usable_blocks == 4
    a = pool.allocate(3)
    assert 0 not in a and len(set(a)) == 3 and all(pool.ref_count(b) == 1 for b in a)
    with pytest.raises(NoFreeBlocks):
        pool.allocate(2)
    assert pool.num_free_blocks == 1  # a failed allocate takes nothing
    pool.free(a)
    assert pool.num_free_blocks == 4
    with pytest.raises(ValueError):
        pool.free([a[0]])  # not in use any more
    with pytest.raises(ValueError):
        pool.free([0])  # the null block
    with pytest.raises(ValueError):
        BlockPool(1, 4)


def test_cached_blocks_survive_free_and_are_found():
    pool = BlockPool(6, 2)
    toks = [1, 2, 3, 4, 5]
    hs = block_hashes(toks, 2)
    blocks = pool.allocate(3)
    assert pool.cache(blocks[0], hs[0]) and pool.cache(blocks[1], hs[1])
    assert not pool.cache(blocks[0], hs[0])  # already cached
    assert pool.lookup(hs) == blocks[:2]
    pool.free(blocks)
    assert pool.num_free_blocks == 5 and pool.num_cached_blocks == 2  # free but still findable
    hit = pool.lookup(block_hashes([1, 2, 3, 4, 9, 9], 2))
    assert hit == blocks[:2]  # longest prefix: stops at the first miss
    assert pool.lookup(block_hashes([7, 7, 3, 4], 2)) == []  # same second block after another first: miss
    assert pool.num_free_among(hit) == 2
    pool.touch(hit)
    assert pool.num_free_blocks == 3 and [pool.ref_count(b) for b in hit] == [1, 1]
    pool.touch(hit[:1])  # a second user
    assert pool.ref_count(hit[0]) == 2
    pool.free(hit[:1])
    assert pool.ref_count(hit[0]) == 1 and pool.is_cached(hit[0])


def test_duplicate_content_keeps_first_copy_and_touch_refuses_uncached_free_block():
    pool = BlockPool(4, 2)
    h = block_hashes([1, 2], 2)[0]
    a, b = pool.allocate(2)
    assert pool.cache(a, h) and not pool.cache(b, h)
    assert pool.lookup([h]) == [a] and not pool.is_cached(b)
    pool.free([b])
    with pytest.raises(ValueError):
        pool.touch([b])
    with pytest.raises(ValueError):
        pool.cache(b, h)  # not in use


def test_eviction_is_lru_and_drops_the_hash():
    pool = BlockPool(4, 1)  # 3 usable blocks of one token
    hs = block_hashes([10, 20, 30], 1)
    blocks = pool.allocate(3)
    for blk, h in zip(blocks, hs):
        pool.cache(blk, h)
    pool.free([blocks[0]])  # freed first: evicted first
    pool.free([blocks[2], blocks[1]])  # free() releases in reverse: blocks[1] then blocks[2]
    (x,) = pool.allocate(1)
    assert x == blocks[0] and not pool.is_cached(x) and pool.stats.evictions == 1
    assert pool.lookup(hs) == []  # the chain's head is gone, so nothing after it is reachable
    assert pool.lookup(hs[1:]) == [blocks[1], blocks[2]]
    # Touching a cached free block takes it out of the queue, so allocation skips it.
    pool.touch([blocks[2]])
    (y,) = pool.allocate(1)
    assert y == blocks[1] and pool.is_cached(blocks[2]) and pool.stats.evictions == 2
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)


def test_caching_off_finds_nothing_and_counts_no_queries():
    """Stats count lookups with caching on; with it off nothing is looked up, so nothing is counted (/metrics
    would otherwise show prefix-cache queries with a 0% hit rate for a server without a prefix cache)."""
    pool = BlockPool(4, 2, enable_caching=False)
    (a,) = pool.allocate(1)
    h = block_hashes([1, 2], 2)[0]
    assert not pool.cache(a, h) and pool.lookup([h]) == []
    pool.record_query(10, 0)
    st = pool.stats
    assert (st.requests, st.hit_requests, st.queries, st.hits) == (0, 0, 0, 0) and st.hit_rate == 0.0
    pool = BlockPool(4, 2, enable_caching=True)
    pool.record_query(10, 0)
    pool.record_query(6, 4)
    st = pool.stats
    assert (st.requests, st.hit_requests, st.queries, st.hits) == (2, 1, 16, 4) and st.hit_rate == 0.25


def test_cache_salt_separates_chains_from_the_first_block():
    ids = list(range(12))
    plain = block_hashes(ids, 4)
    salted = block_hashes(ids, 4, cache_salt="tenant-a")
    other = block_hashes(ids, 4, cache_salt="tenant-b")
    assert len(plain) == len(salted) == len(other) == 3
    assert not set(plain) & set(salted) and not set(salted) & set(other)  # no block is shared across salts
    assert block_hashes(ids, 4, cache_salt="tenant-a") == salted  # stable
    assert block_hashes(ids, 4, cache_salt="") == plain  # "" and None: unsalted
    # extending a salted chain from block 1 on continues it (the salt only seeds block 0's parent)
    assert block_hashes(ids, 4, 1, salted[0], "tenant-a") == salted[1:]
    pool = BlockPool(8, 4)
    (blk,) = pool.allocate(1)
    pool.cache(blk, salted[0])
    assert pool.lookup(plain) == [] and pool.lookup(other) == []
    assert pool.lookup(salted) == [blk]
