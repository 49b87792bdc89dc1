#!/usr/bin/env python
"""Start-up of `kimi serve` on this machine: launch to `/health` ok, the parts the server logs (weights, decode CUDA
graphs, the warm-up's phases, what each kernel library compiled), then whether serving compiles anything afterwards.

    python tools/bench_startup.py [--layers 2] [--max-num-seqs 32] [--token-budget 2048] [--max-model-len 8192]
                                  [--emulate-ep-size N] [--cache-dir DIR] [--runs 1] [--snapshot]

Serves Kimi-K2.6's config (`preset:kimi-k2.6`, dummy weights, `--device cuda`) cut to --layers layers. Each run starts
a server, records its start-up, sends kimi.benchmarks.startup.probe_compiles' requests (many prompt sizes, a chunked
prompt, prompt logprobs, a JSON-constrained request, --max-num-seqs concurrent streams with every sampling option) and
counts the files that appeared in the kernel cache folders meanwhile, then stops it. With --runs 2 the second start
reuses the cache the first filled (the restart case). With --emulate-ep-size 8 the server is one rank of a DP8 x EP8
deployment (48 of the 384 experts; `kimi serve --emulate-ep-size`), so `--layers 61` fits one GPU. The timeline gives
the seconds from launch to each start-up event the log marks (kimi.benchmarks.startup.TIMELINE). Snapshot:
<device>/startup_dummy-k2.6-L<layers>[-ep<N>].json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from kimi import cache_dir
from kimi.benchmarks import snapshot
from kimi.benchmarks.startup import parse_log, probe_compiles, start, timeline
from kimi.ipc import free_tcp_port

VOCAB = 163840


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=snapshot.HelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--token-budget", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--cache-dir", default=None, help="the kernel cache (default: $KIMI_CACHE_DIR, else ~/.cache/kimi)")
    ap.add_argument("--runs", type=int, default=1, help="starts in a row, each reusing the cache the last one filled")
    ap.add_argument(
        "--emulate-ep-size",
        type=int,
        default=1,
        help="serve one rank of an N-rank expert-parallel deployment (its 1 / N of the experts; kimi serve's flag)",
    )
    snapshot.add_arguments(ap)
    args = ap.parse_args(argv)
    cache = args.cache_dir or cache_dir.default_dir()
    serve = ["--device", "cuda", "--model", "preset:kimi-k2.6", "--load-format", "dummy"]
    serve += ["--num-hidden-layers", str(args.layers), "--max-num-seqs", str(args.max_num_seqs)]
    serve += ["--token-budget", str(args.token_budget), "--max-model-len", str(args.max_model_len)]
    if args.emulate_ep_size > 1:
        serve += ["--emulate-ep-size", str(args.emulate_ep_size)]
    serve += ["--zmq-submit-addr", f"tcp://127.0.0.1:{free_tcp_port()}"]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            s = start(serve, Path(tmp) / f"server{i}.log", cache, free_tcp_port())
            try:
                new = probe_compiles(s, args.token_budget, args.max_num_seqs, VOCAB, args.max_model_len)
            finally:
                rc = s.stop()
            run = {"ready_s": round(s.ready_s, 1), **parse_log(s.log()), "new_files_after_ready": len(new)}
            run["timeline_s"] = timeline(s.log(), s.launched_at)
            run["new_file_examples"] = new[:10]
            run["exit_status"] = rc
            print(json.dumps(run), flush=True)
            runs.append(run)
    if args.snapshot:
        rows = []
        first_phases = runs[0].get("warmup_phases", {})
        for i, r in enumerate(runs):
            compiled = ", ".join(f"{k} {n}" for k, n in r.get("compiled_files", {}).items()) or "nothing"
            rows.append(
                [
                    i + 1,
                    r["ready_s"],
                    r.get("weights_s"),
                    r.get("graphs_s"),
                    r.get("warmup_s"),
                    compiled,
                    r["new_files_after_ready"],
                ]
            )
        summary = {
            "columns": [
                "start",
                "ready (s)",
                "weights (s)",
                "graphs (s)",
                "warm-up (s)",
                "files compiled at start-up",
                "files compiled after ready",
            ],
            "rows": rows,
            "notes": [
                "warm-up phases of start 1: " + ", ".join(f"{k} {v[0]:.1f} s" for k, v in first_phases.items()),
                *(
                    f"start {i + 1}, seconds after launch: " + ", ".join(f"{k} {t}" for k, t in r["timeline_s"].items())
                    for i, r in enumerate(runs)
                ),
            ],
        }
        snapshot.write(
            args.snapshot,
            benchmark="startup",
            config=f"dummy-k2.6-L{args.layers}" + (f"-ep{args.emulate_ep_size}" if args.emulate_ep_size > 1 else ""),
            summary=summary,
            results={"serve_args": serve, "cache_dir": cache, "runs": runs},
            conds=snapshot.conditions(gpu=True, server="kimi serve " + " ".join(serve)),
        )
    return 0 if all(r["new_files_after_ready"] == 0 and r["exit_status"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
