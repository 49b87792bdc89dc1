"""Prefill / mixed-step CUDA graphs (kimi/worker/prefill_graph.py) against the eager forward, on the "tiny-mla"
checkpoint of test_gpu_model.py (Kimi's real attention widths, so FlashInfer's MLA kernel runs).

Every step below runs eagerly (its plan made first: `plan_eager`) and through the graphs (the model's forward picks
the bucket), over the same cache: the step's hidden rows agree within bf16 rounding (the graph's GEMMs run at the
bucket's row count, the eager ones at the step's), the graph's are finite although its output buffers are poisoned
with NaN first, and the padding rows (written to the null block 0) leave every other block of the cache unchanged.
With the fresh-step graphs on, steps of fresh prompts only replay them (non-absorbed attention) from their smallest
bucket on (64 in the "auto" run, 256 in the "humming" one) and agree also with the eager non-absorbed forward.
"""

from __future__ import annotations

import pytest
import torch
from test_gpu_model import make_ckpt, report

pytestmark = pytest.mark.gpu

BS, NB = 16, 240


def _steps() -> list[tuple[str, list[int], list[int]]]:
    """(name, query_lens, context lengths after the step): fresh prompts, a chunk over cached context, decode rows
    beside a prompt (a mixed step), a step that fills its bucket exactly, one of the most sequences."""
    return [
        ("one prompt", [40], [40]),
        ("two prompts", [37, 21], [37, 21]),
        ("chunk over cached context", [60], [124]),
        ("mixed: decode rows and a prompt", [1, 1, 1, 50], [57, 90, 33, 50]),
        ("fills the 64 bucket", [30, 34], [30, 98]),
        ("most sequences", [1, 1, 1, 1, 1, 1, 20, 100], [9, 17, 33, 64, 65, 80, 20, 130]),
        ("largest bucket", [200, 50], [200, 70]),
        ("fresh prompts in the largest bucket", [150, 60, 1], [150, 60, 1]),
    ]


@pytest.mark.parametrize(("backend", "mha_min"), [("humming", 256), ("auto", 64)])
def test_prefill_graph_replay_equals_eager(tmp_path, backend, mha_min):
    from kimi.backends.attention.flashinfer import set_prefill_attention
    from kimi.config import ModelConfig
    from kimi.model.attention import build_attention_metadata
    from kimi.model.weights import load_gpu_model
    from kimi.worker.kv_cache import allocate_kv_caches

    path = make_ckpt(tmp_path, "tiny-mla")
    cfg = ModelConfig.from_dir(path)
    gm = load_gpu_model(path, cfg, dtype=torch.bfloat16, device="cuda", moe_backend=backend, progress=False)
    kv = allocate_kv_caches(cfg, NB, BS, torch.bfloat16, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(3)
    for c in kv:
        c.copy_(torch.randn(c.shape, generator=gen, device="cuda", dtype=torch.bfloat16))
    width = 16  # blocks per sequence at most (256 tokens)
    gm.capture_cuda_graphs(kv, BS, 8, width)
    gm.capture_prefill_graphs(kv, BS, 256, 8, width, buckets=[64, 128, 256], mha_min_bucket=mha_min, fresh_mha=True)
    pg = gm.prefill_graphs
    assert pg is not None and pg.buckets == [64, 128, 256] and pg.pool is gm.graphs.pool
    mha_from = mha_min
    assert sorted(pg.graphs_mha) == [b for b in pg.buckets if b >= mha_from]
    results = []
    g = torch.Generator().manual_seed(9)
    with torch.inference_mode():
        for name, qlens, slens in _steps():
            perm = (torch.randperm(NB - 1, generator=g) + 1).tolist()
            tabs = [perm[width * i : width * i + -(-s // BS)] for i, s in enumerate(slens)]
            used = {b for t in tabs for b in t}
            T = sum(qlens)
            ids = torch.randint(0, 163000, (T,), generator=g).cuda()
            pos = torch.tensor([p for q, s in zip(qlens, slens) for p in range(s - q, s)]).cuda()
            a1 = build_attention_metadata(qlens, slens, tabs, BS, "cuda")
            gm.plan_eager(a1)  # attn.plan set: the forward below runs eagerly
            eager = gm(ids, pos, a1, kv).clone()
            before = [c.clone() for c in kv]
            for o in pg.outputs.values():
                o.fill_(float("nan"))
            fresh = qlens == slens and pg.bucket_for(T) >= mha_from
            if fresh:  # the eager non-absorbed forward of the same step
                kv_mla = [c.clone() for c in kv]
                prev = set_prefill_attention("mha")
                try:
                    a0 = build_attention_metadata(qlens, slens, tabs, BS, "cuda")
                    gm.plan_eager(a0)
                    assert a0.plan is not None and a0.plan.prefill_run is not None, name
                    eager_mha = gm(ids, pos, a0, kv).clone()
                finally:
                    set_prefill_attention(prev)
                # both forms write the same latents where their inputs are the same: layer 0's (later layers' differ
                # by the rounding of the attention before them)
                assert torch.equal(kv_mla[0], kv[0]), name
            a2 = build_attention_metadata(qlens, slens, tabs, BS, "cuda")
            assert pg.can_run(a2), name
            n0, m0 = pg.num_replays, pg.num_replays_mha
            graph = gm(ids, pos, a2, kv).clone()
            assert pg.num_replays == n0 + 1 and pg.num_replays_mha == m0 + int(fresh), name
            assert graph.shape == eager.shape and torch.isfinite(graph).all(), name
            rel = float((graph.float() - eager.float()).norm() / eager.float().norm())
            diff = float((graph.float() - eager.float()).abs().max())
            row = dict(step=name, rows=T, bucket=pg.bucket_for(T), max_abs=round(diff, 5), rel=round(rel, 6))
            assert rel <= 1e-2, (name, diff, rel)
            if fresh:
                rel_mha = float((graph.float() - eager_mha.float()).norm() / eager_mha.float().norm())
                row |= dict(fresh_graph=True, rel_vs_eager_mha=round(rel_mha, 6))
                assert rel_mha <= 1e-2, (name, rel_mha)
            results.append(row)
            # the blocks of no sequence of the step (the null block 0 aside) are as they were
            others = [b for b in range(1, NB) if b not in used]
            idx = torch.tensor(others, device="cuda")
            for c0, c1 in zip(before, kv):
                assert torch.equal(c0.index_select(0, idx), c1.index_select(0, idx)), name
    report(dict(test="prefill_graph_replay_vs_eager", moe_backend=backend, mha_min_bucket=mha_from, cases=results))
