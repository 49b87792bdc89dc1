"""Time the batched sampler (kimi.ops.sampling.sample) against the per-row reference (sample_ref) on the GPU.

Logits [B, 163840] float32 (Kimi's vocabulary) on the device; per B in --batch two mixes: all greedy, and
"mixed" (half greedy with 5 logprobs, half temperature 0.8 / top-k 50 / top-p 0.9 with the sampled logprob).
Wall time per call (the call ends with its device->host copy, so host time = step time), median of --iters
after 3 warm-ups. JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_util import require_gpu

from kimi.ops.sampling import sample, sample_ref
from kimi.protocol import SamplingParams

V = 163840


def wall_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="8,64,256")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "bench"), "sampling.json"))
    args = ap.parse_args()
    require_gpu(ap.prog)
    res = {
        "what": __doc__.split("\n")[0],
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "vocab": V,
        "cases": [],
    }
    g = torch.Generator(device="cuda").manual_seed(0)
    for B in [int(b) for b in args.batch.split(",")]:
        logits = torch.randn(B, V, device="cuda", generator=g) * 3
        mixes = {
            "greedy": [SamplingParams(temperature=0.0)] * B,
            "mixed": [
                SamplingParams(temperature=0.0, num_logprobs=5)
                if i % 2 == 0
                else SamplingParams(temperature=0.8, top_k=50, top_p=0.9, num_logprobs=0)
                for i in range(B)
            ],
        }
        for name, params in mixes.items():
            gens = [None] * B
            new = wall_ms(lambda: sample(logits, params, gens), args.iters)
            old = wall_ms(lambda: sample_ref(logits, params, gens), max(3, args.iters // 4))
            case = {"batch": B, "mix": name, "sample_ms": round(new, 3), "sample_ref_ms": round(old, 3)}
            res["cases"].append(case)
            print(json.dumps(case), flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
