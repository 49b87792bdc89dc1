"""The recorded decode-step headlines (bench/decode_*.json from tools/bench_decode.py) against the SM clock they ran at.

The decode step runs at the H200's 700 W power cap, where the SM clock settles at a different median on each lent
machine (docs/benchmarks.md, session 14), and the step's ratio to its HBM-byte floor follows it. This reads every
snapshot whose name sorts at or after `--since`, takes each case's headline (`graph` and `graph_pipelined`: the code on
main at that run, not an A/B variant) with its median SM clock (recorded from session 14 on), and prints one row per
run plus, per number of local sequences, the ratios of the runs below and at or above `--split` MHz.

    python tools/decode_runs_by_clock.py --since decode_2026-11-30_s18 --seqs 8,32 --ctx 2048 [--json out.json]

Rows without a recorded clock are skipped. Nothing here times anything: it reads what the runs wrote.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics


def read_runs(paths: list[str], seqs: set[int] | None = None, ctx: int | None = None) -> list[dict]:
    """Headline rows of decode snapshots: one dict per (file, case) with `file`, `seqs`, `ctx` (tokens per sequence),
    `graph_x` (graph step / floor), `pipelined_x` (None when not measured), `sm_clock_MHz` (median during the graph
    timing) and `graph_ms`. Cases without a clock record, or whose local sequence count is not in `seqs` or whose
    context is not `ctx` (each when given), are left out."""
    rows = []
    for path in paths:
        with open(path) as f:
            snap = json.load(f)
        for case in snap.get("cases", []):
            clock = case.get("graph", {}).get("gpu_clock", {}).get("sm_clock_MHz", {}).get("median")
            if clock is None or "graph_over_floor" not in case:
                continue
            if seqs is not None and case.get("local_seqs") not in seqs:
                continue
            if ctx is not None and case.get("ctx") != ctx:
                continue
            rows.append(
                {
                    "file": os.path.basename(path),
                    "seqs": case["local_seqs"],
                    "ctx": case.get("ctx"),
                    "graph_ms": case["graph"]["median_ms"],
                    "graph_x": case["graph_over_floor"],
                    "pipelined_x": case.get("graph_pipelined_over_floor"),
                    "sm_clock_MHz": clock,
                }
            )
    return rows


def summarize(rows: list[dict], split_mhz: float) -> dict[int, dict[str, dict]]:
    """Per local sequence count, for the runs below `split_mhz` and at or above it: the run count and the min /
    median / max of graph step / floor. Returns {seqs: {"below": {...}, "at_or_above": {...}}} (a side with no run
    is {"runs": 0})."""
    out: dict[int, dict[str, dict]] = {}
    for s in sorted({r["seqs"] for r in rows}):
        sides = {}
        for name, keep in (("below", lambda c: c < split_mhz), ("at_or_above", lambda c: c >= split_mhz)):
            xs = [r["graph_x"] for r in rows if r["seqs"] == s and keep(r["sm_clock_MHz"])]
            sides[name] = (
                {"runs": len(xs), "min": min(xs), "median": statistics.median(xs), "max": max(xs)}
                if xs
                else {"runs": 0}
            )
        out[s] = sides
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", default=os.path.join(os.path.dirname(__file__), "..", "bench"))
    ap.add_argument("--since", default="decode_2026-11-30_s18", help="first snapshot name (sorted by name)")
    ap.add_argument("--seqs", default="8,32", help="local sequence counts to show")
    ap.add_argument("--ctx", type=int, default=2048, help="context per sequence (0: any)")
    ap.add_argument("--split", type=float, default=1700.0, help="SM clock (MHz) that splits the summary")
    ap.add_argument("--json", default=None, help="also write rows and summary here")
    args = ap.parse_args()
    paths = sorted(p for p in glob.glob(os.path.join(args.bench, "decode_*.json")) if os.path.basename(p) >= args.since)
    rows = read_runs(paths, {int(s) for s in args.seqs.split(",")}, args.ctx or None)
    rows.sort(key=lambda r: (r["seqs"], r["sm_clock_MHz"]))
    print(f"{'seqs':>4} {'SM MHz':>7} {'graph ms':>9} {'x floor':>8} {'pipelined x':>12}  file")
    for r in rows:
        pip = f"{r['pipelined_x']:.3f}" if r["pipelined_x"] is not None else "-"
        print(
            f"{r['seqs']:>4} {r['sm_clock_MHz']:>7.0f} {r['graph_ms']:>9.2f} {r['graph_x']:>8.3f} {pip:>12}  {r['file']}"
        )
    summary = summarize(rows, args.split)
    for s, sides in summary.items():
        for name, v in sides.items():
            if v["runs"]:
                print(
                    f"{s} seqs, SM clock {name.replace('_', ' ')} {args.split:.0f} MHz: {v['runs']} runs, graph / floor "
                    f"{v['min']:.3f} - {v['max']:.3f} (median {v['median']:.3f})"
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "since": args.since,
                    "split_MHz": args.split,
                    "rows": rows,
                    "summary": {str(k): v for k, v in summary.items()},
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
