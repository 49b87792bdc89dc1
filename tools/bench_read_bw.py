"""HBM read bandwidth on one GPU: how fast plain read-only kernels stream a buffer, against the device-to-device
copy bandwidth that tools/bench_decode.py's floor uses. Why: the decode step's expert GEMMs stream their weights at
about the copy bandwidth (docs/benchmarks.md); if a read-only stream runs measurably faster, they have headroom, and
how a kernel issues its loads (per-lane 16-byte loads, as kimi's GEMM's cp.async, or TMA bulk copies) says where.

Kernels (compiled with CuPy's NVRTC at run time; each reads every byte of one --gib GiB buffer once per call and
folds it into an XOR that is stored only if it hits a value no random buffer gives, so nothing is optimised away):
- `v4_grid`: 16-byte `ld.global.nc` loads, U per thread in flight, grid-stride over the whole buffer;
- `v4_cta`: the same loads, each CTA over its own contiguous slice (the GEMMs' pattern: a CTA streams its weights);
- `bulk`: one thread per CTA keeps S `cp.async.bulk` copies of C bytes each in flight into shared memory
  (mbarrier completion), each CTA over its own contiguous slice;
plus PyTorch's copy (the floor's bandwidth) and `torch.sum` over int32 (PyTorch's reduction).
Each configuration: median of --iters event-timed calls after warm-up. GB/s = bytes read / time (the copy: read +
written, as bench_util.copy_bandwidth). The SM clock and power over each configuration's timed calls come from
nvidia-smi (bench_util.GpuSampler). Writes JSON to --out (default bench/read_bw_<date>.json, or $OUT).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_util import GpuSampler, copy_bandwidth, event_times, out_paths, require_gpu, run_header

_SRC = r"""
// RBW_U 16-byte loads in flight (p[i + u * step] for u < RBW_U, those below hi), folded into acc by XOR
__device__ __forceinline__ int load_fold(const int4* __restrict__ p, long long i, long long step, long long hi,
                                         int acc) {
    int4 v[RBW_U];
#pragma unroll
    for (int u = 0; u < RBW_U; ++u) {
        long long j = i + u * step;
        if (j < hi) {
            asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];"
                         : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w) : "l"(p + j));
        } else {
            v[u] = make_int4(0, 0, 0, 0);
        }
    }
#pragma unroll
    for (int u = 0; u < RBW_U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    return acc;
}

extern "C" __global__ void v4_grid(const int4* __restrict__ p, long long n16, int* out) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    int acc = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n16; i += stride * RBW_U)
        acc = load_fold(p, i, stride, n16, acc);
    if (acc == 0x13572468) out[0] = acc;
}

extern "C" __global__ void v4_cta(const int4* __restrict__ p, long long n16, int* out) {
    const long long per = (n16 + gridDim.x - 1) / gridDim.x;
    const long long lo = blockIdx.x * per;
    const long long hi = min(n16, lo + per);
    int acc = 0;
    for (long long i = lo + threadIdx.x; i < hi; i += (long long)blockDim.x * RBW_U)
        acc = load_fold(p, i, blockDim.x, hi, acc);
    if (acc == 0x13572468) out[0] = acc;
}

