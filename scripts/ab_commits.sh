#!/usr/bin/env bash
# A/B of two source trees on one GPU machine: the decode and prefill benchmarks of tree A (another commit's files,
# e.g. `git archive <commit> | tar -x -C .ab_a`, carried as an ignored folder) and of this checkout (B), run
# alternately A B A B with the same flags, so the difference between the trees can be read against the run-to-run
# noise of each. The whole output in $OUT/ab.log (one file: a call brings back at most 8).
# Usage (device tool, carry .whl .jitcache .ab_a): bash scripts/ab_commits.sh A_DIR [LAYERS] [SEQS]
set -u
a=${1:?usage: bash scripts/ab_commits.sh A_DIR [LAYERS] [SEQS]}
layers=${2:-20}
seqs=${3:-8,32}
source scripts/device_env.sh || exit 1
log=$OUT/ab.log
b=$PWD
site=/tmp/site
for round in 1 2; do
  for side in A B; do
    dir=$b; [ $side = A ] && dir=$(cd "$a" && pwd)
    echo "== round $round, $side ($dir)"
    echo "== round $round, $side decode" >> $log
    (cd "$dir" && PYTHONPATH=$site:$dir timeout 200 python3 tools/bench_decode.py --seqs $seqs --layers $layers \
      --no-profile --rounds 2 >> $log 2>&1)
    echo "decode rc=$?"; sed -n '/^== round '$round', '$side' decode/,$p' $log | grep -E "^B=[0-9]+: graph [0-9.]+ ms"
    echo "== round $round, $side prefill" >> $log
    (cd "$dir" && PYTHONPATH=$site:$dir timeout 120 python3 tools/bench_prefill.py --cases 2048 --iters 3 \
      --layers $layers --no-profile >> $log 2>&1)
    echo "prefill rc=$?"; sed -n '/^== round '$round', '$side' prefill/,$p' $log | grep -E "prefill [0-9.]+ ms"
  done
done
