"""CudaGraphRunner._stage_pages (kimi/worker/cuda_graph.py), the host side of the CUDA-graph decode path's page ids:
row b of the FlashInfer kv_indices buffer holds sequence b's pages at b * page_stride, kept from step to step,
and each step writes only what the device does not hold yet. Checked on the host staging buffer alone (no GPU):
after every step, rows [0, bucket) of the buffer hold exactly the batch's pages (padded rows: the null block 0), and
the returned last changed row covers every row written."""

import types

import numpy as np

from kimi.worker.cuda_graph import CudaGraphRunner


def _runner(max_batch: int, width: int):
    r = types.SimpleNamespace(
        max_batch=max_batch,
        max_blocks_per_seq=width,
        page_stride=width,
        _host_kv=np.full(max_batch * width, -1, dtype=np.int32),
    )
    CudaGraphRunner._forget_pages(r)
    return r


def _step(r, tables, seq_lens, bs, blk=16):
    ks = [-(-n // blk) for n in seq_lens]
    before = r._host_kv.copy()
    hi = CudaGraphRunner._stage_pages(r, tables, ks, len(tables), bs)
    W = r.page_stride
    for b in range(bs):
        want = tables[b][: ks[b]] if b < len(tables) else [0]
        assert r._host_kv[b * W : b * W + len(want)].tolist() == list(want), (b, want)
    changed = np.nonzero(r._host_kv != before)[0]
    if len(changed):
        assert changed.max() // W <= hi, (changed, hi)  # the copy of rows [0, hi] covers every write
    return hi


def test_rows_kept_appends_reorders_and_pads():
    r = _runner(8, 6)
    a, b, c = [11, 12], [21], [31, 32, 33]
    assert _step(r, [a, b, c], [20, 16, 40], 4) == 3  # first step: every row (and the pad row 3)
    assert _step(r, [a, b, c], [21, 16, 41], 4) == -1  # same pages: nothing to write, nothing to copy
    b.append(22)  # sequence b crosses into a new block: its list grows at the end
    assert _step(r, [a, b, c], [22, 17, 42], 4) == 1
    assert r._row_pages[1] == 2
    assert _step(r, [c, a], [43, 23], 2) == 1  # reordered, smaller bucket: rows 0, 1 rewritten
    assert _step(r, [c, a, b, [41]], [44, 24, 18, 3], 4) == 3  # rows 2 (b again) and 3 (new) rewritten
    assert _step(r, [c, a, b], [45, 25, 19], 4) == 3  # row 3 becomes padding
    assert _step(r, [c, a, b], [46, 26, 20], 4) == -1


def test_forgotten_rows_are_written_again():
    r = _runner(4, 4)
    t = [[1, 2], [3]]
    _step(r, t, [32, 10], 2)
    CudaGraphRunner._forget_pages(r)  # something else wrote the device buffer (CudaGraphRunner._plan)
    r._host_kv[:] = -1
    assert _step(r, t, [32, 10], 2) == 1


def test_page_stride_is_the_next_power_of_two_within_bounds():
    """pages per row: the next power of two of the longest table (at least 16), never past max_blocks_per_seq"""
    r = _runner(4, 4096)
    stride = lambda k: CudaGraphRunner._page_stride(r, k)
    assert [stride(k) for k in (1, 16, 17, 32, 33, 100, 4096)] == [16, 16, 32, 32, 64, 128, 4096]
    r.max_blocks_per_seq = 40
    assert [stride(k) for k in (1, 33, 40)] == [16, 40, 40]