// One thread per CTA: RBW_S bulk copies of RBW_C bytes in flight into RBW_S shared-memory slots, over the CTA's contiguous slice
// of whole chunks (the buffer is a multiple of RBW_C bytes).
extern "C" __global__ void bulk(const char* __restrict__ p, long long nchunks, int* out) {
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned long long* bar = reinterpret_cast<unsigned long long*>(smem + RBW_S * RBW_C);
    if (threadIdx.x != 0) return;
    const long long per = (nchunks + gridDim.x - 1) / gridDim.x;
    const long long lo = blockIdx.x * per;
    const long long hi = min(nchunks, lo + per);
    for (int s = 0; s < RBW_S; ++s) {
        unsigned a = (unsigned)__cvta_generic_to_shared(bar + s);
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(a));
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    int acc = 0;
    long long issued = lo;
    for (int s = 0; s < RBW_S && issued < hi; ++s, ++issued) {
        unsigned b = (unsigned)__cvta_generic_to_shared(bar + s);
        unsigned d = (unsigned)__cvta_generic_to_shared(smem + s * RBW_C);
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(b), "r"(RBW_C) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     :: "r"(d), "l"(p + issued * (long long)RBW_C), "r"(RBW_C), "r"(b) : "memory");
    }
    unsigned phase = 0;
    for (long long c = lo; c < hi; ++c) {
        const int s = (int)((c - lo) % RBW_S);
        unsigned b = (unsigned)__cvta_generic_to_shared(bar + s);
        unsigned done = 0;
        while (!done) {
            asm volatile("{ .reg .pred q; mbarrier.try_wait.parity.shared::cta.b64 q, [%1], %2; selp.u32 %0, 1, 0, q; }"
                         : "=r"(done) : "r"(b), "r"((phase >> s) & 1) : "memory");
        }
        phase ^= 1u << s;
        acc ^= *reinterpret_cast<volatile int*>(smem + s * RBW_C);
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        if (issued < hi) {
            unsigned d = (unsigned)__cvta_generic_to_shared(smem + s * RBW_C);
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(b), "r"(RBW_C) : "memory");
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                         :: "r"(d), "l"(p + issued * (long long)RBW_C), "r"(RBW_C), "r"(b) : "memory");
            ++issued;
        }
    }
    if (acc == 0x13572468) out[0] = acc;
}
"""


def _time(fn, iters: int, sampler: GpuSampler) -> tuple[float, dict | None]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    # about half a second of back-to-back calls first, so the clock settles under the power cap as in a long run
    t_end = time.time() + 0.5
    while time.time() < t_end:
        fn()
        torch.cuda.synchronize()
    t0 = time.time()
    ts = event_times(fn, iters, warmup=0)
    return statistics.median(ts), sampler.windows([(t0, time.time())])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=2.0, help="buffer size, GiB")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    missing = None
    try:
        import cupy as cp
    except Exception as e:
        missing = e
    require_gpu("bench_read_bw", missing)
    out_json, _ = out_paths(args.out, None, "read_bw", "read_bw.txt")
    res = run_header("HBM read bandwidth: read-only kernels against the device-to-device copy", args)
    nbytes = int(args.gib * (1 << 30)) // (1 << 16) * (1 << 16)
    buf = torch.empty(nbytes // 4, dtype=torch.int32, device="cuda").random_()
    sink = torch.zeros(4, dtype=torch.int32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    sampler = GpuSampler(interval_ms=20).start()
    rows = []

    def record(name: str, ms: float, win, **kw) -> None:
        gbps = nbytes / ms / 1e6
        rows.append({"kernel": name, **kw, "ms": ms, "GBps": gbps, "smi": win})
        clk = f"{win['sm_clock_MHz']['median']:.0f} MHz {win['power_W_median']:.0f} W" if win else "-"
        print(f"{name:10s} {json.dumps(kw):60s} {ms:8.3f} ms {gbps:8.0f} GB/s  {clk}", flush=True)

    cb = copy_bandwidth(nbytes)
    res["copy"] = cb
    print(f"copy: {cb['GBps_read_plus_write']:.0f} GB/s (read + write)", flush=True)
    ms, win = _time(lambda: buf.sum(dtype=torch.int64), args.iters, sampler)
    record("torch.sum", ms, win)
    n16 = nbytes // 16
    for u in (4, 8, 16):
        mod = cp.RawModule(code=_SRC, options=("-arch=sm_90a", f"-DRBW_U={u}", "-DRBW_S=2", "-DRBW_C=1024"))
        for name in ("v4_grid", "v4_cta"):
            k = mod.get_function(name)
            for threads, per_sm in ((256, 4), (256, 8), (512, 4), (1024, 2)):
                grid = sms * per_sm

                def fn(k=k, grid=grid, threads=threads):
                    k(
                        (grid,),
                        (threads,),
                        (cp.uint64(buf.data_ptr()), cp.int64(n16), cp.uint64(sink.data_ptr())),
                        stream=stream,
                    )

                ms, win = _time(fn, args.iters, sampler)
                record(name, ms, win, unroll=u, threads=threads, ctas_per_sm=per_sm)
    for chunk, stages in ((2048, 8), (4096, 8), (8192, 8), (16384, 4), (16384, 8), (32768, 4)):
        mod = cp.RawModule(code=_SRC, options=("-arch=sm_90a", "-DRBW_U=4", f"-DRBW_S={stages}", f"-DRBW_C={chunk}"))
        k = mod.get_function("bulk")
        smem = stages * chunk + 8 * stages
        k.max_dynamic_shared_size_bytes = smem
        for per_sm in (1, 2, 4):
            if per_sm * smem > 220 * 1024:
                continue
            grid = sms * per_sm

            def fn(k=k, grid=grid, chunk=chunk, smem=smem):
                k(
                    (grid,),
                    (32,),
                    (cp.uint64(buf.data_ptr()), cp.int64(nbytes // chunk), cp.uint64(sink.data_ptr())),
                    stream=stream,
                    shared_mem=smem,
                )

            ms, win = _time(fn, args.iters, sampler)
            record("bulk", ms, win, chunk_bytes=chunk, stages=stages, ctas_per_sm=per_sm)
    sampler.stop()
    res["bytes"] = nbytes
    res["rows"] = rows
    best = max(rows, key=lambda r: r["GBps"])
    res["best"] = best
    print(
        f"best read: {best['kernel']} {best['GBps']:.0f} GB/s = {best['GBps'] / cb['GBps_read_plus_write']:.3f} x copy"
    )
    with open(out_json, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", out_json)


if __name__ == "__main__":
    main()
