"""The contract checks of kimi.ops.moe_int4_triton.moe_align_split, shared by its CPU test (tests/unit/test_moe_align.py),
the Triton-interpreter test of kimi.ops.fused.moe_align_split_fused (tests/unit/test_fused_cpu.py, run by a python
without pytest) and the GPU test (tests/gpu/test_fused.py). Plain asserts, torch only."""

import torch


def check_split_align(ids, E, offset, sm, bm, s, be_a, be_b, npd, mbb, exact_order=True):
    """The contract of moe_align_split (shared with tests of kimi.ops.fused.moe_align_split_fused): every local pair
    listed once; an expert with 1..sm pairs has exactly one block of sm rows in list A, one with more has
    ceil(pairs / bm) blocks of bm rows in list B, runs in expert order in each list, every pair in its expert's
    run (ascending within a block when exact_order); sentinels everywhere else; num_padded = (rows A, rows B,
    cap_a + rows B); block experts E - 1 past the used blocks."""
    from kimi.ops.moe_int4_triton import split_sizes

    T, k = ids.shape
    P = T * k
    cap_a, mb, cap = split_sizes(P, E, sm, bm)
    assert mbb == mb and s.shape == (cap,) and be_a.shape == (E,) and be_b.shape == (mb,) and npd.shape == (3,)
    assert s.dtype == be_a.dtype == be_b.dtype == npd.dtype == torch.int32
    flat = ids.reshape(-1)
    local = ((flat >= offset) & (flat < offset + E)).nonzero().flatten()
    counts = torch.bincount(flat[local] - offset, minlength=E)
    small, big = (counts > 0) & (counts <= sm), counts > sm
    na, nb = int(small.sum()) * sm, int(((counts + bm - 1) // bm * big).sum()) * bm
    assert npd.tolist() == [na, nb, cap_a + nb]
    listed = [int(r) for r in torch.cat([s[:na], s[cap_a : cap_a + nb]]) if r < P]
    assert sorted(listed) == local.tolist()  # each local pair once
    assert bool((s[na:cap_a] == P).all()) and bool((s[cap_a + nb :] == P).all())  # sentinels past the used rows
    for lst, rows, n, be, want in ((s[:cap_a], sm, na, be_a, small), (s[cap_a:], bm, nb, be_b, big)):
        order = [int(be[b]) for b in range(n // rows)]
        assert order == sorted(order)  # runs in expert order
        assert sorted(set(order)) == want.nonzero().flatten().tolist()  # exactly this list's experts
        for e in set(order):
            assert order.count(e) == -(-int(counts[e]) // rows)
        for b in range(n // rows):
            blk = [int(r) for r in lst[b * rows : (b + 1) * rows] if r < P]
            assert all(int(flat[r]) - offset == order[b] for r in blk)
            if exact_order:
                assert blk == sorted(blk)
        assert bool((be[n // rows :] == E - 1).all())

