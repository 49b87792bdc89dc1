"""Helpers of the benchmarks in tools/ (docs/benchmarks.md), kept in the package so that the benchmarks, the tuners
and the tests share one copy:

- `snapshot`: the snapshot files under benchmarks/snapshots/ (one shape for every benchmark) and their conditions;
- `performance`: the tables of docs/performance.md, rendered from those snapshots;
- `smi`: nvidia-smi's SM clock / power samples during a timing (GpuSampler) and their summary;
- `gpu`: GPU timers (CUDA events, CUDA-graph replay), the copy bandwidth the floors use, the one-line refusal of a
  GPU benchmark on a machine without the GPU or its packages;
- `emulated_rank`: one DP x EP rank of a K2 model on one GPU (the emulated all-to-all, the step timer, the per-kernel
  breakdown) for the decode and prefill benchmarks;
- `moe`: random INT4 experts, routing sets and humming's indexed GEMMs at Kimi's expert shapes;
- `serving`: the HTTP side of the serving benchmarks (base URL, API key, the served model).

Only `smi`, `snapshot`, `performance` and `serving` import without torch's CUDA; none is imported by kimi itself.
"""
