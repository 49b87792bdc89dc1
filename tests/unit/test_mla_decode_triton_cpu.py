"""CPU tests of kimi.kernels.triton.mla_decode: the host helpers in process, and (where Triton is installed and its
interpreter works with the installed numpy) both kernels under TRITON_INTERPRET=1 in a subprocess, in fp16 (the
interpreter's bf16 arithmetic is not faithful), against kimi.model.attention.mla_decode_ref in float32.

Tolerance: max |o - ref| <= 1e-2 * max |ref| (fp16 output rounding and the fp16 p of the P @ V dot are ~1e-3
relative). Outputs are poisoned with NaN before every call.
"""

import textwrap

import pytest
import torch

from kimi.kernels.triton import mla_decode as mdt
from tests.unit.triton_interp import run_interpreted


def test_choose_num_splits():
    # 1 program per SM (the default) over B * head groups programs per split, capped at 64
    assert mdt.choose_num_splits(8, 132) == 17
    assert mdt.choose_num_splits(8, 132, num_head_groups=2) == 9
    assert mdt.choose_num_splits(8, 132, programs_per_sm=2) == 33
    assert mdt.choose_num_splits(1, 132) == 64
    assert mdt.choose_num_splits(128, 132) == 2
    assert mdt.choose_num_splits(1024, 132) == 1
    assert mdt.choose_num_splits(1, 132, max_splits=16) == 16
    # context hint: no split shorter than min_tokens_per_split
    assert mdt.choose_num_splits(1, 132, max_ctx=1000) == 4
    assert mdt.choose_num_splits(1, 132, max_ctx=1) == 1
    for bad in [(0, 132), (8, 0)]:
        with pytest.raises(ValueError):
            mdt.choose_num_splits(*bad)
    with pytest.raises(ValueError):
        mdt.choose_num_splits(8, 132, num_head_groups=0)


def test_configs_and_workspace():
    assert isinstance(mdt.DEFAULT_CONFIG, mdt.MLADecodeConfig)
    names = [c.name() for c in mdt.CONFIGS]
    assert len(set(names)) == len(names)
    for c in mdt.CONFIGS:
        assert c.block_h >= 16 and c.block_n >= 16 and 512 % c.block_dv == 0
    assert mdt.workspace_numel(2, 64, 512, 3) == 2 * 3 * 64 * 513
    C = mdt.MLADecodeConfig
    assert mdt.programs_per_split(64, 512, C(block_h=64)) == 1
    assert mdt.programs_per_split(64, 512, C(block_h=16, block_dv=256)) == 8
    assert mdt.programs_per_split(8, 512, C(block_h=32)) == 1  # heads padded to 16, one group
    assert mdt.programs_per_split(128, 512, C(block_h=32)) == 4


def test_without_triton_raises():
    if mdt.HAS_TRITON:
        pytest.skip("Triton installed (the kernels are tested under the interpreter below)")
    q = torch.zeros(1, 16, 512, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError):
        mdt.mla_decode(
            q,
            torch.zeros(1, 16, 64, dtype=torch.bfloat16),
            torch.zeros(2, 16, 576, dtype=torch.bfloat16),
            torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32),
            0.1,
        )


