#!/usr/bin/env bash
# The H200 snapshots: every maintained GPU benchmark in its headline configuration, each writing its snapshot to
# ROOT/h200/<name>.json (ROOT default: $OUT/snapshots). Four parts, each meant to end within ~9 minutes of one H200
# (every benchmark runs under its own timeout, so a slow one cannot take the rest of its part with it):
#   1  decode_int4-ep8 (K2.6 rank, DP8 x EP8, 8 and 32 local sequences), prefill_int4-ep8-chunk2048
#   2  decode_fp8-ep16 (K2-Instruct's FP8 experts, DP16 x EP16), moe-fp8, fp8-linear
#   3  moe-w4a16 (kimi's CUDA expert GEMM against humming's), mla, sampler, fused
#   4  gemm-small-m, bmm-small-m, serving_dummy-k2.6-L4 (kimi serve over HTTP, dummy K2.6 cut to 4 layers)
# A fresh machine compiles FlashInfer's, humming's and kimi's csrc/ kernels at first use: run the parts one after
# another on the same warm machine (the caches stay in /tmp and ~/.cache there), or carry .jitcache (SAVE_JIT=1
# brings this machine's caches back as $OUT/*.tgz: put them in .jitcache/).
# Each part brings back at most 7 files: its snapshots, $OUT/part<N>.log, $OUT/gpu.txt (part 4: also the server's
# serve.log and bench_serving.json).
# Usage (device tool, at the repository root, carry .whl [.jitcache]; .whl: bash scripts/wheelhouse.sh .whl):
#   KIMI_GIT_COMMIT=<the commit measured> bash scripts/snapshots_h200.sh PART [ROOT]
# Then copy ROOT/h200/*.json into benchmarks/snapshots/h200/ and run python tools/performance_tables.py.
set -u
part=${1:-}
case "$part" in
  1|2|3|4) ;;
  *) echo "usage: bash scripts/snapshots_h200.sh PART [ROOT]   (PART 1-4; see the header)" >&2; exit 2 ;;
esac
source scripts/device_env.sh || exit 1
root=${2:-$OUT/snapshots}
mkdir -p "$root"
log=$OUT/part$part.log
[ -n "${KIMI_GIT_COMMIT:-}" ] || echo "KIMI_GIT_COMMIT is not set: the snapshots record commit null" | tee -a $log

# run SECONDS COMMAND...: one benchmark under a timeout, its output to the log, its exit status and time noted
run() {
  local limit=$1; shift
  local t0=$(date +%s)
  echo "== $* (limit ${limit} s)" | tee -a $log
  timeout $limit "$@" >> $log 2>&1
  local rc=$?
  echo "== rc=$rc after $(( $(date +%s) - t0 )) s" | tee -a $log
  tail -4 $log | grep -v "^== " || true
}

case "$part" in
  1)
    run 330 python3 tools/bench_decode.py --seqs 8,32 --no-profile --snapshot "$root"
    run 200 python3 tools/bench_prefill.py --cases 16x128,2048,8192 --iters 3 --no-profile --snapshot "$root"
    ;;
  2)
    run 300 python3 tools/bench_decode.py --quant fp8 --ep-size 16 --seqs 8,32 --no-profile --snapshot "$root"
    run 90 python3 tools/bench_moe_fp8.py --snapshot "$root"
    run 150 python3 tools/bench_fp8_linear.py --snapshot "$root"
    ;;
  3)
    run 150 python3 tools/bench_moe_cuda.py --snapshot "$root"
    run 200 python3 tools/bench_mla.py --snapshot "$root"
    run 60 python3 tools/bench_sampling.py --snapshot "$root"
    run 120 python3 tools/bench_fused.py --snapshot "$root"
    ;;
  4)
    run 150 python3 tools/bench_gemm.py --snapshot "$root"
    run 90 python3 tools/bench_bmm.py --snapshot "$root"
    run 300 env SNAPSHOT="$root" CHECK=0 LAYERS=4 bash scripts/serve_dummy.sh
    ;;
esac
[ "${SAVE_JIT:-0}" = 1 ] && save_jit_caches
find "$root" -name "*.json" | sort | tee -a $log
