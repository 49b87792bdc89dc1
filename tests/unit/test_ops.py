"""Unit tests of the model ops against direct, independent formula computations (docs/model-format.md, Math)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kimi.config import ModelConfig, RopeScaling
from kimi.model.attention import (
    build_attention_metadata,
    gather_kv_cache,
    mla_decode_ref,
    mla_prefill_ref,
    write_kv_cache,
)
from kimi.model.model import KimiForCausalLM
from kimi.model.moe import MoELayer, fused_experts_ref, select_experts
from kimi.model.norm import rms_norm
from kimi.model.rope import RotaryEmbedding, apply_rope_interleaved, rope_inv_freq, yarn_correction_range
from kimi.worker.kv_cache import allocate_kv_caches, kv_cache_bytes_per_block


def small_cfg(**over) -> ModelConfig:
    d = dict(
        hidden_size=64,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_shared_experts=1,
        num_attention_heads=4,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        max_position_embeddings=1024,
        vocab_size=97,
        routed_scaling_factor=2.827,
        rope_theta=50000.0,
        rms_norm_eps=1e-5,
        rope_scaling=dict(
            type="yarn",
            factor=32.0,
            original_max_position_embeddings=64,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    )
    d.update(over)
    return ModelConfig.from_dict(d)


def kimi_cfg(factor: float, beta_fast: float, beta_slow: float) -> ModelConfig:
    return small_cfg(
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        rope_scaling=dict(
            type="yarn",
            factor=factor,
            original_max_position_embeddings=4096,
            beta_fast=beta_fast,
            beta_slow=beta_slow,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    )


# ---- norm -----------------------------------------------------------------------------------------------


def test_rms_norm_formula_and_dtype():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 32, generator=g)
    w = torch.randn(32, generator=g)
    want = torch.stack([w * r / math.sqrt(float((r * r).mean()) + 1e-6) for r in x])
    torch.testing.assert_close(rms_norm(x, w, 1e-6), want, rtol=1e-5, atol=1e-6)
    y = rms_norm(x.bfloat16(), w.bfloat16(), 1e-6)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), want, rtol=2e-2, atol=2e-2)


# ---- rope / yarn ----------------------------------------------------------------------------------------


def direct_yarn(dim, base, factor, orig, beta_fast, beta_slow):
    """The formula of docs/model-format.md, Math, written out element by element."""

    def corr(r):
        return dim * math.log(orig / (r * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr(beta_fast)), 0)
    high = min(math.ceil(corr(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    out = []
    for i in range(dim // 2):
        f_extra = base ** (-2 * i / dim)
        f_inter = f_extra / factor
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(f_inter * ramp + f_extra * (1 - ramp))
    return torch.tensor(out, dtype=torch.float64), (low, high)


@pytest.mark.parametrize(
    "dim,factor,orig,bf,bs",
    [(64, 32, 4096, 1, 1), (64, 64, 4096, 32, 1), (16, 32, 4096, 32, 1), (8, 32, 64, 32, 1)],
)
def test_yarn_inv_freq_matches_formula(dim, factor, orig, bf, bs):
    sc = RopeScaling(factor, orig, bf, bs, 1.0, 1.0)
    want, (low, high) = direct_yarn(dim, 50000.0, factor, orig, bf, bs)
    got = rope_inv_freq(dim, 50000.0, sc)
    assert got.dtype == torch.float32 and got.shape == (dim // 2,)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)
    assert yarn_correction_range(bf, bs, dim, 50000.0, orig) == (low, high)
    # the scaled frequencies really differ from plain rope: the high-index (low-frequency) end is interpolated
    plain = rope_inv_freq(dim, 50000.0, None)
    torch.testing.assert_close(
        plain.double(),
        torch.tensor([50000.0 ** (-2 * i / dim) for i in range(dim // 2)], dtype=torch.float64),
        rtol=1e-6,
        atol=0,
    )
    assert torch.allclose(got[-1], plain[-1] / factor, rtol=1e-6)
    assert torch.allclose(got[0], plain[0])


def test_yarn_kimi_ranges_and_clamping():
    # Kimi dim 64 / base 50000 / orig 4096: corr(32) = 8.9, corr(1) = 19.2
    assert yarn_correction_range(32, 1, 64, 50000.0, 4096) == (8.0, 20.0)
    assert yarn_correction_range(1, 1, 64, 50000.0, 4096) == (19.0, 20.0)
    # low clamps at 0 (corr(beta_fast) < 0), high clamps at dim - 1
    low, high = yarn_correction_range(1e6, 1e-30, 64, 50000.0, 4096)
    assert (low, high) == (0.0, 63.0)
    # equal bounds get high += 0.001: corr(beta_slow) in (-1, 0] -> ceil 0 == low 0
    low, high = yarn_correction_range(1e6, 4096 / math.pi, 16, 50000.0, 4096)
    assert low == 0.0 and high == pytest.approx(0.001)
    sc = RopeScaling(32.0, 4096, 1e6, 4096 / math.pi, 1.0, 1.0)
    want, _ = direct_yarn(16, 50000.0, 32.0, 4096, 1e6, 4096 / math.pi)
    torch.testing.assert_close(rope_inv_freq(16, 50000.0, sc).double(), want, rtol=1e-6, atol=0)


def test_softmax_scale_kimi_values():
    assert kimi_cfg(32, 1, 1).softmax_scale == pytest.approx(0.130861, abs=1e-6)
    assert kimi_cfg(64, 32, 1).softmax_scale == pytest.approx(0.144680, abs=1e-6)


def test_rope_cache_and_interleaved_rotation():
    cfg = kimi_cfg(64, 32, 1)
    rope = RotaryEmbedding(cfg, max_positions=5000)
    inv = rope_inv_freq(64, 50000.0, cfg.rope_scaling).double()
    pos = torch.tensor([0, 1, 7, 4095, 4999])
    cos, sin = rope.cos_sin(pos)
    torch.testing.assert_close(cos.double(), torch.cos(pos[:, None].double() * inv), atol=1e-6, rtol=0)
    torch.testing.assert_close(sin.double(), torch.sin(pos[:, None].double() * inv), atol=1e-6, rtol=0)

    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, 64, generator=g)  # [T, H, R]
    got = apply_rope_interleaved(x, cos, sin)
    # complex form of the reference: (x[2i] + i x[2i+1]) * e^{i pos f_i}
    xc = torch.view_as_complex(x.double().reshape(5, 3, 32, 2).contiguous())
    rot = torch.polar(torch.ones(5, 32, dtype=torch.float64), pos[:, None].double() * inv)[:, None, :]
    want = torch.view_as_real(xc * rot).reshape(5, 3, 64)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    # 2-D input (k_pe) and bf16 keep their shape / dtype
    assert apply_rope_interleaved(x[:, 0].bfloat16(), cos, sin).shape == (5, 64)
    assert apply_rope_interleaved(x[:, 0].bfloat16(), cos, sin).dtype == torch.bfloat16
    # relative property: q(p).k(p') depends only on p - p'
    q, k = x[0, 0], x[1, 0]

    def dot(pq, pk):
        c, s = rope.cos_sin(torch.tensor([pq, pk]))
        r = apply_rope_interleaved(torch.stack([q, k]), c, s)
        return float(r[0] @ r[1])

    assert dot(10, 3) == pytest.approx(dot(110, 103), rel=1e-4)


# ---- attention ------------------------------------------------------------------------------------------


def test_metadata_slots_and_paged_write_read():
    bs = 4
    tables = [[5, 2, 7], [3], [1, 6]]
    md = build_attention_metadata([3, 1, 6], [10, 3, 6], tables, bs)
    assert md.query_start_loc.tolist() == [0, 3, 4, 10]
    assert md.block_tables.tolist() == [[5, 2, 7], [3, 0, 0], [1, 6, 0]]
    # seq 0: positions 7, 8, 9 -> blocks 2, 7, 7; seq 1: position 2; seq 2: positions 0..5
    want_slots = [2 * 4 + 3, 7 * 4 + 0, 7 * 4 + 1] + [3 * 4 + 2] + [4 + 0, 4 + 1, 4 + 2, 4 + 3, 24 + 0, 24 + 1]
    assert md.slot_mapping.tolist() == want_slots

    cache = torch.zeros(8, bs, 6)
    g = torch.Generator().manual_seed(2)
    ckv, kpe = torch.randn(10, 4, generator=g), torch.randn(10, 2, generator=g)
    write_kv_cache(cache, md.slot_mapping, ckv, kpe)
    assert torch.equal(cache[2, 3], torch.cat([ckv[0], kpe[0]]))
    assert torch.equal(cache[7, 1], torch.cat([ckv[2], kpe[2]]))
    assert torch.equal(cache[3, 2], torch.cat([ckv[3], kpe[3]]))
    assert torch.equal(cache[6, 1], torch.cat([ckv[9], kpe[9]]))
    assert cache[0].abs().sum() == 0  # the null block is untouched
    lat = gather_kv_cache(cache, md.block_tables[2], 6)
    assert torch.equal(lat, torch.cat([ckv[4:], kpe[4:]], dim=1))

    with pytest.raises(ValueError):
        build_attention_metadata([3], [2], [[1]], bs)  # query_len > seq_len
    with pytest.raises(ValueError):
        build_attention_metadata([1], [9], [[1, 2]], bs)  # too few blocks


def naive_attention(q_nope, q_pe, ckv, kpe, w_kv_b, H, N, V, scale, q_pos):
    """Direct MLA: expand the latents per head, q.k = q_nope.k_nope + q_pe.k_pe, causal, per head/query loop."""
    S = ckv.shape[0]
    kv = (ckv.double() @ w_kv_b.double().T).view(S, H, N + V)
    out = torch.zeros(q_nope.shape[0], H, V, dtype=torch.float64)
    for i in range(q_nope.shape[0]):
        for h in range(H):
            n = q_pos[i] + 1
            s = (kv[:n, h, :N] @ q_nope[i, h].double() + kpe[:n].double() @ q_pe[i, h].double()) * scale
            out[i, h] = torch.softmax(s, 0) @ kv[:n, h, N:]
    return out


def test_absorbed_decode_equals_naive():
    g = torch.Generator().manual_seed(3)
    H, N, R, V, L, bs = 4, 16, 8, 12, 32, 4
    seq_lens = [9, 1, 14]
    tables = [[3, 8, 1], [6], [2, 9, 4, 7]]
    cache = torch.randn(10, bs, L + R, generator=g)  # random latents everywhere, incl. unused slots
    w = torch.randn(H * (N + V), L, generator=g) / math.sqrt(L)
    q_nope = torch.randn(3, H, N, generator=g)
    q_pe = torch.randn(3, H, R, generator=g)
    scale = 0.3
    md = build_attention_metadata([1, 1, 1], seq_lens, tables, bs)
    w3 = w.view(H, N + V, L)
    q_lat = torch.einsum("bhn,hnl->bhl", q_nope, w3[:, :N])
    o_lat = mla_decode_ref(q_lat, q_pe, cache, md.block_tables, md.seq_lens, scale)
    assert o_lat.shape == (3, H, L) and o_lat.dtype == torch.float32
    o = torch.einsum("bhl,hvl->bhv", o_lat, w3[:, N:])
    for b in range(3):
        lat = gather_kv_cache(cache, md.block_tables[b], seq_lens[b])
        want = naive_attention(
            q_nope[b : b + 1], q_pe[b : b + 1], lat[:, :L], lat[:, L:], w, H, N, V, scale, [seq_lens[b] - 1]
        )
        torch.testing.assert_close(o[b : b + 1].double(), want, atol=1e-5, rtol=1e-5)
        got_naive = mla_prefill_ref(q_nope[b : b + 1], q_pe[b : b + 1], lat, w, H, N, V, scale)
        torch.testing.assert_close(got_naive.double(), want, atol=1e-5, rtol=1e-5)


def test_prefill_ref_is_causal():
    g = torch.Generator().manual_seed(4)
    H, N, R, V, L = 2, 8, 4, 8, 16
    lat = torch.randn(11, L + R, generator=g)
    w = torch.randn(H * (N + V), L, generator=g) / 4
    qn, qp = torch.randn(5, H, N, generator=g), torch.randn(5, H, R, generator=g)
    got = mla_prefill_ref(qn, qp, lat, w, H, N, V, 0.25)  # queries at positions 6..10
    want = naive_attention(qn, qp, lat[:, :L], lat[:, L:], w, H, N, V, 0.25, list(range(6, 11)))
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


# ---- moe ------------------------------------------------------------------------------------------------


def test_select_experts_matches_loop():
    g = torch.Generator().manual_seed(5)
    T, D, E, k = 7, 16, 12, 4
    x = torch.randn(T, D, generator=g)
    wg = torch.randn(E, D, generator=g)
    bias = torch.randn(E, generator=g) * 0.5  # large enough to change the selection
    w, ids = select_experts(x, wg, bias, k, 2.827)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and w.shape == ids.shape == (T, k)
    changed = False
    for t in range(T):
        s = [1 / (1 + math.exp(-float(x[t].double() @ wg[e].double()))) for e in range(E)]
        order = sorted(range(E), key=lambda e: -(s[e] + float(bias[e])))[:k]
        unbiased = sorted(range(E), key=lambda e: -s[e])[:k]
        changed |= set(order) != set(unbiased)
        tot = sum(s[e] for e in order)
        want = {e: s[e] / tot * 2.827 for e in order}
        got = {int(i): float(v) for i, v in zip(ids[t], w[t])}
        assert set(got) == set(want)
        for e in want:
            assert got[e] == pytest.approx(want[e], rel=1e-5)
    assert changed, "the bias never changed the selection: the test would not catch a missing bias"
    # without normalisation: raw sigmoid times the factor
    w2, ids2 = select_experts(x, wg, bias, k, 2.0, norm_topk_prob=False)
    torch.testing.assert_close(w2, torch.sigmoid(x @ wg.T).gather(1, ids2) * 2.0)


def moe_loop(x, w13, w2, tw, tid, lo, hi):
    I = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(tid.shape[1]):
            e = int(tid[t, j])
            if not lo <= e < hi:
                continue
            gu = w13[e].double() @ x[t].double()  # w13 / w2 hold all experts, indexed by global id
            h = F.silu(gu[:I]) * gu[I:]
            out[t] += float(tw[t, j]) * (w2[e].double() @ h)
    return out


def test_fused_experts_ref_and_expert_range():
    g = torch.Generator().manual_seed(6)
    T, D, I, E, k = 9, 16, 8, 8, 3
    x = torch.randn(T, D, generator=g)
    w13 = torch.randn(E, 2 * I, D, generator=g) / 4
    w2 = torch.randn(E, D, I, generator=g) / 3
    tw, tid = select_experts(x, torch.randn(E, D, generator=g), torch.zeros(E), k, 1.5)
    full = fused_experts_ref(x, w13, w2, tw, tid)
    torch.testing.assert_close(full.double(), moe_loop(x, w13, w2, tw, tid, 0, E), atol=1e-5, rtol=1e-5)
    # two "ranks" of 4 experts each: each sees only its range, together they give the full output
    parts = []
    for r in range(2):
        lo = r * 4
        part = fused_experts_ref(x, w13[lo : lo + 4], w2[lo : lo + 4], tw, tid, expert_offset=lo)
        torch.testing.assert_close(part.double(), moe_loop(x, w13, w2, tw, tid, lo, lo + 4), atol=1e-5, rtol=1e-5)
        assert not torch.allclose(part, full)
        parts.append(part)
    torch.testing.assert_close(parts[0] + parts[1], full, atol=1e-5, rtol=1e-5)
    # no local pair at all -> zeros
    assert fused_experts_ref(x, w13[:2], w2[:2], tw, tid, expert_offset=100).abs().sum() == 0


def test_moe_layer_needs_backend_for_ep():
    layer = MoELayer(small_cfg(), ep_rank=1, ep_size=2)
    assert layer.expert_offset == 4 and layer.w13.shape[0] == 4
    with pytest.raises(RuntimeError):
        layer(torch.zeros(2, 64))
    with pytest.raises(ValueError):
        MoELayer(small_cfg(), ep_rank=0, ep_size=3)


# ---- model on random weights ----------------------------------------------------------------------------


def random_weights(model: KimiForCausalLM, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in model.expected_weight_names():
        shape = dict(model._weight_targets())[name].shape
        if "norm" in name:
            t = 1 + 0.1 * torch.randn(shape, generator=g)
        elif "bias" in name:
            t = 0.1 * torch.randn(shape, generator=g)
        else:
            t = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
        out[name] = t
    return out


@pytest.fixture(scope="module")
def rand_model():
    cfg = small_cfg()
    m = KimiForCausalLM(cfg, max_positions=256)
    w = random_weights(m)
    m.load_weights(w)
    return m, w


def test_load_weights_errors(rand_model):
    m, w = rand_model
    bad = dict(w)
    del bad["model.layers.1.mlp.experts.3.up_proj.weight"]
    bad["model.layers.9.foo.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"experts\.3\.up_proj.*|foo") as ei:
        m.load_weights(bad)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in str(ei.value)
    assert "model.layers.9.foo.weight" in str(ei.value)
    bad = dict(w)
    bad["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        m.load_weights(bad)
    # rank 1 of 2 wants experts 4..7 only
    m1 = KimiForCausalLM(small_cfg(), ep_rank=1, ep_size=2, max_positions=16)
    names = m1.expected_weight_names()
    assert "model.layers.1.mlp.experts.4.gate_proj.weight" in names
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" not in names
    # the stacked experts hold the right tensors
    inter = 32
    assert torch.equal(m.layers[1].mlp.w13[5, :inter], w["model.layers.1.mlp.experts.5.gate_proj.weight"])
    assert torch.equal(m.layers[1].mlp.w13[5, inter:], w["model.layers.1.mlp.experts.5.up_proj.weight"])
    assert torch.equal(m.layers[1].mlp.w2[5], w["model.layers.1.mlp.experts.5.down_proj.weight"])


def test_random_model_prefill_decode_chunked_mixed_agree(rand_model):
    m, _ = rand_model
    cfg = m.cfg
    g = torch.Generator().manual_seed(7)
    lens = [13, 9, 6]
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lens]
    bs = 4
    tables = [[7, 3, 11, 1], [2, 9, 5], [4, 10]]

    with torch.inference_mode():
        # (a) whole prompts one at a time
        full = []
        caches = allocate_kv_caches(cfg, 12, bs, torch.float32, "cpu")
        for p, bt in zip(prompts, tables):
            md = build_attention_metadata([len(p)], [len(p)], [bt], bs)
            full.append(m.compute_logits(m(p, torch.arange(len(p)), md, caches)))
        # (b) one token at a time (decode path)
        caches = allocate_kv_caches(cfg, 12, bs, torch.float32, "cpu")
        for p, bt, want in zip(prompts, tables, full):
            rows = []
            for i in range(len(p)):
                md = build_attention_metadata([1], [i + 1], [bt], bs)
                rows.append(m.compute_logits(m(p[i : i + 1], torch.tensor([i]), md, caches)))
            torch.testing.assert_close(torch.cat(rows), want, atol=1e-4, rtol=1e-4)
        # (d) mixed: first 5 / 1 / 4 tokens, then the rest of seq 0, one decode of seq 1, rest of seq 2
        caches = allocate_kv_caches(cfg, 12, bs, torch.float32, "cpu")
        done = [0, 0, 0]
        outs = [[], [], []]
        for step in ([5, 1, 4], [8, 1, 2], [0, 7, 0]):
            sel = [b for b in range(3) if step[b] > 0]
            ids = torch.cat([prompts[b][done[b] : done[b] + step[b]] for b in sel])
            pos = torch.cat([torch.arange(done[b], done[b] + step[b]) for b in sel])
            md = build_attention_metadata(
                [step[b] for b in sel], [done[b] + step[b] for b in sel], [tables[b] for b in sel], bs
            )
            logits = m.compute_logits(m(ids, pos, md, caches))
            qsl = md.query_start_loc.tolist()
            for j, b in enumerate(sel):
                outs[b].append(logits[qsl[j] : qsl[j + 1]])
                done[b] += step[b]
        for b in range(3):
            torch.testing.assert_close(torch.cat(outs[b]), full[b], atol=1e-4, rtol=1e-4)
    assert logits.dtype == torch.float32


def test_bf16_model_runs_close_to_fp32(rand_model):
    m, w = rand_model
    mb = KimiForCausalLM(m.cfg, dtype=torch.bfloat16, max_positions=64)
    mb.load_weights(w)
    assert mb.layers[1].mlp.e_score_correction_bias.dtype == torch.float32
    ids = torch.arange(10) * 7
    md = build_attention_metadata([10], [10], [[1, 2, 3]], 4)
    with torch.inference_mode():
        a = m.compute_logits(m(ids, torch.arange(10), md, allocate_kv_caches(m.cfg, 4, 4, torch.float32, "cpu")))
        b = mb.compute_logits(mb(ids, torch.arange(10), md, allocate_kv_caches(m.cfg, 4, 4, torch.bfloat16, "cpu")))
    assert b.dtype == torch.float32
    assert (a - b).abs().max() < 0.1 * a.abs().max()


def test_kv_cache_sizes():
    cfg = small_cfg()
    caches = allocate_kv_caches(cfg, 5, 4, torch.bfloat16, "cpu")
    assert len(caches) == 2 and caches[0].shape == (5, 4, 40) and caches[0].dtype == torch.bfloat16
    assert kv_cache_bytes_per_block(cfg, 4, torch.bfloat16) == 2 * 4 * 40 * 2
    real = kimi_cfg(64, 32, 1).with_overrides(num_hidden_layers=61, kv_lora_rank=512)
    assert kv_cache_bytes_per_block(real, 64, torch.bfloat16) == 61 * 64 * 576 * 2
    with pytest.raises(ValueError):
        allocate_kv_caches(cfg, 0, 4, torch.float32, "cpu")


def test_kv_cache_size_checked_against_free_memory():
    """check_kv_cache_fits: a cache larger than the free bytes raises KVCacheSizeError naming the flag and both
    sizes; one that fits (exactly) passes; an unknown free size skips the check. MemAvailable is read on Linux."""
    from kimi.worker.kv_cache import KVCacheSizeError, available_bytes, check_kv_cache_fits

    cfg = small_cfg()
    per = kv_cache_bytes_per_block(cfg, 4, torch.bfloat16)  # 640 bytes
    check_kv_cache_fits(cfg, 10, 4, torch.bfloat16, "cpu", "--num-blocks", available=10 * per)
    with pytest.raises(
        KVCacheSizeError,
        match=r"--num-blocks: the KV cache of 11 blocks needs .*640 bytes per block "
        r"of 4 tokens over 2 layers",
    ):
        check_kv_cache_fits(cfg, 11, 4, torch.bfloat16, "cpu", "--num-blocks", available=10 * per)
    assert available_bytes("meta") is None
    check_kv_cache_fits(cfg, 10**15, 4, torch.bfloat16, "meta", "--num-blocks")  # unknown: no check
    free = available_bytes("cpu")
    assert free is None or free > 0
    if free is not None:
        with pytest.raises(KVCacheSizeError, match="--kv-cache-memory-gib"):
            check_kv_cache_fits(cfg, 2 * (free // per) + 2, 4, torch.bfloat16, "cpu", "--kv-cache-memory-gib")
