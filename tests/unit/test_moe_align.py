"""kimi.ops.moe_int4_triton.moe_align (the torch reference of the MoE align): every local pair listed once, in its
expert's padded run, runs in the block order (experts with more than one block first), block_expert matching."""

import pytest
import torch

from kimi.ops.moe_int4_triton import align_block_order, moe_align


@pytest.mark.parametrize("multi_first", [True, False])
@pytest.mark.parametrize("T,k,E_total,E,offset,bm", [(40, 8, 32, 12, 8, 8), (256, 8, 384, 48, 96, 8),
                                                     (5, 4, 16, 8, 4, 16), (0, 8, 32, 12, 8, 8)])
def test_moe_align_lists_each_local_pair_once_in_block_order(multi_first, T, k, E_total, E, offset, bm):
    g = torch.Generator().manual_seed(T + bm)
    ids = torch.rand((T, E_total), generator=g).topk(k, dim=-1).indices
    s, be, npd, mb = moe_align(ids, E, offset, bm, multi_first=multi_first)
    P = T * k
    flat = ids.reshape(-1)
    local = ((flat >= offset) & (flat < offset + E)).nonzero().flatten()
    n = int(npd)
    assert n % bm == 0 and s.numel() == mb * bm and be.numel() == mb
    listed = s[:n]
    assert sorted(int(r) for r in listed if r < P) == local.tolist()  # each local pair once
    assert bool((s[n:] == P).all())  # nothing past num_padded
    counts = torch.bincount(flat[local] - offset, minlength=E)
    blocks = (counts + bm - 1) // bm
    assert n == int(blocks.sum()) * bm
    for b in range(n // bm):  # each block's rows belong to its expert (pads aside); pairs ascending in a run
        rows = [int(r) for r in s[b * bm : (b + 1) * bm] if r < P]
        assert all(int(flat[r]) - offset == int(be[b]) for r in rows)
        assert rows == sorted(rows)
    assert bool((be[n // bm :] == E - 1).all())
    # run order: experts' runs are contiguous; multi-block experts first when multi_first
    order = [int(be[b]) for b in range(n // bm)]
    runs = [e for i, e in enumerate(order) if i == 0 or order[i - 1] != e]
    assert len(runs) == len(set(runs)) == int((counts > 0).sum())
    if multi_first:
        nb = [int(blocks[e]) for e in runs]
        assert nb == sorted(nb, key=lambda v: v <= 1)  # every expert with 2+ blocks before every 1-block expert
        assert [e for e in runs if blocks[e] > 1] == sorted(e for e in runs if blocks[e] > 1)
        assert [e for e in runs if blocks[e] == 1] == sorted(e for e in runs if blocks[e] == 1)
    else:
        assert runs == sorted(runs)


def test_align_block_order():
    padded = torch.tensor([8, 16, 0, 8, 24, 8])
    assert align_block_order(padded, 8, False).tolist() == [0, 8, 24, 24, 32, 56]
    # multi-block experts (1: 16 rows, 4: 24 rows) first, then 0, 2 (empty), 3, 5
    assert align_block_order(padded, 8, True).tolist() == [40, 0, 48, 48, 16, 56]
