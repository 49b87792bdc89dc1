"""Benchmark the per-head small-M GEMM (kimi.kernels.triton.bmm_small_m) against the torch path on the absorbed-MLA
shapes.

The two per-head products of every MLA layer at Kimi-K2.6's shape (H = 64 heads per rank):
  - uk: q_lat [M, H, 512] = q_nope [M, H, 128] @ W_UK; q_nope is a strided view of q [M, H, 192] (as in the model);
    w_uk_t [H, 512, 128].
  - uv: o [M, H * 128] = o_lat [M, H, 512] @ W_UV^T per head, written into the [M, H * 128] o_proj input; w_uv [H, 128,
    512].
Each at M in --ms (the dispatch buckets 1, 8, 16, 32, 64). Timed:
  - "torch_old": torch.bmm on head-major transposes with the checkpoint's weight layouts ([H, 128, 512] for uk,
    then .contiguous(); [H, 512, 128] for uv, then .reshape to [M, H * 128], a copy): the path this kernel replaced;
  - "torch": kimi.kernels.triton.bmm_small_m.bmm_heads_ref (torch.bmm with the kernel's layouts, writing the output in
  place:
    the model's path where the table has no entry, e.g. prefill);
  - every Triton config of kimi.kernels.triton.bmm_small_m.CONFIGS (checked against fp32 first: max abs err <= 1e-2 *
    max |ref|, else dropped).
Method: as tools/bench_gemm.py (kimi.benchmarks.gpu.GraphTimer): each sample is one CUDA-graph replay of R calls cycling
through enough copies of W to cover >= 512 MiB (so W comes from HBM, not the 50 MB L2), median of samples, per call.
GB/s = (W + x + y bytes) / time; "of copy" = that / a 2 GiB device copy's bandwidth measured in the same run.

Output: a table on stdout, JSON to --out, the snapshot (--snapshot: bmm-small-m.json; bmm-small-m_custom for
other M) and, as the tuner of kimi/kernels/tuning/bmm_small_m.json, the dispatch table (entries where the best Triton
config beats the faster torch path by more than --margin) to --table-out (`--table-out
kimi/kernels/tuning/bmm_small_m.json` regenerates the shipped one).

Usage: python tools/bench_bmm.py [--ms 1,8,16,32,64] [--out F.json] [--table-out T.json] [--snapshot]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time

import torch

from kimi.benchmarks import snapshot
from kimi.benchmarks.gpu import MIN_POOL_BYTES, GraphTimer, copy_bandwidth, require_gpu
from kimi.kernels import tuning
from kimi.kernels.triton import bmm_small_m as bmm
from kimi.kernels.triton import linear_small_m as lsm

H, NOPE, ROPE, L, V = 64, 128, 64, 512, 128


def log(*a):
    print(*a, flush=True)


DEFAULT_MS = "1,8,16,32,64"


def summarize(report: dict, ms: tuple[int, ...] = (8, 32, 64)) -> dict:
    """The snapshot's table at M in `ms`: the replaced torch path, the torch fallback and the best Triton config."""
    copy = report["copy"]["GBps_read_plus_write"]
    rows = []
    for r in report["results"]:
        if r["M"] not in ms:
            continue
        b = r["best"]
        rows.append(
            [
                r["shape"],
                r["M"],
                round(r["torch_old_us"], 1),
                round(r["torch_us"], 1),
                round(b["us"], 1) if b else None,
                round(100 * b["GBps"] / copy) if b else None,
                round(r["torch_old_us"] / b["us"], 2) if b else None,
                "yes" if r["chosen"] else "no",
            ]
        )
    return {
        "columns": [
            "product",
            "M",
            "torch.bmm, checkpoint layout (us)",
            "torch.bmm, kernel layout (us)",
            "kimi (us)",
            "kimi, % of copy",
            "speed-up over the replaced path",
            "chosen by the run",
        ],
        "rows": rows,
        "notes": ["uk: q_nope @ W_UK; uv: o_lat @ W_UV^T; 64 heads, weights streamed from HBM, CUDA-graph replay"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=snapshot.HelpFormatter)
    ap.add_argument("--ms", default=DEFAULT_MS, help="rows M (each a dispatch bucket), comma list")
    ap.add_argument("--samples", type=int, default=50, help="timed graph replays per measurement (at least 50)")
    ap.add_argument("--margin", type=float, default=0.02, help="a table entry needs this fraction over torch")
    ap.add_argument("--out", default=None, help="write the full JSON result here")
    ap.add_argument(
        "--table-out", default=None, help="write the dispatch table here (kimi/kernels/tuning/bmm_small_m.json)"
    )
    snapshot.add_arguments(ap)
    args = ap.parse_args()
    require_gpu(ap.prog)
    import triton

    t0 = time.time()
    gpu = torch.cuda.get_device_name()
    timer = GraphTimer(max(50, args.samples))
    copy = copy_bandwidth(2 << 30)
    copy_gbps = copy["GBps_read_plus_write"]
    log(f"{gpu} torch {torch.__version__} triton {triton.__version__} copy {copy_gbps:.0f} GB/s")
    torch.manual_seed(0)
    dev = "cuda"
    bf = torch.bfloat16
    # weights: per-head [N, K] (new layouts) and the old bmm layouts, as many copies as cover MIN_POOL_BYTES
    wbytes = H * L * NOPE * 2
    copies = max(1, math.ceil(MIN_POOL_BYTES / wbytes))
    reps = max(4, copies)
    kv_b = [torch.randn(H, NOPE + V, L, device=dev, dtype=bf) * 0.05 for _ in range(copies)]
    w_uk_t = [w[:, :NOPE, :].transpose(1, 2).contiguous() for w in kv_b]  # [H, L, N]
    w_uv = [w[:, NOPE:, :].contiguous() for w in kv_b]  # [H, V, L]
    w_uk_old = [w[:, :NOPE, :].contiguous() for w in kv_b]  # [H, N, L]
    w_uv_t_old = [w[:, NOPE:, :].transpose(1, 2).contiguous() for w in kv_b]  # [H, L, V]
    del kv_b
    results, table = [], {}
    for M in [int(m) for m in args.ms.split(",")]:
        q = torch.randn(M, H, NOPE + ROPE, device=dev, dtype=bf)
        q_nope = q[..., :NOPE]  # [M, H, N] strided view
        o_lat = torch.randn(M, H, L, device=dev, dtype=bf)
        o = torch.empty(M, H * V, device=dev, dtype=bf)
        o3 = o.view(M, H, V)
        shapes = {
            "uk": dict(
                x=q_nope,
                w=w_uk_t,
                out=None,
                N=L,
                K=NOPE,
                old=lambda i, x=q_nope: torch.bmm(x.transpose(0, 1), w_uk_old[i]).transpose(0, 1).contiguous(),
            ),
            "uv": dict(
                x=o_lat,
                w=w_uv,
                out=o3,
                N=V,
                K=L,
                old=lambda i, x=o_lat, M=M: (
                    torch.bmm(x.transpose(0, 1), w_uv_t_old[i]).transpose(0, 1).reshape(M, H * V)
                ),
            ),
        }
        for name, sp in shapes.items():
            x, ws, out, N, K = sp["x"], sp["w"], sp["out"], sp["N"], sp["K"]
            nbytes = wbytes + (M * H * K + M * H * N) * 2
            ref = torch.einsum("mhk,hnk->mhn", x.float(), ws[0].float())
            tol = 1e-2 * ref.abs().max().item()
            row = {"shape": name, "M": M, "H": H, "N": N, "K": K, "bytes": nbytes, "copies_of_W": copies}
            at = [i % copies for i in range(reps)]  # the weight copy each call of the graph reads
            row["torch_old_us"] = timer.time_calls([lambda j=j, old=sp["old"]: old(j) for j in at])
            row["torch_us"] = timer.time_calls([lambda x=x, w=ws[j], out=out: bmm.bmm_heads_ref(x, w, out) for j in at])
            trit = []
            for cfg in bmm.CONFIGS:
                rec = {"config": bmm.table_entry(cfg), "name": cfg.name()}
                try:
                    y = bmm.bmm_small_m(x, ws[0], config=cfg)
                    err = (y.float() - ref).abs().max().item()
                    rec["max_err"] = err
                    if not err <= tol:
                        rec["error"] = f"max err {err:.3g} > tol {tol:.3g}"
                    else:
                        t = timer.time_calls(
                            [lambda x=x, w=ws[j], out=out, c=cfg: bmm.bmm_small_m(x, w, out=out, config=c) for j in at]
                        )
                        rec["us"] = t
                        rec["GBps"] = nbytes / t / 1e3
                except Exception as e:
                    rec["error"] = repr(e)[:300]
                trit.append(rec)
            ok = [r for r in trit if "us" in r]
            best = min(ok, key=lambda r: r["us"]) if ok else None
            base = min(row["torch_old_us"], row["torch_us"])
            row["triton"] = trit
            row["best"] = best and {k: best[k] for k in ("name", "config", "us", "GBps")}
            row["chosen"] = bool(best and best["us"] < base * (1 - args.margin))
            if row["chosen"]:
                table[f"{lsm.m_bucket(M)},{N},{K}"] = best["config"]
            results.append(row)
            log(
                f"{name} M={M:2d}: torch_old {row['torch_old_us']:6.1f} us, torch {row['torch_us']:6.1f} us, "
                + (
                    f"triton {best['us']:6.1f} us ({best['GBps']:.0f} GB/s, {best['GBps'] / copy_gbps:.0%} of copy) "
                    f"{best['name']}{' *' if row['chosen'] else ''}"
                    if best
                    else "triton: none"
                )
                + f"  [{time.time() - t0:.0f}s]"
            )
    report = {
        "args": vars(args),
        "gpu": gpu,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "copy": copy,
        "method": "CUDA-graph replay of R calls cycling >= 512 MiB of W copies, median of samples, per call; "
        "GB/s = (W + x + y bytes) / time",
        "margin": args.margin,
        "results": results,
        "table": table,
        "wall_s": round(time.time() - t0, 1),
    }
    report["conditions"] = conds = snapshot.conditions(copy_GBps=copy_gbps)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    if args.table_out:
        tuning.dump(args.table_out, gpu, snapshot.command_line(), tuning.bucket_entries(table))
    if args.snapshot:
        snapshot.write(
            args.snapshot,
            benchmark="bmm-small-m",
            config="" if args.ms == DEFAULT_MS else "custom",
            summary=summarize(report),
            results=report,
            conds=conds,
        )
    log(f"{len(table)} table entries; done in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
