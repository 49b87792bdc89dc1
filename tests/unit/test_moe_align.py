"""kimi.ops.moe_int4_triton.moe_align (the torch reference of the MoE align; kimi.ops.fused.moe_align_fused must equal
it): every local pair listed once, inside its expert's padded run, runs contiguous and in expert order, pairs in
ascending id within a run, block_expert matching the runs, nothing past num_padded."""

import pytest
import torch

from kimi.ops.moe_int4_triton import moe_align
from tests.unit.align_checks import check_split_align


@pytest.mark.parametrize("T,k,E_total,E,offset,bm", [(40, 8, 32, 12, 8, 8),  # experts with 1 and with 2 blocks
                                                     (256, 8, 384, 48, 96, 8),  # 32 local seqs under EP8
                                                     (5, 4, 16, 8, 4, 16), (200, 8, 32, 12, 8, 64),
                                                     (0, 8, 32, 12, 8, 8)])
def test_moe_align_lists_each_local_pair_once(T, k, E_total, E, offset, bm):
    g = torch.Generator().manual_seed(T + bm)
    ids = torch.rand((T, E_total), generator=g).topk(k, dim=-1).indices
    s, be, npd, mb = moe_align(ids, E, offset, bm)
    P = T * k
    flat = ids.reshape(-1)
    local = ((flat >= offset) & (flat < offset + E)).nonzero().flatten()
    n = int(npd)
    assert n % bm == 0 and s.numel() == mb * bm and be.numel() == mb
    assert mb == (P + bm - 1) // bm + min(E, P)
    assert sorted(int(r) for r in s[:n] if r < P) == local.tolist()  # each local pair once
    assert bool((s[n:] == P).all())  # sentinels past num_padded
    counts = torch.bincount(flat[local] - offset, minlength=E)
    blocks = (counts + bm - 1) // bm
    assert n == int(blocks.sum()) * bm
    for b in range(n // bm):  # a block's rows are its expert's pairs (pads aside), ascending
        rows = [int(r) for r in s[b * bm : (b + 1) * bm] if r < P]
        assert all(int(flat[r]) - offset == int(be[b]) for r in rows)
        assert rows == sorted(rows)
    assert bool((be[n // bm :] == E - 1).all())
    order = [int(be[b]) for b in range(n // bm)]
    runs = [e for i, e in enumerate(order) if i == 0 or order[i - 1] != e]
    assert runs == sorted(set(runs)) and len(runs) == int((counts > 0).sum())  # contiguous runs, expert order
    assert all(order.count(e) == int(blocks[e]) for e in runs)


@pytest.mark.parametrize("T,k,E_total,E,offset,sm,bm,skew", [
    (256, 8, 384, 48, 96, 8, 16, 0.0),  # 32 local seqs under EP8: a few experts with 9-16 pairs
    (256, 8, 384, 48, 96, 8, 16, 3.0),  # experts with 17+ pairs: several 16-row blocks
    (40, 8, 32, 12, 8, 8, 16, 0.0), (5, 4, 16, 8, 4, 4, 16, 0.0), (0, 8, 32, 12, 8, 8, 16, 0.0),
    (64, 8, 32, 12, 8, 16, 64, 0.0)])
def test_moe_align_split(T, k, E_total, E, offset, sm, bm, skew):
    from kimi.ops.moe_int4_triton import moe_align_split

    g = torch.Generator().manual_seed(T + 7 * sm)
    scores = torch.rand((T, E_total), generator=g)
    scores[:, offset : offset + 4] += skew
    ids = scores.topk(k, dim=-1).indices
    out = moe_align_split(ids, E, offset, sm, bm)
    check_split_align(ids, E, offset, sm, bm, *out)
    counts = torch.bincount((ids[(ids >= offset) & (ids < offset + E)] - offset).flatten(), minlength=E)
    if T == 256:  # the case holds what it is for
        assert int((counts > sm).sum()) >= 1 and (skew == 0 or int((counts > bm).sum()) >= 1)


def test_moe_align_split_rejects_bad_sizes():
    from kimi.ops.moe_int4_triton import moe_align_split

    ids = torch.zeros((2, 2), dtype=torch.int64)
    for sm, bm in ((8, 8), (16, 8), (0, 8)):
        with pytest.raises(ValueError, match="small_m < big_m"):
            moe_align_split(ids, 4, 0, sm, bm)
