"""Host-speed probe (bench/host_2026-11-30.json): pure Python list work and single torch / CUDA API calls on the GPU
host, median us over 200 repeats each (the parts of CudaGraphRunner.run_host's staging, one at a time).

Usage: python tools/probe_host.py   (prints one JSON line; needs a CUDA device)
"""

import argparse
import json
import os
import random
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_util import require_gpu


def med(fn, n: int = 200) -> float:
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    return round(statistics.median(ts), 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.parse_args()
    require_gpu(ap.prog)
    B, blk, nb = 32, 64, 33  # 32 sequences of 2k tokens in 64-token blocks
    perm = list(range(1, B * nb + 1))
    random.shuffle(perm)
    tabs = [perm[i * nb : (i + 1) * nb] for i in range(B)]
    lens = [2048] * B
    out = {}

    def pyflat():
        flat = []
        for t, n in zip(tabs, lens):
            flat += t[: -(-n // blk)]
        return flat

    out["python_flat_32x32"] = med(pyflat)
    host = torch.zeros(4096, dtype=torch.int64, pin_memory=True)
    dev = torch.zeros(4096, dtype=torch.int64, device="cuda")
    kvn = host[96:].numpy().view(np.int32)
    fl = pyflat()
    out["numpy_from_list_1024"] = med(lambda: kvn.__setitem__(slice(0, len(fl)), fl))
    ev = torch.cuda.Event()
    ev.record()
    torch.cuda.synchronize()
    out["event_synchronize_done"] = med(ev.synchronize)
    out["event_query_done"] = med(ev.query)
    out["event_record"] = med(ev.record)
    out["current_stream_dev"] = med(lambda: torch.cuda.current_stream(dev.device))
    out["slice_views"] = med(lambda: (dev[:1024], host[:1024]))
    d1, h1 = dev[:1024], host[:1024]
    out["copy_pinned_nonblocking"] = med(lambda: d1.copy_(h1, non_blocking=True))
    torch.cuda.synchronize()
    x = torch.zeros(1024, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        x.add_(1)  # warm-up off the default stream before capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(500):
            x.add_(1)
    torch.cuda.synchronize()
    out["graph500_replay_launch"] = med(g.replay, 50)
    torch.cuda.synchronize()
    out["torch_threads"] = torch.get_num_threads()
    with open("/proc/cpuinfo") as f:
        out["cpu"] = f.read().split("model name")[1].split("\n")[0].strip(" \t:")
    out["loadavg"] = os.getloadavg()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
