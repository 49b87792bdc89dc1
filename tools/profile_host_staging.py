"""Host cost of the pieces of one CUDA-graph decode step's input staging (CudaGraphRunner.run_host before its
replay), each timed alone on this machine: the page-id list, its conversion into the pinned buffer, the slots,
the staging event's synchronize / query / record, the one pinned host-to-device copy, plus two host-speed
references (a plain Python loop and one tiny torch op). Median microseconds over --iters repetitions, at B
sequences x ctx tokens, block size 64. Needs CUDA (pinned memory, events, copies); no model.

Usage: python tools/profile_host_staging.py [--batch 8,32] [--ctx 2048] [--iters 2000] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_util import require_gpu


def timed(fn, iters: int) -> float:
    for _ in range(10):
        fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return round(statistics.median(ts) * 1e6, 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="8,32")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    require_gpu(ap.prog)
    dev = torch.device("cuda")
    blk = 64
    res = {
        "what": __doc__.split("\n")[0],
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "ctx": args.ctx,
        "cases": [],
    }
    res["python_loop_1000_us"] = timed(lambda: sum(range(1000)), args.iters)
    small = torch.zeros(4, device=dev)
    res["torch_tiny_op_us"] = timed(lambda: small.add_(1), args.iters)
    for B in [int(b) for b in args.batch.split(",")]:
        W = -(-(args.ctx + 64) // blk)
        perm = (torch.randperm(B * W) + 1).tolist()
        tables = [perm[i * W : (i + 1) * W] for i in range(B)]
        lens = [args.ctx] * B
        pos = [n - 1 for n in lens]
        ids = list(range(B))
        host = torch.zeros(3 * B + B * W, dtype=torch.int64, pin_memory=True)
        h = host[: 3 * B].numpy().reshape(3, B)
        hk = host[3 * B :].numpy().view(np.int32)
        devbuf = torch.zeros_like(host, device=dev)
        ev = torch.cuda.Event()
        ev.record()
        torch.cuda.synchronize()

        def flat_list():
            flat = []
            for b, (t, n) in enumerate(zip(tables, lens)):
                k = -(-n // blk)
                if k > len(t):
                    raise ValueError
                flat.extend(t[:k])
            return flat

        flat = flat_list()

        def fill():
            h[:, :B] = 0
            h[0, :B] = ids
            h[1, :B] = pos
            h[2, :B] = [t[p // blk] * blk + p % blk for t, p in zip(tables, pos)]

        n_in = 3 * B + (len(flat) + 1) // 2
        case = {
            "B": B,
            "pages": len(flat),
            "page_list_us": timed(flat_list, args.iters),
            "page_ids_to_pinned_us": timed(lambda: hk.__setitem__(slice(0, len(flat)), flat), args.iters),
            "ids_positions_slots_us": timed(fill, args.iters),
            "event_synchronize_done_us": timed(ev.synchronize, args.iters),
            "event_query_done_us": timed(ev.query, args.iters),
            "event_record_us": timed(ev.record, args.iters),
        }

        def copy():
            devbuf[:n_in].copy_(host[:n_in], non_blocking=True)

        case["pinned_copy_us"] = timed(copy, args.iters // 4)
        torch.cuda.synchronize()
        res["cases"].append(case)
        print(json.dumps(case), flush=True)
    print(json.dumps({k: v for k, v in res.items() if k != "cases"}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
