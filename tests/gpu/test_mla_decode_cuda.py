"""GPU tests of kimi's CUDA MLA decode (kimi.ops.mla_decode_cuda, csrc/mla_decode.cu) on Kimi's shapes.

Reference: kimi.ops.attention.mla_decode_ref in float32 on random bf16 inputs, blocks scattered by a random
permutation; outputs are poisoned with NaN before every kernel call; tolerance max |o - ref| <= 1e-2 * max |ref|
(bf16 output rounding and the bf16 p of the P @ V product are ~4e-3 relative). The cache rows past each request's
length hold NaN (what a reused block may hold). Also: split counts from 1 (direct) to 32, lengths that are not
multiples of the 64-token tile, empty requests (seq_len 0), int64 tables, 128-token pages, 64-bit cache offsets,
CUDA graph replay with new lengths / tables in the static buffers, and FlashInfer's MLA decode on the same inputs.
"""

import pytest
import torch

from kimi.ops import mla_decode_cuda as mdc
from kimi.ops.attention import mla_decode_ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

H, L, R, BS = 64, 512, 64, 64
SCALE = 0.1308  # ~ Kimi's softmax_scale (192-dim based, with the yarn mscale)
DT = torch.bfloat16


def _make(seq, bs=BS, bt_dtype=torch.int32, seq_dtype=torch.int32, width=None, num_blocks=None, seed=0):
    """Random q (q_lat / q_pe as views of one [B, H, L+R] tensor), cache, permuted tables for lengths `seq`."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    B = len(seq)
    nb = [-(-s // bs) for s in seq]
    need = sum(nb) + 1
    num_blocks = num_blocks or need
    kv = torch.randn(num_blocks, bs, L + R, device="cuda", dtype=DT, generator=g)
    ids = torch.randperm(need - 1, device="cuda", generator=g) + (num_blocks - need + 1)
    width = width or max(1, max(nb))
    bt = torch.zeros(B, width, dtype=bt_dtype, device="cuda")
    i = 0
    for b in range(B):
        bt[b, : nb[b]] = ids[i: i + nb[b]].to(bt_dtype)
        i += nb[b]
    for b in range(B):  # the rest of each request's last block: NaN (never read into the result)
        if seq[b] % bs:
            kv[int(bt[b, nb[b] - 1]), seq[b] % bs:] = float("nan")
    q = torch.randn(B, H, L + R, device="cuda", dtype=DT, generator=g)
    return q[..., :L], q[..., L:], kv, bt, torch.tensor(seq, dtype=seq_dtype, device="cuda")


def _ref(q_lat, q_pe, kv, bt, seq):
    ref = mla_decode_ref(q_lat, q_pe, kv.nan_to_num(0.0), bt.long(), seq.long().clamp(min=1), SCALE)
    return torch.where((seq == 0).view(-1, 1, 1), torch.zeros_like(ref), ref)  # seq_len 0 -> o_lat = 0


def _rel_err(out, ref):
    return (out.float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)


def _run_check(args, label, ref=None, **kw):
    q_lat, q_pe, kv, bt, seq = args
    out = torch.full(q_lat.shape, float("nan"), dtype=DT, device="cuda")
    mdc.mla_decode(q_lat, q_pe, kv, bt, seq, SCALE, out=out, **kw)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any(), f"{label}: NaN left in the output"
    err = _rel_err(out, _ref(q_lat, q_pe, kv, bt, seq) if ref is None else ref)
    assert err <= 1e-2, f"{label}: rel err {err:.3g}"
    return out



CASES = [(B, ctx) for B in (1, 3, 8, 32, 64) for ctx in (1, 31, 100, 2048)] + [(1, 33000), (4, 9000)]


@pytest.mark.parametrize("B,ctx", CASES, ids=[f"B{b}_ctx{c}" for b, c in CASES])
def test_shapes_vs_reference(B, ctx):
    """Auto splits, 1 split (direct path), 3, 8 and 32 splits; equal and ragged lengths."""
    ragged = [max(1, ctx - (37 * b) % max(ctx, 1)) for b in range(B)]
    for k, seq in enumerate(([ctx] * B, ragged)):
        args = _make(seq, seed=B * 7 + ctx + k)
        ref = _ref(*args)
        for ns in (None, 1, 3, 8, 32):
            _run_check(args, f"B={B} ctx={ctx} {'ragged' if k else 'equal'} splits={ns}", ref, num_splits=ns)


def test_empty_requests_int64_inputs_and_page_128():
    """seq_len 0 rows give zeros (direct and split paths); int64 tables / lengths; 128-token pages."""
    for bs in (64, 128):
        args = _make([0, 700, 0, 33, 64], bs=bs, bt_dtype=torch.int64, seq_dtype=torch.int64, seed=bs)
        for ns in (1, 4, None):
            out = _run_check(args, f"bs={bs} splits={ns}", num_splits=ns)
            assert out[0].abs().max().item() == 0 and out[2].abs().max().item() == 0


def test_large_cache_64bit_offsets():
    """num_blocks * 64 * 576 > 2^31 elements, request pages at the highest ids."""
    nblk = (2**31) // (BS * (L + R)) + 200
    args = _make([5000, 64, 1], num_blocks=nblk, seed=9)
    assert args[3].max().item() * BS * (L + R) > 2**31
    ref = _ref(*args)
    for ns in (None, 1):
        _run_check(args, f"large cache splits={ns}", ref, num_splits=ns)
    del args
    torch.cuda.empty_cache()


def test_cuda_graph_capture_and_replay():
    """Capture once with static buffers; replay with other lengths (longer and shorter than at capture) and other
    tables written into the same buffers; replay equals the eager call bit for bit."""
    B, max_ctx = 8, 4096
    width = max_ctx // BS
    num_blocks = B * width + 1
    g = torch.Generator(device="cuda").manual_seed(12)
    kv = torch.randn(num_blocks, BS, L + R, device="cuda", dtype=DT, generator=g)
    kv0 = kv.clone()
    q = torch.randn(B, H, L + R, device="cuda", dtype=DT, generator=g)
    q_lat, q_pe = q[..., :L], q[..., L:]
    bt = torch.zeros(B, width, dtype=torch.int32, device="cuda")
    seq = torch.ones(B, dtype=torch.int32, device="cuda")
    out = torch.empty(B, H, L, dtype=DT, device="cuda")
    ns = mdc.choose_num_splits(B, torch.cuda.get_device_properties(0).multi_processor_count, max_ctx)

    def fill(lens):
        perm = torch.randperm(num_blocks - 1, device="cuda", generator=g) + 1
        bt.copy_(perm[: B * width].view(B, width).to(torch.int32))
        seq.copy_(torch.tensor(lens, dtype=torch.int32))
        kv.copy_(kv0)
        for b in range(B):  # NaN past each length in its last block
            if lens[b] % BS:
                kv[int(bt[b, lens[b] // BS]), lens[b] % BS:] = float("nan")
        q.copy_(torch.randn(B, H, L + R, device="cuda", dtype=DT, generator=g))

    fill([100] * B)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # build the extension outside capture
        mdc.mla_decode(q_lat, q_pe, kv, bt, seq, SCALE, out=out, num_splits=ns)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mdc.mla_decode(q_lat, q_pe, kv, bt, seq, SCALE, out=out, num_splits=ns)
    for lens in ([100] * B, [1, 4096, 65, 2048, 3000, 7, 64, 129], [4096] * B, [1] * B):
        fill(lens)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not torch.isnan(out).any(), f"graph replay {lens}: NaN left"
        err = _rel_err(out, _ref(q_lat, q_pe, kv, bt, seq))
        assert err <= 1e-2, f"graph replay {lens}: rel err {err:.3g}"
        eager = mdc.mla_decode(q_lat, q_pe, kv, bt, seq, SCALE, num_splits=ns)
        assert torch.equal(eager, out), "graph replay differs from the eager call"


def test_split_counters_return_to_zero_and_results_repeat():
    """The last split of each request merges and resets its counter: after many calls (split counts 2..32) every
    counter is 0, and the same inputs give bit-identical outputs whichever CTA finished last."""
    args = _make([2048, 700, 1, 4096, 129], seed=21)
    first = {ns: _run_check(args, f"splits={ns}", num_splits=ns) for ns in (2, 5, 32)}
    for _ in range(20):
        for ns, want in first.items():
            assert torch.equal(mdc.mla_decode(*args, SCALE, num_splits=ns), want), ns
    torch.cuda.synchronize()
    assert int(mdc._done[args[0].device].abs().sum()) == 0


def test_matches_flashinfer():
    try:
        from kimi.ops.attention_flashinfer import FlashInferMLADecode

        m = FlashInferMLADecode(H, SCALE, backend="fa3")
    except Exception as e:  # noqa: BLE001 - ImportError, or no fa3 on this GPU
        pytest.skip(f"FlashInfer MLA not available: {e!r}")
    for seq in ([2048] * 8, [1, 100, 33000], [37 + 300 * b for b in range(32)]):
        q_lat, q_pe, kv, bt, sl = _make(seq, seed=len(seq))
        ours = mdc.mla_decode(q_lat, q_pe, kv, bt, sl, SCALE)
        m.plan(list(seq), bt, BS)
        theirs = torch.full_like(ours, float("nan"))
        m.run(q_lat.contiguous(), q_pe.contiguous(), kv.nan_to_num(0.0), out=theirs)
        torch.cuda.synchronize()
        ref = _ref(q_lat, q_pe, kv, bt, sl)
        assert _rel_err(theirs, ref) <= 1e-2
        diff = (ours.float() - theirs.float()).abs().max().item() / ref.abs().max().item()
        assert diff <= 1e-2, f"{len(seq)} requests: CUDA vs FlashInfer rel diff {diff:.3g}"


def test_errors():
    q_lat, q_pe, kv, bt, seq = _make([10, 20], seed=13)
    bad = [
        dict(q_lat=q_lat.float()),
        dict(bt=bt.cpu()),
        dict(kv=kv[..., :L]),
        dict(q_lat=torch.randn(2, 16, L, device="cuda", dtype=DT)),  # other head counts: not compiled
        dict(kv=torch.randn(3, 48, L + R, device="cuda", dtype=DT)),  # page not a multiple of the tile
        dict(out=torch.empty(2, H, L, device="cuda")),
        dict(num_splits=0),
        dict(num_splits=33),
        dict(workspace=torch.empty(5, device="cuda"), num_splits=4),
    ]
    for kw in bad:
        a = dict(q_lat=q_lat, q_pe=q_pe, kv=kv, bt=bt, seq=seq) | kw
        extra = {k: v for k, v in a.items() if k in ("out", "num_splits", "workspace")}
        with pytest.raises(ValueError):
            mdc.mla_decode(a["q_lat"], a["q_pe"], a["kv"], a["bt"], a["seq"], SCALE, **extra)
