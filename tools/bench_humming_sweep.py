"""Sweep humming-kernels' schedule configs for Kimi's two expert GEMMs at decode shapes (one H200): the tuner of
kimi/kernels/tuning/humming.json.

The default (`HummingInt4Experts._configs`) asks humming's heuristics for a config at shape_m = the expected
number of local (token, expert) pairs. This tool times, per GEMM (w13 gate_up [4096 x 7168], w2 down
[7168 x 2048]) and per T in --tokens (tokens routed over 384 experts, the 48 of EP rank 2 of 8 computed):
  - the heuristic's config for shape_m hints in --hints (x the expected pairs), and humming's whole candidate
    table (get_heuristics_config without shape_m);
  - variants of the default: num_stages and num_ctas_per_sm changed;
  - with --grid / --grid-only: GRID_TILES (N / K tiles and warp shapes at M tile 8) x stream-K x CTAs per SM.
Each distinct config is JIT-compiled on first use (the compile time is recorded); after --budget seconds no
new config is tried. Timing: triton.testing.do_bench median, L2 cleared, NSETS distinct routing sets cycled.
GB/s = weight bytes of the distinct local experts hit by that GEMM / time. rel_diff_vs_default: the relative
difference from the default config's output over the local pairs' rows (the only rows written) of the first
input set. Output: JSON (--out) and a table; --table-out writes a kimi.backends.experts humming table: per GEMM and
T, the fastest config when it beats the default by more than --min-gain (`--grid --table-out
kimi/kernels/tuning/humming.json` regenerates the shipped table's plain entries; its `over_heuristic` entries were
chosen
in the decode step, tools/bench_decode.py --ab humming_table_alt, and are carried over by hand).

Usage: python tools/bench_humming_sweep.py [--tokens 64,256] [--grid] [--out F] [--table-out T]
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
import traceback

import torch

from kimi.benchmarks import snapshot
from kimi.benchmarks.gpu import copy_bandwidth, import_gpu_module, require_gpu
from kimi.benchmarks.moe import (
    E_TOTAL,
    OFFSET,
    TOPK,
    E,
    H,
    Humming,
    I,
    cycle,
    do_bench,
    make_sets,
    make_weights,
    touched,
)
from kimi.kernels import tuning
from kimi.kernels.triton.moe_w4a16 import moe_align

# --help without Triton or humming; a run stops in require_gpu
_MISSING = import_gpu_module("triton.testing")[1] or import_gpu_module("humming.tune")[1]


def key(c: dict) -> str:
    return json.dumps({k: c[k] for k in sorted(c)}, default=str)


def variants(c: dict) -> list[dict]:
    out = []
    for st in (3, 4, 6, 8):
        if st != c.get("num_stages"):
            out.append(c | {"num_stages": st})
    for n in (1, 2, 4):
        if n != c.get("num_ctas_per_sm"):
            out.append(c | {"num_ctas_per_sm": n})
    return out


# --grid: (block_shape, warp_shape) pairs tried with the default's other fields, x use_stream_k x num_ctas_per_sm.
# M tile 8 throughout (decode: ~1-6 pairs per expert); N / K tiles the defaults (w13 [8,128,64], w2 [8,256,128])
# never crossed.
GRID_TILES = (
    ((8, 128, 64), (8, 64, 32)),
    ((8, 128, 128), (8, 64, 64)),
    ((8, 128, 128), (8, 32, 64)),
    ((8, 256, 64), (8, 64, 32)),
    ((8, 256, 128), (8, 64, 64)),
    ((8, 64, 128), (8, 32, 64)),
    ((8, 64, 256), (8, 32, 64)),
    ((8, 512, 64), (8, 64, 64)),
)

# --tiles m16: M tile 16 (one M block per expert up to 16 pairs: no weight tile read twice for experts with 9-16
# pairs, which block_m 8 reads twice; mma's native M is 16)
GRID_TILES_M16 = (
    ((16, 128, 64), (16, 64, 32)),
    ((16, 128, 128), (16, 64, 64)),
    ((16, 256, 64), (16, 64, 32)),
)


def grid(c: dict, mma_types: list[str], tiles=GRID_TILES) -> list[tuple[str, dict]]:
    """GRID_TILES x stream-K x CTAs per SM over config c; mma_types: values of mma_type to cross with ("" keeps c's)."""
    out = []
    for mma in mma_types:
        for bs, ws in tiles:
            for sk in (True, False):
                for ncta in (2, 4):
                    label = (
                        f"grid_m{bs[0]}_b{bs[1]}x{bs[2]}_w{ws[1]}x{ws[2]}_sk{int(sk)}_c{ncta}"
                        if bs[0] != 8
                        else f"grid_b{bs[1]}x{bs[2]}_w{ws[1]}x{ws[2]}_sk{int(sk)}_c{ncta}"
                    ) + (f"_{mma}" if mma else "")
                    cfg = c | {
                        "block_shape": list(bs),
                        "warp_shape": list(ws),
                        "use_stream_k": sk,
                        "num_ctas_per_sm": ncta,
                    }
                    if mma:
                        cfg["mma_type"] = mma
                    out.append((label, cfg))
    return out


def heuristic_candidates(layer, m_local: int, hints: str, res: dict) -> list[tuple[str, dict]]:
    """humming's heuristic config at shape_m hints (x m_local) and its whole candidate table."""
    from humming.tune import get_heuristics_config

    cands = []
    for h in (float(x) for x in hints.split(",")):
        m = max(1, int(m_local * h))
        cands.append((f"hint_m{m}", get_heuristics_config(layer.humming_config, shape_m=m, gemm_type="indexed")))
    try:
        table = get_heuristics_config(layer.humming_config, shape_m=None, gemm_type="indexed")
        for i, entry in enumerate(table):
            cands.append((f"table{i}_{entry[0]}-{entry[1]}", dict(entry[2])))
    except Exception as e:
        res.setdefault("table_errors", []).append(repr(e))
    return cands


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=snapshot.HelpFormatter)
    ap.add_argument("--tokens", default="64,256", help="MoE tokens of one step (comma list)")
    ap.add_argument("--hints", default="0.25,0.5,1,2,4", help="shape_m hints, times the expected local pairs")
    ap.add_argument("--budget", type=float, default=240.0, help="seconds after which no new config is compiled")
    ap.add_argument("--grid", action="store_true", help="also the GRID_TILES x stream-K x CTAs-per-SM grid")
    ap.add_argument(
        "--mma", default="", help="comma list of mma_type values crossed with the grid (empty: the default's)"
    )
    ap.add_argument(
        "--tiles", default="m8", choices=["m8", "m16"], help="tile set of the grid (GRID_TILES / GRID_TILES_M16)"
    )
    ap.add_argument("--gemms", default="w13,w2", help="which expert GEMMs to sweep")
    ap.add_argument(
        "--grid-only", action="store_true", help="the default and the grid only (no table / hints / variants)"
    )
    ap.add_argument(
        "--table-out",
        default=None,
        help="write a kimi.backends.experts humming table: per GEMM and T, the fastest config when it beats "
        "the default by more than --min-gain, for expected local pairs from midway to the previous swept "
        "T's to midway to the next one's (the largest T: up to its own)",
    )
    ap.add_argument("--min-gain", type=float, default=0.02, help="a table entry needs this fraction over the default")
    ap.add_argument("--out", default=None, help="write the full JSON result here")
    args = ap.parse_args()
    require_gpu(ap.prog, _MISSING)
    from humming.tune import get_heuristics_config

    t_start = time.time()
    gen = torch.Generator(device="cuda").manual_seed(0)
    res = {
        "what": "humming indexed MoE GEMM config sweep, Kimi-K2 expert shapes (48 local of 384, top-8)",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "conditions": snapshot.conditions(),
        "copy": copy_bandwidth(4 << 30),
        "cases": [],
    }
    copy_bw = res["copy"]["GBps_read_plus_write"]
    w13p, w13s, w2p, w2s = make_weights(gen)
    b13 = w13p[0].numel() * 4 + w13s[0].numel() * 2
    b2 = w2p[0].numel() * 4 + w2s[0].numel() * 2
    hum = Humming(w13p, w13s, w2p, w2s)
    for T in [int(t) for t in args.tokens.split(",")]:
        sets = make_sets(T, gen)
        n_exp = sum(touched(s[2])[0] for s in sets) / len(sets)
        m_local = max(1, T * TOPK * E // E_TOTAL)
        acts = [torch.randn(T * TOPK, I, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in sets]  # w2 inputs
        ids0 = sets[0][2].reshape(-1)
        loc0 = ((ids0 >= OFFSET) & (ids0 < OFFSET + E)).nonzero().flatten()  # pair rows written by both GEMMs
        for name, layer, nbytes in (("w13", hum.l1, b13), ("w2", hum.l2, b2)):
            if name not in args.gemms.split(","):
                continue
            default = get_heuristics_config(layer.humming_config, shape_m=m_local, gemm_type="indexed")
            cands = [("default", default)]
            if args.grid or args.grid_only:
                cands += grid(default, args.mma.split(","), GRID_TILES_M16 if args.tiles == "m16" else GRID_TILES)
            if not args.grid_only:
                cands += heuristic_candidates(layer, m_local, args.hints, res)
                cands += [(f"var{i}", v) for i, v in enumerate(variants(default))]
            seen, rows, base = set(), [], None
            # inputs per set: the GEMM's own input (x for w13; act [T*k, I] for w2) and alignment
            for label, cfg in cands:
                k = key(cfg)
                if k in seen:
                    continue
                seen.add(k)
                if time.time() - t_start > args.budget:
                    rows.append({"label": label, "config": cfg, "skipped": "budget"})
                    continue
                bm = cfg["block_shape"][0]
                inputs = []
                for (x, _w, ids), act in zip(sets, acts):
                    a = moe_align(ids, E, OFFSET, bm)
                    inputs.append((x if name == "w13" else act, a))

                def run(inp, a, cfg=cfg, layer=layer, name=name):
                    return layer(
                        inp,
                        sorted_ids=a[0],
                        expert_ids=a[1],
                        num_tokens_padded=a[2].view(()),
                        top_k=TOPK if name == "w13" else 1,
                        compute_config={"gemm_type": "indexed"},
                        tuning_config=cfg,
                    )

                row = {"label": label, "config": cfg}
                try:
                    t0 = time.time()
                    ref = run(*inputs[0]).float()[loc0]  # rows of the local pairs (the only ones written)
                    torch.cuda.synchronize()
                    row["first_call_s"] = round(time.time() - t0, 2)
                    ms = do_bench(cycle(run, inputs), rep=200)
                    row["ms"] = ms
                    row["GBps"] = n_exp * nbytes / ms / 1e6
                    row["frac_copy"] = row["GBps"] / copy_bw
                    if label == "default":
                        base = ref
                    else:
                        row["rel_diff_vs_default"] = float((ref - base).norm() / base.norm())
                except Exception:
                    row["error"] = traceback.format_exc()[-600:]
                rows.append(row)
                print(T, name, json.dumps(row, default=str)[:300], flush=True)
            res["cases"].append(
                {"T": T, "gemm": name, "experts_hit_mean": n_exp, "bytes_per_expert": nbytes, "rows": rows}
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)
    if args.table_out:
        entries = []
        ms_local = sorted({max(1, c["T"] * TOPK * E // E_TOTAL) for c in res["cases"]})
        for c in res["cases"]:
            ok = sorted([r for r in c["rows"] if "ms" in r], key=lambda r: r["ms"])
            d = next((r for r in c["rows"] if r["label"] == "default" and "ms" in r), None)
            if ok and d and ok[0]["ms"] < d["ms"] * (1 - args.min_gain) and ok[0].get("rel_diff_vs_default", 1) < 1e-2:
                n, k = (2 * I, H) if c["gemm"] == "w13" else (H, I)
                m = max(1, c["T"] * TOPK * E // E_TOTAL)
                i = ms_local.index(m)  # the range up to the next swept size's midpoint, from the previous one's
                lo = 1 if i == 0 else (ms_local[i - 1] + m) // 2 + 1
                hi = m if i == len(ms_local) - 1 else (m + ms_local[i + 1]) // 2
                entries.append(
                    {
                        "n": n,
                        "k": k,
                        "m_min": lo,
                        "m_max": hi,
                        "config": ok[0]["config"],
                        "label": ok[0]["label"],
                        "ms": ok[0]["ms"],
                        "default_ms": d["ms"],
                    }
                )
        tuning.dump(args.table_out, res["gpu"], snapshot.command_line(), json.loads(json.dumps(entries, default=str)))
        print(f"humming table: {len(entries)} entries -> {args.table_out}")
    print(f"\ncopy {copy_bw:.0f} GB/s")
    for c in res["cases"]:
        ok = sorted([r for r in c["rows"] if "ms" in r], key=lambda r: r["ms"])
        d = next((r for r in c["rows"] if r["label"] == "default"), {})
        print(
            f"T={c['T']} {c['gemm']}: default {d.get('ms', float('nan')):.4f} ms; best {ok[0]['label'] if ok else '-'} "
            f"{ok[0]['ms'] if ok else float('nan'):.4f} ms {ok[0].get('GBps', 0) if ok else 0:.0f} GB/s; "
            f"{json.dumps(ok[0]['config'], default=str) if ok else ''}"
        )


if __name__ == "__main__":
    main()
