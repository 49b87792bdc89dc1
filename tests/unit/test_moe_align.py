"""kimi.kernels.triton.moe_w4a16.moe_align (the torch reference of the MoE align;
kimi.kernels.triton.fused.moe_align_fused must equal
it): every local pair listed once, inside its expert's padded run, runs contiguous and in expert order, pairs in
ascending id within a run, block_expert matching the runs, nothing past num_padded."""

import pytest
import torch

from kimi.kernels.triton.moe_w4a16 import moe_align


@pytest.mark.parametrize(
    "T,k,E_total,E,offset,bm",
    [
        (40, 8, 32, 12, 8, 8),  # experts with 1 and with 2 blocks
        (256, 8, 384, 48, 96, 8),  # 32 local seqs under EP8
        (5, 4, 16, 8, 4, 16),
        (200, 8, 32, 12, 8, 64),
        (0, 8, 32, 12, 8, 8),
    ],
)
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
