"""Benchmark the Triton W4A16 MoE (kimi.ops.moe_int4_triton) against humming-kernels' indexed MoE GEMM.

One run measures, on the current CUDA device:
  - HBM copy bandwidth: a 4 GiB device-to-device torch copy (bytes read + written), median of do_bench.
  - For each T (tokens in the batch) in --tokens: routing of T tokens over 384 experts (top-8, distinct random
    scores per input set), only the 48 local experts [offset, offset+48) computed (EP rank 2 of 8).
    Weights: real Kimi shapes (H=7168, I=2048), random pack-quantized INT4 words and bf16 scales.
    Timed: our full fused_experts_int4 (align + 2 GEMMs + combine) for several tile configs, eagerly and as
    CUDA-graph replays; the align step alone; humming's two indexed GEMMs (+ torch SiLU*up glue + our combine).
    Each timed call cycles over NSETS distinct (x, routing) sets; weights (1.2 GB) far exceed the 60 MB L2, and
    triton.testing.do_bench clears the L2 before every call. Time = median over the repetitions.
  - Weight bytes touched = (#distinct local experts hit) x (packed + scales of w13 and w2), averaged over sets;
    GB/s = that / time, compared with the measured copy bandwidth (read+write counted, as is usual).
Writes JSON to --out (default $OUT/moe_int4_<date>.json or bench/).
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

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_util import import_gpu_module, require_gpu

from kimi.ops.moe_int4_triton import MoeTileConfig, combine_into, default_config, fused_experts_int4, moe_align

triton, _MISSING = import_gpu_module("triton.testing")  # --help without Triton; a run stops in require_gpu

H, I, E, E_TOTAL, TOPK, OFFSET = 7168, 2048, 48, 384, 8, 96
NSETS = 4


def bench(fn, rep=300):
    return triton.testing.do_bench(fn, warmup=50, rep=rep, return_mode="median")  # ms


def versions():
    v = {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda}
    for mod in ("flashinfer", "humming"):
        try:
            m = __import__(mod)
            v[mod] = getattr(m, "__version__", "?")
        except Exception as e:
            v[mod] = f"unavailable: {e!r}"
    return v


def copy_bandwidth():
    n = 4 * 1024**3
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    b = torch.empty_like(a)
    ms = bench(lambda: b.copy_(a), rep=200)
    del a, b
    return {"bytes_per_copy": n, "median_ms": ms, "GBps_read_plus_write": 2 * n / ms / 1e6}


def make_weights(gen):
    w13p = torch.randint(-(2**31), 2**31 - 1, (E, 2 * I, H // 8), dtype=torch.int32, device="cuda", generator=gen)
    w2p = torch.randint(-(2**31), 2**31 - 1, (E, H, I // 8), dtype=torch.int32, device="cuda", generator=gen)
    w13s = ((torch.rand(E, 2 * I, H // 32, device="cuda", generator=gen) + 0.5) * (0.02 / 7.5)).to(torch.bfloat16)
    w2s = ((torch.rand(E, H, I // 32, device="cuda", generator=gen) + 0.5) * (0.03 / 7.5)).to(torch.bfloat16)
    return w13p, w13s, w2p, w2s


def make_sets(T, gen):
    sets = []
    for _ in range(NSETS):
        x = (torch.randn(T, H, device="cuda", generator=gen)).to(torch.bfloat16)
        scores = torch.rand(T, E_TOTAL, device="cuda", generator=gen)
        w, ids = scores.topk(TOPK, dim=1)
        w = (w / w.sum(1, keepdim=True) * 2.827).float()
        sets.append((x, w, ids.to(torch.int64)))
    return sets


def expert_bytes(w13p, w13s, w2p, w2s):
    return sum(t[0].numel() * t.element_size() for t in (w13p, w13s, w2p, w2s))


def touched(ids):
    loc = ids.flatten() - OFFSET
    loc = loc[(loc >= 0) & (loc < E)]
    return int(torch.unique(loc).numel()), int(loc.numel())


def cycle(fn, sets):
    it = [0]

    def f():
        s = sets[it[0] % len(sets)]
        it[0] += 1
        return fn(*s)

    return f


def graph_time(fn, sets):
    """Capture one CUDA graph per input set and time round-robin replays (median)."""
    graphs = []
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for inp in sets:
            fn(*inp)
    torch.cuda.current_stream().wait_stream(s)
    pool = torch.cuda.graph_pool_handle()
    for inp in sets:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            fn(*inp)
        graphs.append(g)
    return bench(cycle(lambda g: g.replay(), [(g,) for g in graphs]))


def configs_for(T):
    C = MoeTileConfig
    base = default_config(T, TOPK, E_TOTAL)
    c = [base]
    if T <= 512:
        c += [C(16, 64, 128, 64, 128, 4, 4, True), C(16, 32, 128, 32, 128, 4, 4), C(16, 64, 256, 64, 256, 4, 3)]
    else:
        c += [C(64, 128, 128, 128, 128, 8, 3, True), C(64, 256, 64, 256, 64, 8, 3), C(32, 64, 128, 64, 128, 4, 4)]
    out, seen = [], set()
    for x in c:
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out


class Humming:
    """humming-kernels indexed MoE GEMMs over the same compressed-tensors tensors (API read from its source)."""

    def __init__(self, w13p, w13s, w2p, w2s):
        from humming.layer import HummingLayer

        wcfg = dict(
            quant_method="compressed-tensors",
            format="pack-quantized",
            type="int",
            num_bits=4,
            strategy="group",
            group_size=32,
            symmetric=True,
        )
        self.l1 = HummingLayer(
            shape_n=2 * I, shape_k=H, weight_config=dict(wcfg), num_experts=E, torch_dtype=torch.bfloat16
        ).cuda()
        self.l2 = HummingLayer(
            shape_n=H, shape_k=I, weight_config=dict(wcfg), num_experts=E, torch_dtype=torch.bfloat16
        ).cuda()
        shp13 = torch.tensor([[2 * I, H]] * E, dtype=torch.int64)
        shp2 = torch.tensor([[H, I]] * E, dtype=torch.int64)
        self.l1.load_from_tensors({"weight_packed": w13p.clone(), "weight_scale": w13s.clone(), "weight_shape": shp13})
        self.l2.load_from_tensors({"weight_packed": w2p.clone(), "weight_scale": w2s.clone(), "weight_shape": shp2})
        self.l1.transform()
        self.l2.transform()
        self.cfg = {}

    def tuning(self, T):
        from humming.tune import get_heuristics_config

        if T not in self.cfg:
            m_local = max(1, T * TOPK * E // E_TOTAL)
            c1 = get_heuristics_config(self.l1.humming_config, shape_m=m_local, gemm_type="indexed")
            c2 = get_heuristics_config(self.l2.humming_config, shape_m=m_local, gemm_type="indexed")
            self.cfg[T] = (c1, c2)
        return self.cfg[T]

    def gemms(self, x, ids, T):
        c1, c2 = self.tuning(T)
        bm1, bm2 = c1["block_shape"][0], c2["block_shape"][0]
        a1 = moe_align(ids, E, OFFSET, bm1)
        a2 = a1 if bm2 == bm1 else moe_align(ids, E, OFFSET, bm2)
        cc = {"gemm_type": "indexed"}
        y1 = self.l1(
            x,
            sorted_ids=a1[0],
            expert_ids=a1[1],
            num_tokens_padded=a1[2].view(()),
            top_k=TOPK,
            compute_config=cc,
            tuning_config=c1,
        )  # [T*k, 2I]
        act = torch.nn.functional.silu(y1[:, :I]) * y1[:, I:]
        y2 = self.l2(
            act,
            sorted_ids=a2[0],
            expert_ids=a2[1],
            num_tokens_padded=a2[2].view(()),
            top_k=1,
            compute_config=cc,
            tuning_config=c2,
        )  # [T*k, H]
        return y2

    def forward(self, x, w, ids):
        y2 = self.gemms(x, ids, x.shape[0])
        out = torch.empty_like(x)
        combine_into(y2, w, ids, OFFSET, E, out)
        return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="8,64,256,2048")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-humming", action="store_true")
    args = ap.parse_args()
    require_gpu(ap.prog, _MISSING)
    date = datetime.date.today().isoformat()
    out_path = args.out or os.path.join(os.environ.get("OUT", "bench"), f"moe_int4_{date}.json")
    torch.manual_seed(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    res = {
        "what": "Triton W4A16 fused MoE vs humming-kernels indexed MoE GEMM, Kimi-K2 shapes",
        "date": date,
        "gpu": torch.cuda.get_device_name(),
        "sm_count": torch.cuda.get_device_properties(0).multi_processor_count,
        "versions": versions(),
        "shapes": {
            "H": H,
            "I": I,
            "local_experts": E,
            "total_experts": E_TOTAL,
            "top_k": TOPK,
            "expert_offset": OFFSET,
        },
        "conditions": "random pack-quantized weights (48 experts, 1.19 GB); NSETS=4 distinct (x, routing) sets "
        "cycled per call; triton.testing.do_bench median (L2 cleared before each call), warmup 50 ms, rep 300 ms; "
        "clocks as found (not locked)",
        "cases": [],
    }
    res["hbm_copy"] = copy_bandwidth()
    copy_bw = res["hbm_copy"]["GBps_read_plus_write"]
    print(f"copy bandwidth {copy_bw:.0f} GB/s (read+write)", flush=True)
    w13p, w13s, w2p, w2s = make_weights(gen)
    per_expert = expert_bytes(w13p, w13s, w2p, w2s)
    res["bytes_per_expert"] = per_expert
    hum = None
    if not args.no_humming:
        try:
            t0 = time.time()
            hum = Humming(w13p, w13s, w2p, w2s)
            res["humming_setup_s"] = time.time() - t0
        except Exception:
            res["humming_error"] = traceback.format_exc()
            print(res["humming_error"], flush=True)
    for T in [int(t) for t in args.tokens.split(",")]:
        sets = make_sets(T, gen)
        tl = [touched(s[2]) for s in sets]
        n_exp = sum(a for a, _ in tl) / len(tl)
        n_pairs = sum(b for _, b in tl) / len(tl)
        wbytes = n_exp * per_expert
        case = {
            "T": T,
            "local_pairs_mean": n_pairs,
            "experts_touched_mean": n_exp,
            "weight_bytes_touched": wbytes,
            "ours": [],
            "flops": 2 * n_pairs * (H * 2 * I + I * H),
        }
        # align alone (default block_m)
        cfg0 = default_config(T, TOPK, E_TOTAL)
        case["align_ms"] = bench(cycle(lambda x, w, ids: moe_align(ids, E, OFFSET, cfg0.block_m), sets))
        ref_out = None
        for cfg in configs_for(T):
            entry = {"config": cfg.__dict__}
            try:
                fn = lambda x, w, ids, cfg=cfg: fused_experts_int4(x, w13p, w13s, w2p, w2s, w, ids, OFFSET, config=cfg)
                o = fn(*sets[0])
                if ref_out is None:
                    ref_out = o.float()
                entry["rel_diff_vs_first_config"] = ((o.float() - ref_out).norm() / ref_out.norm()).item()
                ms = bench(cycle(fn, sets))
                entry["eager_ms"] = ms
                entry["weight_GBps"] = wbytes / ms / 1e6
                entry["frac_of_copy_bw"] = entry["weight_GBps"] / copy_bw
                entry["TFLOPs"] = case["flops"] / ms / 1e9
                try:
                    entry["graph_ms"] = graph_time(fn, sets)
                    entry["graph_weight_GBps"] = wbytes / entry["graph_ms"] / 1e6
                except Exception as e:
                    entry["graph_error"] = repr(e)
            except Exception:
                entry["error"] = traceback.format_exc()[-2000:]
            case["ours"].append(entry)
            print(T, json.dumps(entry)[:400], flush=True)
        if hum is not None:
            h = {}
            try:
                c1, c2 = hum.tuning(T)
                h["tuning"] = [c1, c2]
                o = hum.forward(*sets[0])
                if ref_out is not None:
                    h["rel_diff_vs_ours"] = ((o.float() - ref_out).norm() / ref_out.norm()).item()
                ms = bench(cycle(lambda x, w, ids: hum.gemms(x, ids, T), sets))
                h["gemms_plus_glue_ms"] = ms  # align + 2 GEMMs + silu*up in torch (no combine)
                h["weight_GBps"] = wbytes / ms / 1e6
                h["full_ms"] = bench(cycle(hum.forward, sets))
                try:
                    h["full_graph_ms"] = graph_time(hum.forward, sets)
                except Exception as e:
                    h["graph_error"] = repr(e)
            except Exception:
                h["error"] = traceback.format_exc()[-3000:]
            case["humming"] = h
            print(T, "humming", json.dumps(h, default=str)[:1500], flush=True)
        res["cases"].append(case)
        del sets
    os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1, default=str)
    print("\nT    pairs  experts  best_ours_ms(graph)  GB/s   humming_ms(full)  copy_bw", flush=True)
    for c in res["cases"]:
        ok = [o for o in c["ours"] if "eager_ms" in o]
        best = min(ok, key=lambda o: o.get("graph_ms", o["eager_ms"])) if ok else {}
        bt = best.get("graph_ms", best.get("eager_ms", float("nan")))
        hm = c.get("humming", {}).get("full_graph_ms", c.get("humming", {}).get("full_ms", float("nan")))
        print(
            f"{c['T']:5d} {c['local_pairs_mean']:6.0f} {c['experts_touched_mean']:6.1f} {bt:10.4f} "
            f"{c['weight_bytes_touched'] / bt / 1e6 if bt == bt else 0:8.0f} {hm:10.4f} {copy_bw:8.0f}"
        )


if __name__ == "__main__":
    main()
