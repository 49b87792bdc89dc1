"""Benchmark kimi's FP8 block-weight GEMM and humming's against the bf16 GEMM (K2-Instruct dense shapes).

Sweeps kimi.kernels.triton.linear_fp8's launch configs: the tuner of kimi/kernels/tuning/linear_fp8.json (--table-out).

For each dense FP8 shape N x K of a K2-Instruct decode step (attention q_a+kv_a merged and padded to 2176 rows,
q_b, o_proj; shared expert gate_up, down; dense layer-0 gate_up, down) and each M in --ms:
  - bf16: kimi's dense GEMM (`kimi.kernels.triton.linear_small_m.linear`, its table's pick or cuBLAS) on the weight
    dequantised to bf16, what the model ran before FP8 weights stayed FP8;
  - fp8: kimi.kernels.triton.linear_fp8.fp8_linear_small_m for every config of --configs;
  - humming: humming-kernels' dense W8A16 GEMM (Fp8Linear.to_humming, its heuristic schedule without Stream-K, as
    Fp8Linear runs it, and with Stream-K, humming's default: "humming_streamk");
and for each M in --prefill-ms (prefill chunks): humming against the dequantise + F.linear path (`fp8_linear_ref`).
Every output is checked against the float32 reference (max err <= 1e-2 * max |ref|, else dropped).
Timing: tools/bench_gemm.py's method (kimi.benchmarks.gpu.GraphTimer: CUDA-graph replay of R calls cycling through
>= 512 MiB of weight copies, so every call streams its weights from HBM; median of --samples). GB/s = (weight
bytes incl. scales + x + y) / time; "of copy" against a 2 GiB device copy measured in the same run.

Output: a table on stdout; JSON to --out (copy bandwidth, every measurement), the snapshot (--snapshot:
fp8-linear.json; fp8-linear_custom for other shapes, M or configs) and the dispatch table to --table-out
(kimi.kernels.tuning format; `--table-out kimi/kernels/tuning/linear_fp8.json` regenerates the
shipped one).

Usage: python tools/bench_fp8_linear.py [--ms 1,8,16,32,64] [--shapes qkv_a,o_proj] [--out F.json] [--snapshot]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
import traceback

import torch

from kimi.benchmarks import snapshot
from kimi.benchmarks.gpu import DENSE_SHAPES, MIN_POOL_BYTES, GraphTimer, copy_bandwidth, pick_shapes, require_gpu
from kimi.kernels import tuning
from kimi.kernels.triton import linear_fp8 as lf

# the K2 dense shapes without lm_head (never FP8); q_a + kv_a as the FP8 merge holds it: 1536 + 576 rows
# zero-padded to whole 128-row tiles (Fp8Linear.cat)
SHAPES = {name: (2176, 7168) if name == "qkv_a" else nk for name, nk in DENSE_SHAPES.items() if name != "lm_head"}
CONFIGS = (
    "n64_w4_st3_u2_s0,n64_w4_st4_u2_s0,n64_w4_st3_u4_s0,n128_w4_st3_u2_s0,n128_w8_st3_u2_s0,n128_w4_st2_u4_s0,"
    "n64_w4_st3_u2_s1,n128_w4_st3_u2_s1,n32_w4_st4_u4_s0,n64_w4_st3_u1_s0"
)
DEFAULT_MS, DEFAULT_PREFILL_MS = "1,8,16,32,64", "2048,8192"


def parse_config(name: str) -> lf.Fp8Config:
    """n{block_n}_w{num_warps}_st{num_stages}_u{k_unroll}_s{split_k} (Fp8Config.name)."""
    n, w, st, u, sp = name.split("_")
    return lf.Fp8Config(
        block_n=int(n[1:]), num_warps=int(w[1:]), num_stages=int(st[2:]), k_unroll=int(u[1:]), split_k=int(sp[1:])
    )


def summarize(report: dict, ms: tuple[int, ...] = (8, 32, 2048)) -> dict:
    """The snapshot's table at M in `ms`: the bf16 GEMM on the dequantised weight, kimi's FP8 GEMM (best config),
    humming's W8A16 GEMM (what Fp8Linear runs: no Stream-K) and, at prefill sizes, dequantise + F.linear."""
    rows = []
    for r in report["results"]:
        if r["M"] not in ms:
            continue
        b = r.get("best")
        rows.append(
            [
                r["shape"],
                f"{r['N']} x {r['K']}",
                r["M"],
                round(r["bf16_us"], 1) if "bf16_us" in r else None,
                round(b["us"], 1) if b else None,
                round(r["humming_us"], 1) if "humming_us" in r else None,
                round(r["humming_streamk_us"], 1) if "humming_streamk_us" in r else None,
                round(r["dequant_us"], 1) if "dequant_us" in r else None,
            ]
        )
    return {
        "columns": [
            "weight",
            "N x K",
            "M",
            "bf16, dequantised (us)",
            "kimi FP8, best (us)",
            "humming (us)",
            "humming, Stream-K (us)",
            "dequantise + F.linear (us)",
        ],
        "rows": rows,
        "notes": [
            "weights streamed from HBM (>= 512 MiB of copies cycled), CUDA-graph replay; copy bandwidth "
            f"{report['copy']['GBps_read_plus_write']:.0f} GB/s"
        ],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=snapshot.HelpFormatter)
    ap.add_argument("--ms", default=DEFAULT_MS, help="decode row counts (each a table bucket)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of: {', '.join(SHAPES)}")
    ap.add_argument(
        "--configs", default=CONFIGS, help="comma-separated n{block_n}_w{warps}_st{stages}_u{unroll}_s{split}"
    )
    ap.add_argument(
        "--prefill-ms", default=DEFAULT_PREFILL_MS, help="prefill row counts: humming vs dequantise + F.linear"
    )
    ap.add_argument("--samples", type=int, default=50, help="timed graph replays per measurement (at least 50)")
    ap.add_argument("--out", default=None, help="write the full JSON result here")
    ap.add_argument(
        "--table-out", default=None, help="write the dispatch table here (kimi/kernels/tuning/linear_fp8.json)"
    )
    snapshot.add_arguments(ap)
    args = ap.parse_args()
    require_gpu(ap.prog, None if lf.HAS_TRITON else ImportError("Triton is not installed"))
    import triton

    from kimi.kernels.triton import linear_small_m as lsm
    from kimi.model.quant import dequant_fp8_block, quant_fp8_block

    t0 = time.time()
    ms_list = [int(v) for v in args.ms.split(",") if v] + [int(v) for v in args.prefill_ms.split(",") if v]
    cfgs = [parse_config(c) for c in args.configs.split(",") if c]
    names = pick_shapes(args.shapes, SHAPES)
    dev = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(dev)
    gpu = torch.cuda.get_device_name(dev)
    timer = GraphTimer(max(50, args.samples))
    copy = copy_bandwidth(2 << 30)
    copy_gbps = copy["GBps_read_plus_write"]
    print(
        f"{gpu}  SMs={props.multi_processor_count}  torch {torch.__version__}  triton {triton.__version__}  "
        f"copy {copy_gbps:.0f} GB/s",
        flush=True,
    )
    results, table, fatal = [], {}, None
    torch.manual_seed(0)
    try:
        for name in names:
            N, K = SHAPES[name]
            sbytes = math.ceil(N / 128) * math.ceil(K / 128) * 4
            fbytes = N * K + sbytes
            copies = max(1, math.ceil(MIN_POOL_BYTES / fbytes))
            qs = [quant_fp8_block(torch.randn(N, K, device="cuda") / K**0.5) for _ in range(copies)]
            b_copies = max(1, math.ceil(MIN_POOL_BYTES / (2 * N * K)))
            wb = [dequant_fp8_block(*qs[i % copies]).to(torch.bfloat16) for i in range(b_copies)]
            reps = max(4, copies, b_copies)
            hum = []
            for q, sc in qs:
                layer = lf.Fp8Linear(q, sc)
                if not layer.to_humming():
                    hum = None
                    break
                hum.append(layer)
            for M in ms_list:
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                ref = x.float() @ dequant_fp8_block(*qs[0]).T
                tol = 1e-2 * ref.abs().max().item()
                io = (M * K + M * N) * 2
                row = {"shape": name, "N": N, "K": K, "M": M, "fp8_bytes": fbytes + io, "bf16_bytes": 2 * N * K + io}
                r = max(1, reps if M <= lf.MAX_M else 4)
                at_r = [i % copies for i in range(r)]  # the weight copy each call of a graph reads
                at = [i % copies for i in range(reps)]
                for key, sk in (("humming", False), ("humming_streamk", True)) if hum else ():
                    # humming's heuristic schedule without Stream-K (what Fp8Linear runs) and with it (its default)
                    for h in hum:
                        h.humming_stream_k = sk
                        h._tuning.clear()
                    try:
                        err = (hum[0](x).float() - ref).abs().max().item()
                        row[f"{key}_max_err_rel"] = err / ref.abs().max().item()
                        if err <= tol:
                            row[f"{key}_us"] = timer.time_calls([lambda h=hum[j], x=x: h(x) for j in at_r])
                            row[f"{key}_GBps"] = row["fp8_bytes"] / row[f"{key}_us"] / 1e3
                    except Exception as e:
                        row[f"{key}_error"] = repr(e)[:300]
                for h in hum:
                    h.humming_stream_k = False
                    h._tuning.clear()
                if M > lf.MAX_M:  # prefill: humming vs dequantise + F.linear
                    row["dequant_us"] = timer.time_calls([lambda q=qs[j], x=x: lf.fp8_linear_ref(x, *q) for j in at_r])
                    results.append(row)
                    print(
                        f"{name:15s} {N:6d}x{K:5d} M={M:5d} dequant+F.linear {row['dequant_us']:8.1f} us | humming "
                        f"{row.get('humming_us', float('nan')):8.1f} us "
                        f"(Stream-K {row.get('humming_streamk_us', float('nan')):8.1f})  [{time.time() - t0:.0f}s]",
                        flush=True,
                    )
                    continue
                us_b = timer.time_calls([lambda w=wb[i % b_copies], x=x: lsm.linear(x, w) for i in range(reps)])
                row["bf16_us"] = us_b
                row["bf16_GBps"] = row["bf16_bytes"] / us_b / 1e3
                recs = []
                for cfg in cfgs:
                    rec = {"config": lf.table_entry(cfg), "name": cfg.name()}
                    try:
                        y = lf.fp8_linear_small_m(x, *qs[0], config=cfg)
                        torch.cuda.synchronize()
                        err = (y.float() - ref).abs().max().item()
                        rec["max_err_rel"] = err / ref.abs().max().item()
                        if not err <= tol:
                            rec["error"] = f"max err {err:.3g} > tol {tol:.3g}"
                        else:
                            t = timer.time_calls(
                                [lambda q=qs[j], x=x, c=cfg: lf.fp8_linear_small_m(x, *q, config=c) for j in at]
                            )
                            rec["us"] = t
                            rec["GBps"] = row["fp8_bytes"] / t / 1e3
                    except Exception as e:
                        rec["error"] = repr(e)[:300]
                    recs.append(rec)
                ok = [r for r in recs if "us" in r]
                best = min(ok, key=lambda r: r["us"]) if ok else None
                row["fp8"] = recs
                row["best"] = best and {k: best[k] for k in ("name", "config", "us", "GBps", "max_err_rel")}
                if best:
                    table[f"{M},{N},{K}"] = best["config"]
                results.append(row)
                bt = (
                    f"{best['us']:7.1f} us {best['GBps']:5.0f} GB/s {best['GBps'] / copy_gbps:5.1%} {best['name']:14s}"
                    f" x{us_b / best['us']:.2f} vs bf16"
                    if best
                    else "none"
                )
                hu = "".join(
                    f" | {k} {row[k + '_us']:7.1f} us {row[k + '_GBps'] / copy_gbps:5.1%} x{us_b / row[k + '_us']:.2f}"
                    if k + "_us" in row
                    else f" | {k} {row.get(k + '_error', 'n/a')}"
                    for k in ("humming", "humming_streamk")
                )
                print(
                    f"{name:15s} {N:6d}x{K:5d} M={M:2d} bf16 {us_b:7.1f} us {row['bf16_GBps']:5.0f} GB/s | fp8 {bt}{hu}"
                    f"  [{time.time() - t0:.0f}s]",
                    flush=True,
                )
            qs = wb = hum = None
            torch.cuda.empty_cache()
    except Exception:
        fatal = traceback.format_exc()
        print(f"FATAL, writing partial results:\n{fatal}", flush=True)
    report = {
        "what": "FP8 block-weight small-M GEMM (kimi.kernels.triton.linear_fp8) vs kimi's bf16 GEMM"
        " on the dequantised weight",
        "args": vars(args),
        "gpu": gpu,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "copy": copy,
        "method": "CUDA-graph replay of R calls cycling >= 512 MiB of weight copies, median of samples, per call; "
        "GB/s = (weight + scales + x + y bytes) / time",
        "samples": timer.samples,
        "results": results,
        "wall_s": round(time.time() - t0, 1),
        "fatal": fatal,
    }
    report["conditions"] = conds = snapshot.conditions(copy_GBps=copy_gbps)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    if args.table_out:
        tuning.dump(args.table_out, gpu, snapshot.command_line(), tuning.bucket_entries(table))
    if args.snapshot and not fatal:
        custom = (args.ms, args.prefill_ms, args.shapes, args.configs) != (
            DEFAULT_MS,
            DEFAULT_PREFILL_MS,
            ",".join(SHAPES),
            CONFIGS,
        )
        snapshot.write(
            args.snapshot,
            benchmark="fp8-linear",
            config="custom" if custom else "",
            summary=summarize(report),
            results=report,
            conds=conds,
        )
    return 1 if fatal else 0


if __name__ == "__main__":
    sys.exit(main())
