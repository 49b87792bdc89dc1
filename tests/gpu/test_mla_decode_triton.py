"""GPU tests of the planless Triton MLA decode kernel (kimi.kernels.triton.mla_decode) on Kimi's shapes.

Reference: kimi.model.attention.mla_decode_ref in float32 on random bf16 inputs, blocks scattered by a random
permutation; outputs are poisoned with NaN before every kernel call; tolerance max |o - ref| <= 1e-2 * max |ref|
(bf16 output rounding and the bf16 p of the P @ V dot are ~4e-3 relative). Also: every config of CONFIGS, CUDA
graph capture + replay with new lengths / tables in the static buffers, 64-bit cache offsets, and FlashInfer's
MLA decode (when importable) on the same inputs.
"""

import pytest
import torch

from kimi.kernels.triton import mla_decode as mdt
from kimi.model.attention import mla_decode_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not mdt.HAS_TRITON, reason="needs Triton"),
]

H, L, R, BS = 64, 512, 64, 64
SCALE = 0.1308  # ~ Kimi's softmax_scale (192-dim based, with the yarn mscale)
DT = torch.bfloat16


def _make(seq, heads=H, bs=BS, bt_dtype=torch.int32, seq_dtype=torch.int32, width=None, num_blocks=None, seed=0):
    """Random q (q_lat / q_pe as views of one [B, H, L+R] tensor), cache, permuted tables for lengths `seq`."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    B = len(seq)
    nb = [-(-s // bs) for s in seq]
    need = sum(nb) + 1
    num_blocks = num_blocks or need
    kv = torch.randn(num_blocks, bs, L + R, device="cuda", dtype=DT, generator=g)
    # pages at the END of the cache (large ids: exercises 64-bit offsets when the cache is big)
    ids = torch.randperm(need - 1, device="cuda", generator=g) + (num_blocks - need + 1)
    width = width or max(nb)
    bt = torch.zeros(B, width, dtype=bt_dtype, device="cuda")
    i = 0
    for b in range(B):
        bt[b, : nb[b]] = ids[i : i + nb[b]].to(bt_dtype)
        i += nb[b]
    q = torch.randn(B, heads, L + R, device="cuda", dtype=DT, generator=g)
    return q[..., :L], q[..., L:], kv, bt, torch.tensor(seq, dtype=seq_dtype, device="cuda")


def _rel_err(out, ref):
    return (out.float() - ref).abs().max().item() / ref.abs().max().item()


def _run_check(args, label, **kw):
    q_lat, q_pe, kv, bt, seq = args
    out = torch.full(q_lat.shape, float("nan"), dtype=DT, device="cuda")
    mdt.mla_decode(q_lat, q_pe, kv, bt, seq, SCALE, out=out, **kw)
    torch.cuda.synchronize()
    ref = mla_decode_ref(q_lat, q_pe, kv, bt.long(), seq.long(), SCALE)
    assert not torch.isnan(out).any(), f"{label}: NaN left in the output"
    err = _rel_err(out, ref)
    assert err <= 1e-2, f"{label}: rel err {err:.3g}"
    return out, ref


CASES = [(B, ctx) for B in (1, 3, 8, 32, 64) for ctx in (1, 100, 2048)] + [(1, 33000), (3, 33000)]


@pytest.mark.parametrize("B,ctx", CASES, ids=[f"B{b}_ctx{c}" for b, c in CASES])
def test_shapes_vs_reference(B, ctx):
    """Default config: auto splits, 1 split (direct path) and 64 splits; equal and ragged lengths."""
    ragged = [max(1, ctx - (37 * b) % max(ctx, 1)) for b in range(B)]
    for k, seq in enumerate(([ctx] * B, ragged)):
        args = _make(seq, seed=B * 7 + ctx + k)
        for ns in (None, 1, 64):
            _run_check(args, f"B={B} ctx={ctx} {'ragged' if k else 'equal'} splits={ns}", num_splits=ns)


@pytest.mark.parametrize("cfg", mdt.CONFIGS, ids=[c.name() for c in mdt.CONFIGS])
def test_every_config(cfg):
    for B, seq in [(3, [2048, 1, 777]), (8, [100 + 61 * b for b in range(8)]), (1, [33000])]:
        args = _make(seq, bt_dtype=torch.int64, seq_dtype=torch.int64, width=-(-max(seq) // BS) + 5, seed=B)
        hg = mdt.programs_per_split(H, L, cfg)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        for ns in sorted({1, 3, mdt.choose_num_splits(B, sms, hg)}):
            _run_check(args, f"{cfg.name()} B={B} splits={ns}", num_splits=ns, config=cfg)


def test_other_head_counts_and_page_sizes():
    """tiny-mla (H 16), H 128 and 8, block sizes 16 and 32 (tiles spanning several pages)."""
    for heads, bs in [(16, 64), (128, 64), (8, 64), (64, 16), (16, 32)]:
        args = _make([1, 300, 1000], heads=heads, bs=bs, seed=heads + bs)
        for ns in (None, 1, 5):
            _run_check(args, f"H={heads} bs={bs} splits={ns}", num_splits=ns)


def test_large_cache_64bit_offsets():
    """num_blocks * 64 * 576 > 2^31 elements, request pages at the highest ids."""
    nblk = (2**31) // (BS * (L + R)) + 200
    args = _make([5000, 64, 1], num_blocks=nblk, seed=9)
    assert args[3].max().item() * BS * (L + R) > 2**31
    for ns in (None, 1):
        _run_check(args, f"large cache splits={ns}", num_splits=ns)
    del args
    torch.cuda.empty_cache()


def test_fp16_and_workspace():
    q_lat, q_pe, kv, bt, seq = _make([700, 33, 2048], seed=11)
    q_lat, q_pe, kv = q_lat.half(), q_pe.half(), kv.half()
    ws = torch.empty(mdt.workspace_numel(3, H, L, 8), dtype=torch.float32, device="cuda")
    out = mdt.mla_decode(q_lat, q_pe, kv, bt, seq, SCALE, num_splits=8, workspace=ws)
    assert out.dtype == torch.float16
    assert _rel_err(out, mla_decode_ref(q_lat, q_pe, kv, bt.long(), seq.long(), SCALE)) <= 1e-2


def test_cuda_graph_capture_and_replay():
    """Capture once per batch size with static buffers; replay with other lengths (longer and shorter than at
    capture) and other tables written into the same buffers."""
    B, max_ctx = 8, 4096
    width = max_ctx // BS
    num_blocks = B * width + 1
    g = torch.Generator(device="cuda").manual_seed(12)
    kv = torch.randn(num_blocks, BS, L + R, device="cuda", dtype=DT, generator=g)
    q = torch.randn(B, H, L + R, device="cuda", dtype=DT, generator=g)
    q_lat, q_pe = q[..., :L], q[..., L:]
    bt = torch.zeros(B, width, dtype=torch.int32, device="cuda")
    seq = torch.ones(B, dtype=torch.int32, device="cuda")
    out = torch.empty(B, H, L, dtype=DT, device="cuda")

    def fill(lens):
        perm = torch.randperm(num_blocks - 1, device="cuda", generator=g) + 1
        bt.copy_(perm[: B * width].view(B, width).to(torch.int32))
        seq.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn(B, H, L + R, device="cuda", dtype=DT, generator=g))

    fill([100] * B)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # compile outside capture
        mdt.mla_decode(q_lat, q_pe, kv, bt, seq, SCALE, out=out)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mdt.mla_decode(q_lat, q_pe, kv, bt, seq, SCALE, out=out)
    for lens in ([100] * B, [1, 4096, 65, 2048, 3000, 7, 64, 129], [4096] * B, [1] * B):
        fill(lens)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not torch.isnan(out).any(), f"graph replay {lens}: NaN left"
        ref = mla_decode_ref(q_lat, q_pe, kv, bt.long(), seq.long(), SCALE)
        err = _rel_err(out, ref)
        assert err <= 1e-2, f"graph replay {lens}: rel err {err:.3g}"
        eager = mdt.mla_decode(q_lat, q_pe, kv, bt, seq, SCALE)
        assert torch.equal(eager, out), "graph replay differs from the eager call"


def test_matches_flashinfer():
    try:
        from kimi.backends.attention.flashinfer import FlashInferMLADecode

        m = FlashInferMLADecode(H, SCALE, backend="fa3")
    except Exception as e:
        pytest.skip(f"FlashInfer MLA not available: {e!r}")
    for seq in ([2048] * 8, [1, 100, 33000], [37 + 300 * b for b in range(32)]):
        q_lat, q_pe, kv, bt, sl = _make(seq, seed=len(seq))
        ours = mdt.mla_decode(q_lat, q_pe, kv, bt, sl, SCALE)
        m.plan(list(seq), bt, BS)
        theirs = torch.full_like(ours, float("nan"))
        m.run(q_lat.contiguous(), q_pe.contiguous(), kv, out=theirs)
        torch.cuda.synchronize()
        ref = mla_decode_ref(q_lat, q_pe, kv, bt.long(), sl.long(), SCALE)
        assert _rel_err(theirs, ref) <= 1e-2
        diff = (ours.float() - theirs.float()).abs().max().item() / ref.abs().max().item()
        assert diff <= 1e-2, f"{len(seq)} requests: Triton vs FlashInfer rel diff {diff:.3g}"


def test_errors():
    q_lat, q_pe, kv, bt, seq = _make([10, 20], seed=13)
    with pytest.raises(ValueError):
        mdt.mla_decode(q_lat.float(), q_pe, kv, bt, seq, SCALE)
    with pytest.raises(ValueError):
        mdt.mla_decode(q_lat, q_pe, kv, bt.cpu(), seq, SCALE)
    with pytest.raises(ValueError):
        mdt.mla_decode(q_lat, q_pe, kv[..., :L], bt, seq, SCALE)
    with pytest.raises(ValueError):
        mdt.mla_decode(q_lat.cpu(), q_pe.cpu(), kv.cpu(), bt.cpu(), seq.cpu(), SCALE)
    with pytest.raises(ValueError):
        mdt.mla_decode(q_lat, q_pe, kv, bt, seq, SCALE, out=torch.empty(2, H, L, device="cuda"))
