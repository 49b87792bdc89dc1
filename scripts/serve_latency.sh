#!/usr/bin/env bash
# One device call: TTFT and TPOT of `kimi serve --device cuda` over HTTP. The server: K2.6's config with dummy weights
# cut to $LAYERS layers (default 61), --max-num-seqs 64, plus $EXTRA flags (default --emulate-ep-size 8: one rank of a
# DP8 x EP8 deployment whose peers are idle). tools/bench_serving.py runs --cases $CASES (default: 8 lone prompts of
# 1, 128 and 1024 tokens and 4 of 8192, then a 64-request burst of each) with $OUT_LEN output tokens (default 8), and
# writes the snapshot <gpu>/serving_$NAME.json under $SNAPSHOT (default $OUT/snap) when NAME is set.
# Logs: $OUT/serve_$NAME.log, $OUT/bench_serving_$NAME.json (NAME default: latency).
# Usage (device tool, carry .whl .whl_e2e .jitcache): NAME=dummy-k2.6-L61-ep8-ttft bash scripts/serve_latency.sh
set -u
source scripts/device_env.sh || exit 1
LAYERS=${LAYERS:-61}
EXTRA=${EXTRA:---emulate-ep-size 8}
CASES=${CASES:-1x1x8,128x1x8,1024x1x8,8192x1x4,1x64x64,128x64x64,1024x64x64,8192x64x64}
serve=(python3 -m kimi serve --device cuda --model preset:kimi-k2.6 --load-format dummy --num-hidden-layers $LAYERS
       --max-num-seqs 64 --port 8000 --served-model-name k26 $EXTRA)
"${serve[@]}" > $OUT/serve_${NAME:-latency}.log 2>&1 &
pid=$!
t0=$(date +%s)
until curl -sf localhost:8000/health | grep -q ok; do
  sleep 1
  if ! kill -0 $pid 2>/dev/null; then echo "server exited"; tail -40 $OUT/serve_${NAME:-latency}.log; exit 1; fi
  if [ $(( $(date +%s) - t0 )) -gt ${T_START:-400} ]; then echo "not ready"; tail -40 $OUT/serve_${NAME:-latency}.log; kill $pid; exit 1; fi
done
echo "ready after $(( $(date +%s) - t0 )) s"
snap=()
[ -n "${NAME:-}" ] && snap=(--snapshot "${SNAPSHOT:-$OUT/snap}" --snapshot-config "$NAME" --server-note "${serve[*]:2}")
timeout ${T_BENCH:-300} python3 tools/bench_serving.py --base-url http://127.0.0.1:8000/v1 --cases "$CASES" \
  --output-len ${OUT_LEN:-8} --no-progress --out $OUT/bench_serving_${NAME:-latency}.json "${snap[@]}" 2>&1 | grep -v '^ \|^{\|^}' | tail -20
kill -TERM $pid; wait $pid; echo "server exit rc=$?"
grep -E "warm-up in|captured|weights loaded|compiled" $OUT/serve_${NAME:-latency}.log | head -8
