"""Benchmark kimi's CUDA MLA decode (kimi.ops.mla_decode_cuda, csrc/mla_decode.cu) next to FlashInfer's MLA (fa3).

Per case (B requests, all at ctx tokens of context; 64 heads, 512 + 64 latent, block_size 64, bf16, blocks
scattered by a random permutation): the CUDA kernel at a few num_splits values
(choose_num_splits' pick, half and double it, or --splits), each call captured in a CUDA graph and timed as graph
replays; FlashInfer fa3 replayed from a CUDA graph (plan excluded; plan's host time reported apart). Median of
triton.testing.do_bench (L2 cleared before each call). Every timed variant is first checked against
kimi.ops.attention.mla_decode_ref (rel err = max abs err / max abs ref) after its output was poisoned with NaN.
Bytes = KV read (B * ctx * 576 * 2) + q + o; GB/s = bytes / time.

Usage (repo root): PYTHONPATH=$PWD python3 tools/bench_mla_cuda.py [--cases 8x2048,32x2048,...] [--out F]
Writes JSON to --out, else $OUT/mla_cuda_<date>.json, else bench/mla_cuda_<date>.json; prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
if not torch.cuda.is_available():
    raise SystemExit("bench_mla_cuda: needs a CUDA device (none found)")
from bench_mla_triton import BS, HEADS, L, R, SCALE, bench, rel_err, replay_checked  # noqa: E402 (tools/)

from kimi.ops import mla_decode_cuda as mdc  # noqa: E402
from kimi.ops.attention import mla_decode_ref  # noqa: E402


PROFILE = False  # --profile: kernel durations of each timed variant from torch.profiler


def kernel_times(fn, n: int = 20) -> dict:
    """Mean device duration (us) per kernel name over n calls of fn (torch.profiler, CUDA activity)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    return {e.key[:80]: round(e.device_time_total / n, 2) for e in prof.key_averages() if e.device_time_total > 0}


