"""Diagnosis of the long-context GPU discrepancy (issue #6 item 4; not a test): where does the GPU model's
0.5-nat miss at 33000 tokens come from?

For each context length in $KIMI_DIAG_CTX (default "32764,33000") it runs the run_long() protocol of
test_long_context_gpu.py (chunked prefill in 2048-token chunks, shuffled 64-token blocks, 8 teacher-forced
decodes) through three models on the GPU, all from the same "tiny-mla" checkpoint:

- G: the GPU model (bf16, FlashInfer, fused Triton kernels, humming INT4 experts) = what the test checks;
- R32: the reference model (kimi/worker/model.py, plain PyTorch) in float32 on the GPU = the CPU reference's
  math (TF32 off), used as the truth;
- R16: the same reference model with bf16 weights / activations (its attention cores compute in float32).

It prints, per context and decode step: |logprob diff| of R32's top-1 for G and R16, top-1 agreement, and the
MoE layers whose top-8 expert SET differs from R32's for that decode token (routing flips). If R16 misses by as
much as G at the same steps, the miss is bf16 rounding amplified by a routing flip, not a GPU-kernel bug; if G
misses where R16 does not, a kernel is wrong. JSON lines go to $KIMI_GPU_REPORT.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_gpu_model import make_ckpt, report
from test_long_context_gpu import DECODE_STEPS, run_long

ROUTES: list = []  # filled by the patched routers: one [T, k] id tensor per MoE layer call


def patch_routers():
    import kimi.ops.fused as fused
    import kimi.ops.moe as moe

    f_orig, m_orig = fused.router_topk, moe.select_experts

    def f(*a, **k):
        w, ids = f_orig(*a, **k)
        if ids.shape[0] == 1:
            ROUTES.append(ids.detach().cpu())
        return w, ids

    def m(*a, **k):
        w, ids = m_orig(*a, **k)
        if ids.shape[0] == 1:
            ROUTES.append(ids.detach().cpu())
        return w, ids

    fused.router_topk = f
    moe.select_experts = m


def ref_on_gpu(path, cfg, dtype):
    from kimi.checkpoint import load_checkpoint
    from kimi.worker.model import KimiForCausalLM

    m = KimiForCausalLM(cfg, dtype=dtype, device="cuda")
    m.load_weights(load_checkpoint(path, cfg, progress=False))
    return m.eval()


def run(model, cfg, dtype, n_ctx):
    ROUTES.clear()
    t0 = time.time()
    logits = run_long(model, cfg, "cuda", dtype, n_ctx, poison=dtype == torch.bfloat16)
    n_moe = sum(1 for layer in model.layers if getattr(layer, "is_moe", False))
    routes = [ROUTES[s * n_moe : (s + 1) * n_moe] for s in range(DECODE_STEPS)]
    return logits, routes, time.time() - t0


def main():
    from kimi.config import ModelConfig
    from kimi.worker.gpu_model import load_gpu_model

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    patch_routers()
    root = Path(os.environ.get("KIMI_DIAG_DIR", "/tmp/diag"))
    root.mkdir(parents=True, exist_ok=True)
    path = make_ckpt(root, "tiny-mla")
    cfg = ModelConfig.from_dir(path)
    gm = load_gpu_model(path, cfg, dtype=torch.bfloat16, device="cuda", moe_backend="humming", progress=False)
    r32 = ref_on_gpu(path, cfg, torch.float32)
    r16 = ref_on_gpu(path, cfg, torch.bfloat16)
    for n_ctx in [int(x) for x in os.environ.get("KIMI_DIAG_CTX", "32764,33000").split(",")]:
        want, rw, tw = run(r32, cfg, torch.float32, n_ctx)
        res = {"R32_s": round(tw, 1)}
        top = want.argmax(-1)
        lw = torch.log_softmax(want, -1)
        for name, model in (("G", gm), ("R16", r16)):
            got, rg, tg = run(model, cfg, torch.bfloat16, n_ctx)
            lg = torch.log_softmax(got, -1)
            diff = (lw.gather(1, top[:, None]) - lg.gather(1, top[:, None])).abs()[:, 0]
            flips = [
                [li for li, (a, b) in enumerate(zip(rs, gs)) if set(a[0].tolist()) != set(b[0].tolist())]
                for rs, gs in zip(rw, rg)
            ]
            res[name] = dict(
                seconds=round(tg, 1),
                top1_agree=int((got.argmax(-1) == top).sum()),
                per_step_logprob_diff=[round(float(x), 4) for x in diff],
                routing_flip_layers_per_step=flips,
            )
        # G vs R16 directly: how far apart the two bf16 computations are
        report(dict(diag="long_context", context=n_ctx, **res))


if __name__ == "__main__":
    main()
