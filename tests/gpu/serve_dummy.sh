#!/usr/bin/env bash
# One device call: `kimi serve --device cuda` on the real K2.6 config with dummy weights cut to $LAYERS layers
# (FlashInfer MLA decode, packed INT4 experts, CUDA graphs), driven by real HTTP requests
# (tests/gpu/serve_check.py) and tools/bench_serving.py; logs and JSON under $OUT.
# Usage (device tool, carry .whl .jitcache): LAYERS=4 bash tests/gpu/serve_dummy.sh
set -u
source tests/gpu/device_env.sh || exit 1
LAYERS=${LAYERS:-4}
python3 -m kimi serve --device cuda --model preset:kimi-k2.6 --load-format dummy --num-hidden-layers $LAYERS \
  --max-num-seqs 64 --port 8000 --served-model-name k26 > $OUT/serve.log 2>&1 &
pid=$!
t0=$(date +%s)
until curl -sf localhost:8000/health | grep -q ok; do
  sleep 2
  if ! kill -0 $pid 2>/dev/null; then echo "server exited"; tail -40 $OUT/serve.log; exit 1; fi
  if [ $(( $(date +%s) - t0 )) -gt ${T_START:-300} ]; then echo "not ready"; tail -40 $OUT/serve.log; kill $pid; exit 1; fi
done
echo "ready after $(( $(date +%s) - t0 )) s"
timeout 200 python3 tests/gpu/serve_check.py --base-url http://127.0.0.1:8000 --model k26 --concurrency 32 --out $OUT/serve_check.json
echo "serve_check rc=$?"
timeout 150 python3 tools/bench_serving.py --base-url http://127.0.0.1:8000 --model k26 --num-requests 128 --concurrency 64 \
  --input-len 512 --output-len 64 --no-progress --out $OUT/bench_serving.json 2>&1 | tail -25
kill -TERM $pid; wait $pid; echo "server exit rc=$?"
sleep 2; ps aux | grep -c "[k]imi.worker.main" | sed 's/^/worker processes left: /'
grep -iE "graph|flashinfer|backend|ready|error|Traceback" $OUT/serve.log | head -30
(cd /tmp/hcache 2>/dev/null && tar czf $OUT/humming.tgz .) ; (cd ~/.cache 2>/dev/null && tar czf $OUT/flashinfer.tgz flashinfer) ; ls -la $OUT
