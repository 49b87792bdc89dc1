"""Decode at long positions on the GPU (issue #6 item 4): the GPU model (bf16, FlashInfer MLA decode, packed
INT4 experts) against the CPU reference model (float32, plain PyTorch, run on the CPU) past 32k positions.

Checkpoint: "tiny-mla" (the K2.6 layout with Kimi's real attention widths, so FlashInfer's MLA kernel runs;
see test_gpu_model.py). Both models take the same $KIMI_LONG_CTX-token random prompt (default 33000) by
chunked prefill (2048-token chunks, blocks of 64 in a shuffled order), then 8 teacher-forced decode steps
at positions >= 33000. Compared on the 8 decode rows: top-1 agreement >= 7/8 and max |logprob difference| of
the reference's top-1 token <= 0.25 nats (the bf16 tolerance of test_gpu_model.py). The GPU KV cache is
poisoned outside the null block before the run, so a read of an unwritten slot would show.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from test_gpu_model import cpu_model, make_ckpt, report

pytestmark = pytest.mark.gpu

BS = 64
CHUNK = 2048
DECODE_STEPS = 8


def run_long(model, cfg, device, dtype, n_ctx: int, poison: bool) -> torch.Tensor:
    """Chunked prefill of n_ctx tokens then DECODE_STEPS decodes; returns [DECODE_STEPS, V] float32 logits (CPU)."""
    from kimi.ops.attention import build_attention_metadata
    from kimi.worker.kv_cache import allocate_kv_caches

    n_blocks = -(-(n_ctx + DECODE_STEPS) // BS)
    kv = allocate_kv_caches(cfg, n_blocks + 1, BS, dtype, device)
    if poison:
        for c in kv:
            c[1:].fill_(1e4)
    table = list(range(1, n_blocks + 1))
    random.Random(3).shuffle(table)
    rng = random.Random(11)
    toks = [rng.randrange(0, 163000) for _ in range(n_ctx)]
    out = []
    with torch.inference_mode():
        done = 0
        while done < n_ctx:
            q = min(CHUNK, n_ctx - done)
            a = build_attention_metadata([q], [done + q], [table], BS, device)
            h = model(torch.tensor(toks[done:done + q], device=device), torch.arange(done, done + q, device=device), a, kv)
            done += q
        for step in range(DECODE_STEPS):
            toks.append(1000 + 17 * step)
            p = len(toks) - 1
            a = build_attention_metadata([1], [p + 1], [table], BS, device)
            h = model(torch.tensor([toks[-1]], device=device), torch.tensor([p], device=device), a, kv)
            out.append(model.compute_logits(h).float().cpu()[0])
    return torch.stack(out)


def test_gpu_decode_past_32k_matches_cpu_reference(tmp_path_factory):
    from kimi.worker.gpu_model import load_gpu_model

    n_ctx = int(os.environ.get("KIMI_LONG_CTX", "33000"))
    path = make_ckpt(tmp_path_factory.mktemp("long"), "tiny-mla")
    cfg, ref = cpu_model(path)
    gm = load_gpu_model(path, cfg, dtype=torch.bfloat16, device="cuda", moe_backend="humming", progress=False)
    got = run_long(gm, cfg, "cuda", torch.bfloat16, n_ctx, poison=True)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    want = run_long(ref, cfg, "cpu", torch.float32, n_ctx, poison=False)
    assert torch.isfinite(got).all()
    top = want.argmax(-1)
    agree = int((got.argmax(-1) == top).sum())
    lw, lg = torch.log_softmax(want, -1), torch.log_softmax(got, -1)
    per_step = (lw.gather(1, top[:, None]) - lg.gather(1, top[:, None])).abs()[:, 0]
    max_lp = float(per_step.max())
    report(dict(test="gpu_long_context_vs_cpu", checkpoint="tiny-mla", context=n_ctx, flashinfer=gm.flashinfer_ok,
                top1_agree=f"{agree}/{DECODE_STEPS}", max_logprob_diff=round(max_lp, 4),
                per_step_logprob_diff=[round(float(x), 4) for x in per_step]))
    assert gm.flashinfer_ok
    assert agree >= DECODE_STEPS - 1
    assert max_lp <= 0.25
