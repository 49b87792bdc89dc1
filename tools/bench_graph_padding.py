"""Decode CUDA graphs of a padded bucket: padding rows routed to no expert (main) against routed like real rows.

A batch of B sequences replays the graph of the smallest bucket >= B (kimi/worker/cuda_graph.py); rows [B, bucket)
are padding (token 0 at position 0 over the null block). Before, the MoE router gave them experts like any row, so
the expert GEMMs read up to top_k more experts per layer than the batch needs. Now the graph's static `row_valid`
row marks them and the router writes id -1 / weight 0 for them (kimi.ops.fused.router_topk).

The model: the preset's config (default Kimi-K2.6) cut to --layers layers, random weights generated on the GPU
(`--load-format dummy`), EP 1: every routed expert on this GPU, real routing by the model's router (unlike
tools/bench_decode.py's fixed emulated routing, where the padding would not matter). Graphs for every bucket up to
--max-bs, FlashInfer MLA decode over --ctx tokens per sequence.

Per batch size B: one `run_host` stages the batch (with `CudaGraphRunner.mask_padding` on or off), then the bucket's
graph replay alone is timed (CUDA events, the GPU time of the replay; the attention schedule is the one run_host
left). --rounds interleaved rounds, the order alternating. Recorded per B: bucket, padding rows, the median replay
time of each mode and the median over rounds of (unmasked - masked), the distinct experts each MoE layer's routing
used in each mode (read from the graph's own routing tensors after the replay), whether the batch rows' hidden
outputs are bit-equal between the modes, and the SM clock during the timings.

Usage: python tools/bench_graph_padding.py --layers 6 --batches 3,5,12,20,40 --out bench/graph_padding_DATE.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from bench_util import GpuSampler, event_times, require_gpu, run_header  # tools/, this script's folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="kimi-k2.6")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batches", default="1,3,5,7,12,20,28,40,56")
    ap.add_argument("--max-bs", type=int, default=64, help="largest CUDA graph bucket")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--moe-backend", default="auto")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    require_gpu(ap.prog)

    from kimi.config import ModelConfig
    from kimi.presets import load_preset
    from kimi.worker import gpu_model
    from kimi.worker.gpu_model import load_gpu_model
    from kimi.worker.kv_cache import allocate_kv_caches

    dev = torch.device("cuda", torch.cuda.current_device())
    res = run_header(__doc__.split("\n")[0], args)
    batches = [int(b) for b in args.batches.split(",")]
    if not batches or min(batches) < 1 or max(batches) > args.max_bs:
        raise SystemExit(f"--batches must lie in [1, --max-bs = {args.max_bs}]")
    cfg = ModelConfig.from_dict(load_preset(args.preset)).with_overrides(num_hidden_layers=args.layers)
    t0 = time.time()
    model = load_gpu_model(
        "",
        cfg,
        dtype=torch.bfloat16,
        device=dev,
        moe_backend=args.moe_backend,
        load_format="dummy",
        max_positions=args.ctx + 64,
    )
    torch.cuda.synchronize()
    res["load_s"] = round(time.time() - t0, 1)
    bs = args.block_size
    nblk = -(-(args.ctx + 1) // bs)
    kv = allocate_kv_caches(cfg, args.max_bs * nblk + 1, bs, torch.bfloat16, dev)
    g = torch.Generator(device=dev).manual_seed(1)
    for c in kv:
        c.normal_(0, 1, generator=g)

    routing: list[torch.Tensor] = []  # the routing ids each captured MoE layer writes, in capture order
    real_run_experts = gpu_model.run_experts

    def recording(impl, recv):
        if torch.cuda.is_current_stream_capturing():
            routing.append(recv.topk_ids)  # kept alive: the graph pool never hands its memory to another tensor
        return real_run_experts(impl, recv)

    gpu_model.run_experts = recording
    try:
        model.capture_cuda_graphs(kv, bs, args.max_bs, nblk)
    finally:
        gpu_model.run_experts = real_run_experts
    runner = model.graphs
    if runner is None:
        raise SystemExit("no CUDA graphs were captured (see the log)")
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    order = sorted(runner.buckets, reverse=True)  # capture order
    ids_of = {b: routing[i * n_moe : (i + 1) * n_moe] for i, b in enumerate(order)}
    res.update(buckets=runner.buckets, moe_layers=n_moe, experts=cfg.n_routed_experts, cases=[])
    sampler = GpuSampler(dev).start()
    gen = torch.Generator().manual_seed(0)
    perm = (torch.randperm(args.max_bs * nblk, generator=gen) + 1).tolist()
    try:
        with torch.inference_mode():
            for B in batches:
                bucket = runner.bucket_for(B)
                tabs = [perm[i * nblk : (i + 1) * nblk] for i in range(B)]
                lens = [args.ctx] * B
                tok = torch.randint(0, cfg.vocab_size, (B,), generator=gen).tolist()
                case = {"batch": B, "bucket": bucket, "padding_rows": bucket - B}

                def stage(mask: bool) -> torch.Tensor:
                    runner.mask_padding = mask
                    h = model.forward_decode(tok, [n - 1 for n in lens], lens, tabs, bs, kv)
                    torch.cuda.synchronize()
                    return h.clone()

                outs, experts = {}, {}
                for mask in (True, False):
                    outs[mask] = stage(mask)
                    experts[mask] = [int(torch.unique(t[t >= 0]).numel()) for t in ids_of[bucket]]
                case["bit_equal_batch_rows"] = bool(torch.equal(outs[True], outs[False]))
                case["experts_per_layer"] = {"masked": experts[True], "unmasked": experts[False]}
                rounds = {True: [], False: []}
                spans = []
                for r in range(args.rounds):
                    for mask in (True, False) if r % 2 == 0 else (False, True):
                        stage(mask)
                        s0 = time.time()
                        rounds[mask].append(statistics.median(event_times(lambda: runner.replay(bucket), args.iters)))
                        spans.append((s0, time.time()))
                runner.mask_padding = True
                case["replay_ms"] = {
                    "masked": statistics.median(rounds[True]),
                    "unmasked": statistics.median(rounds[False]),
                }
                case["round_medians_ms"] = {"masked": rounds[True], "unmasked": rounds[False]}
                case["unmasked_minus_masked_ms"] = statistics.median(u - m for u, m in zip(rounds[False], rounds[True]))
                case["gpu_clock"] = sampler.windows(spans)
                res["cases"].append(case)
                print(
                    f"B={B} bucket {bucket}: replay {case['replay_ms']['masked']:.3f} ms masked, "
                    f"{case['replay_ms']['unmasked']:.3f} unmasked (paired {case['unmasked_minus_masked_ms']:+.3f}); "
                    f"experts/layer {statistics.mean(experts[True]):.1f} vs {statistics.mean(experts[False]):.1f}; "
                    f"bit-equal {case['bit_equal_batch_rows']}",
                    flush=True,
                )
    finally:
        sampler.stop()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