def run_case(B, ctx, num_sms, gen, fi_mod, explicit_splits):
    case = {"B": B, "ctx": ctx}
    nb = -(-ctx // BS)
    num_blocks = B * nb + 1
    perm = torch.randperm(num_blocks - 1, device="cuda", generator=gen) + 1
    bt = perm.view(B, nb).to(torch.int32)
    kv = torch.randn(num_blocks, BS, L + R, device="cuda", generator=gen, dtype=torch.bfloat16)
    q_lat = torch.randn(B, HEADS, L, device="cuda", generator=gen, dtype=torch.bfloat16)
    q_pe = torch.randn(B, HEADS, R, device="cuda", generator=gen, dtype=torch.bfloat16)
    seq = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    ref = mla_decode_ref(q_lat, q_pe, kv, bt.long(), seq.long(), SCALE)
    case["bytes"] = B * ctx * (L + R) * 2 + B * HEADS * (L + R) * 2 + B * HEADS * L * 2
    out = torch.empty(B, HEADS, L, dtype=torch.bfloat16, device="cuda")

    if fi_mod is not None:
        fi = {}
        try:
            lens = [ctx] * B
            mg = fi_mod.FlashInferMLADecode(HEADS, SCALE, backend="fa3", use_cuda_graph=True, max_batch=B,
                                            max_pages=B * nb)
            mg.plan(lens, bt, BS)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                mg.plan(lens, bt, BS)
            torch.cuda.synchronize()
            fi["plan_host_ms"] = (time.perf_counter() - t0) / 20 * 1e3
            g, fi["graph_rel_err"] = replay_checked(lambda: mg.run(q_lat, q_pe, kv, out=out), out, ref)
            fi["graph_us"] = bench(g.replay) * 1e3
            fi["graph_GBps"] = case["bytes"] / fi["graph_us"] / 1e3
            if PROFILE:
                fi["kernels_us"] = kernel_times(g.replay)
            del g, mg
        except Exception:  # noqa: BLE001
            fi["error"] = traceback.format_exc()[-2000:]
        case["flashinfer_fa3"] = fi

    auto = mdc.choose_num_splits(B, num_sms, ctx)
    splits = sorted(set(explicit_splits)) if explicit_splits else sorted({auto, max(1, auto // 2), min(64, auto * 2)})
    rows = []
    for ns in splits:
        row = {"num_splits": ns, "auto": ns == auto}
        try:
            def fn(ns=ns):
                mdc.mla_decode(q_lat, q_pe, kv, bt, seq, SCALE, out=out, num_splits=ns)

            t0 = time.perf_counter()
            out.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            row["first_call_s"] = time.perf_counter() - t0  # the extension's build included the first time
            row["rel_err"] = rel_err(out, ref)
            row["nan"] = bool(torch.isnan(out).any())
            g, row["graph_rel_err"] = replay_checked(fn, out, ref)
            row["us"] = bench(g.replay) * 1e3
            row["GBps"] = case["bytes"] / row["us"] / 1e3
            if PROFILE:
                row["kernels_us"] = kernel_times(g.replay)
            row["ok"] = row["rel_err"] <= 1e-2 and row["graph_rel_err"] <= 1e-2 and not row["nan"]
            del g
        except Exception:  # noqa: BLE001
            row["error"] = traceback.format_exc()[-1500:]
            row["ok"] = False
        rows.append(row)
        print(f"B={B} ctx={ctx} splits={ns}: {row.get('us', float('nan')):.1f} us "
              f"err {row.get('rel_err', float('nan')):.2e}" + (" ERROR" if "error" in row else ""), flush=True)
    case["cuda"] = rows
    ok = [r for r in rows if r.get("ok")]
    if ok:
        best = min(ok, key=lambda r: r["us"])
        case["best"] = {k: best[k] for k in ("num_splits", "us", "GBps")}
    return case


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="8x2048,32x2048,64x2048,128x2048,8x8192,1x2048",
                    help="BxCTX,... (all requests at ctx)")
    ap.add_argument("--splits", default="", help="num_splits values to time (default: the pick, half and double)")
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--profile", action="store_true", help="also each variant's kernel durations (torch.profiler)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    global PROFILE
    PROFILE = args.profile
    t_start = time.perf_counter()
    date = datetime.date.today().isoformat()
    out_path = args.out or os.path.join(os.environ.get("OUT", "bench"), f"mla_cuda_{date}.json")
    fi_mod, fi_version = None, None
    if not args.no_flashinfer:
        try:
            import flashinfer

            from kimi.ops import attention_flashinfer as fi_mod

            fi_version = flashinfer.__version__
        except Exception as e:  # noqa: BLE001
            print(f"FlashInfer not importable ({e!r}): CUDA kernel only", flush=True)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = {
        "what": "kimi's CUDA (wgmma + TMA) split-KV MLA decode (kimi.ops.mla_decode_cuda) vs FlashInfer fa3 decode",
        "date": date, "gpu": torch.cuda.get_device_name(), "num_sms": num_sms,
        "versions": {"torch": torch.__version__, "flashinfer": fi_version, "cuda": torch.version.cuda},
        "shape": {"heads": HEADS, "kv_lora_rank": L, "rope_dim": R, "block_size": BS, "dtype": "bf16"},
        "conditions": "every request at ctx tokens; blocks randomly permuted; int32 tables / seq_lens; each variant "
                      "timed as CUDA-graph replay of one call (main kernel + combine when split); FlashInfer graph "
                      "replay, plan excluded (plan_host_ms apart); do_bench median, L2 cleared before each call, "
                      "warmup 25 ms, rep 100 ms; clocks as found",
        "cases": [],
    }
    gen = torch.Generator(device="cuda").manual_seed(0)
    explicit = [int(v) for v in args.splits.split(",") if v]
    for spec in args.cases.split(","):
        B, ctx = (int(v) for v in spec.lower().split("x"))
        res["cases"].append(run_case(B, ctx, num_sms, gen, fi_mod, explicit))
        torch.cuda.empty_cache()
    res["wall_s"] = time.perf_counter() - t_start
    os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"\n{'B':>4} {'ctx':>6} {'fa3 us':>8} {'cuda us':>8}  {'splits':>6} {'GB/s':>7}")
    for c in res["cases"]:
        fi = c.get("flashinfer_fa3", {}).get("graph_us", float("nan"))
        b = c.get("best", {})
        print(f"{c['B']:>4} {c['ctx']:>6} {fi:8.1f} {b.get('us', float('nan')):8.1f}  "
              f"{b.get('num_splits', '-'):>6} {b.get('GBps', float('nan')):7.0f}")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
