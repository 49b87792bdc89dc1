"""Time the batched sampler (kimi.model.sampling.sample) against the per-row reference (sample_ref) on the GPU.

Logits [B, 163840] float32 (Kimi's vocabulary) on the device; per B in --batch two mixes: all greedy, and
"mixed" (half greedy with 5 logprobs, half temperature 0.8 / top-k 50 / top-p 0.9 with the sampled logprob).
Wall time per call (the call ends with its device->host copy, so host time = step time), median of --iters
after 3 warm-ups. `sample_ref` is the per-row implementation of the same semantics (the tests' reference).

Usage: python tools/bench_sampling.py [--batch 8,64,256] [--out F] [--snapshot]
Snapshot: sampler.json (sampler_custom for other batch sizes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kimi.benchmarks import snapshot
from kimi.benchmarks.gpu import require_gpu
from kimi.model.sampling import sample, sample_ref
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


DEFAULT_BATCH = "8,64,256"


def summarize(res: dict) -> dict:
    """The snapshot's table: per batch and mix, the batched sampler against the per-row sample_ref."""
    rows = [
        [c["batch"], c["mix"], c["sample_ms"], c["sample_ref_ms"], round(c["sample_ref_ms"] / c["sample_ms"], 1)]
        for c in res["cases"]
    ]
    return {
        "columns": ["rows", "mix", "batched sampler (ms)", "per-row sample_ref (ms)", "speed-up"],
        "rows": rows,
        "notes": [f"logits [rows, {res['vocab']}] float32; wall time per call including the device-to-host copy"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=snapshot.HelpFormatter)
    ap.add_argument("--batch", default=DEFAULT_BATCH, help="rows of logits, comma list")
    ap.add_argument("--iters", type=int, default=20, help="timed calls of the batched sampler (the per-row: 1/4)")
    ap.add_argument("--out", default=None, help="write the full JSON result here")
    snapshot.add_arguments(ap)
    args = ap.parse_args()
    require_gpu(ap.prog)
    res: dict = {"what": __doc__.split("\n")[0], "args": vars(args), "vocab": V, "cases": []}
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
            new = wall_ms(lambda x=logits, p=params, g=gens: sample(x, p, g), args.iters)
            old = wall_ms(lambda x=logits, p=params, g=gens: sample_ref(x, p, g), max(3, args.iters // 4))
            case = {"batch": B, "mix": name, "sample_ms": round(new, 3), "sample_ref_ms": round(old, 3)}
            res["cases"].append(case)
            print(json.dumps(case), flush=True)
    res["conditions"] = conds = snapshot.conditions()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    if args.snapshot:
        snapshot.write(
            args.snapshot,
            benchmark="sampler",
            config="" if args.batch == DEFAULT_BATCH else "custom",
            summary=summarize(res),
            results=res,
            conds=conds,
        )


if __name__ == "__main__":
    main()
