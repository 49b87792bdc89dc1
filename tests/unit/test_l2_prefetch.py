"""kimi.ops.l2_prefetch: the byte runs the gate_up L2 prefetch covers (CPU; the kernel itself runs in
tests/gpu/test_moe_int4_cuda.py and in the GPU model tests)."""

import pytest
import torch

from kimi.ops import l2_prefetch as lp
from kimi.ops import moe_int4_cuda as mc


def _layout(E, N, K):
    return (torch.zeros((E, K // 16, 2 * N), dtype=torch.int32), torch.zeros((E, K // 32, N), dtype=torch.bfloat16))


def test_runs_start_at_each_warps_k_range_of_the_first_experts():
    E, N, K, kw = 6, 256, 1024, 4  # 16 k64 chunks, 4 per warp
    w, s = _layout(E, N, K)
    runs = lp.gate_up_ranges(w, s, kw, experts=2, frac=0.5)
    assert [r[0] is t for r, t in zip(runs, (w, s))] == [True, True]
    for t, stride_e, stride_q, length, n_e, n_q in runs:
        per_expert = t[0].numel() * t.element_size()
        assert (stride_e, stride_q, n_e, n_q) == (per_expert, per_expert // kw, 2, kw)
        assert length == per_expert // kw // 2 and length % lp.LINE == 0
    # warp q of kimi's kernel reads k64 chunks [q * C / kw, (q + 1) * C / kw): k16 steps from 4 * that, i.e. byte
    # q * stride_q of the expert's weights (k16 steps outermost), and scale groups from 2 * that
    k16_row = 2 * N * 4
    assert runs[0][2] == (K // 64 // kw) * 4 * k16_row
    assert runs[1][2] == (K // 64 // kw) * 2 * N * 2


def test_nothing_asked_gives_no_runs_and_bad_arguments_raise():
    w, s = _layout(4, 128, 512)
    assert lp.gate_up_ranges(w, s, 2, experts=0, frac=0.5) == []
    assert lp.gate_up_ranges(w, s, 2, experts=3, frac=0.0) == []
    assert lp.gate_up_ranges(w, s, 2, experts=99, frac=1.0)[0][4] == 4  # at most E experts
    with pytest.raises(ValueError, match="frac"):
        lp.gate_up_ranges(w, s, 2, experts=1, frac=1.5)
    with pytest.raises(ValueError, match="warps"):
        lp.gate_up_ranges(w, s, 3, experts=1, frac=0.5)
    lp.prefetch_gate_up_l2(w, s, 2, 1, 0.5)  # CPU tensors: nothing to do, no error


def test_the_decode_configurations_split_kimis_gate_up_k():
    """Every launch configuration kimi's GEMM may pick for Kimi's gate_up [4096, 7168] has a warp split the prefetch
    can follow."""
    w, s = _layout(1, 4096, 7168)
    for m in (64, 256, 512):
        kw = mc.config_for(4096, 7168, m)[1]
        assert lp.gate_up_ranges(w, s, kw, experts=1, frac=0.25)
