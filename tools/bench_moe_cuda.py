"""kimi's CUDA W4A16 indexed expert GEMM (kimi/kernels/cuda/moe_w4a16.py, kimi/kernels/cuda/csrc/moe_w4a16.cu) against
humming-kernels'
indexed GEMM, one run, one GPU, at Kimi-K2's expert shapes.

For each T (MoE tokens of one rank's step; the decode bench's 8 / 32 local sequences under EP8 are T = 64 / 256) in
--tokens: routing of T tokens over 384 experts (top-8, distinct random experts per token, seeded), the 48 local
experts [96, 144) computed (EP rank 2 of 8). Weights: real shapes (gate_up [48, 4096, 7168], down [48, 7168, 2048]),
random pack-quantized INT4 words and bf16 scales. For each GEMM:
- correctness: every listed row against the fp32 product with `dequant_int4`'s bf16 weights (max |err| / max |ref|),
  for ours (every config) and humming; output rows poisoned with NaN before each checked call;
- time: a CUDA graph of 20 back-to-back calls of the GEMM alone (align done once outside), replayed; median over
  replays of the per-call time (L2 not flushed: one call's weights, 0.4-0.8 GB, far exceed the 50 MB L2);
- GB/s: bytes of the experts hit (packed words + scales) / time, against the copy bandwidth measured in the run.
- the SM clock and board power during each timing (`kimi.benchmarks.smi.GpuSampler`, nvidia-smi every 20 ms; a
  timing lasts ~50 ms and the power reading lags, so each row's power mostly shows the rows before it).
`table_config` is the configuration kimi.kernels.cuda.moe_w4a16.TABLE picks at the step's expected local pairs (what the
model runs); its picks, and kimi.backends.experts.AUTO_CUDA_MAX_PAIRS (where `auto` hands over to humming's GEMM), come
from this sweep and the decode step's A/B of the candidates (tools/bench_decode.py --ab moe_cuda_...). Also whether
kimi's repack builds humming's transformed tensors bit for bit (`repack_equals_humming`: the layout --moe-backend auto
shares).

Usage: python tools/bench_moe_cuda.py [--tokens 64,256,512,1024] [--out F] [--snapshot]
Snapshot: moe-w4a16.json (moe-w4a16_custom for other tokens or GEMMs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kimi.benchmarks import snapshot
from kimi.benchmarks.gpu import copy_bandwidth, require_gpu
from kimi.benchmarks.smi import GpuSampler
from kimi.kernels.cuda import moe_w4a16 as mc
from kimi.model.quant import dequant_int4
from kimi.model.weights import random_packed_experts

_MISSING = None  # its imports need no GPU package; main() still exits with one line without a CUDA device

H, I, E, E_TOTAL, TOPK, OFFSET = 7168, 2048, 48, 384, 8, 96


def graph_time(fn, calls: int = 20, replays: int = 15) -> float:
    """Median per-call ms of a CUDA graph holding `calls` calls of fn."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / calls)
    del g
    return statistics.median(ts)


