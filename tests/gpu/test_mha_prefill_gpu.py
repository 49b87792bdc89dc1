"""The non-absorbed ("MHA") prefill path on the GPU (kimi.backends.attention.flashinfer.set_prefill_attention("mha"):
FlashInferMHAPrefill + kimi.model.gpu_forward._split) through the model's real attention call: layer 0's
MLAAttention of the bf16 GPU model of the "tiny-mla" checkpoint (tests/gpu/test_gpu_model.py: 16 heads, kv_lora 512,
rope 64, nope 128, v 128 -> q / k of 192, v of 128), planned by the model's own backend (step_attention), against

- the CPU float32 reference layer (MLAAttention.forward_reference: naive per-sequence form) on the same inputs, and
- the same GPU layer with the default absorbed path ("mla": FlashInfer's paged MLA kernel for every row),

for one fresh prompt, several fresh prompts of different lengths in one step, and a mixed step (decode rows, a chunk
over cached context, a one-token prompt and fresh prompts, fresh rows neither first nor contiguous). The cache write
is the same in both paths (the second run rewrites the same values). Tolerances (bf16 projections, bf16 q / k / v):
rel_max = max |out - want| / max |want| <= 1.5e-2 and rel_norm = ||out - want|| / ||want|| <= 1.5e-2, per step (on an
H200 both are at most 0.0066 for every case and comparison, the default path against the reference included).

Run: KIMI_GPU_REPORT=/tmp/mha_prefill.jsonl .venv/bin/python -m pytest -q -s tests/gpu/test_mha_prefill_gpu.py
"""

from __future__ import annotations

import pytest
import torch
from test_gpu_model import cpu_model, make_ckpt, report

pytestmark = pytest.mark.gpu

BS = 64
REL_MAX, REL_NORM = 1.5e-2, 1.5e-2

CASES = {
    # steps of (sequence, query_len) in batch order; a sequence's first step is its fresh prompt chunk
    "one_fresh": [[("A", 300)]],
    "several_fresh": [[("A", 100), ("B", 37), ("C", 256), ("D", 2), ("E", 129)]],
    "mixed": [
        [("A", 200), ("B", 50)],
        [("B", 1), ("C", 120), ("A", 90), ("D", 1), ("E", 33)],  # decode, fresh, chunk over 200, 1-token prompt, fresh
        [("C", 1), ("A", 1), ("F", 70), ("B", 1), ("E", 5)],  # decodes around a fresh prompt, a chunk over 33
    ],
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("flashinfer")
    from kimi.model.weights import load_gpu_model

    path = make_ckpt(tmp_path_factory.mktemp("mha_ckpt"), "tiny-mla")
    cfg, ref = cpu_model(path)
    gm = load_gpu_model(path, cfg, dtype=torch.bfloat16, device="cuda", progress=False)
    return cfg, ref, gm


def _rel(out: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    d = out.double() - want.double()
    return float(d.abs().max() / want.abs().max()), float(d.norm() / want.double().norm())


@pytest.mark.parametrize("case", list(CASES))
def test_mha_prefill_matches_reference_and_mla(models, case):
    from kimi.backends.attention.flashinfer import set_prefill_attention
    from kimi.model.attention import build_attention_metadata

    cfg, ref, gm = models
    steps = CASES[case]
    names = sorted({n for st in steps for n, _ in st})
    total = {n: sum(q for st in steps for m, q in st if m == n) for n in names}
    per = {n: -(-total[n] // BS) for n in names}
    tables, nxt = {}, 1  # block 0 is the null block
    for n in names:
        tables[n] = list(range(nxt, nxt + per[n]))
        nxt += per[n]
    L, R = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    kv_gpu = torch.zeros((nxt, BS, L + R), dtype=torch.bfloat16, device="cuda")
    kv_cpu = torch.zeros((nxt, BS, L + R), dtype=torch.float32)
    g = torch.Generator().manual_seed(7 + list(CASES).index(case))
    a_gpu, a_ref = gm.layers[0].self_attn, ref.layers[0].self_attn
    done = dict.fromkeys(names, 0)
    previous = set_prefill_attention("mla")
    try:
        for i, st in enumerate(steps):
            qlens = [q for _, q in st]
            slens = [done[n] + q for n, q in st]
            fresh = [done[n] == 0 and q > 1 for n, q in st]
            pos = torch.cat([torch.arange(done[n], done[n] + q) for n, q in st])  # [T]
            x = torch.randn(sum(qlens), cfg.hidden_size, generator=g).to(torch.bfloat16)  # [T, D]
            tabs = [tables[n] for n, _ in st]
            want = a_ref(x.float(), pos, build_attention_metadata(qlens, slens, tabs, BS), kv_cpu, ref.rope)  # [T, D]
            outs = {}
            for mode in ("mha", "mla"):
                set_prefill_attention(mode)
                attn = build_attention_metadata(qlens, slens, tabs, BS, "cuda")
                attn.plan = gm.step_attention(attn).plan(attn)
                if mode == "mha":  # the split plan: fresh sequences on the ragged prefill, the rest absorbed
                    assert attn.plan.prefill_run is not None and attn.plan.prefill_run.num_rows == sum(
                        q for q, f in zip(qlens, fresh) if f
                    )
                    assert (attn.plan.run is None) == all(fresh)
                else:
                    assert attn.plan.prefill_run is None
                outs[mode] = a_gpu(x.cuda(), pos.cuda(), attn, kv_gpu, gm.rope).float().cpu()  # [T, D]
            torch.cuda.synchronize()
            rel_ref = _rel(outs["mha"], want)
            rel_mla = _rel(outs["mha"], outs["mla"])
            rel_mla_ref = _rel(outs["mla"], want)
            report(
                dict(
                    test="mha_prefill_gpu",
                    case=case,
                    step=i,
                    query_lens=qlens,
                    seq_lens=slens,
                    mha_vs_ref=[round(v, 5) for v in rel_ref],
                    mha_vs_mla=[round(v, 5) for v in rel_mla],
                    mla_vs_ref=[round(v, 5) for v in rel_mla_ref],
                )
            )
            assert torch.isfinite(outs["mha"]).all()
            for got in (rel_ref, rel_mla):
                assert got[0] <= REL_MAX and got[1] <= REL_NORM, (case, i, rel_ref, rel_mla, rel_mla_ref)
            for n, q in st:
                done[n] += q
    finally:
        set_prefill_attention(previous)
