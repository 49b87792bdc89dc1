"""Host cost of one decode step's attention plan (FlashInferMLA.plan_pages, the CUDA-graph decode path): median
wall time per call over --iters calls at B requests x ctx tokens, and a cProfile of those calls (top entries by
total time). GPU idle between calls (each call waits for the previous plan's copies, as in a step).

Usage: python tools/profile_plan.py [--batch 8,32] [--ctx 2048] [--iters 200]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_util import require_gpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="8,32")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    require_gpu(ap.prog)
    from kimi.ops.attention_flashinfer import FlashInferMLADecode

    res = {"gpu": torch.cuda.get_device_name(), "ctx": args.ctx, "cases": []}
    bs = 64
    for B in [int(b) for b in args.batch.split(",")]:
        nb = -(-args.ctx // bs)
        fi = FlashInferMLADecode(64, 0.13, "cuda", use_cuda_graph=True, max_batch=B, max_pages=B * nb)
        pages = [list(range(1 + i * nb, 1 + (i + 1) * nb)) for i in range(B)]
        lens = [args.ctx] * B
        fi.plan_pages([1] * B, lens, pages, bs, causal=False)
        torch.cuda.synchronize()
        ts = []
        for i in range(args.iters):
            t = time.perf_counter()
            fi.plan_pages([1] * B, [args.ctx - (i % 7)] * B, pages, bs, causal=False)
            ts.append((time.perf_counter() - t) * 1e6)
        prof = cProfile.Profile()
        prof.enable()
        for i in range(args.iters):
            fi.plan_pages([1] * B, [args.ctx - (i % 7)] * B, pages, bs, causal=False)
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(12)
        case = {
            "B": B,
            "plan_pages_us_median": statistics.median(ts),
            "plan_pages_us_min": min(ts),
            "profile": s.getvalue(),
        }
        res["cases"].append(case)
        print(f"B={B}: plan_pages median {case['plan_pages_us_median']:.0f} us (min {case['plan_pages_us_min']:.0f})")
        print("\n".join(s.getvalue().splitlines()[:30]))
    out = args.out or os.path.join(os.environ.get("OUT", "bench"), "plan_profile.json")
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
