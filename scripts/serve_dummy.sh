#!/usr/bin/env bash
# One device call: `kimi serve --device cuda` on the real K2.6 config with dummy weights cut to $LAYERS layers
# (FlashInfer MLA decode, packed INT4 experts, CUDA graphs), driven by real HTTP requests (scripts/serve_check.py,
# unless CHECK=0) and tools/bench_serving.py (128 requests of 512 + 64 tokens, 64 at a time); logs and JSON under $OUT.
# SNAPSHOT=ROOT writes the serving snapshot to ROOT/<gpu>/serving_dummy-k2.6-L<LAYERS>.json; SAVE_JIT=1 brings the
# JIT caches back (scripts/device_env.sh); BENCH=0 skips tools/bench_serving.py.
# Usage (device tool, carry .whl .jitcache): LAYERS=4 bash scripts/serve_dummy.sh
set -u
source scripts/device_env.sh || exit 1
LAYERS=${LAYERS:-4}
serve=(python3 -m kimi serve --device cuda --model preset:kimi-k2.6 --load-format dummy --num-hidden-layers $LAYERS
       --max-num-seqs 64 --port 8000 --served-model-name k26)
"${serve[@]}" > $OUT/serve.log 2>&1 &
pid=$!
t0=$(date +%s)
until curl -sf localhost:8000/health | grep -q ok; do
  sleep 2
  if ! kill -0 $pid 2>/dev/null; then echo "server exited"; tail -40 $OUT/serve.log; exit 1; fi
  if [ $(( $(date +%s) - t0 )) -gt ${T_START:-300} ]; then echo "not ready"; tail -40 $OUT/serve.log; kill $pid; exit 1; fi
done
echo "ready after $(( $(date +%s) - t0 )) s"
if [ "${CHECK:-1}" = 1 ]; then
  timeout 200 python3 scripts/serve_check.py --base-url http://127.0.0.1:8000 --model k26 --concurrency 32 --out $OUT/serve_check.json
  echo "serve_check rc=$?"
fi
snap=()
[ -n "${SNAPSHOT:-}" ] && snap=(--snapshot "$SNAPSHOT" --snapshot-config "dummy-k2.6-L$LAYERS" --server-note "${serve[*]:2}")
[ "${BENCH:-1}" = 1 ] && timeout 150 python3 tools/bench_serving.py --base-url http://127.0.0.1:8000/v1 --num-requests 128 --concurrency 64 \
  --input-len 512 --output-len 64 --no-progress --out $OUT/bench_serving.json "${snap[@]}" 2>&1 | tail -25
kill -TERM $pid; wait $pid; echo "server exit rc=$?"
sleep 2; ps aux | grep -c "[k]imi.worker.main" | sed 's/^/worker processes left: /'
grep -iE "graph|flashinfer|backend|ready|error|Traceback" $OUT/serve.log | head -30
[ "${SAVE_JIT:-0}" = 1 ] && save_jit_caches
ls -la $OUT
