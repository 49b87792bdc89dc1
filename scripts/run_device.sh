#!/usr/bin/env bash
# One device call (carry .whl, .whl_e2e for the e2e part, .jitcache): the GPU tests, the e2e suite's serving tests on
# the GPU path, and the decode benchmark; logs under $OUT. Parts, in the order given (default: tests e2e bench):
#   tests   python -m pytest -m gpu tests/gpu ($GPU_TESTS: other test files or -k expressions)
#   e2e     KIMI_TEST_DEVICE=cuda pytest $E2E (default tests/e2e/test_serve.py)
#   bench   tools/bench_decode.py --seqs $SEQS (default 8,32) --layers $LAYERS (default 61)
# SAVE_JIT=1 also brings the JIT caches back (scripts/device_env.sh, save_jit_caches).
# Usage: bash scripts/run_device.sh [tests|e2e|bench ...]
source scripts/device_env.sh || exit 1
export KIMI_GPU_REPORT=$OUT/gpu_report.jsonl
for p in ${*:-tests e2e bench}; do
  case $p in
    tests) timeout ${T_TESTS:-400} python3 -m pytest -q -rf -p no:cacheprovider -m gpu ${GPU_TESTS:-tests/gpu} 2>&1 | tee $OUT/gpu_tests.log | tail -40 ;;
    e2e) KIMI_TEST_DEVICE=cuda timeout ${T_E2E:-300} python3 -m pytest -q -rf -p no:cacheprovider ${E2E:-tests/e2e/test_serve.py} 2>&1 | tee $OUT/e2e_cuda.log | tail -40 ;;
    bench) timeout ${T_BENCH:-300} python3 tools/bench_decode.py --seqs ${SEQS:-8,32} --layers ${LAYERS:-61} --no-profile --out $OUT/decode.json 2>&1 | tee $OUT/bench.log | tail -30 ;;
    *) echo "run_device.sh: unknown part $p (tests, e2e, bench)" >&2; exit 2 ;;
  esac
done
[ "${SAVE_JIT:-0}" = 1 ] && save_jit_caches
ls -la $OUT
