"""Sweep the launch parameters of the decode step's small kernels (kimi.kernels.triton.fused.LAUNCH and
kimi.kernels.triton.moe_w4a16.COMBINE_LAUNCH, both from kimi/kernels/tuning/small_kernels.json) at the Kimi-K2.6
decode shapes of one rank, on one GPU.

Ops and shapes (B local rows = 8 / 32; the MoE sees 8 * B tokens, top-8 of 384 experts, the 48 of one EP rank):
  - combine_into: y [8B * 8, 7168] -> out [8B, 7168]; block_n x warps.
  - silu_mul_rows: y [8B * 8, 4096] over moe_align_fused's rows (block_m 8); rows x block x warps.
  - moe_align_fused (two-kernel path): count warps x (scatter block, warps).
  - router_topk (two-kernel path): x [B, 7168], 20 distinct [384, 7168] gates cycled (read from HBM as in the
    model); one parameter at a time around the default (row / expert / K tiles, warps, split size, top-k warps).
  - rms_norm [B, 1536] and add_rms_norm [B, 7168] with two addends: warps.
Every variant's output is compared with the default's first (combine / silu_mul_rows: bit-equal on the rows
written; align: block experts and num_padded equal, row blocks equal as sets; router: ids equal, weights within
1e-5; norms within 1e-2 relative) and a variant that differs is not eligible.

Timing: kimi.benchmarks.gpu.GraphTimer: one sample = one CUDA-graph replay of --reps back-to-back calls with PDL as
configured (kimi.kernels.triton.pdl), CUDA-event timed, divided by reps; median of --samples samples. Pick per op: the
variant with the smallest sum over both B, when it beats the default's sum by more than --min-gain; "picks" in the JSON
(--out) holds them. Each variant is passed to the op as its `launch` (the module defaults stay as they are).
--table-out F writes the small_kernels table (kimi.kernels.tuning) with the picks over the current values (entries
not swept kept as found): the tuner of kimi/kernels/tuning/small_kernels.json. tools/bench_decode.py --ab small_tuned
applies such a table ($KIMI_SMALL_KERNELS_TABLE_ALT) to a whole decode step first.

Usage: python tools/sweep_small_kernels.py [--out small_kernels_sweep.json] [--table-out F]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import traceback

import torch

from kimi.benchmarks import snapshot
from kimi.benchmarks.gpu import GraphTimer, require_gpu
from kimi.kernels import tuning
from kimi.kernels.triton import moe_w4a16 as mi

# GPU packages: a CPU-only install still gets --help; main() then exits with one line (require_gpu)
_MISSING = None
try:
    from kimi.kernels.triton import fused
except ImportError as _e:
    _MISSING = _e

DEV = "cuda"
BF16 = torch.bfloat16
D, I2, E_ALL, E_LOC, TOPK, OFF = 7168, 4096, 384, 48, 8, 96
# the `tuner` of the table --table-out writes (router_logits_large is not swept here: kept as found)
TUNER = (
    "python tools/sweep_small_kernels.py --table-out kimi/kernels/tuning/small_kernels.json (router_logits_large, "
    "which the sweep keeps as found: its m_min and tiles from python tools/bench_fused.py --ops router_large)"
)


def graph_us(timer, fn, launch, reps: int) -> float:
    """Median us per call of fn(0..reps-1, launch) replayed as one CUDA graph (GraphTimer)."""
    return timer.time_calls([lambda i=i: fn(i, launch) for i in range(reps)])


def routing(T: int, g):
    scores = torch.rand(T, E_ALL, generator=g, device=DEV)
    w, ids = scores.topk(TOPK, 1)
    return (w / w.sum(1, keepdim=True)).float(), ids.to(torch.int64)


def current_launch() -> dict:
    """{name: config} of every small_kernels entry as the kernels use it now (fused.LAUNCH and "combine")."""
    return {**fused.LAUNCH, "combine": dict(mi.COMBINE_LAUNCH)}


def op_cases(g):
    """([(op, launch names, variants)], {B: {op: (run(i, launch) -> output, check(out, ref) -> bool, poison() or
    None)}}); launch: {name: config} as current_launch()."""
    ops = []
    setups = {}
    for B in (8, 32):
        T = 8 * B
        w, ids = routing(T, g)
        y2 = torch.randn(T * TOPK, D, generator=g, device=DEV).to(BF16)
        out = torch.empty(T, D, dtype=BF16, device=DEV)
        y1 = torch.randn(T * TOPK, I2, generator=g, device=DEV).to(BF16) * 3
        al = fused.moe_align_fused(ids, E_LOC, OFF, 8)
        so = torch.empty(T * TOPK, I2 // 2, dtype=BF16, device=DEV)
        x = torch.randn(B, D, generator=g, device=DEV).to(BF16)
        gates = [torch.randn(E_ALL, D, generator=g, device=DEV).to(BF16) * 0.02 for _ in range(20)]
        bias = torch.randn(E_ALL, generator=g, device=DEV) * 0.01
        xq = torch.randn(B, 1536, generator=g, device=DEV).to(BF16)
        wq = (torch.rand(1536, generator=g, device=DEV) + 0.5).to(BF16)
        wd = (torch.rand(D, generator=g, device=DEV) + 0.5).to(BF16)
        d1, d2 = (torch.randn(B, D, generator=g, device=DEV).to(BF16) for _ in range(2))
        loc = ((ids >= OFF) & (ids < OFF + E_LOC)).reshape(-1).nonzero().flatten()
        setups[B] = dict(
            combine=(
                lambda i, lp, w=w, ids=ids, y2=y2, out=out: mi.combine_into(
                    y2, w, ids, OFF, E_LOC, out, launch=lp["combine"]
                ),
                lambda a, b: torch.equal(a, b),
                lambda out=out: out.fill_(float("nan")),
            ),
            silu_rows=(
                lambda i, lp, y1=y1, al=al, so=so: fused.silu_mul_rows(y1, al[0], al[2], I2 // 2, out=so, launch=lp),
                lambda a, b, loc=loc: torch.equal(a[loc], b[loc]),
                lambda so=so: so.fill_(float("nan")),
            ),
            align=(
                lambda i, lp, ids=ids: fused._moe_align(ids, E_LOC, OFF, 8, False, launch=lp),
                lambda a, b: (
                    torch.equal(a[1], b[1])
                    and torch.equal(a[2], b[2])
                    and torch.equal(a[0].view(-1, 8).sort(1).values, b[0].view(-1, 8).sort(1).values)
                ),
                None,
            ),
            router=(
                lambda i, lp, x=x, gates=gates, bias=bias: fused._router_topk(
                    x, gates[i % 20], bias, TOPK, 2.827, True, False, launch=lp
                ),
                lambda a, b: torch.equal(a[1], b[1]) and (a[0] - b[0]).abs().max().item() <= 1e-5,
                None,
            ),
            rmsnorm=(
                lambda i, lp, xq=xq, wq=wq, x=x, d1=d1, d2=d2, wd=wd: (
                    fused.rms_norm(xq, wq, 1e-6, launch=lp),
                    fused.add_rms_norm(x, d1, d2, wd, 1e-6, launch=lp)[1],
                ),
                lambda a, b: all(
                    ((p.float() - q.float()).norm() / q.float().norm()).item() <= 1e-2 for p, q in zip(a, b)
                ),
                None,
            ),
        )
    lr, tk = fused.LAUNCH["router_logits"], fused.LAUNCH["router_topk"]
    router_vars = [{"router_logits": lr, "router_topk": tk}]
    for k, vals in (
        ("bt", (32,)),
        ("be", (64, 128)),
        ("bk", (64, 256)),
        ("warps", (2, 8)),
        ("split_elems", (256, 1024, 2048)),
    ):
        for v in vals:
            router_vars.append({"router_logits": lr | {k: v}, "router_topk": tk})
    for tw in (1, 4):
        router_vars.append({"router_logits": lr, "router_topk": {"warps": tw}})
    ops.append(
        (
            "combine",
            ["combine"],
            [
                {"combine": {"block_n": bn, "warps": nw}}
                for bn, nw in itertools.product((1024, 512, 2048, 4096), (4, 2, 8))
            ],
        )
    )
    ops.append(
        (
            "silu_rows",
            ["silu_rows"],
            [
                {"silu_rows": {"rows": r, "block": bl, "warps": nw}}
                for r, bl, nw in itertools.product((4, 1, 2, 8, 16), (1024, 512, 2048), (4, 2, 8))
            ],
        )
    )
    ops.append(
        (
            "align",
            ["align_count", "align_scatter"],
            [
                {"align_count": {"warps": cw}, "align_scatter": {"block": sb, "warps": sw}}
                for cw, (sb, sw) in itertools.product((8, 4, 16), ((256, 4), (128, 4), (512, 4), (1024, 4), (256, 2)))
            ],
        )
    )
    ops.append(("router", ["router_logits", "router_topk"], router_vars))
    ops.append(("rmsnorm", ["rmsnorm"], [{"rmsnorm": {"warps": n}} for n in (None, 2, 4, 8, 16)]))
    return ops, setups


def snap(o):
    """A copy of an op's output (tensors cloned, other values kept), so later runs cannot change it."""
    if isinstance(o, (tuple, list)):
        return type(o)(snap(v) for v in o)
    return o.clone() if isinstance(o, torch.Tensor) else o


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=snapshot.HelpFormatter)
    ap.add_argument("--reps", type=int, default=20, help="calls per graph replay")
    ap.add_argument("--samples", type=int, default=30, help="timed graph replays per measurement")
    ap.add_argument("--min-gain", type=float, default=0.03, help="a pick needs this fraction over the default")
    ap.add_argument("--ops", default="combine,silu_rows,align,router,rmsnorm", help="which ops to sweep")
    ap.add_argument("--out", default=None, help="write the full JSON result (and its picks) here")
    ap.add_argument(
        "--table-out",
        default=None,
        help="write the small_kernels table (kimi.kernels.tuning schema): the picks over the current values",
    )
    args = ap.parse_args()
    require_gpu(ap.prog, _MISSING)
    from kimi.kernels.triton import pdl

    g = torch.Generator(device=DEV).manual_seed(0)
    res = {
        "what": __doc__.split("\n")[0],
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "conditions": snapshot.conditions(),
        "pdl": pdl.ENABLED,
        "reps": args.reps,
        "samples": args.samples,
        "ops": {},
        "picks": {},
    }
    ops, setups = op_cases(g)
    timer = GraphTimer(args.samples)
    current = current_launch()
    notes = []
    for name, keys, variants in ops:
        if name not in args.ops.split(","):
            continue
        default = {k: current[k] for k in keys}
        variants = [default] + [v for v in variants if v != default]  # rows[0]: the current default
        refs = {}
        for B, st in setups.items():
            if st[name][2] is not None:
                st[name][2]()
            refs[B] = snap(st[name][0](0, current))
        torch.cuda.synchronize()
        rows = []
        for var in variants:
            row = {"launch": var}
            launch = current | var
            try:
                ok = True
                for B, st in setups.items():
                    run, check, poison = st[name]
                    if poison is not None:
                        poison()
                    outp = run(0, launch)
                    torch.cuda.synchronize()
                    ok = ok and check(outp, refs[B])
                row["same_output"] = bool(ok)
                row["us"] = {B: graph_us(timer, st[name][0], launch, args.reps) for B, st in setups.items()}
                row["sum_us"] = sum(row["us"].values())
            except Exception:
                row["error"] = traceback.format_exc()[-500:]
            rows.append(row)
            print(name, json.dumps(row, default=str)[:240], flush=True)
        base = rows[0].get("sum_us")
        good = sorted([r for r in rows if r.get("same_output") and "sum_us" in r], key=lambda r: r["sum_us"])
        res["ops"][name] = {"default": default, "rows": rows}
        if good and base and good[0]["sum_us"] < base * (1 - args.min_gain):
            res["picks"][name] = good[0]["launch"]
            notes.append(f"{name} {good[0]['sum_us']:.2f} us vs {base:.2f} (sum over B = 8, 32)")
            print(
                f"PICK {name}: {json.dumps(good[0]['launch'])} {good[0]['sum_us']:.2f} us vs default {base:.2f}",
                flush=True,
            )
        else:
            print(f"KEEP {name}: default {base} us", flush=True)
    print(f"picks: {json.dumps(res['picks'])}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)
    if args.table_out:
        table = current | {k: v for pick in res["picks"].values() for k, v in pick.items()}
        tuning.dump(
            args.table_out,
            torch.cuda.get_device_name(),
            TUNER,
            tuning.launch_entries(table),
            notes="picks over the previous values: " + ("; ".join(notes) or "none"),
        )
        print(f"wrote {args.table_out}", flush=True)


if __name__ == "__main__":
    main()