_INTERP_SCRIPT = textwrap.dedent("""
    import torch
    from kimi.model.attention import mla_decode_ref
    from kimi.kernels.triton.mla_decode import MLADecodeConfig, mla_decode, workspace_numel

    L, R, SCALE = 512, 64, 0.05

    def make(seq, H, bs, bt_dtype, seq_dtype, extra_cols=1, seed=0):
        g = torch.Generator().manual_seed(seed)
        B = len(seq)
        nb = [-(-s // bs) for s in seq]
        num_blocks = sum(nb) + 2
        kv = torch.randn(num_blocks, bs, L + R, generator=g).half()
        kv[0] = float("nan")  # null block: padded table entries point here and must never be read unmasked
        perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
        width = max(max(nb) + extra_cols, 1)
        bt = torch.zeros(B, width, dtype=bt_dtype)
        i = 0
        for b in range(B):
            bt[b, : nb[b]] = torch.tensor(perm[i: i + nb[b]])
            i += nb[b]
        # a fully written page past seq_len holds NaN in its unused slots: they must be masked
        for b in range(B):
            if seq[b] % bs:
                kv[bt[b, nb[b] - 1], seq[b] % bs:] = float("nan")
        q = torch.randn(B, H, L + R + 8, generator=g).half()  # q_lat / q_pe are row-strided views of one tensor
        return q[..., :L], q[..., L: L + R], kv, bt, torch.tensor(seq, dtype=seq_dtype)

    def check(args, cfg, ns, label, workspace=None):
        q_lat, q_pe, kv, bt, seq = args
        ref = mla_decode_ref(q_lat, q_pe, torch.nan_to_num(kv), bt.long(), seq.long(), SCALE)  # [B, H, L] fp32
        out = torch.full(q_lat.shape, float("nan"), dtype=q_lat.dtype)
        ret = mla_decode(q_lat, q_pe, kv, bt, seq, SCALE, out=out, num_splits=ns, config=cfg, workspace=workspace)
        assert ret is out
        assert not torch.isnan(out).any(), (label, cfg, ns, "NaN in output")
        err = (out.float() - ref).abs().max().item()
        tol = 1e-2 * ref.abs().max().item()
        assert err <= tol, (label, cfg, ns, err, tol)
        return err

    worst = 0.0
    c16 = MLADecodeConfig(block_h=16, block_n=16, block_dv=512, num_warps=4)
    # H=16 (tiny-mla), block_size 16: ragged lengths incl. 1, not multiples of 16, one past a page boundary
    a = make([1, 37, 16, 100, 17], 16, 16, torch.int32, torch.int64)
    for cfg, ns in [(c16, 1), (c16, 3), (c16, 40),                              # 40 splits > pages of every request
                    (MLADecodeConfig(block_h=16, block_n=32, block_dv=512), 2),  # tiles span 2 pages
                    (MLADecodeConfig(block_h=64, block_n=16, block_dv=256), 4)]:  # value dim in 2 programs
        worst = max(worst, check(a, cfg, ns, "bs16 i32 tables"))
    # int64 tables, int32 seq_lens; block_size 64 with 16-token tiles (4 per page); preallocated workspace
    a = make([65, 3, 128], 16, 64, torch.int64, torch.int32, extra_cols=3, seed=1)
    ws = torch.empty(workspace_numel(3, 16, L, 5) + 7, dtype=torch.float32)
    worst = max(worst, check(a, c16, 5, "bs64 i64 tables", workspace=ws))
    worst = max(worst, check(a, MLADecodeConfig(block_h=16, block_n=64, block_dv=512), 1, "bs64 direct"))
    # 8 heads (< 16: masked head rows), block size 32
    a = make([33, 1], 8, 32, torch.int64, torch.int64, seed=2)
    worst = max(worst, check(a, c16, 2, "H8 bs32"))
    # seq_len 0 (a padded row): zeros, both paths
    q_lat, q_pe, kv, bt, seq = make([5, 20], 16, 16, torch.int32, torch.int32, seed=3)
    seq[0] = 0
    for ns in (1, 3):
        out = torch.full(q_lat.shape, float("nan"), dtype=q_lat.dtype)
        mla_decode(q_lat, q_pe, kv, bt, seq, SCALE, out=out, num_splits=ns, config=c16)
        assert torch.equal(out[0].float(), torch.zeros_like(out[0].float())), ns
        ref = mla_decode_ref(q_lat[1:], q_pe[1:], torch.nan_to_num(kv), bt[1:].long(), seq[1:].long(), SCALE)
        assert (out[1:].float() - ref).abs().max().item() <= 1e-2 * ref.abs().max().item()
    # default num_splits / config and out=None
    q_lat, q_pe, kv, bt, seq = make([50, 7], 16, 16, torch.int64, torch.int64, seed=4)
    o = mla_decode(q_lat, q_pe, kv, bt, seq, SCALE, config=c16)
    ref = mla_decode_ref(q_lat, q_pe, torch.nan_to_num(kv), bt, seq, SCALE)
    assert o.shape == ref.shape and o.dtype == q_lat.dtype
    assert (o.float() - ref).abs().max().item() <= 1e-2 * ref.abs().max().item()

    # validation: ValueError with a message
    def bad(fn, *args, **kw):
        try:
            fn(*args, **kw)
        except ValueError as e:
            assert str(e)
            return
        raise AssertionError(f"no ValueError for {args and [getattr(x, 'shape', x) for x in args]} {kw}")
    good = (q_lat, q_pe, kv, bt, seq, SCALE)
    bad(mla_decode, q_lat.float(), q_pe, kv, bt, seq, SCALE)                        # dtype
    bad(mla_decode, q_lat, q_pe[:, :8], kv, bt, seq, SCALE)                         # heads mismatch
    bad(mla_decode, q_lat, q_pe, kv[..., :570], bt, seq, SCALE)                     # L + R
    bad(mla_decode, q_lat, q_pe, kv, bt.float(), seq, SCALE)                        # table dtype
    bad(mla_decode, q_lat, q_pe, kv, bt[:1], seq, SCALE)                            # table rows
    bad(mla_decode, q_lat, q_pe, kv, bt, seq[:1], SCALE)                            # seq_lens
    bad(mla_decode, q_lat.transpose(1, 2).contiguous().transpose(1, 2), q_pe, kv, bt, seq, SCALE)  # stride
    bad(mla_decode, *good, out=torch.empty(2, 16, 256).half())                      # out shape
    bad(mla_decode, *good, num_splits=0)
    bad(mla_decode, *good, config=MLADecodeConfig(block_n=8))
    bad(mla_decode, *good, num_splits=3, workspace=torch.empty(10))
    print("OK worst", worst)
""")


def test_kernels_under_triton_interpreter():
    r = run_interpreted(_INTERP_SCRIPT, timeout=240)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
