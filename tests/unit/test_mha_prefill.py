"""The non-absorbed ("MHA") prefill of fresh sequences (kimi.model.attention.mha_prefill_inputs + mha_prefill_ref,
the math of the GPU's MHA prefill path) against the absorbed form (mla_prefill_absorbed_ref, what FlashInfer's MLA
kernel computes) and the naive per-sequence reference the CPU model runs (mla_prefill_ref), float32 on the CPU.

The absorption is an identity (q_nope . (W_UK ckv) = (q_nope W_UK) . ckv; p @ (ckv W_UV^T) = (p @ ckv) W_UV^T), so
the tolerance is float32 rounding: |mha - absorbed| <= 1e-5 * max |absorbed| + 1e-5 * |absorbed| elementwise.
"""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from kimi.config import ModelConfig
from kimi.model.attention import mha_prefill_inputs, mha_prefill_ref, mla_prefill_absorbed_ref, mla_prefill_ref
from kimi.presets import load_preset

H, N, R, V, L = 4, 16, 8, 12, 32  # tiny MLA: heads, nope, rope, v, latent


def _inputs(lens: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q_nope = torch.randn(T, H, N, generator=g)
    q_pe = torch.randn(T, H, R, generator=g)
    latent = torch.randn(T, L + R, generator=g)
    kv_b = torch.randn(H * (N + V), L, generator=g) / L**0.5
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return q_nope, q_pe, latent, kv_b, cu


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("lens", [[37], [7, 1, 20, 13, 2]])
def test_mha_prefill_equals_absorbed(lens):
    scale = ModelConfig.from_dict(load_preset("kimi-k2.6")).softmax_scale  # 192^-0.5 * YaRN mscale^2
    q_nope, q_pe, latent, kv_b, cu = _inputs(lens, seed=len(lens))
    q, k, v = mha_prefill_inputs(q_nope, q_pe, latent, kv_b, H, N, V)
    assert q.shape == k.shape == (cu[-1], H, N + R) and v.shape == (cu[-1], H, V)
    assert torch.equal(k[:, 0, N:], latent[:, L:]) and torch.equal(k[:, H - 1, N:], latent[:, L:])  # k_pe shared
    mha = mha_prefill_ref(q, k, v, cu, scale)
    absorbed = mla_prefill_absorbed_ref(q_nope, q_pe, latent, kv_b, cu, H, N, V, scale)
    _close(mha, absorbed)
    for s, e in pairwise(cu):  # the naive per-sequence reference the CPU model runs (its context = its rows)
        _close(mha[s:e], mla_prefill_ref(q_nope[s:e], q_pe[s:e], latent[s:e], kv_b, H, N, V, scale))
    # the comparison can fail: one sequence boundary off changes the output
    cu_wrong = [cu[0], cu[1] + 1, *cu[2:]] if len(lens) > 1 else [0, cu[1] - 1]
    assert not torch.allclose(mha_prefill_ref(q, k, v, cu_wrong, scale), absorbed, rtol=1e-3, atol=1e-3)


def test_mha_prefill_ref_padding_and_errors():
    q_nope, q_pe, latent, kv_b, _cu = _inputs([5, 3], seed=3)
    q, k, v = mha_prefill_inputs(q_nope, q_pe, latent, kv_b, H, N, V)
    o = mha_prefill_ref(q, k, v, [0, 5], 0.2)  # rows 5..7 are not planned: zeros
    assert torch.count_nonzero(o[5:]) == 0 and torch.count_nonzero(o[:5]) > 0
    # the first row of a sequence attends to itself only: its output is its own v
    torch.testing.assert_close(o[0], v[0], rtol=0, atol=0)
    for bad in ([], [1, 5], [0, 9], [0, 5, 4]):
        with pytest.raises(ValueError, match="cu_seqlens"):
            mha_prefill_ref(q, k, v, bad, 0.2)


def test_set_prefill_attention():
    from kimi.backends.attention import flashinfer as fib

    assert fib.PREFILL_ATTENTION == "mla"  # the default: the absorbed MLA kernel for every prefill row
    previous = fib.set_prefill_attention("mha")
    try:
        assert previous == "mla" and fib.PREFILL_ATTENTION == "mha"
        with pytest.raises(ValueError, match="prefill attention"):
            fib.set_prefill_attention("naive")
        assert fib.PREFILL_ATTENTION == "mha"  # a bad name changes nothing
    finally:
        fib.set_prefill_attention(previous)