def routing(T: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.rand((T, E_TOTAL), device="cuda", generator=g)
    return scores.topk(TOPK, dim=-1).indices.to(torch.int64)  # [T, 8] distinct experts


DEFAULT_TOKENS = "64,256,512,1024"


def summarize(res: dict) -> dict:
    """The snapshot's table: per step size and GEMM, kimi's GEMM at the table's pick and at its best configuration,
    humming's, and the pick against humming."""
    rows = []
    for c in res["cases"]:
        by_cfg = {tuple(r["config"]): r for r in c["ours"]}
        pick = by_cfg.get(tuple(c.get("table_config") or ()))
        best = min(c["ours"], key=lambda r: r["ms"])
        h = c["humming"]
        rows.append(
            [
                c["T"],
                c["gemm"],
                "x".join(map(str, c["table_config"])) if pick else None,
                round(pick["ms"] * 1e3, 1) if pick else None,
                round(pick["pct_copy"]) if pick else None,
                "x".join(map(str, best["config"])),
                round(best["ms"] * 1e3, 1),
                round(h["ms"] * 1e3, 1),
                round(h["pct_copy"]),
                round(pick["ms"] / h["ms"], 3) if pick else None,
            ]
        )
    return {
        "columns": [
            "MoE tokens",
            "GEMM",
            "kimi: table's pick",
            "kimi (us)",
            "kimi, % of copy",
            "kimi: best",
            "kimi best (us)",
            "humming (us)",
            "humming, % of copy",
            "kimi / humming",
        ],
        "rows": rows,
        "notes": [f"48 local of 384 experts, top-8; copy bandwidth {res['copy_GBps']:.0f} GB/s"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=snapshot.HelpFormatter)
    ap.add_argument("--tokens", default=DEFAULT_TOKENS, help="MoE tokens of one step (comma list)")
    ap.add_argument("--out", default=None, help="write the full JSON result here")
    ap.add_argument("--gemms", default="gate_up,down", help="which GEMMs")
    snapshot.add_arguments(ap)
    args = ap.parse_args()
    require_gpu(ap.prog, _MISSING)
    from humming.layer import HummingLayer  # noqa: F401  (fails loudly when humming is absent)

    from kimi.backends.experts.humming import HummingInt4Experts
    from kimi.kernels.triton.fused import moe_align_fused

    torch.manual_seed(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    t_build = time.time()
    bw = copy_bandwidth(2 * 1024**3)["GBps_read_plus_write"]
    res: dict = {"what": __doc__.split("\n")[0], "args": vars(args), "copy_GBps": bw, "cases": []}
    w13, s13 = random_packed_experts(E, 2 * I, H, gen, "cuda")  # random pack-quantized words, bf16 scales
    w2, s2 = random_packed_experts(E, H, I, gen, "cuda")
    ours = {"gate_up": mc.repack(w13, s13), "down": mc.repack(w2, s2)}
    ext_s = time.time()
    mc.load_extension()
    res["extension_build_s"] = time.time() - ext_s
    hum = HummingInt4Experts(w13.clone(), s13.clone(), w2.clone(), s2.clone(), OFFSET, E_TOTAL)
    res["setup_s"] = time.time() - t_build
    sampler = GpuSampler(interval_ms=20).start()
    # kimi's repack builds humming's layout (so --moe-backend auto keeps one copy of the experts): bit for bit
    res["repack_equals_humming"] = {
        name: {
            "weights": torch.equal(ours[name][0], layer.weight),
            "scales": torch.equal(ours[name][1], layer.weight_scale),
        }
        for name, layer in (("gate_up", hum.l1), ("down", hum.l2))
    }
    print("repack == humming's transformed tensors:", res["repack_equals_humming"], flush=True)
    shapes = {"gate_up": (2 * I, H, w13, s13, hum.l1), "down": (H, I, w2, s2, hum.l2)}
    for T in [int(t) for t in args.tokens.split(",")]:
        ids = routing(T, seed=T)
        P = T * TOPK
        local = ((ids >= OFFSET) & (ids < OFFSET + E)).reshape(-1)
        hit = torch.unique(ids[(ids >= OFFSET) & (ids < OFFSET + E)]) - OFFSET
        a16 = moe_align_fused(ids, E, OFFSET, 16)
        m_local = hum._m_local(T, TOPK)
        c1, c2 = hum._configs(m_local)
        for name in args.gemms.split(","):
            n, k, packed, scale, layer = shapes[name]
            top_k = TOPK if name == "gate_up" else 1
            R = T if name == "gate_up" else P
            x = (torch.randn((R, k), device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
            hcfg = c1 if name == "gate_up" else c2
            ah = moe_align_fused(ids, E, OFFSET, hcfg["block_shape"][0])
            bytes_hit = len(hit) * (packed[0].numel() * 4 + scale[0].numel() * 2)
            # reference over the listed rows
            rows = torch.nonzero(local).flatten()  # pair ids of local pairs
            ref = torch.empty((len(rows), n), device="cuda")
            exp_of_row = ids.reshape(-1)[rows] - OFFSET
            for ex in exp_of_row.unique().tolist():
                sel = exp_of_row == ex
                wdq = dequant_int4(packed[ex], scale[ex], 32, torch.bfloat16).float()
                ref[sel] = x[rows[sel] // top_k].float() @ wdq.T
            scale_ref = ref.abs().max().item()
            case = {
                "T": T,
                "gemm": name,
                "n": n,
                "k": k,
                "local_pairs": int(local.sum()),
                "experts_hit": len(hit),
                "bytes": bytes_hit,
                "ref_absmax": scale_ref,
                "expected_local_pairs": m_local,
                "table_config": list(mc.config_for(n, k, m_local)),
                "ours": [],
            }

            def err(y, rows=rows, ref=ref, scale_ref=scale_ref):
                d = (y[rows].float() - ref).abs()
                return {"rel_err": (d.max() / scale_ref).item(), "nan": bool(torch.isnan(y[rows]).any())}

            for cfg in mc.CONFIGS:
                if not mc.config_valid(cfg, n, k):
                    continue
                out = torch.full((P, n), float("nan"), dtype=torch.bfloat16, device="cuda")

                def fn(cfg=cfg, out=out, x=x, w=ours[name], a16=a16, top_k=top_k):
                    return mc.indexed_gemm(x, *w, a16[0], a16[1], a16[2], top_k, out, config=cfg)

                y = fn()
                torch.cuda.synchronize()
                r = {"config": list(cfg)} | err(y)
                t0 = time.time()
                r["ms"] = graph_time(fn)
                r["smi"] = sampler.windows([(t0, time.time())])
                r["GBps"] = bytes_hit / r["ms"] / 1e6
                r["pct_copy"] = 100 * r["GBps"] / bw
                case["ours"].append(r)
                smi = r["smi"]
                clk = f" {smi['sm_clock_MHz']['median']:.0f} MHz {smi['power_W_median']:.0f} W" if smi else ""
                print(
                    f"T={T} {name} ours {cfg}: {r['ms'] * 1e3:.1f} us {r['GBps']:.0f} GB/s "
                    f"({r['pct_copy']:.0f}%) err {r['rel_err']:.2e}{clk}",
                    flush=True,
                )
            out = torch.full((P, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            cc = {"gemm_type": "indexed"}

            def hfn(out=out, layer=layer, x=x, ah=ah, top_k=top_k, hcfg=hcfg, cc=cc):
                y = layer(
                    x,
                    sorted_ids=ah[0],
                    expert_ids=ah[1],
                    num_tokens_padded=ah[2].view(()),
                    top_k=top_k,
                    compute_config=cc,
                    tuning_config=hcfg,
                )
                return y

            y = hfn()
            torch.cuda.synchronize()
            h = {"config": hcfg} | err(y)
            t0 = time.time()
            h["ms"] = graph_time(hfn)
            h["smi"] = sampler.windows([(t0, time.time())])
            h["GBps"] = bytes_hit / h["ms"] / 1e6
            h["pct_copy"] = 100 * h["GBps"] / bw
            case["humming"] = h
            best = min(case["ours"], key=lambda r: r["ms"])
            case["best_ours"] = best["config"]
            case["ours_over_humming"] = best["ms"] / h["ms"]
            print(
                f"T={T} {name} humming: {h['ms'] * 1e3:.1f} us {h['GBps']:.0f} GB/s ({h['pct_copy']:.0f}%) "
                f"err {h['rel_err']:.2e}; best ours {case['best_ours']} x{case['ours_over_humming']:.3f}",
                flush=True,
            )
            res["cases"].append(case)
    sampler.stop()
    res["conditions"] = conds = snapshot.conditions(copy_GBps=bw)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)
    if args.snapshot:
        custom = args.tokens != DEFAULT_TOKENS or args.gemms != "gate_up,down"
        snapshot.write(
            args.snapshot,
            benchmark="moe-w4a16",
            config="custom" if custom else "",
            summary=summarize(res),
            results=res,
            conds=conds,
        )


if __name__ == "__main__":
    main()
