#!/usr/bin/env bash
# One device call: an A/B of an environment switch on the real server. `kimi serve --device cuda` on the real K2.6
# config with dummy weights cut to $LAYERS layers is started once per value in $VALUES of the variable $VAR, and
# tools/bench_serving.py drives each over HTTP; JSON and logs under $OUT (one subfolder per value).
# Usage (device tool, carry .whl .whl_e2e .jitcache): VAR=KIMI_HUMMING_TABLE VALUES="off kimi/kernels/tuning/humming.json" LAYERS=4 bash scripts/serve_ab.sh
# VAR=flag: each value is a `kimi serve` flag instead (none = no flag), e.g. VALUES="none --no-async-scheduling".
set -u
source scripts/device_env.sh || exit 1
LAYERS=${LAYERS:-4}
i=0
for v in $VALUES; do
  i=$((i + 1)); d=$OUT/${i}_${VAR}_${v#--}; mkdir -p $d
  if [ "$VAR" = flag ]; then envv=(); flag=(); [ "$v" != none ] && flag=("$v"); else envv=("$VAR=$v"); flag=(); fi
  env "${envv[@]}" python3 -m kimi serve --device cuda --model preset:kimi-k2.6 --load-format dummy \
    --num-hidden-layers $LAYERS --max-num-seqs ${MAX_SEQS:-64} --port 8000 --served-model-name k26 "${flag[@]}" > $d/serve.log 2>&1 &
  pid=$!
  t0=$(date +%s)
  until curl -sf localhost:8000/health | grep -q ok; do
    sleep 2
    if ! kill -0 $pid 2>/dev/null; then echo "$VAR=$v: server exited"; tail -30 $d/serve.log; exit 1; fi
    if [ $(( $(date +%s) - t0 )) -gt ${T_START:-240} ]; then echo "$VAR=$v: not ready"; kill $pid; exit 1; fi
  done
  echo "$VAR=$v: ready after $(( $(date +%s) - t0 )) s"
  timeout ${T_BENCH:-150} python3 tools/bench_serving.py --base-url http://127.0.0.1:8000 --model k26 \
    --num-requests ${REQUESTS:-128} --concurrency ${CONCURRENCY:-64} --input-len 512 --output-len ${OUTPUT_LEN:-128} \
    --no-progress --out $d/bench_serving.json 2>&1 | tail -12
  kill -TERM $pid; wait $pid; echo "$VAR=$v: server exit rc=$?"
  grep -E "plan ahead|graph replays|captured" $d/serve.log | tail -3
  sleep 2
done
