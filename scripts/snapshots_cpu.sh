#!/usr/bin/env bash
# The CPU snapshots: the controller's cost per step (tools/bench_controller.py: kimi serve --fake-workers at 64, 256
# and 1024 running streams) and serving through HTTP against kimi serve --fake-workers (tools/bench_serving.py:
# 512 requests of 512 + 128 tokens, 64 at a time). Both write ROOT/cpu/<name>.json (ROOT default: the checkout's
# benchmarks/snapshots). Run it on a quiet machine with 2 or more cores (server and client each pinned to a core);
# it takes about 3-5 minutes.
# SHORT=1: small settings that only check the two benchmarks work (seconds), written under /tmp/kimi_snapshots_short
# unless ROOT is given.
# Usage: bash scripts/snapshots_cpu.sh [ROOT]     (PYTHON: the interpreter with kimi installed, default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
if [ "${SHORT:-0}" = 1 ]; then
  root=${1:-/tmp/kimi_snapshots_short}
  ctl=(--running 16 --input-len 16 --output-len 32)
  srv=(--num-requests 32 --concurrency 8 --input-len 64 --output-len 16)
else
  root=${1:-benchmarks/snapshots}
  ctl=()
  srv=(--num-requests 512 --concurrency 64 --input-len 512 --output-len 128)
fi
pin_server=() pin_client=()
if command -v taskset > /dev/null && [ "$(nproc)" -ge 2 ]; then pin_server=(taskset -c 0) pin_client=(taskset -c 1); fi

echo "== controller"
"$py" tools/bench_controller.py "${ctl[@]}" --snapshot "$root" > /dev/null

echo "== serving against kimi serve --fake-workers"
tmp=$(mktemp -d) pid=""
trap '[ -z "$pid" ] || kill $pid 2> /dev/null || true; rm -rf "$tmp"' EXIT
"$py" tools/make_tiny_checkpoint.py "$tmp/tiny-k2.6" --builtin-tokenizer 2> /dev/null
port=$("$py" -c "from kimi.ipc import free_tcp_port; print(free_tcp_port())")
zport=$("$py" -c "from kimi.ipc import free_tcp_port; print(free_tcp_port())")
serve=(kimi serve --model "$tmp/tiny-k2.6" --fake-workers --port "$port" --zmq-submit-addr "tcp://127.0.0.1:$zport"
       --max-num-seqs 64 --num-blocks 4096 --max-model-len 4096 --log-level warning)
"${pin_server[@]}" "$py" -m "${serve[@]}" > "$tmp/server.log" 2>&1 &
pid=$!
for _ in $(seq 240); do
  curl -sf "http://127.0.0.1:$port/health" | grep -q ok && break
  kill -0 $pid 2> /dev/null || { cat "$tmp/server.log"; exit 1; }
  sleep 0.5
done
note="${serve[*]}"
"${pin_client[@]}" "$py" tools/bench_serving.py --base-url "http://127.0.0.1:$port/v1" "${srv[@]}" --no-progress \
  --snapshot "$root" --snapshot-device cpu --snapshot-config fake-workers --server-note "${note//$tmp/TMP}" | head -1
kill -TERM $pid; wait $pid || true
ls -l "$root"/cpu/
