"""FlashInfer's MLA decode (fa3, kimi's decode attention) against kimi's planless Triton MLA decode kernel
(kimi.kernels.triton.mla_decode, `decode_attention = "triton"`), on kimi's paged latent cache.

Per case (B requests, all at ctx tokens of context; 64 heads, 512 + 64 latent, block_size 64, bf16, blocks
scattered by a random permutation): every config of CONFIGS at a few num_splits values (choose_num_splits' pick,
half and double it, and 1 for B >= 64), each call captured in a CUDA graph and timed as graph replays; FlashInfer
fa3 (if importable) eager `run()` (plan excluded; plan's host time reported apart) and replayed from a CUDA graph.
Median of triton.testing.do_bench (L2 cleared before each call: cold cache).
Every timed variant is first checked against kimi.model.attention.mla_decode_ref (rel err = max abs err / max abs
ref). Bytes = KV read (B * ctx * 576 * 2) + q + o; GB/s = bytes / time.

The Triton kernel's CONFIGS and choose_num_splits come from this sweep, and its DEFAULT_CONFIG: --table-out F writes
the mla_decode table (kimi.kernels.tuning) holding the config with the smallest sum over the cases of its best time
(over the split counts; configs correct in every case only), the tuner of kimi/kernels/tuning/mla_decode.json.

Usage: python tools/bench_mla.py [--cases 8x2048,32x2048,...] [--out F] [--table-out F] [--snapshot]
Prints a table; --out: the full JSON; --snapshot: mla.json (mla_<config> for another case list or configs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
import traceback

import torch

from kimi.benchmarks import snapshot
from kimi.benchmarks.gpu import import_gpu_module, require_gpu
from kimi.kernels import tuning
from kimi.kernels.triton import mla_decode as mdt
from kimi.model.attention import mla_decode_ref

triton, _MISSING = import_gpu_module("triton.testing")  # --help without Triton; a run stops in require_gpu

HEADS, L, R, BS = 64, 512, 64, 64
SCALE = 0.130861


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def rel_err(out, ref):
    return (out.float() - ref).abs().max().item() / ref.abs().max().item()


def graph_of(fn):
    """fn captured in a CUDA graph (after one eager call on a side stream: compiles outside capture)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def replay_checked(fn, out, ref):
    """(fn captured in a CUDA graph, the relative error of one replay's `out` (poisoned with NaN first) to ref)."""
    g = graph_of(fn)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    return g, rel_err(out, ref)


