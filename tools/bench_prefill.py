"""Prefill steps of one rank of Kimi-K2.6 under DP8 x EP8, emulated on one GPU (kimi/model/gpu_forward.py).

The rank is the decode benchmark's (tools/bench_decode.py): the real K2.6 text config, all 61 layers at full width,
random weights generated on the GPU (`--load-format dummy`), EP rank 0 of 8 with its 48 local INT4 experts per MoE
layer. Each step prefills --chunk new tokens on this rank (the server's --token-budget, default 2048), and every
other rank does the same: the MoE of each layer sees 8 x chunk tokens, routed to top-8 of 384 experts by fixed random
routing drawn per layer (kimi.benchmarks.emulated_rank.EmulatedEP, per_layer), and computes the pairs that land on
the 48 local experts. No communication is timed (single GPU).

Cases (`--cases`, comma list):
  NxL   N prompts of L tokens in one step (N * L = chunk), no cached context;
  L     one prompt of L tokens, prefilled in chunks of --chunk new tokens (chunked prefill, each chunk attending to
        the cached ones): a step per chunk; their sum is the prompt's prefill time (its TTFT less scheduling and
        sampling, on a rank whose peers are prefilling too).
Step = forward of the step's tokens (eager: prefill does not replay CUDA graphs) + lm_head on the last token of every
prompt that ends in the step + argmax. Timed with CUDA events, median of --iters steps after 2 warm-up steps.

FLOPs counted (multiply-add = 2):
  dense: 2 x (every non-expert 2-D weight the step's tokens multiply, layer 0's dense MLP, the absorbed MLA's
         per-head W_UK / W_UV (kv_b), router, shared expert) per token; lm_head per prompt ending in the step;
  experts: 2 x (gate_up 4096 x 7168 + down 7168 x 2048) per local (token, expert) pair of the drawn routing;
  attention as the GPU path runs it (FlashInfer's MLA kernel in the latent space): 2 x heads x (576 + 512) per
         (query, key) pair, causal; `attention_nonabsorbed_flops` gives the same pairs at 2 x heads x (192 + 128),
         the cost of a 192/128 ragged prefill kernel, for comparison.
Ceiling: bf16 matmul TFLOPS measured in the same run (torch.matmul 8192^3, the best of 20 calls); `tflops` /
`matmul_tflops` is the step's fraction of it. Floor of a step: the larger of its FLOPs at that matmul rate and its
bytes at the measured HBM copy bandwidth (4 GiB device copy): every non-expert weight, each local expert the routing
hits and lm_head (when a prompt ends) read once, the step's KV written and its cached context's KV read.
--idle-peers: the other ranks send nothing, so the MoE sees only this rank's tokens (one prompt on a quiet server:
`--chunk 1024 --cases 1024 --idle-peers` is a lone 1024-token prompt's prefill). Per-op breakdown: torch.profiler
kernel time of one step by class (kimi.benchmarks.emulated_rank.KERNEL_CLASSES); its `kernel_sum_ms` below the step
time is time the GPU idles (host launches, host waits). --sync-debug: where a step makes the host wait for the device
(`syncs`) and a cProfile of one step's host time (`host_profile`). --graph: each step also captured as one CUDA
graph and timed by replay (`graph_ms`), as kimi serve's prefill graphs run it on one rank: with their fresh-step
graphs on (kimi.worker.prefill_graph.FRESH_MHA_GRAPHS, off by default) or `--graph-attention mha`, a step of fresh
prompts only, of at least MHA_MIN_BUCKET rows, in the non-absorbed form (`graph_attention` "mha"; its floor
`graph_floor_ms` counts that form's attention FLOPs, 2 x heads x (192 + 128) per pair: the up-projection GEMM it adds
is as large as the absorbed form's W_UK / W_UV products it drops), any other step with the absorbed MLA kernel
("mla", floor as the eager step's). `--graph-attention mla` forces the absorbed form.

--prefill-attention mha: the rows of fresh prompt chunks run non-absorbed (kimi.backends.attention.flashinfer.
set_prefill_attention); the FLOP counts and the floor stay those of the absorbed form, so the two choices' floors are
equal and their times compare directly (`attention_nonabsorbed_flops` is the mha path's attention work).

Usage: python tools/bench_prefill.py [--cases 16x128,2048,8192] [--chunk 2048] [--snapshot]

Snapshot (--snapshot): prefill_<config>.json, config "int4-ep8-chunk2048" and whatever else differs from the
headline run (layers, backend, preset, prefill attention).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kimi.backends.attention.flashinfer import PREFILL_ATTENTION_CHOICES, set_prefill_attention
from kimi.backends.experts import BACKENDS
from kimi.benchmarks import snapshot
from kimi.benchmarks.emulated_rank import (
    EmulatedEP,
    breakdown,
    bytes_per_expert,
    capture_forward,
    dense_weight_bytes,
    time_ms,
)
from kimi.benchmarks.gpu import copy_bandwidth, require_gpu, sync_points


def matmul_tflops(dev, n: int = 8192, iters: int = 20) -> float:
    """Best bf16 torch.matmul TFLOPS of an n x n x n product over `iters` timed calls."""
    a = torch.randn((n, n), device=dev, dtype=torch.bfloat16)
    b = torch.randn((n, n), device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        e.synchronize()
        best = min(best, s.elapsed_time(e))
    return 2 * n**3 / (best * 1e-3) / 1e12


def parse_cases(spec: str, chunk: int) -> list[dict]:
    """'16x128,8192' -> [{"name", "prompts": [len, ...], "steps": [(query_lens, context_before), ...]}, ...].
    Raises ValueError for a batch case whose tokens are not `chunk`, a prompt that is not a multiple of `chunk`,
    or a malformed entry."""
    out = []
    for c in [c for c in spec.split(",") if c]:
        if "x" in c:
            n, L = (int(v) for v in c.split("x"))
            if n * L != chunk:
                raise ValueError(f"case {c}: {n} x {L} = {n * L} tokens, the chunk is {chunk}")
            out.append({"name": c, "prompts": [L] * n, "steps": [([L] * n, [0] * n)]})
        else:
            L = int(c)
            if L < 1 or L % chunk:
                # the emulated peers send a full chunk every step, so every step of this rank is a full chunk too
                raise ValueError(f"case {c}: a prompt length must be a positive multiple of the chunk {chunk}")
            steps = [([min(chunk, L - p)], [p]) for p in range(0, L, chunk)]
            out.append({"name": c, "prompts": [L], "steps": steps})
    return out


def config_name(args: argparse.Namespace) -> str:
    """The snapshot configuration: EP size and chunk, then whatever differs from the headline run."""
    parts = [f"int4-ep{args.ep_size}-chunk{args.chunk}"]
    if args.idle_peers:
        parts.append("idle-peers")
    if args.layers != 61:
        parts.append(f"L{args.layers}")
    if args.moe_backend != "auto":
        parts.append(args.moe_backend)
    if args.preset != "kimi-k2.6":
        parts.append(args.preset)
    if args.prefill_attention != "mla":
        parts.append(f"prefill-{args.prefill_attention}")
    if args.graph and args.graph_attention != "auto":
        parts.append(f"graph-{args.graph_attention}")
    return "-".join(parts)


def summarize(res: dict) -> dict:
    """The snapshot's table: per case its steps' times, TFLOPS (and fraction of the matmul rate) and new tokens/s;
    with --graph, the steps' times as CUDA graphs, their attention form, and their sum over the floor of that form."""
    rows = []
    graphs = any("graph_ms" in s for c in res["cases"] for s in c["steps"])  # --graph
    for c in res["cases"]:
        st = c["steps"]
        tf = [s["tflops"] for s in st]
        frac = [s["fraction_of_matmul"] for s in st]
        toks = sum(s["tokens"] for s in st)
        rows.append(
            [
                c["name"],
                len(st),
                " + ".join(f"{s['median_ms']:.1f}" for s in st),
                round(c["prefill_ms"], 1),
                round(c["floor_ms"], 1) if "floor_ms" in c else None,
                round(c["prefill_ms"] / c["floor_ms"], 2) if "floor_ms" in c else None,
                f"{min(tf):.0f}" if len(st) == 1 else f"{min(tf):.0f}-{max(tf):.0f}",
                f"{min(frac):.2f}" if len(st) == 1 else f"{min(frac):.2f}-{max(frac):.2f}",
                round(toks / (c["prefill_ms"] * 1e-3)),
            ]
        )
        if graphs:
            g = [s.get("graph_ms") for s in st]
            gf = [s.get("graph_floor_ms", s.get("floor_ms")) for s in st]
            ok = None not in g and None not in gf
            rows[-1].append(" + ".join(f"{x:.1f}" for x in g) if ok else None)
            rows[-1].append(" + ".join(s.get("graph_attention", "mla") for s in st))
            rows[-1].append(round(sum(gf), 1) if ok else None)
            rows[-1].append(round(sum(g) / sum(gf), 2) if ok else None)
    return {
        "columns": [
            "case",
            "steps",
            "step times (ms)",
            "prefill (ms)",
            "floor (ms)",
            "prefill / floor",
            "TFLOPS",
            "of matmul",
            "new tokens/s",
        ]
        + (["as CUDA graphs (ms)", "graph attention", "graph floor (ms)", "graphs / floor"] if graphs else []),
        "rows": rows,
        "notes": [
            f"bf16 matmul {res['matmul_tflops']:.0f} TFLOPS in the same run (the ceiling)"
            + (f", copy {res['copy_GBps']:.0f} GB/s" if "copy_GBps" in res else "")
        ],
    }


