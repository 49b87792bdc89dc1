"""GPU tests of FlashMLA decode attention (kimi.ops.attention_flashmla: sglang-kernel's FlashMLA library) on Kimi's
shapes.

Reference: kimi.ops.attention.mla_decode_ref in float32 on random bf16 inputs, 64-token pages scattered by a random
permutation; outputs are poisoned with NaN before every call; tolerance max |o - ref| <= 1e-2 * max |ref| (bf16
output rounding and the bf16 p of the P @ V product are ~4e-3 relative). Also: the cache past each length poisoned
(NaN, and 1e4), CUDA graph capture of the schedule + attention replayed with new lengths / tables in the static
buffers (bit-equal to eager), page ids past 2^31 cache elements, head counts 16 / 64 / 128, and bad arguments.
Skipped (with the reason) where the library does not load: it needs sglang-kernel 0.4.6 (torch 2.11, CUDA 13).
"""

import pytest
import torch

from kimi.ops import attention_flashmla as fm
from kimi.ops.attention import mla_decode_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

H, L, R, BS = 64, 512, 64, 64
SCALE = 0.1308  # ~ Kimi's softmax_scale (192-dim based, with the yarn mscale)
DT = torch.bfloat16


@pytest.fixture(scope="module", autouse=True)
def _library():
    if not fm.available():
        pytest.skip(f"FlashMLA library not loadable here: {fm.load_error()}")


