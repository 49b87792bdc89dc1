"""Time humming's MoE with one align list against the two-list align (kimi.ops.moe_backend.HummingExperts.split) at
Kimi-K2.6 expert shapes on one GPU.

Why: humming's decode schedules take 8-row blocks; at 32 local sequences under EP8 (256 MoE tokens, 48 local experts
of 384, ~5.3 pairs per expert) ~9% of the experts hit get 9-16 pairs and stream their weights twice. The split
runs those experts in a second launch with 16-row tiles. This tool times, per T in --tokens (NSETS routing sets of T
tokens over 384 experts, top-8, uniform scores as in tools/bench_decode.py), the whole HummingInt4Experts forward
(align, both GEMMs, SiLU, combine) as CUDA-graph replays (do_bench median, L2 cleared):
  - `one_list`: the default (no split);
  - `split_gI_dJ`: split at max_small = the small row tile, big-list gate_up fields GATE_UP[I], down fields DOWN[J]
    (first every gate_up candidate with DOWN[0], then every down candidate with the best gate_up).
It also checks each split variant's output against one_list's on the first set (max |diff| / max |one_list|), and
reports the weight bytes each variant streams (row blocks x bytes per expert) at copy bandwidth. Writes JSON
(--out, default $OUT/moe_split_<date>.json) with the best split ("best": the dict for HummingExperts.split).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_moe import _MISSING, E, E_TOTAL, OFFSET, TOPK, copy_bandwidth, graph_time, make_sets, make_weights, versions  # noqa: E402
from bench_util import require_gpu  # noqa: E402

GATE_UP = (
    {"block_shape": [16, 512, 64], "warp_shape": [16, 64, 64]},
    {"block_shape": [16, 256, 64], "warp_shape": [16, 64, 32]},
    {"block_shape": [16, 128, 64], "warp_shape": [16, 64, 32], "num_ctas_per_sm": 4},
    {"block_shape": [16, 256, 64], "warp_shape": [16, 64, 32], "use_stream_k": True, "num_ctas_per_sm": 2},
)
DOWN = (
    {"block_shape": [16, 128, 128], "warp_shape": [16, 64, 64]},
    {"block_shape": [16, 256, 64], "warp_shape": [16, 64, 32]},
    {"block_shape": [16, 128, 128], "warp_shape": [16, 64, 64], "use_stream_k": True, "num_ctas_per_sm": 2},
)


def row_blocks(ids, bm_small: int, bm_big: int | None) -> float:
    """Row blocks the GEMMs take per layer for routing ids (bm_big None: one list of bm_small blocks)."""
    loc = ids.flatten() - OFFSET
    cnt = torch.bincount(loc[(loc >= 0) & (loc < E)], minlength=E)
    if bm_big is None:
        return float(((cnt + bm_small - 1) // bm_small).sum())
    small = cnt <= bm_small
    return float(((cnt[small] + bm_small - 1) // bm_small).sum() + ((cnt[~small] + bm_big - 1) // bm_big).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="64,256,384", help="MoE tokens per step (8 local seqs x EP8 = 64)")
    ap.add_argument("--min-mean", type=float, default=0.0, help="the split's min_mean in the best dict written")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    require_gpu(ap.prog, _MISSING)
    from kimi.ops.moe_backend import HummingInt4Experts

    date = datetime.date.today().isoformat()
    out_path = args.out or os.path.join(os.environ.get("OUT", "bench"), f"moe_split_{date}.json")
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13p, w13s, w2p, w2s = make_weights(gen)
    bytes_per_expert = sum(t[0].numel() * t.element_size() for t in (w13p, w13s, w2p, w2s))
    hum = HummingInt4Experts(w13p, w13s, w2p, w2s, OFFSET, E_TOTAL)
    del w13p, w13s, w2p, w2s
    copy = copy_bandwidth()
    gbps = copy["GBps_read_plus_write"]
    res = {"what": __doc__.split("\n")[0], "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "gpu": torch.cuda.get_device_name(), "versions": versions(), "copy": copy,
           "bytes_per_expert": bytes_per_expert, "cases": []}
    best_by_T = {}
    for T in [int(t) for t in args.tokens.split(",")]:
        sets = make_sets(T, gen)
        c1, c2 = hum._configs(T, TOPK)
        bs = c1["block_shape"][0]
        case = {"T": T, "small_configs": [c1, c2], "rows": []}
        blocks1 = sum(row_blocks(s[2], bs, None) for s in sets) / len(sets)
        hum.split = None
        ref = hum(*sets[0]).float()
        one = graph_time(hum, sets)
        case["rows"].append({"label": "one_list", "ms": one, "row_blocks": blocks1,
                             "bytes_floor_ms": blocks1 * bytes_per_expert / gbps / 1e6})
        print(f"T={T} one_list {one * 1e3:.1f} us ({blocks1:.1f} blocks of {bs})", flush=True)

        def run(label, gu, dn, concurrent=False):
            hum.split = {"max_small": bs, "block_big": 16, "min_mean": 0.0, "gate_up": gu, "down": dn,
                         "concurrent": concurrent}
            try:
                y = hum(*sets[0]).float()
                diff = ((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
                ms = graph_time(hum, sets)
            except Exception as e:  # noqa: BLE001 (a schedule humming cannot build: recorded, the sweep goes on)
                case["rows"].append({"label": label, "gate_up": gu, "down": dn, "error": repr(e)[:300]})
                print(f"T={T} {label} failed: {e!r}"[:300], flush=True)
                traceback.print_exc()
                return None
            blocks = sum(row_blocks(s[2], bs, 16) for s in sets) / len(sets)
            case["rows"].append({"label": label, "gate_up": gu, "down": dn, "concurrent": concurrent, "ms": ms,
                                 "rel_diff_vs_one_list": diff,
                                 "row_blocks": blocks, "bytes_floor_ms": blocks * bytes_per_expert / gbps / 1e6})
            print(f"T={T} {label} {ms * 1e3:.1f} us (one_list {one * 1e3:.1f}), rel diff {diff:.2e}", flush=True)
            return ms

        times = [run(f"split_g{i}_d0", gu, DOWN[0]) for i, gu in enumerate(GATE_UP)]
        ok = [(t, i) for i, t in enumerate(times) if t is not None]
        if ok:
            gi = min(ok)[1]
            dtimes = {0: times[gi]} | {j: run(f"split_g{gi}_d{j}", GATE_UP[gi], dn) for j, dn in enumerate(DOWN) if j}
            dok = [(t, j) for j, t in dtimes.items() if t is not None]
            dj = min(dok)[1]
            # the big list's launches on a side stream, concurrent with the small list's (stream-K off in the big
            # list: humming's lock buffer is per layer)
            nosk = {"use_stream_k": False}
            for i, gu in enumerate(GATE_UP):
                run(f"split_g{i}_d{dj}_concurrent", gu | nosk, DOWN[dj] | nosk, concurrent=True)
        done = [r for r in case["rows"] if r["label"] != "one_list" and "ms" in r]
        if done:
            b = min(done, key=lambda r: r["ms"])
            case["best"] = {"label": b["label"], "ms": b["ms"], "one_list_ms": one,
                            "split": {"max_small": bs, "block_big": 16, "min_mean": args.min_mean,
                                      "gate_up": b["gate_up"], "down": b["down"], "concurrent": b["concurrent"]}}
            best_by_T[T] = case["best"]
        hum.split = None
        res["cases"].append(case)
    # the best over the T that gains most (what bench_decode's A/B takes)
    if best_by_T:
        T_best = max(best_by_T, key=lambda t: best_by_T[t]["one_list_ms"] - best_by_T[t]["ms"])
        res["best"] = best_by_T[T_best]["split"]
        res["best_at_T"] = T_best
    os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