def splits_for(B, cfg, num_sms, explicit=None):
    """(choose_num_splits' pick, the values to time): the pick, half and double it (and 1 for B >= 64), or the
    explicit list given with --splits."""
    auto = mdt.choose_num_splits(B, num_sms, mdt.programs_per_split(HEADS, L, cfg))
    if explicit:
        return auto, sorted(set(explicit))
    vals = {auto, max(1, auto // 2), min(mdt.MAX_SPLITS, auto * 2)}
    if B >= 64:
        vals.add(1)
    return auto, sorted(vals)


def run_case(B, ctx, num_sms, gen, fi_mod, configs, explicit_splits):
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
    case["kv_floor_us_at_4.8TBps"] = case["bytes"] / 4.8e6
    out = torch.empty(B, HEADS, L, dtype=torch.bfloat16, device="cuda")

    if fi_mod is not None:
        fi = {}
        try:
            m = fi_mod.FlashInferMLADecode(HEADS, SCALE, backend="fa3")
            lens = [ctx] * B
            m.plan(lens, bt, BS)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                m.plan(lens, bt, BS)
            torch.cuda.synchronize()
            fi["plan_host_ms"] = (time.perf_counter() - t0) / 20 * 1e3
            out.fill_(float("nan"))
            m.run(q_lat, q_pe, kv, out=out)
            fi["rel_err"] = rel_err(out, ref)
            fi["eager_us"] = bench(lambda: m.run(q_lat, q_pe, kv, out=out)) * 1e3
            mg = fi_mod.FlashInferMLADecode(
                HEADS, SCALE, backend="fa3", use_cuda_graph=True, max_batch=B, max_pages=B * nb
            )
            mg.plan(lens, bt, BS)
            g, fi["graph_rel_err"] = replay_checked(lambda: mg.run(q_lat, q_pe, kv, out=out), out, ref)
            fi["graph_us"] = bench(g.replay) * 1e3
            fi["graph_GBps"] = case["bytes"] / fi["graph_us"] / 1e3
            del g, mg, m
        except Exception:
            fi["error"] = traceback.format_exc()[-2000:]
        case["flashinfer_fa3"] = fi

    rows = []
    for cfg in configs:
        auto, vals = splits_for(B, cfg, num_sms, explicit_splits)
        for ns in vals:
            row = {"config": cfg.name(), "num_splits": ns, "auto": ns == auto}
            try:

                def fn(ns=ns, cfg=cfg):
                    mdt.mla_decode(q_lat, q_pe, kv, bt, seq, SCALE, out=out, num_splits=ns, config=cfg)

                t0 = time.perf_counter()
                out.fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
                row["first_call_s"] = time.perf_counter() - t0  # compile included the first time
                row["rel_err"] = rel_err(out, ref)
                row["nan"] = bool(torch.isnan(out).any())
                g, row["graph_rel_err"] = replay_checked(fn, out, ref)
                row["us"] = bench(g.replay) * 1e3
                row["GBps"] = case["bytes"] / row["us"] / 1e3
                row["ok"] = row["rel_err"] <= 1e-2 and row["graph_rel_err"] <= 1e-2 and not row["nan"]
                del g
            except Exception:
                row["error"] = traceback.format_exc()[-1500:]
                row["ok"] = False
            rows.append(row)
    case["triton"] = rows
    ok = [r for r in rows if r.get("ok")]
    if ok:
        best = min(ok, key=lambda r: r["us"])
        case["best"] = {
            "config": best["config"],
            "num_splits": best["num_splits"],
            "us": best["us"],
            "GBps": best["GBps"],
        }
    return case


DEFAULT_CASES = "8x2048,32x2048,64x2048,128x2048,8x8192"


def summarize(res: dict) -> dict:
    """The snapshot's table: per case FlashInfer's graph replay and eager call, its host plan, and the Triton
    kernel's best config against FlashInfer's graph."""
    rows = []
    for c in res["cases"]:
        fi, b = c.get("flashinfer_fa3") or {}, c.get("best") or {}
        fg, tb = fi.get("graph_us"), b.get("us")
        rows.append(
            [
                c["B"],
                c["ctx"],
                round(fg, 1) if fg else None,
                round(fi["eager_us"], 1) if fi.get("eager_us") else None,
                round(fi["plan_host_ms"] * 1e3) if fi.get("plan_host_ms") else None,
                round(tb, 1) if tb else None,
                f"{b['config']} s{b['num_splits']}" if b else None,
                round(tb / fg, 2) if tb and fg else None,
            ]
        )
    return {
        "columns": [
            "requests",
            "context",
            "FlashInfer fa3, graph (us)",
            "FlashInfer, eager (us)",
            "FlashInfer plan, host (us)",
            "Triton, best (us)",
            "Triton config, splits",
            "Triton / FlashInfer",
        ],
        "rows": rows,
    }


def fastest_config(cases: list[dict], configs: list) -> tuple | None:
    """(config, {case "BxCTX": us}) of the config with the smallest sum over `cases` of its best correct time (over
    the split counts), among the configs correct in every case; None when none is."""
    best = None
    for cfg in configs:
        us = {}
        for c in cases:
            ok = [r["us"] for r in c.get("triton", []) if r.get("ok") and r["config"] == cfg.name()]
            if not ok:
                break
            us[f"{c['B']}x{c['ctx']}"] = min(ok)
        else:
            if cases and (best is None or sum(us.values()) < sum(best[1].values())):
                best = (cfg, us)
    return best


def write_table(path: str, cases: list[dict], configs: list, cases_arg: str) -> None:
    """The mla_decode table with fastest_config's pick as its "stage1" entry (SystemExit when no config is correct
    in every case)."""
    best = fastest_config(cases, configs)
    if best is None:
        raise SystemExit("--table-out: no config ran correctly in every case")
    cfg, us = best
    timings = ", ".join(f"{k}: {v:.1f} us" for k, v in us.items())
    tuning.dump(
        path,
        torch.cuda.get_device_name(),
        f"python tools/bench_mla.py --cases {cases_arg} --table-out {path}",
        tuning.launch_entries({"stage1": dataclasses.asdict(cfg)}),
        notes=f"stage 1's fastest config of {len(configs)} at {HEADS} heads ({timings}, best split count each)",
    )
    print(f"wrote {path}: {cfg.name()}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=snapshot.HelpFormatter)
    ap.add_argument("--cases", default=DEFAULT_CASES, help="BxCTX,... (B requests, all at CTX tokens)")
    ap.add_argument(
        "--splits",
        default="",
        help="num_splits values to time, e.g. 8,16,32 (default: the auto pick, half and double it)",
    )
    ap.add_argument(
        "--configs",
        default="",
        help="comma-separated config names (MLADecodeConfig.name()) to time; default: all of CONFIGS",
    )
    ap.add_argument("--no-flashinfer", action="store_true", help="time the Triton kernel only")
    ap.add_argument("--out", default=None, help="write the full JSON result here")
    ap.add_argument("--table-out", default=None, help="write the mla_decode table (the fastest config) here")
    snapshot.add_arguments(ap)
    args = ap.parse_args()
    require_gpu(ap.prog, _MISSING)
    t_start = time.perf_counter()
    fi_mod, fi_version = None, None
    if not args.no_flashinfer:
        try:
            import flashinfer

            from kimi.backends.attention import flashinfer as fi_mod

            fi_version = flashinfer.__version__
        except Exception as e:
            print(f"FlashInfer not importable ({e!r}): Triton only", flush=True)
            fi_mod = None
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    configs = list(mdt.CONFIGS)
    if args.configs:
        by_name = {c.name(): c for c in mdt.CONFIGS}
        names = args.configs.split(",")
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise SystemExit(f"unknown configs {unknown}; known: {list(by_name)}")
        configs = [by_name[n] for n in names]
    explicit_splits = [int(v) for v in args.splits.split(",") if v]
    res = {
        "what": "planless Triton split-KV MLA decode (kimi.kernels.triton.mla_decode) vs FlashInfer fa3 decode",
        "num_sms": num_sms,
        "versions": {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "flashinfer": fi_version,
            "cuda": torch.version.cuda,
        },
        "shape": {"heads": HEADS, "kv_lora_rank": L, "rope_dim": R, "block_size": BS, "dtype": "bf16"},
        "conditions": "every request at ctx tokens; blocks randomly permuted; int32 tables / seq_lens; Triton "
        "timed as CUDA-graph replay of one call (stage 1 + combine); FlashInfer eager run() and graph "
        "replay, plan excluded (plan_host_ms apart); do_bench median, L2 cleared before each call, "
        "warmup 25 ms, rep 100 ms; clocks as found",
        "configs": [c.name() for c in configs],
        "default_config": mdt.DEFAULT_CONFIG.name(),
        "splits_arg": args.splits or "auto, auto/2, auto*2 (+1 for B>=64)",
        "cases": [],
    }
    gen = torch.Generator(device="cuda").manual_seed(0)
    for spec in args.cases.split(","):
        B, ctx = (int(v) for v in spec.lower().split("x"))
        try:
            case = run_case(B, ctx, num_sms, gen, fi_mod, configs, explicit_splits)
        except Exception:
            case = {"B": B, "ctx": ctx, "error": traceback.format_exc()[-3000:]}
        torch.cuda.empty_cache()
        res["cases"].append(case)
        print(
            f"\n== B={B} ctx={ctx}  bytes={case.get('bytes', 0) / 1e6:.1f} MB  "
            f"floor@4.8TB/s={case.get('kv_floor_us_at_4.8TBps', 0):.1f} us",
            flush=True,
        )
        fi = case.get("flashinfer_fa3")
        if fi:
            if "error" in fi:
                print(f"  flashinfer fa3: ERROR {fi['error'].splitlines()[-1]}")
            else:
                print(
                    f"  flashinfer fa3: eager {fi['eager_us']:.1f} us, graph {fi['graph_us']:.1f} us "
                    f"({fi['graph_GBps']:.0f} GB/s), plan host {fi['plan_host_ms']:.3f} ms, "
                    f"rel err {fi['rel_err']:.2e}"
                )
        print(f"  {'config':<28}{'splits':>7}{'us':>9}{'GB/s':>8}{'rel err':>10}")
        for r in case.get("triton", []):
            if "us" in r:
                print(
                    f"  {r['config']:<28}{r['num_splits']:>6}{'*' if r['auto'] else ' '}{r['us']:>9.1f}"
                    f"{r['GBps']:>8.0f}{r['rel_err']:>10.2e}{'' if r['ok'] else '  WRONG'}"
                )
            else:
                print(f"  {r['config']:<28}{r['num_splits']:>6}  ERROR {r.get('error', '').strip().splitlines()[-1]}")
        if "best" in case:
            b = case["best"]
            print(f"  BEST triton: {b['config']} splits={b['num_splits']}: {b['us']:.1f} us ({b['GBps']:.0f} GB/s)")
        if "error" in case:
            print(case["error"])
    print("\n== summary (us per call; * = choose_num_splits' pick)")
    print(f"  {'B':>4}{'ctx':>7}{'fi eager':>10}{'fi graph':>10}{'triton best':>13}  config")
    for c in res["cases"]:
        fi = c.get("flashinfer_fa3") or {}
        b = c.get("best", {})
        nan = float("nan")
        print(
            f"  {c['B']:>4}{c['ctx']:>7}{fi.get('eager_us', nan):>10.1f}{fi.get('graph_us', nan):>10.1f}"
            f"{b.get('us', nan):>13.1f}  {b.get('config', '-')} s{b.get('num_splits', '-')}"
        )
    res["wall_s"] = time.perf_counter() - t_start
    res["conditions"] = conds = snapshot.conditions()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    if args.table_out:
        write_table(args.table_out, res["cases"], configs, args.cases)
    if args.snapshot:
        custom = args.cases != DEFAULT_CASES or args.configs or args.splits or args.no_flashinfer
        snapshot.write(
            args.snapshot,
            benchmark="mla",
            config="custom" if custom else "",
            summary=summarize(res),
            results=res,
            conds=conds,
        )


if __name__ == "__main__":
    main()
