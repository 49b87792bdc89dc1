"""L2 prefetch of a GEMM's weights during a latency-bound kernel (kimi/ops/l2_prefetch.py), measured alone.

Per "layer" l of --layers (distinct weights and buffers per layer, so nothing stays in L2 from one layer to the next):
  [prefetch_rows(W_l, C, policy)] -> busy phase -> y = x @ W_l^T (kimi.ops.linear_small_m.linear, M = --rows)
with W_l [7168, 8192] bf16 (Kimi's o_proj), C the prefetched columns (0 = none). Busy phases:
- sleep: torch.cuda._sleep for about --busy-us (a kernel that keeps HBM idle, as a latency-bound one does);
- stream: a read of --stream-mb of other memory (as the MLA kernel reads its KV), bandwidth-bound;
- stream_sleep: both, one after the other.
All of a variant's layers are one CUDA graph; time per layer = median replay time / layers. `saved_us` is the time per
layer against C = 0 with the same busy phase; `ideal_us` the prefetched bytes at the copy bandwidth (what the GEMM
would no longer stream from HBM). Writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_util import copy_bandwidth, run_header  # noqa: E402  (tools/, the script's folder)


def graph_ms(fn, replays: int = 20) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    del g
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rows", type=int, default=32, help="activation rows M of the GEMM")
    ap.add_argument("--cols", default="0,1024,2048,3072,4096", help="prefetched columns of W's 8192")
    ap.add_argument("--busy", default="sleep,stream,stream_sleep")
    ap.add_argument("--busy-us", type=float, default=25.0)
    ap.add_argument("--stream-mb", type=float, default=75.0)
    ap.add_argument("--policies", default="evict_last,evict_normal")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from kimi.ops.l2_prefetch import prefetch_rows
    from kimi.ops.linear_small_m import linear

    dev = torch.device("cuda")
    res = run_header(__doc__.split("\n")[0], args)
    bw = copy_bandwidth(2 << 30, dev)["GBps_read_plus_write"]
    res["copy_GBps"] = bw
    res["l2_bytes"] = torch.cuda.get_device_properties(dev).L2_cache_size
    N, K, L = 7168, 8192, args.layers
    g = torch.Generator(device=dev).manual_seed(0)
    W = [(torch.randn((N, K), device=dev, generator=g) * 0.02).to(torch.bfloat16) for _ in range(L)]
    x = torch.randn((args.rows, K), device=dev, generator=g).to(torch.bfloat16)
    n_stream = int(args.stream_mb * 2**20) // 4
    S = [torch.rand(n_stream, device=dev, generator=g) for _ in range(L)]
    out = torch.empty((L, args.rows, N), device=dev, dtype=torch.bfloat16)
    red = torch.empty(L, device=dev)
    # cycles for --busy-us at the SM clock (the sleep kernel counts clock64 cycles)
    clock_khz = getattr(torch.cuda.get_device_properties(dev), "clock_rate", 0) or 1_980_000  # H200 boost clock
    cycles = int(args.busy_us * clock_khz / 1e3)
    res["sleep_cycles"] = cycles

    def run(cols: int, policy: str, busy: str):
        def fn():
            for i in range(L):
                if cols:
                    prefetch_rows(W[i], cols, policy)
                if busy in ("stream", "stream_sleep"):
                    torch.sum(S[i], dim=0, out=red[i])
                if busy in ("sleep", "stream_sleep"):
                    torch.cuda._sleep(cycles)
                out[i].copy_(linear(x, W[i]))
        return fn

    # the busy phases alone (no GEMM) and the GEMM alone, for reference
    res["busy_alone_us"] = {}
    for busy in args.busy.split(","):
        def only(busy=busy):
            for i in range(L):
                if busy in ("stream", "stream_sleep"):
                    torch.sum(S[i], dim=0, out=red[i])
                if busy in ("sleep", "stream_sleep"):
                    torch.cuda._sleep(cycles)
        res["busy_alone_us"][busy] = graph_ms(only) / L * 1e3
    res["gemm_alone_us"] = graph_ms(run(0, "evict_normal", "none")) / L * 1e3
    print(f"copy {bw:.0f} GB/s; gemm alone {res['gemm_alone_us']:.1f} us; busy alone {res['busy_alone_us']}", flush=True)
    rows = []
    for busy in args.busy.split(","):
        base = graph_ms(run(0, "evict_normal", busy)) / L * 1e3
        rows.append({"busy": busy, "cols": 0, "policy": None, "us_per_layer": base, "saved_us": 0.0, "ideal_us": 0.0})
        print(f"{busy}: no prefetch {base:.1f} us/layer", flush=True)
        for policy in args.policies.split(","):
            for cols in [int(c) for c in args.cols.split(",") if int(c)]:
                t = graph_ms(run(cols, policy, busy)) / L * 1e3
                ideal = N * cols * 2 / bw / 1e3
                rows.append({"busy": busy, "cols": cols, "policy": policy, "us_per_layer": t, "saved_us": base - t,
                             "ideal_us": ideal})
                print(f"{busy}: {policy} {cols} cols: {t:.1f} us/layer, saved {base - t:+.1f} us (ideal {ideal:.1f})",
                      flush=True)
    res["rows"] = rows
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
