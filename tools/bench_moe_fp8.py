"""FP8 routed experts (K2-Instruct) on one GPU: humming's W8A16 indexed GEMMs (kimi.backends.experts.HummingFp8Experts)
against the fallback path of FP8 experts (dequantised to bf16 on load, `RefExperts`: the other backends, or an
expert width humming cannot tile), with the INT4 humming backend of K2.6 at the same shapes for scale.

Shapes: the real Kimi experts (D 7168, I 2048), 48 local of 384 (EP rank 2 of 8), top-8. Weights: random FP8
(kimi.model.weights.random_fp8_experts: N(0, 1) e4m3 values, float32 128 x 128 tile scales) and random packed
INT4 (random_packed_experts). For each T in --tokens, NSETS distinct (x, routing) sets; each timed call takes the
next set. Timer: triton.testing.do_bench (L2 cleared before every call), median. humming runs as CUDA-graph replays
(one graph per set: what the decode step does); RefExperts eagerly (it reads expert counts on the host and cannot be
captured). Correctness of every output against the RefExperts of the
same FP8 weights: max |y - ref| / max |ref|.

Bytes: the distinct local experts hit (mean over the sets) times the bytes each backend holds per expert (FP8:
weights + humming's bf16 group scales; INT4: packed words + scales; bf16 for RefExperts); GB/s against the measured
copy bandwidth (a 4 GiB device-to-device copy, read + write counted).

Usage: python tools/bench_moe_fp8.py [--tokens 8,64,256,2048] [--out F] [--snapshot]
Snapshot: moe-fp8.json (moe-fp8_custom for other tokens or --no-ref).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kimi.backends.experts import make_experts
from kimi.benchmarks import snapshot
from kimi.benchmarks.gpu import copy_bandwidth, import_gpu_module, require_gpu
from kimi.model.weights import random_fp8_experts, random_packed_experts

triton, _MISSING = import_gpu_module("triton.testing")  # --help without Triton; a run stops in require_gpu

D, INTER, E, E_TOTAL, TOPK, OFFSET = 7168, 2048, 48, 384, 8, 96
NSETS = 4


def held_bytes(module) -> int:
    """Bytes of a backend's expert tensors (humming's stream-K 'locks' buffers excluded)."""
    return sum(t.numel() * t.element_size() for n, t in module.state_dict().items() if not n.endswith("locks"))


DEFAULT_TOKENS = "8,64,256,2048"


def summarize(res: dict) -> dict:
    """The snapshot's table: per step size, humming's FP8 experts against the dequantised bf16 fallback, and
    humming's INT4 experts (K2.6) at the same shapes for scale."""

    def us(c: dict, k: str) -> float | None:
        return round(c[k]["ms"] * 1e3, 1) if k in c else None

    rows = [
        [
            c["T"],
            round(c["experts_hit_mean"], 1),
            us(c, "humming_fp8"),
            round(100 * c["humming_fp8"]["frac_copy"]),
            round(c["humming_fp8"]["rel_err_vs_ref"], 4) if "rel_err_vs_ref" in c["humming_fp8"] else None,
            us(c, "ref_bf16_eager"),
            us(c, "humming_int4"),
        ]
        for c in res["cases"]
    ]
    return {
        "columns": [
            "MoE tokens",
            "experts hit",
            "humming FP8 (us)",
            "FP8, % of copy",
            "FP8 rel. error vs dequantised",
            "dequantised bf16, eager (us)",
            "humming INT4 (us)",
        ],
        "rows": rows,
        "notes": [f"48 local of 384 experts, top-8; copy bandwidth {res['copy_GBps']:.0f} GB/s"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=snapshot.HelpFormatter)
    ap.add_argument("--tokens", default=DEFAULT_TOKENS, help="MoE tokens of one step (comma list)")
    ap.add_argument("--no-ref", action="store_true", help="skip the dequantised bf16 RefExperts timing")
    ap.add_argument("--out", default=None, help="write the full JSON result here")
    snapshot.add_arguments(ap)
    args = ap.parse_args()
    require_gpu(ap.prog, _MISSING)
    dev = torch.device("cuda")
    res: dict = {"what": __doc__.split("\n")[0], "args": vars(args)}
    res["copy_GBps"] = bw = copy_bandwidth(4 << 30, dev)["GBps_read_plus_write"]
    gen = torch.Generator(device=dev).manual_seed(0)
    w13, s13 = random_fp8_experts(E, 2 * INTER, D, gen, dev)
    w2, s2 = random_fp8_experts(E, D, INTER, gen, dev)
    parts = {"w13_fp8": w13, "w13_scale_inv": s13, "w2_fp8": w2, "w2_scale_inv": s2}
    del w13, s13, w2, s2
    t0 = time.time()
    fp8 = make_experts("humming", {k: v.clone() for k, v in parts.items()}, OFFSET, E_TOTAL, torch.bfloat16)
    res["fp8_setup_s"] = time.time() - t0
    ref = None
    if not args.no_ref:
        ref = make_experts("ref", {k: v.clone() for k, v in parts.items()}, OFFSET, E_TOTAL, torch.bfloat16)
    del parts
    p13, q13 = random_packed_experts(E, 2 * INTER, D, gen, dev)
    p2, q2 = random_packed_experts(E, D, INTER, gen, dev)
    int4 = make_experts(
        "humming",
        {"w13_packed": p13, "w13_scale": q13, "w2_packed": p2, "w2_scale": q2},
        OFFSET,
        E_TOTAL,
        torch.bfloat16,
    )
    del p13, q13, p2, q2
    torch.cuda.empty_cache()
    per_expert = {"humming_fp8": held_bytes(fp8) / E, "humming_int4": held_bytes(int4) / E}
    if ref is not None:
        per_expert["ref_bf16"] = held_bytes(ref) / E
    res["bytes_per_expert"] = per_expert
    print(
        f"copy {bw:.0f} GB/s; bytes per expert {json.dumps({k: round(v) for k, v in per_expert.items()})}", flush=True
    )
    res["cases"] = []
    for T in [int(t) for t in args.tokens.split(",")]:
        g = torch.Generator(device=dev).manual_seed(T)
        sets = []
        for _ in range(NSETS):
            x = torch.randn((T, D), generator=g, device=dev).to(torch.bfloat16)
            ids = torch.rand((T, E_TOTAL), generator=g, device=dev).topk(TOPK, dim=-1).indices
            w = torch.rand((T, TOPK), generator=g, device=dev)
            sets.append((x, w, ids))
        hit = statistics.mean(int(torch.unique(i[(i >= OFFSET) & (i < OFFSET + E)]).numel()) for _, _, i in sets)
        case = {"T": T, "experts_hit_mean": hit}
        want = [ref(*s).float() for s in sets] if ref is not None else None
        for name, mod in (("humming_fp8", fp8), ("humming_int4", int4)):
            outs, graphs = [], []
            for s in sets:
                mod(*s)  # schedules chosen and kernels compiled outside the capture
                torch.cuda.synchronize()
                o = torch.empty((T, D), dtype=torch.bfloat16, device=dev)
                gr = torch.cuda.CUDAGraph()
                with torch.cuda.graph(gr):
                    o.copy_(mod(*s))
                graphs.append(gr)
                outs.append(o)
            it = iter(range(1 << 30))
            ms = triton.testing.do_bench(
                lambda gs=graphs, it=it: gs[next(it) % NSETS].replay(), warmup=50, rep=300, return_mode="median"
            )
            nbytes = hit * per_expert[name]
            case[name] = {"ms": ms, "GBps": nbytes / ms / 1e6, "frac_copy": nbytes / ms / 1e6 / bw}
            if want is not None and name == "humming_fp8":
                for gr in graphs:
                    gr.replay()
                torch.cuda.synchronize()
                case[name]["rel_err_vs_ref"] = max(
                    ((o.float() - r).abs().max() / r.abs().max()).item() for o, r in zip(outs, want)
                )
            del graphs, outs
        if ref is not None:
            it = iter(range(1 << 30))
            ms = triton.testing.do_bench(
                lambda sets=sets, it=it: ref(*sets[next(it) % NSETS]), warmup=50, rep=300, return_mode="median"
            )
            nbytes = hit * per_expert["ref_bf16"]
            case["ref_bf16_eager"] = {"ms": ms, "GBps": nbytes / ms / 1e6, "frac_copy": nbytes / ms / 1e6 / bw}
        res["cases"].append(case)
        print(
            f"T={T}: experts hit {hit:.1f}; "
            + "; ".join(
                f"{k} {v['ms'] * 1e3:.1f} us {v['GBps']:.0f} GB/s ({100 * v['frac_copy']:.0f}% of copy)"
                + (f" err {v['rel_err_vs_ref']:.2g}" if "rel_err_vs_ref" in v else "")
                for k, v in case.items()
                if isinstance(v, dict)
            ),
            flush=True,
        )
    res["conditions"] = conds = snapshot.conditions(copy_GBps=bw)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    if args.snapshot:
        snapshot.write(
            args.snapshot,
            benchmark="moe-fp8",
            config="" if args.tokens == DEFAULT_TOKENS and not args.no_ref else "custom",
            summary=summarize(res),
            results=res,
            conds=conds,
        )


if __name__ == "__main__":
    main()
