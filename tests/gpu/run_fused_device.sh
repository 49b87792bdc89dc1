#!/usr/bin/env bash
# One device call for the fused-kernel work: fused kernel tests, GPU model tests, decode bench (B=8,32), and the
# single-GPU e2e check of the a2a backends (nccl / local, --nproc 1). Logs under $OUT. Carry .whl.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl $(ls .whl_e2e/*.whl 2>/dev/null) || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HUMMING_CACHE_DIR=/tmp/hcache KIMI_GPU_REPORT=$OUT/gpu_report.jsonl
mkdir -p /tmp/hcache ~/.cache
[ -f .jitcache/humming.tgz ] && tar xzf .jitcache/humming.tgz -C /tmp/hcache
[ -f .jitcache/flashinfer.tgz ] && tar xzf .jitcache/flashinfer.tgz -C ~/.cache
nvidia-smi --query-gpu=name,memory.used,clocks.sm,clocks.mem --format=csv
for p in ${*:-fused model bench a2a}; do
  case $p in
    fused) timeout 120 python3 -m pytest -q -rf -p no:cacheprovider tests/gpu/test_fused.py 2>&1 | tee $OUT/fused_tests.log | tail -25 ;;
    model) timeout 150 python3 -m pytest -q -rA -p no:cacheprovider tests/gpu/test_gpu_model.py 2>&1 | tee $OUT/gpu_model.log | grep -E "PASS|FAIL|XFAIL|Error|passed|failed" | tail -20 ;;
    bench) timeout ${T_BENCH:-270} python3 tools/bench_decode.py --seqs ${SEQS:-8,32} --out $OUT/decode.json 2>&1 | tee $OUT/bench.log | tail -14 ;;
    a2a) for b in nccl local; do echo "== e2e a2a $b"; touch /tmp/stamp_$b; KIMI_TEST_DEVICE=cuda KIMI_TEST_A2A=$b timeout 90 python3 -m pytest -q -p no:cacheprovider tests/e2e/test_serve.py 2>&1 | tee $OUT/e2e_a2a_$b.log | tail -4; mkdir -p $OUT/serve_$b; find /tmp/pytest-of-* -name '*.log' -newer /tmp/stamp_$b -exec cp {} $OUT/serve_$b/ \; 2>/dev/null; grep -ih "a2a\|all-to-all\|nccl\|process group" $OUT/serve_$b/*.log 2>/dev/null | sort | uniq -c | head -5; done ;;
  esac
done
ls $OUT
