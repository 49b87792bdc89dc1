"""Benchmark FlashInfer MLA decode (kimi.ops.attention_flashinfer.FlashInferMLADecode) on kimi's cache layout.

Per batch size B in --batch (all requests at --ctx tokens of context, 64 heads, 512+64 latent, block_size 64,
blocks scattered by a random permutation): time `run()` (plan excluded; plan's host time reported apart) with
  (a) kimi's one buffer [num_blocks, 64, 576] passed as two strided views ([..., :512], [..., 512:]),
  (b) two separate contiguous buffers (FlashInfer's native layout) with the same contents,
  (c) (a) replayed from a CUDA graph (wrapper built with use_cuda_graph=True).
Median of triton.testing.do_bench (L2 cleared before each call). Also checks (a) against
kimi.ops.attention.mla_decode_ref. Bytes = KV read (B * ctx * 576 * 2) + q + o.
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
from bench_util import require_gpu

# GPU packages: a CPU-only install still gets --help; main() then exits with one line (bench_util.require_gpu)
_MISSING = None
try:
    import triton.testing

    from kimi.ops.attention_flashinfer import FlashInferMLADecode
except ImportError as _e:
    _MISSING = _e

HEADS, L, R, BS = 64, 512, 64, 64
SCALE = 0.130861


def bench(fn):
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="8,64,128")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--backend", default="fa3", help="FlashInfer MLA backend: fa3 (kimi's default), fa2, auto")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    require_gpu(ap.prog, _MISSING)
    date = datetime.date.today().isoformat()
    out_path = args.out or os.path.join(os.environ.get("OUT", "bench"), f"mla_flashinfer_{date}.json")
    import flashinfer

    res = {
        "what": "FlashInfer BatchMLAPagedAttentionWrapper (fa3) decode over kimi's latent cache",
        "date": date,
        "gpu": torch.cuda.get_device_name(),
        "versions": {"torch": torch.__version__, "flashinfer": flashinfer.__version__, "cuda": torch.version.cuda},
        "shape": {
            "heads": HEADS,
            "kv_lora_rank": L,
            "rope_dim": R,
            "block_size": BS,
            "ctx": args.ctx,
            "dtype": "bf16",
            "backend": args.backend,
        },
        "conditions": "every request at ctx tokens; blocks randomly permuted; do_bench median (L2 cleared), "
        "warmup 50 ms, rep 300 ms; clocks as found",
        "cases": [],
    }
    from kimi.ops.attention import mla_decode_ref

    gen = torch.Generator(device="cuda").manual_seed(0)
    for B in [int(b) for b in args.batch.split(",")]:
        case = {"B": B}
        try:
            nb = args.ctx // BS
            num_blocks = B * nb + 1
            perm = torch.randperm(num_blocks - 1, device="cuda", generator=gen) + 1
            bt = perm.view(B, nb).to(torch.int64)
            kv = torch.randn(num_blocks, BS, L + R, device="cuda", generator=gen).to(torch.bfloat16)
            q_lat = torch.randn(B, HEADS, L, device="cuda", generator=gen).to(torch.bfloat16)
            q_pe = torch.randn(B, HEADS, R, device="cuda", generator=gen).to(torch.bfloat16)
            seq = [args.ctx] * B
            m = FlashInferMLADecode(HEADS, SCALE, backend=args.backend)
            t0 = time.perf_counter()
            m.plan(seq, bt, BS)
            torch.cuda.synchronize()
            case["first_plan_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            for _ in range(20):
                m.plan(seq, bt, BS)
            torch.cuda.synchronize()
            case["plan_host_ms"] = (time.perf_counter() - t0) / 20 * 1e3
            out = torch.full((B, HEADS, L), float("nan"), dtype=torch.bfloat16, device="cuda")
            m.run(q_lat, q_pe, kv, out=out)
            ref = mla_decode_ref(q_lat, q_pe, kv, bt, torch.tensor(seq, device="cuda"), SCALE)
            case["rel_err_views"] = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
            case["nan_in_out"] = bool(torch.isnan(out).any())
            kv_bytes = B * args.ctx * (L + R) * 2
            io_bytes = B * HEADS * (L + R) * 2 + B * HEADS * L * 2
            case["bytes"] = kv_bytes + io_bytes
            case["views_us"] = bench(lambda: m.run(q_lat, q_pe, kv, out=out)) * 1e3
            ckv = kv[..., :L].contiguous()
            kpe = kv[..., L:].contiguous()
            out2 = torch.empty_like(out)
            case["separate_us"] = bench(lambda: m.wrapper.run(q_lat, q_pe, ckv, kpe, out=out2)) * 1e3
            case["separate_vs_views_maxdiff"] = (out2.float() - out.float()).abs().max().item()
            del ckv, kpe
            try:
                mg = FlashInferMLADecode(
                    HEADS, SCALE, backend=args.backend, use_cuda_graph=True, max_batch=B, max_pages=B * nb
                )
                mg.plan(seq, bt, BS)
                out3 = torch.empty_like(out)
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    mg.run(q_lat, q_pe, kv, out=out3)
                torch.cuda.current_stream().wait_stream(s)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    mg.run(q_lat, q_pe, kv, out=out3)
                out3.fill_(float("nan"))
                g.replay()
                torch.cuda.synchronize()
                case["graph_rel_err"] = ((out3.double() - ref.double()).norm() / ref.double().norm()).item()
                case["graph_us"] = bench(g.replay) * 1e3
            except Exception as e:
                case["graph_error"] = repr(e)[-1500:]
            case["views_GBps"] = case["bytes"] / case["views_us"] / 1e3
        except Exception:
            case["error"] = traceback.format_exc()[-3000:]
        print(json.dumps(case), flush=True)
        res["cases"].append(case)
    os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
