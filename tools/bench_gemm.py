"""Benchmark the small-M bf16 GEMM (kimi.kernels.triton.linear_small_m) against cuBLAS (F.linear) on Kimi-K2.6 shapes.

One run measures, on the current CUDA device:
  - HBM copy bandwidth: a 2 GiB device-to-device copy (`b.copy_(a)`), median of 20 timed copies, reported as
    (bytes read + bytes written) / time, the usual convention.
  - For each weight shape N x K of a decode step (attention q_a+kv_a, q_b, o_proj; shared expert gate_up, down;
    dense layer-0 MLP gate_up, down; lm_head) and each M in --ms (default 1, 8, 16, 32, 64):
    F.linear(x, W) and every Triton config of kimi.kernels.triton.linear_small_m.CONFIGS at several split_k values.
    Each config's first output is checked against F.linear (max abs err <= 1e-2 * max |ref|, else dropped).

Timing (each number is the median of --samples >= 50 samples):
  - Weights come from HBM, not L2: each shape gets enough copies of W to cover >= 512 MiB (e.g. 17 copies of
    the 30 MB 2112x7168 matrix, 2 of the 264 MB dense down, 1 of lm_head or dense gate_up), and consecutive
    calls cycle through the copies: the copy a call reads was last read >= ~480 MiB of traffic earlier, or is
    itself >= 512 MiB, far beyond the H200's 50 MB L2. x and y stay L2-resident, as in the model.
  - One sample = one CUDA-graph replay of R >= 4 back-to-back calls (cycling the copies), timed with CUDA
    events and divided by R. Graphs are how the decode step runs, and they keep the host's launch cost
    (Triton's Python launcher takes tens of us) out of the measurement; a torch.cuda._sleep before each sample
    lets the host queue the events and the replay before the GPU reaches them.
  - GB/s = (bytes of W + x + y) / time; "of copy" = that / the measured copy bandwidth.

Output: a table on stdout, JSON to --out (every measurement, the chosen table), the snapshot (--snapshot:
gemm-small-m.json; gemm-small-m_custom for other shapes or M) and, as the tuner of
kimi/kernels/tuning/linear_small_m.json,
the dispatch table to --table-out in kimi.kernels.tuning's format (`--table-out
kimi/kernels/tuning/linear_small_m.json` regenerates the shipped one). A (bucket, N, K) entry is chosen only when the
best Triton config beats F.linear by more than --margin (default 2 %). --budget-s (default 85): once exceeded, the
remaining (shape, M) pairs are measured with cuBLAS and only the configs that won so far. Progress goes to stdout; a
fatal error (e.g. a CUDA fault) still writes the JSON with what was measured and the error.

Usage: python tools/bench_gemm.py [--ms 1,8,16,32,64] [--shapes q_b,o_proj] [--out F.json] [--table-out T.json]
       [--snapshot]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

from kimi.benchmarks import snapshot
from kimi.benchmarks.gpu import DENSE_SHAPES, MIN_POOL_BYTES, GraphTimer, copy_bandwidth, pick_shapes, require_gpu
from kimi.kernels import tuning
from kimi.kernels.triton import linear_small_m as lsm

SHAPES = DENSE_SHAPES
SPLITS = (1, 2, 3, 4, 6, 8)
DEFAULT_MS = "1,8,16,32,64"


def log(*a):
    print(*a, flush=True)


def split_options(cfg: lsm.SmallMConfig, N: int, K: int, sms: int) -> list[int]:
    n_tiles = math.ceil(N / cfg.block_n)
    k_blocks = math.ceil(K / cfg.block_k)
    if n_tiles >= 2 * sms:
        return [1]
    return [s for s in SPLITS if s == 1 or (k_blocks >= 2 * s and n_tiles * s <= 4 * sms)]


def summarize(report: dict, ms: tuple[int, ...] = (8, 32)) -> dict:
    """The snapshot's table at M in `ms` (the decode step's 8 and 32 local sequences): cuBLAS against the best Triton
    config per shape, and whether the dispatch table takes it."""
    copy = report["copy"]["GBps_read_plus_write"]
    rows = []
    for r in report["results"]:
        if r["M"] not in ms:
            continue
        b = r["best"]
        rows.append(
            [
                r["shape"],
                f"{r['N']} x {r['K']}",
                r["M"],
                round(r["cublas_us"], 1),
                round(100 * r["cublas_GBps"] / copy),
                round(b["us"], 1) if b else None,
                round(100 * b["GBps"] / copy) if b else None,
                round(r["cublas_us"] / b["us"], 2) if b else None,
                "yes" if r["chosen"] else "no",
            ]
        )
    return {
        "columns": [
            "weight",
            "N x K",
            "M",
            "cuBLAS (us)",
            "cuBLAS, % of copy",
            "kimi, best (us)",
            "kimi, % of copy",
            "speed-up",
            "chosen by the run",
        ],
        "rows": rows,
        "notes": [
            "weights streamed from HBM (>= 512 MiB of copies cycled), CUDA-graph replay; "
            f"copy bandwidth {copy:.0f} GB/s"
        ],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=snapshot.HelpFormatter)
    ap.add_argument("--ms", default=DEFAULT_MS, help="rows M (each a dispatch bucket), comma list")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of: {', '.join(SHAPES)}")
    ap.add_argument("--samples", type=int, default=50, help="timed graph replays per measurement (at least 50)")
    ap.add_argument("--margin", type=float, default=0.02, help="a table entry needs this fraction over cuBLAS")
    ap.add_argument("--budget-s", type=float, default=85.0, help="seconds after which only winning configs are timed")
    ap.add_argument("--out", default=None, help="write the full JSON result here")
    ap.add_argument(
        "--table-out", default=None, help="write the dispatch table here (kimi/kernels/tuning/linear_small_m.json)"
    )
    snapshot.add_arguments(ap)
    args = ap.parse_args()
    require_gpu(ap.prog, None if lsm.HAS_TRITON else ImportError("Triton is not installed"))
    import triton

    t0 = time.time()
    ms_list = [int(v) for v in args.ms.split(",")]
    names = pick_shapes(args.shapes, SHAPES)
    dev = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(dev)
    gpu = torch.cuda.get_device_name(dev)
    sms = props.multi_processor_count
    timer = GraphTimer(max(50, args.samples))
    copy = copy_bandwidth(2 << 30)  # 2 GiB
    copy_gbps = copy["GBps_read_plus_write"]
    log(
        f"{gpu}  SMs={sms}  L2={props.L2_cache_size >> 20} MiB  torch {torch.__version__}  triton "
        f"{triton.__version__}  copy bandwidth {copy_gbps:.0f} GB/s (2 GiB d2d, read+write)"
    )

    results = []
    table = {}
    budget_hit = False
    torch.manual_seed(0)
    fatal = None
    try:
        for name in names:
            N, K = SHAPES[name]
            wbytes = N * K * 2
            copies = max(1, math.ceil(MIN_POOL_BYTES / wbytes))
            wlist = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
            reps = max(4, copies)
            for M in ms_list:
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                nbytes = wbytes + (M * K + M * N) * 2
                ref = F.linear(x, wlist[0]).float()
                tol = 1e-2 * ref.abs().max().item()
                row = {
                    "shape": name,
                    "N": N,
                    "K": K,
                    "M": M,
                    "bytes": nbytes,
                    "copies_of_W": copies,
                    "calls_per_graph": reps,
                }
                w_at = [wlist[i % copies] for i in range(reps)]  # the weight copy each call of the graph reads
                us = timer.time_calls([lambda x=x, w=w: F.linear(x, w) for w in w_at])
                row["cublas_us"] = us
                row["cublas_GBps"] = nbytes / us / 1e3
                trit = []
                over = time.time() - t0 > args.budget_s
                if over and not budget_hit:
                    log(f"  budget of {args.budget_s:.0f} s used: the rest get only the configs that won so far")
                    budget_hit = True
                if over:  # the distinct winners so far (with their split_k where this shape allows it)
                    winners = {r["best"]["name"]: lsm.SmallMConfig(**r["best"]["config"]) for r in results if r["best"]}
                    cands = []
                    for c in list(winners.values()) or [lsm.CONFIGS[0]]:
                        s = c.split_k if c.split_k in split_options(c, N, K, sms) else 1
                        cands.append(lsm.SmallMConfig(**{**lsm.table_entry(c), "split_k": s}))
                    cands = list({c.name(): c for c in cands}.values())
                else:
                    cands = [
                        lsm.SmallMConfig(**{**lsm.table_entry(b), "split_k": s})
                        for b in lsm.CONFIGS
                        for s in split_options(b, N, K, sms)
                    ]
                for cfg in cands:
                    rec = {"config": lsm.table_entry(cfg), "name": cfg.name()}
                    try:
                        tc = time.time()
                        y = lsm.linear_small_m(x, wlist[0], config=cfg)
                        torch.cuda.synchronize()
                        rec["first_call_s"] = round(time.time() - tc, 3)
                        err = (y.float() - ref).abs().max().item()
                        rec["max_err"] = err
                        if not err <= tol:
                            rec["error"] = f"max err {err:.3g} > tol {tol:.3g}"
                            trit.append(rec)
                            continue
                        t = timer.time_calls([lambda x=x, w=w, c=cfg: lsm.linear_small_m(x, w, config=c) for w in w_at])
                        rec["us"] = t
                        rec["GBps"] = nbytes / t / 1e3
                    except Exception as e:
                        rec["error"] = repr(e)[:300]
                    trit.append(rec)
                ok = [r for r in trit if "us" in r]
                best = min(ok, key=lambda r: r["us"]) if ok else None
                row["triton"] = trit
                row["best"] = best and {k: best[k] for k in ("name", "config", "us", "GBps")}
                bucket = lsm.m_bucket(M)
                chosen = best is not None and best["us"] < us * (1 - args.margin)
                row["chosen"] = bool(chosen)
                if chosen and bucket == M:
                    table[f"{bucket},{N},{K}"] = best["config"]
                results.append(row)
                bt = (
                    f"{best['us']:8.1f} us {best['GBps']:6.0f} GB/s {best['GBps'] / copy_gbps:5.1%} {best['name']}"
                    if best
                    else "none"
                )
                errs = sum("error" in r for r in trit)
                log(
                    f"{name:15s} {N:6d}x{K:5d} M={M:2d} cuBLAS {us:8.1f} us {nbytes / us / 1e3:6.0f} GB/s "
                    f"{nbytes / us / 1e3 / copy_gbps:5.1%} | triton {bt} | x{us / best['us'] if best else 0:.2f}"
                    f"{' *' if chosen else ''}{f' ({errs} failed)' if errs else ''}  [{time.time() - t0:.0f}s]"
                )
            wlist = w_at = None  # free this shape's copies
            torch.cuda.empty_cache()
    except Exception:
        fatal = traceback.format_exc()
        log(f"FATAL, writing partial results:\n{fatal}")

    # summary table: weight-stream time of one decode step's dense GEMMs (one layer's worth per shape)
    log("\nshape            N x K          M   cuBLAS us  GB/s  %copy   best us  GB/s  %copy  speedup  config")
    for r in results:
        b = r["best"]
        log(
            f"{r['shape']:15s} {r['N']:6d}x{r['K']:5d} {r['M']:3d} {r['cublas_us']:9.1f} {r['cublas_GBps']:5.0f} "
            f"{r['cublas_GBps'] / copy_gbps:6.1%} "
            + (
                f"{b['us']:9.1f} {b['GBps']:5.0f} {b['GBps'] / copy_gbps:6.1%} {r['cublas_us'] / b['us']:7.2f}x  "
                f"{b['name']}{' (chosen)' if r['chosen'] else ''}"
                if b
                else "   -"
            )
        )
    table_py = "{\n" + "".join(f"    {k!r}: {v!r},\n" for k, v in table.items()) + "}"
    log(f"\nchosen table ({len(table)} entries, key 'bucket,N,K'):\n{table_py}")
    report = {
        "args": vars(args),
        "gpu": gpu,
        "sms": sms,
        "l2_bytes": props.L2_cache_size,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "copy": copy,
        "method": "CUDA-graph replay of R calls cycling >= 512 MiB of W copies, median of samples, per call; "
        "GB/s = (W + x + y bytes) / time",
        "samples": timer.samples,
        "margin": args.margin,
        "budget_hit": budget_hit,
        "results": results,
        "table": table,
        "table_py": table_py,
        "wall_s": round(time.time() - t0, 1),
        "fatal": fatal,
    }
    report["conditions"] = conds = snapshot.conditions(copy_GBps=copy_gbps)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    if args.table_out:
        os.makedirs(os.path.dirname(os.path.abspath(args.table_out)), exist_ok=True)
        tuning.dump(args.table_out, gpu, snapshot.command_line(), tuning.bucket_entries(table))
    if args.snapshot and not fatal:
        custom = args.ms != DEFAULT_MS or args.shapes != ",".join(SHAPES)
        snapshot.write(
            args.snapshot,
            benchmark="gemm-small-m",
            config="custom" if custom else "",
            summary=summarize(report),
            results=report,
            conds=conds,
        )
    log(f"done in {time.time() - t0:.0f} s")
    return 1 if fatal else 0


if __name__ == "__main__":
    sys.exit(main())
