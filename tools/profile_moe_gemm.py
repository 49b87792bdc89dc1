"""The routed experts' gate_up or down GEMM at a decode shape, kimi's CUDA kernel and humming's, a few eager calls
each: the target for Nsight Compute, e.g.

    ncu --kernel-name regex:"w4a16|humming" --launch-skip 2 --launch-count 2 --section SpeedOfLight \
        --section WarpStateStats --section SchedulerStats python3 tools/profile_moe_gemm.py --tokens 256

Routing: --tokens tokens x top-8 over 384 experts (distinct random experts per token), the 48 local experts [96, 144)
computed, as tools/bench_moe_cuda.py. Weights: random pack-quantized INT4, Kimi's gate_up shape [48, 4096, 7168]
(--gemm gate_up) or down shape [48, 7168, 2048] (--gemm down, over random inputs per pair row). kimi's kernel runs
at --config NT,KW,S (default: its table's pick for the step).
Prints each backend's median time over --calls event-timed calls (ncu's replays make those meaningless under ncu).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_util import require_gpu

from kimi.ops import moe_int4_cuda as mc
from kimi.worker.dummy_weights import random_packed_experts

H, I, E, E_TOTAL, TOPK, OFFSET = 7168, 2048, 48, 384, 8, 96


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--gemm", default="gate_up", choices=["gate_up", "down"])
    ap.add_argument("--config", default=None, help="kimi's launch configuration NT,KW,S (default: the table's)")
    args = ap.parse_args()
    require_gpu(ap.prog)
    from kimi.ops.fused import moe_align_fused
    from kimi.ops.moe_backend import HummingInt4Experts

    gen = torch.Generator(device="cuda").manual_seed(0)
    w13, s13 = random_packed_experts(E, 2 * I, H, gen, "cuda")
    w2, s2 = random_packed_experts(E, H, I, gen, "cuda")
    ours = mc.repack(w13, s13)
    mc.load_extension()
    hum = HummingInt4Experts(w13.clone(), s13.clone(), w2.clone(), s2.clone(), OFFSET, E_TOTAL)
    T = args.tokens
    ids = torch.rand((T, E_TOTAL), device="cuda", generator=gen).topk(TOPK, dim=-1).indices.to(torch.int64)
    down = args.gemm == "down"
    n, k = (H, I) if down else (2 * I, H)
    top_k = 1 if down else TOPK
    x = (torch.randn((T * TOPK if down else T, k), device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
    out = torch.empty((T * TOPK, n), dtype=torch.bfloat16, device="cuda")
    a16 = moe_align_fused(ids, E, OFFSET, 16)
    c1, c2 = hum._configs(hum._m_local(T, TOPK))
    hc, layer, w = (c2, hum.l2, mc.repack(w2, s2)) if down else (c1, hum.l1, ours)
    cfg = tuple(int(v) for v in args.config.split(",")) if args.config else mc.config_for(n, k, T * TOPK // 8)
    if not mc.config_valid(cfg, n, k):
        raise SystemExit(f"--config {cfg} cannot run [{n}, {k}] (configurations: {mc.CONFIGS})")
    ah = moe_align_fused(ids, E, OFFSET, hc["block_shape"][0])
    print(f"{args.gemm} [{n}, {k}] at {T} MoE tokens: kimi's config {cfg}, humming's {hc}", flush=True)
    runs = {
        "kimi_cuda": lambda: mc.indexed_gemm(x, *w, a16[0], a16[1], a16[2], top_k, out, config=cfg),
        "humming": lambda: layer(
            x,
            sorted_ids=ah[0],
            expert_ids=ah[1],
            num_tokens_padded=ah[2].view(()),
            top_k=top_k,
            compute_config={"gemm_type": "indexed"},
            tuning_config=hc,
        ),
    }
    for name, fn in runs.items():
        ts = []
        for _ in range(args.calls):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e) * 1e3)
        print(f"{name}: {statistics.median(ts):.1f} us (median of {args.calls} eager calls)", flush=True)


if __name__ == "__main__":
    main()
