"""kimi.ops.l2_prefetch's host side (no GPU): the byte ranges each region is cut into, the errors for layouts it
cannot describe, and the switch (off, or CPU tensors: no launch). The kernel itself: tests/gpu/test_l2_prefetch.py."""

from __future__ import annotations

import pytest
import torch

from kimi.ops import l2_prefetch


def test_whole_tensor_in_chunks():
    w = torch.zeros(64, 128, 512, dtype=torch.bfloat16)  # K2.6's W_UV: 8 MiB
    rows, pitch, nbytes = l2_prefetch.region_rows(w)
    assert pitch == nbytes == l2_prefetch.CHUNK_BYTES
    assert rows * nbytes == w.numel() * 2
    odd = torch.zeros(3, 8, dtype=torch.float32)  # 96 bytes: not whole chunks, one range
    assert l2_prefetch.region_rows(odd) == (1, 96, 96)


@pytest.mark.parametrize("fraction,want", [(0.25, 4096), (0.2, 3264), (1.0, 16384), (1e-6, 16)])
def test_row_fractions(fraction, want):
    o = torch.zeros(7168, 8192, dtype=torch.bfloat16)  # K2.6's o_proj: 16 KiB rows
    assert l2_prefetch.region_rows(o, fraction) == (7168, 16384, want)
    assert want % 16 == 0


def test_strided_rows_use_the_row_pitch():
    base = torch.zeros(10, 96, dtype=torch.bfloat16)
    view = base[:, :64]  # rows 192 bytes apart, 128 bytes used
    assert l2_prefetch.region_rows(view, 0.5) == (10, 192, 64)


@pytest.mark.parametrize("make,fraction,match", [
    (lambda: torch.zeros(8, 16, dtype=torch.bfloat16).t(), None, "contiguous"),
    (lambda: torch.zeros(7, dtype=torch.bfloat16), None, "multiple of 16"),
    (lambda: torch.zeros(4, 8, 8, dtype=torch.bfloat16), 0.5, "2-D"),
    (lambda: torch.zeros(8, 16, dtype=torch.bfloat16).t(), 0.5, "unit last stride"),
    (lambda: torch.zeros(8, 12, dtype=torch.bfloat16), 0.5, "pitch"),
    (lambda: torch.zeros(8, 16, dtype=torch.bfloat16), 0.0, "fraction"),
    (lambda: torch.zeros(8, 16, dtype=torch.bfloat16), 1.5, "fraction"),
    (lambda: torch.zeros(65, dtype=torch.bfloat16)[1:], None, "aligned"),
])
def test_layouts_it_cannot_describe_raise(make, fraction, match):
    with pytest.raises(ValueError, match=match):
        l2_prefetch.region_rows(make(), fraction)


def test_off_or_on_cpu_launches_nothing(monkeypatch):
    w_uv, o = torch.zeros(64, 128, 512, dtype=torch.bfloat16), torch.zeros(256, 1024, dtype=torch.bfloat16)
    monkeypatch.setattr(l2_prefetch, "ATTN_PREFETCH", None)
    assert not l2_prefetch.prefetch_before_attention(w_uv, o)
    monkeypatch.setattr(l2_prefetch, "ATTN_PREFETCH", (0.3, True))
    assert not l2_prefetch.prefetch_before_attention(w_uv, o)  # CPU tensors
    with pytest.raises(ValueError, match="CUDA"):
        l2_prefetch.prefetch_regions(w_uv, l2_prefetch.region_rows(w_uv), o, l2_prefetch.region_rows(o, 0.3), True)
