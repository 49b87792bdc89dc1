"""Benchmark the per-head small-M GEMM (kimi.ops.bmm_small_m) against the torch path on the absorbed-MLA shapes.

The two per-head products of every MLA layer at Kimi-K2.6's shape (H = 64 heads per rank):
  - uk: q_lat [M, H, 512] = q_nope [M, H, 128] @ W_UK; q_nope is a strided view of q [M, H, 192] (as in the
    model); w_uk_t [H, 512, 128].
  - uv: o [M, H * 128] = o_lat [M, H, 512] @ W_UV^T per head, written into the [M, H * 128] o_proj input;
    w_uv [H, 128, 512].
Each at M in --ms (the dispatch buckets 1, 8, 16, 32, 64). Timed, as the model ran them before this kernel:
  - "torch_old": torch.bmm on head-major transposes with the old weight layouts ([H, 128, 512] for uk, then
    .contiguous(); [H, 512, 128] for uv, then .reshape to [M, H * 128], a copy);
  - "torch": kimi.ops.bmm_small_m.bmm_heads_ref (torch.bmm with the new layouts; since 2026-11-30 it writes the
    output in place, the table measurements before that date include a copy into the output);
  - every Triton config of kimi.ops.bmm_small_m.CONFIGS (checked against fp32 first: max abs err <= 1e-2 *
    max |ref|, else dropped).
Method: as tools/bench_gemm.py (its Timer): each sample is one CUDA-graph replay of R calls cycling through enough
copies of W to cover >= 512 MiB (so W comes from HBM, not the 50 MB L2), median of samples, per call. GB/s =
(W + x + y bytes) / time; "of copy" = that / a 2 GiB device copy's bandwidth measured in the same run.

Output: a table on stdout, JSON to --out ($OUT/ or bench/ by default) and the dispatch table (entries where the
best Triton config beats the faster torch path by more than --margin) to --table-out, in the format
kimi.ops.linear_small_m.load_table reads (copy it to kimi/ops/bmm_small_m_table.json to enable it).

Usage: python tools/bench_bmm.py [--ms 1,8,16,32,64] [--out F.json] [--table-out T.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_gemm import MIN_POOL_BYTES, Timer
from bench_util import copy_bandwidth, require_gpu

from kimi.ops import bmm_small_m as bmm
from kimi.ops import linear_small_m as lsm

H, NOPE, ROPE, L, V = 64, 128, 64, 512, 128


def log(*a):
    print(*a, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ms", default="1,8,16,32,64")
    ap.add_argument("--samples", type=int, default=50)
    ap.add_argument("--margin", type=float, default=0.02)
    ap.add_argument("--out", default=None)
    ap.add_argument("--table-out", default=None)
    args = ap.parse_args()
    require_gpu(ap.prog)
    import triton

    t0 = time.time()
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench")
    date = datetime.date.today().isoformat()
    out_path = args.out or os.path.join(out_dir, f"bmm_small_m_{date}.json")
    table_path = args.table_out or os.path.join(out_dir, "bmm_small_m_table.json")
    gpu = torch.cuda.get_device_name()
    timer = Timer(max(50, args.samples))
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
                old=lambda i: torch.bmm(q_nope.transpose(0, 1), w_uk_old[i]).transpose(0, 1).contiguous(),
            ),
            "uv": dict(
                x=o_lat,
                w=w_uv,
                out=o3,
                N=V,
                K=L,
                old=lambda i: torch.bmm(o_lat.transpose(0, 1), w_uv_t_old[i]).transpose(0, 1).reshape(M, H * V),
            ),
        }
        for name, sp in shapes.items():
            x, ws, out, N, K = sp["x"], sp["w"], sp["out"], sp["N"], sp["K"]
            nbytes = wbytes + (M * H * K + M * H * N) * 2
            ref = torch.einsum("mhk,hnk->mhn", x.float(), ws[0].float())
            tol = 1e-2 * ref.abs().max().item()
            row = {"shape": name, "M": M, "H": H, "N": N, "K": K, "bytes": nbytes, "copies_of_W": copies}
            row["torch_old_us"] = timer.time_calls([lambda i=i: sp["old"](i % copies) for i in range(reps)])
            row["torch_us"] = timer.time_calls(
                [lambda i=i: bmm.bmm_heads_ref(x, ws[i % copies], out) for i in range(reps)]
            )
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
                            [
                                lambda i=i, c=cfg: bmm.bmm_small_m(x, ws[i % copies], out=out, config=c)
                                for i in range(reps)
                            ]
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
        "gpu": gpu,
        "versions": {"torch": torch.__version__, "triton": triton.__version__},
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "copy": copy,
        "method": "CUDA-graph replay of R calls cycling >= 512 MiB of W copies, median of samples, per call; "
        "GB/s = (W + x + y bytes) / time",
        "margin": args.margin,
        "results": results,
        "table": table,
        "wall_s": round(time.time() - t0, 1),
    }
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)
    with open(table_path, "w") as f:
        json.dump(
            {"gpu": gpu, "date": report["date"], "source": os.path.basename(out_path), "table": table}, f, indent=1
        )
    log(f"wrote {out_path} and {table_path} ({len(table)} entries) in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