def graph_attention(cfg, qlens: list[int], slens: list[int], force: str) -> str:
    """The attention form kimi serve's prefill graphs give this step (force "auto"), or with force "mha" their
    fresh-step graphs: "mha" for fresh sequences only (qlens == slens) of at least MHA_MIN_BUCKET rows when the head
    dims have FlashInfer's ragged kernel and the fresh-step graphs are on (FRESH_MHA_GRAPHS, or force "mha"), else
    "mla"; force "mla" keeps the absorbed form."""
    from kimi.backends.attention.flashinfer import MHA_HEAD_DIMS
    from kimi.worker.prefill_graph import FRESH_MHA_GRAPHS, MHA_MIN_BUCKET

    heads_ok = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim) == MHA_HEAD_DIMS
    fresh = qlens == slens and sum(qlens) >= MHA_MIN_BUCKET
    on = force == "mha" or (force == "auto" and FRESH_MHA_GRAPHS)
    return "mha" if on and heads_ok and fresh else "mla"


def graph_step_ms(model, kv, cfg, ids, pos, qlens, slens, tabs, bs, last, iters: int, form: str = "mla") -> float:
    """--graph: the step (one causal FlashInfer plan over its sequences, made once with fixed index buffers: the MLA
    kernel's, or with form "mha" the ragged prefill's as the fresh-step graphs plan it; the forward, the logits and
    argmax of the prompts that end) captured as one CUDA graph; median ms of `iters` replays (CUDA events, each after
    the last one ended). The EmulatedEP routing is drawn per layer as in the eager step."""
    from kimi.backends.attention.base import AttentionPlan
    from kimi.backends.attention.flashinfer import FlashInferMHAPrefill, FlashInferMLA
    from kimi.model.attention import build_attention_metadata

    a = build_attention_metadata(qlens, slens, tabs, bs, ids.device)
    fi = FlashInferMLA.for_model(
        cfg,
        ids.device,
        use_cuda_graph=True,
        max_batch=len(qlens),
        max_pages=sum(-(-s // bs) for s in slens),
    )
    if form == "mha":
        mha = FlashInferMHAPrefill(
            cfg.num_attention_heads,
            cfg.softmax_scale,
            fi.workspace,
            cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
            cfg.v_head_dim,
            use_cuda_graph=True,
            max_batch=len(qlens) + 1,
        )
        mha.plan_padded(qlens, sum(qlens))
        a.plan = AttentionPlan(None, a.slot_mapping, False, prefill_run=mha)
    else:
        fi.plan(qlens, slens, a.block_tables, bs, causal=True)
        a.plan = AttentionPlan(fi, a.slot_mapping, False)
    for layer in model.layers:
        if hasattr(layer.mlp, "a2a"):
            layer.mlp.a2a.i = 0
    g, _ = capture_forward(model, kv, ids, pos, a, logit_rows=last if last.numel() else None)
    t = time_ms(g.replay, iters, warmup=2)["median_ms"]
    del g
    torch.cuda.empty_cache()
    return t


def host_profile(step, top: int = 25) -> str:
    """cProfile of one call of step after a device sync, ended by another (so time the host waits for the device
    shows in the waiting call): the `top` functions by own time."""
    import cProfile
    import io
    import pstats

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    step()
    torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=snapshot.HelpFormatter)
    ap.add_argument("--preset", default="kimi-k2.6", help="model preset (kimi/presets)")
    ap.add_argument("--layers", type=int, default=61, help="layers of the model (61: all of K2's)")
    ap.add_argument("--ep-size", type=int, default=8, help="EP ranks emulated (this rank holds 1 / ep-size experts)")
    ap.add_argument(
        "--moe-backend", default="auto", choices=BACKENDS, help="routed-expert backend, as kimi serve's flag"
    )
    ap.add_argument("--block-size", type=int, default=64, help="KV cache block size (tokens)")
    ap.add_argument("--chunk", type=int, default=2048, help="new tokens per step on this rank (--token-budget)")
    ap.add_argument("--cases", default="16x128,2048,8192", help="comma list of NxL (N prompts of L) or L (chunked)")
    ap.add_argument(
        "--idle-peers",
        action="store_true",
        help="the other ranks send no tokens: the MoE sees only this rank's (a lone prompt's TTFT on a quiet server)",
    )
    ap.add_argument(
        "--prefill-attention",
        default="mla",
        choices=PREFILL_ATTENTION_CHOICES,
        help="fresh prompt chunks: absorbed MLA kernel (mla) or non-absorbed 192/128 ragged prefill (mha)",
    )
    ap.add_argument("--iters", type=int, default=5, help="timed steps per step of a case")
    ap.add_argument("--no-profile", action="store_true", help="skip the per-kernel breakdown of each step")
    ap.add_argument(
        "--graph",
        action="store_true",
        help="also each step captured as one CUDA graph and timed by replay (`graph_ms`: the step without its host "
        "launches, as kimi serve's prefill graphs run it on one rank)",
    )
    ap.add_argument(
        "--graph-attention",
        default="auto",
        choices=("auto", "mha", "mla"),
        help="--graph's attention: as the server's prefill graphs (auto), their fresh-step graphs on (mha: "
        "non-absorbed for fresh prompts only from MHA_MIN_BUCKET rows), or the absorbed MLA kernel for every step",
    )
    ap.add_argument(
        "--sync-debug",
        action="store_true",
        help="also where each step makes the host wait for the device (kimi.benchmarks.gpu.sync_points) and a "
        "cProfile of one step's host time (the functions with the most own time)",
    )
    ap.add_argument("--out", default=None, help="write the full JSON result here")
    snapshot.add_arguments(ap)
    args = ap.parse_args()
    require_gpu(ap.prog)
    cases = parse_cases(args.cases, args.chunk)
    set_prefill_attention(args.prefill_attention)

    from kimi.config import ModelConfig
    from kimi.model.attention import build_attention_metadata
    from kimi.model.weights import load_gpu_model
    from kimi.presets import load_preset
    from kimi.worker.kv_cache import allocate_kv_caches

    dev = torch.device("cuda", torch.cuda.current_device())
    res: dict = {"what": __doc__.split("\n")[0], "args": vars(args)}
    res["matmul_tflops"] = peak = matmul_tflops(dev)
    res["copy_GBps"] = bw = copy_bandwidth(4 << 30, dev)["GBps_read_plus_write"]  # 4 GiB copy
    print(f"bf16 matmul {peak:.0f} TFLOPS, copy {bw:.0f} GB/s", flush=True)

    cfg = ModelConfig.from_dict(load_preset(args.preset)).with_overrides(num_hidden_layers=args.layers)
    n_local = cfg.n_routed_experts // args.ep_size
    offset = 0  # EP rank 0's experts
    ep = EmulatedEP.for_model(cfg, args.chunk, args.ep_size, dev, per_layer=True, idle_peers=args.idle_peers)
    max_len = max(max(c["prompts"]) for c in cases)
    t0 = time.time()
    model = load_gpu_model(
        "",
        cfg,
        ep_rank=0,
        ep_size=args.ep_size,
        a2a=ep,
        dtype=torch.bfloat16,
        device=dev,
        moe_backend=args.moe_backend,
        load_format="dummy",
        max_positions=max_len + 64,
    )
    torch.cuda.synchronize()
    res["load_s"] = time.time() - t0
    res["experts_impl"] = type(model.layers[cfg.first_k_dense_replace].mlp.experts_impl).__name__
    print(
        f"model built in {res['load_s']:.1f} s ({res['experts_impl']}); mem "
        f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB",
        flush=True,
    )

    # FLOPs per token of the non-expert weights (2-D parameters but the embedding; lm_head counted per prompt)
    dense_elems = sum(
        p.numel()
        for n, p in model.named_parameters()
        if not p.is_meta and p.dim() == 2 and ".experts_impl." not in n and n not in ("embed_tokens", "lm_head")
    )
    lm_head = model.lm_head if model.lm_head is not None else model.embed_tokens
    expert_flops_per_pair = 2 * (
        2 * cfg.moe_intermediate_size * cfg.hidden_size + cfg.hidden_size * cfg.moe_intermediate_size
    )
    H = cfg.num_attention_heads
    lat, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    res["dense_flops_per_token"] = 2 * dense_elems
    res["expert_flops_per_pair"] = expert_flops_per_pair
    pairs = ep.local_pairs(offset, n_local)  # per step (every step routes the same drawn pairs)
    res["local_pairs_per_step"] = pairs
    # bytes a step must move at least: every weight it multiplies read once (non-expert weights, the local experts the
    # routing hits, lm_head), the new tokens' KV written and the cached context's read (kv_cache_dim bf16 per layer)
    expert_bytes = bytes_per_expert(model, n_local)
    weight_bytes = dense_weight_bytes(model, exclude=("embed_tokens", "lm_head"))
    weight_bytes += sum(ep.experts_hit(offset, n_local)) * expert_bytes
    kv_token_bytes = cfg.kv_cache_dim * 2 * cfg.num_hidden_layers
    res["bytes_per_expert"], res["weight_bytes_per_step"] = expert_bytes, weight_bytes

    bs = args.block_size
    nblk = 1 + max(len(c["prompts"]) * -(-max(c["prompts"]) // bs) for c in cases)  # + the null block 0
    kv = allocate_kv_caches(cfg, nblk, bs, torch.bfloat16, dev)
    g = torch.Generator(device=dev).manual_seed(1)
    for c in kv:
        c.normal_(0, 1, generator=g)
    res["cases"] = []
    with torch.inference_mode():
        for case in cases:
            n = len(case["prompts"])
            per = -(-max(case["prompts"]) // bs)
            tabs = [list(range(1 + i * per, 1 + (i + 1) * per)) for i in range(n)]  # block 0 is the null block
            out_steps = []
            for qlens, ctx in case["steps"]:
                T = sum(qlens)
                slens = [c + q for c, q in zip(ctx, qlens)]
                ends = [i for i, s in enumerate(slens) if s == case["prompts"][i]]  # prompts that end here
                ids = torch.randint(0, cfg.vocab_size, (T,), device=dev)
                pos = torch.cat([torch.arange(c, c + q, device=dev) for c, q in zip(ctx, qlens)])
                last = torch.tensor([sum(qlens[: i + 1]) - 1 for i in ends], device=dev, dtype=torch.int64)

                def step(ids=ids, pos=pos, qlens=qlens, slens=slens, tabs=tabs, last=last):
                    ep.i = 0
                    a = build_attention_metadata(qlens, slens, tabs, bs, dev)
                    h = model(ids, pos, a, kv)  # [T, D]
                    if last.numel():
                        return model.compute_logits(h[last]).argmax(-1)
                    return h

                t = time_ms(step, args.iters, warmup=2)
                ms, ts = t["median_ms"], t["samples"]
                kv_pairs = sum(q * c + q * (q + 1) // 2 for q, c in zip(qlens, ctx))  # causal (query, key) pairs
                f_dense = 2 * dense_elems * T + 2 * lm_head.numel() * len(ends)
                f_exp = expert_flops_per_pair * pairs
                f_attn = 2 * H * (lat + rope + lat) * kv_pairs * cfg.num_hidden_layers
                f_attn_na = 2 * H * (cfg.qk_nope_head_dim + rope + cfg.v_head_dim) * kv_pairs * cfg.num_hidden_layers
                total = f_dense + f_exp + f_attn
                nbytes = weight_bytes + (lm_head.numel() * 2 if ends else 0) + kv_token_bytes * (T + sum(ctx))
                floor = max(total / (peak * 1e12), nbytes / (bw * 1e9)) * 1e3  # ms
                st = {
                    "query_lens": qlens if n <= 4 else f"{n} x {qlens[0]}",
                    "context_before": ctx if n <= 4 else 0,
                    "tokens": T,
                    "median_ms": ms,
                    "samples_ms": ts,
                    "dense_flops": f_dense,
                    "expert_flops": f_exp,
                    "attention_flops": f_attn,
                    "attention_nonabsorbed_flops": f_attn_na,
                    "tflops": total / (ms * 1e-3) / 1e12,
                    "tokens_per_s": T / (ms * 1e-3),
                    "bytes": nbytes,
                    "floor_ms": floor,
                    "over_floor": ms / floor,
                }
                st["fraction_of_matmul"] = st["tflops"] / peak
                if args.graph:
                    form = graph_attention(cfg, qlens, slens, args.graph_attention)
                    st["graph_attention"] = form
                    st["graph_ms"] = graph_step_ms(
                        model, kv, cfg, ids, pos, qlens, slens, tabs, bs, last, args.iters, form
                    )
                    g_total = total - f_attn + f_attn_na if form == "mha" else total
                    st["graph_floor_ms"] = max(g_total / (peak * 1e12), nbytes / (bw * 1e9)) * 1e3
                    st["graph_over_floor"] = st["graph_ms"] / st["graph_floor_ms"]
                    print(
                        f"{case['name']}: step {len(out_steps) + 1} as a CUDA graph ({form} attention) "
                        f"{st['graph_ms']:.1f} ms ({st['graph_over_floor']:.2f}x its floor {st['graph_floor_ms']:.1f})",
                        flush=True,
                    )
                if args.sync_debug:
                    st["syncs"] = sync_points(step)
                    print(f"{case['name']}: {sum(x['count'] for x in st['syncs'])} device syncs per step", flush=True)
                    for x in st["syncs"][:8]:
                        print(f"  {x['count']} x {' <- '.join(reversed(x['stack']))}", flush=True)
                    st["host_profile"] = host_profile(step)
                    print(st["host_profile"], flush=True)
                if not args.no_profile:
                    try:
                        st["breakdown"] = breakdown(step, steps=2)
                    except Exception as ex:
                        st["breakdown_error"] = repr(ex)
                out_steps.append(st)
                print(
                    f"{case['name']}: step {len(out_steps)} ({T} tokens after {max(ctx)} cached) {ms:.1f} ms, "
                    f"{st['tflops']:.0f} TFLOPS ({st['fraction_of_matmul']:.2f} of matmul), "
                    f"{st['tokens_per_s']:.0f} tok/s",
                    flush=True,
                )
            total_ms = sum(s["median_ms"] for s in out_steps)
            floor_ms = sum(s["floor_ms"] for s in out_steps)
            res["cases"].append(
                {
                    "name": case["name"],
                    "prompts": case["prompts"],
                    "steps": out_steps,
                    "prefill_ms": total_ms,
                    "floor_ms": floor_ms,
                }
            )
            print(
                f"{case['name']}: prefill {total_ms:.1f} ms in {len(out_steps)} step(s), floor {floor_ms:.1f} ms "
                f"({total_ms / floor_ms:.2f}x)",
                flush=True,
            )
    res["conditions"] = conds = snapshot.conditions(matmul_tflops=res["matmul_tflops"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)
    if args.snapshot:
        snapshot.write(
            args.snapshot,
            benchmark="prefill",
            config=config_name(args),
            summary=summarize(res),
            results=res,
            conds=conds,
        )


if __name__ == "__main__":
    main()
