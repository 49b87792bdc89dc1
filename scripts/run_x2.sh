#!/usr/bin/env bash
# One call on a 2-GPU machine (device kind nvidia-h200-x2; carry .whl .whl_e2e .jitcache):
#  1. tests/gpu/test_long_context_gpu.py (GPU model vs CPU reference past 32k positions; uses GPU 0)
#  2. kimi serve --device cuda --nproc 2 with --a2a-backend nccl, then deepep, on the tiny K2.6 checkpoint
#     (or, with LAYERS=N, on the real K2.6 config with dummy weights cut to N layers: hidden 7168, 384 experts;
#     EXPERTS=M sets its routed experts to M),
#     driven by scripts/serve_check.py (real HTTP requests), server logs kept.
# BENCH=1 adds tools/bench_serving.py (64 requests of 512 + 64 tokens, 32 at a time) per backend.
# NVLink multicast stays off (the machine sets NCCL_NVLS_ENABLE=0, NVSHMEM_DISABLE_NVLS=1; not overridden here).
set -u
source scripts/device_env.sh || exit 1
export KIMI_GPU_REPORT=$OUT/report.jsonl
nvidia-smi -L | tee $OUT/gpus.txt; env | grep -E "NVLS|MULTICAST" | tee -a $OUT/gpus.txt
if [ "${SKIP_LONG:-0}" != 1 ]; then
  timeout ${T_LONG:-240} python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_long_context_gpu.py 2>&1 | tail -8 | tee $OUT/long_context.log
fi
if [ -n "${LAYERS:-}" ] && [ -n "${EXPERTS:-}" ]; then
  # K2.6's config with EXPERTS routed experts (DeepEP takes at most 128 per rank: 256 over 2 ranks)
  python3 -c "
import json, os, sys
from kimi.presets import load_preset
from kimi.tokenizer import default_tokenizer_source, write_tokenizer_files
d = sys.argv[1]; os.makedirs(d, exist_ok=True)
c = load_preset('kimi-k2.6'); c['text_config']['n_routed_experts'] = int(sys.argv[2])
json.dump(c, open(os.path.join(d, 'config.json'), 'w'), indent=1)
write_tokenizer_files(d, default_tokenizer_source())" /tmp/k26e$EXPERTS $EXPERTS || exit 1
  model="/tmp/k26e$EXPERTS --load-format dummy --num-hidden-layers $LAYERS --max-model-len 8192"
elif [ -n "${LAYERS:-}" ]; then
  model="preset:kimi-k2.6 --load-format dummy --num-hidden-layers $LAYERS --max-model-len 8192"
else
  python3 tools/make_tiny_checkpoint.py /tmp/tiny --layout k2.6 > /dev/null; model=/tmp/tiny
fi
for be in ${BACKENDS:-nccl deepep}; do
  python3 -m kimi serve --device cuda --nproc 2 --a2a-backend $be --model $model --port 8000 \
    --served-model-name tiny --heartbeat-timeout 30 > $OUT/serve_$be.log 2>&1 &
  pid=$!; t0=$(date +%s); ok=1
  until curl -sf localhost:8000/health | grep -q ok; do
    sleep 2
    if ! kill -0 $pid 2>/dev/null || [ $(( $(date +%s) - t0 )) -gt ${T_READY:-150} ]; then ok=0; break; fi
  done
  if [ $ok = 1 ]; then
    echo "== $be: ready after $(( $(date +%s) - t0 )) s"
    timeout 120 python3 scripts/serve_check.py --base-url http://127.0.0.1:8000 --model tiny --concurrency 16 \
      --out $OUT/serve_check_$be.json; echo "== $be serve_check rc=$?"
    if [ "${BENCH:-0}" = 1 ]; then
      timeout 150 python3 tools/bench_serving.py --base-url http://127.0.0.1:8000 --model tiny --num-requests 64 \
        --concurrency 32 --input-len 512 --output-len 64 --no-progress --out $OUT/bench_serving_$be.json 2>&1 | tail -12
    fi
  else
    echo "== $be: not ready"; tail -25 $OUT/serve_$be.log
  fi
  kill -TERM $pid 2>/dev/null; timeout 30 tail --pid=$pid -f /dev/null; echo "== $be server exit"
  grep -E "all-to-all backend|served|Error|error" $OUT/serve_$be.log | head -12
  pkill -9 -f kimi.worker.main 2>/dev/null; sleep 1
done
ls -la $OUT