def _make(seq, heads=H, num_blocks=None, seed=0, past=None):
    """Random joint q [B, heads, L + R], cache [num_blocks, 64, L + R] with the given lengths' pages at the END of the
    cache (large ids), int32 tables and lengths. past: a value written into every cache slot past each length in
    the sequence's last page (None: random data)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    B = len(seq)
    nb = [-(-s // BS) for s in seq]
    need = sum(nb) + 1
    num_blocks = num_blocks or need
    if num_blocks == need:
        kv = torch.randn(num_blocks, BS, L + R, device="cuda", dtype=DT, generator=g)
    else:  # a big cache: random data in the pages used only
        kv = torch.zeros(num_blocks, BS, L + R, device="cuda", dtype=DT)
    ids = torch.randperm(need - 1, device="cuda", generator=g) + (num_blocks - need + 1)
    if num_blocks != need:
        kv[ids] = torch.randn(need - 1, BS, L + R, device="cuda", dtype=DT, generator=g)
    bt = torch.zeros(B, max(nb) + 3, dtype=torch.int32, device="cuda")
    i = 0
    for b in range(B):
        bt[b, : nb[b]] = ids[i: i + nb[b]].to(torch.int32)
        i += nb[b]
        if past is not None and seq[b] % BS:
            kv[int(bt[b, nb[b] - 1]), seq[b] % BS:] = past
    q = torch.randn(B, heads, L + R, device="cuda", dtype=DT, generator=g)
    return q, kv, bt, torch.tensor(seq, dtype=torch.int32, device="cuda")


def _check(q, kv, bt, seq, label, heads=H):
    run = fm.FlashMLADecode(seq, bt, SCALE, heads)
    run.begin_step()
    out = torch.full((len(seq), heads, L), float("nan"), dtype=DT, device="cuda")
    run.run_joint(q, kv, out=out)
    torch.cuda.synchronize()
    ref = mla_decode_ref(q[..., :L], q[..., L:], kv, bt.long(), seq.long(), SCALE)
    assert not torch.isnan(out).any(), f"{label}: NaN in the output"
    err = (out.float() - ref).abs().max().item() / ref.abs().max().item()
    assert err <= 1e-2, f"{label}: rel err {err:.3g}"
    return out, err


CASES = [(B, ctx) for B in (1, 3, 8, 32, 64) for ctx in (1, 100, 2048)] + [(1, 33000), (3, 33000)]


@pytest.mark.parametrize("B,ctx", CASES, ids=[f"B{b}_ctx{c}" for b, c in CASES])
def test_shapes_vs_reference(B, ctx):
    """Equal and ragged lengths (1 .. 33000 tokens)."""
    ragged = [max(1, ctx - (37 * b) % max(ctx, 1)) for b in range(B)]
    for k, seq in enumerate(([ctx] * B, ragged)):
        _check(*_make(seq, seed=B * 7 + ctx + k), f"B={B} ctx={ctx} {'ragged' if k else 'equal'}")


@pytest.mark.parametrize("heads", [16, 128])
def test_head_counts(heads):
    seq = [1, 65, 700, 2048, 129]
    _check(*_make(seq, heads=heads, seed=heads), f"heads={heads}", heads=heads)


@pytest.mark.parametrize("past", [1e4, float("nan")], ids=["1e4", "nan"])
def test_cache_past_lengths_not_read(past):
    """Slots past a length in its last page hold 1e4 or NaN: neither reaches the output (kimi's cache starts as
    zeros, but a freed page keeps its previous sequence's values)."""
    seq = [1, 63, 65, 130, 2047, 777]
    _check(*_make(seq, seed=11, past=past), f"past={past}")


def test_page_ids_past_2_to_31_elements():
    """Pages at the end of a 70000-page cache: offsets up to 70000 * 64 * 576 ~ 2.6e9 elements (> 2^31)."""
    seq = [2048, 1000, 64, 1]
    _check(*_make(seq, num_blocks=70000, seed=5), "70000 pages")


def test_cuda_graph_replay_equals_eager():
    """The schedule kernel and the attention captured in one graph over static length / table buffers; replays
    after writing new lengths (other splits) and tables into them give the eager result bit for bit."""
    maxb, width = 8, 44
    lens = torch.ones(maxb, dtype=torch.int32, device="cuda")
    tabs = torch.zeros(maxb, width, dtype=torch.int32, device="cuda")
    qbuf = torch.zeros(maxb, H, L + R, dtype=DT, device="cuda")
    _, kv, bt0, s0 = _make([2048, 1, 5, 64, 65, 1500, 300, 2500], seed=1)  # 107 pages of random data
    lens.copy_(s0)
    tabs[:, : bt0.shape[1]] = bt0
    run = fm.FlashMLADecode(lens, tabs, SCALE, H)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run.begin_step()
        run.run_joint(qbuf, kv)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run.begin_step()
        out = run.run_joint(qbuf, kv)
    gen = torch.Generator(device="cuda").manual_seed(21)
    for k, seq in enumerate([[2048, 1, 5, 64, 65, 1500, 300, 2500], [100] * 8, [1] * 8, [800] * 8]):
        nb = [-(-n // BS) for n in seq]
        assert sum(nb) < kv.shape[0]
        ids = (torch.randperm(kv.shape[0] - 1, device="cuda", generator=gen) + 1).to(torch.int32)
        bt = torch.zeros(maxb, width, dtype=torch.int32, device="cuda")
        i = 0
        for b in range(maxb):
            bt[b, : nb[b]] = ids[i : i + nb[b]]
            i += nb[b]
        sl = torch.tensor(seq, dtype=torch.int32, device="cuda")
        q = torch.randn(maxb, H, L + R, device="cuda", dtype=DT, generator=gen)
        lens.copy_(sl)
        tabs.copy_(bt)
        qbuf.copy_(q)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        got = out.clone()
        want, _ = _check(q, kv, bt, sl, f"graph case {k}")
        assert torch.equal(got, want), f"graph case {k}: replay differs from eager"


def test_bad_arguments():
    q, kv, bt, seq = _make([10, 20])
    with pytest.raises(ValueError, match="int32"):
        fm.FlashMLADecode(seq.long(), bt, SCALE, H)
    run = fm.FlashMLADecode(seq, bt, SCALE, H)
    with pytest.raises(RuntimeError, match="begin_step"):
        run.run_joint(q, kv)
    run.begin_step()
    with pytest.raises(ValueError, match="q "):
        run.run_joint(q[:, :, :L], kv)
    with pytest.raises(ValueError, match="kv_cache"):
        run.run_joint(q, kv.view(-1, 32, L + R))
