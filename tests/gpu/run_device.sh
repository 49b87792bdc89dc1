#!/usr/bin/env bash
# One device call: GPU model tests, e2e on cuda, and the decode benchmark; logs + JIT caches under $OUT.
# Usage (device tool, carry .whl): bash tests/gpu/run_device.sh [tests|e2e|bench ...]
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl $(ls .whl_e2e/*.whl 2>/dev/null) || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HUMMING_CACHE_DIR=/tmp/hcache KIMI_GPU_REPORT=$OUT/gpu_report.jsonl
[ -f .jitcache/humming.tgz ] && mkdir -p /tmp/hcache && tar xzf .jitcache/humming.tgz -C /tmp/hcache
[ -f .jitcache/flashinfer.tgz ] && mkdir -p ~/.cache && tar xzf .jitcache/flashinfer.tgz -C ~/.cache
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv
parts=${*:-tests e2e bench}
for p in $parts; do
  case $p in
    tests) timeout ${T_TESTS:-200} python3 -m pytest -q -rA -p no:cacheprovider tests/gpu/test_gpu_model.py 2>&1 | tee $OUT/gpu_model.log | grep -v "^$" | tail -40 ;;
    kernels) timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_kernels.py 2>&1 | tail -5 ;;
    e2e) KIMI_TEST_DEVICE=cuda timeout ${T_E2E:-150} python3 -m pytest -q -rA -p no:cacheprovider ${E2E:-tests/e2e/test_serve.py} 2>&1 | tee $OUT/e2e_cuda.log | grep -E "PASS|FAIL|ERROR|passed|failed" | tail -60 ;;
    bench) timeout ${T_BENCH:-240} python3 tools/bench_decode.py --seqs ${SEQS:-8,32} --layers ${LAYERS:-61} --out $OUT/decode.json 2>&1 | tee $OUT/bench.log | tail -30 ;;
  esac
done
(cd /tmp/hcache 2>/dev/null && tar czf $OUT/humming.tgz .) ; (cd ~/.cache 2>/dev/null && tar czf $OUT/flashinfer.tgz flashinfer) ; ls -la $OUT
