"""The verify step of speculative decoding (EAGLE3, docs/speculative.md) on one rank of Kimi-K2.6 under DP8 x EP8,
emulated on one GPU, against the 1-token decode step; the EAGLE3 draft's cost per proposed token; and the tokens per
second per sequence they give at given mean accepted lengths.

    python tools/bench_verify.py [--seqs 8,32] [--k 1,2,3,4] [--accepted 2.0,2.5,3.0] [--snapshot]

The rank is tools/bench_decode.py's: the real K2.6 text config (all 61 layers at full width), random weights made on
the GPU (`--load-format dummy`: INT4 experts), EP rank 0 of 8 (kimi.benchmarks.emulated_rank.EmulatedEP: the MoE of
every layer sees the rows of all 8 ranks, fixed random top-8 routing over the 384 experts, only the pairs of this
rank's 48 experts computed; no communication timed), B local sequences at CTX tokens of context in the paged
[num_blocks, 64, 576] cache (blocks randomly permuted).

Verify step at k draft tokens: every sequence's last token and its k draft tokens, q_len = k + 1 rows per sequence
(T = B * (k + 1) rows; every peer rank verifies as many, so the MoE sees 8 * T rows), the sequence's context CTX
counting them: one FlashInfer MLA run with a causal plan over the paged cache (the plan made once, outside the
graph, use_cuda_graph index buffers), the forward from the embedding to the final norm, the lm_head over all T rows
and their argmax (greedy acceptance compares them with the drafts: a few more small kernels, not timed) captured as
ONE CUDA graph per (B, k) and timed by replay (CUDA events, each replay after the last one ended; `--rounds`
interleaved rounds of `--iters` replays, the order rotating each round, pooled median). k = 0 is the decode step
captured the same way (q_len 1); `decode_runner` is the product's own decode graph for bucket B
(kimi.worker.cuda_graph.CudaGraphRunner) replayed with the same fixed plan, then the lm_head and argmax, as a check
that the generic capture is the decode step kimi serves. Rejection sampling of sampled requests (a softmax over
T x 163840 logits) is not in the verify step timed here.

Draft (kimi.model.eagle3.Eagle3Draft, the published K2 / K2.5 Llama layout: hidden 7168, 64 heads of 128 and 64 kv
heads, intermediate 18432, draft vocabulary 32000, the target's embedding shared; bf16 random weights): `draft_fc`
is `fc` over the target's three aux states of B rows (once per step), `draft_step` one draft forward of B rows (the
embedding, the decoder layer, the norm and the lm_head over the draft vocabulary). It runs the draft's PyTorch path
eagerly (CUDA events around each call): its B rows are positions of ONE request over a dense cache of CTX entries,
so its attention reads one sequence's draft KV where B sequences read B; `draft_step_batched_ms` adds the other
B - 1 sequences' draft KV bytes (B - 1) * CTX * 2 * 64 * 128 * 2 at the measured copy bandwidth. Beside it: its
kernel time (`draft_step_kernel_ms`, the sum of its CUDA kernels' durations from torch.profiler, taken after every
graph timing: what the step would cost with its launch gaps gone, as in a CUDA graph) and its floor (its weights
and the B sequences' draft KV read once / copy bandwidth).

Floors (`floor_ms_q<q>`, `over_floor`), as tools/bench_decode.py's: the weights but the embedding (of which the T
rows), each local expert hit once in each MoE layer, the B sequences' KV, all at the copy bandwidth measured in the
same run.

Tokens per second per sequence (`projection`): a step of k drafts costs verify(k) + draft_fc + k * draft_step
(kimi's step: verify, then the draft over the accepted positions and k - 1 more proposals; draft_step_batched_ms is
used), and emits A tokens per sequence on average (A: the mean accepted length, counting the target's own token,
A <= k + 1); without speculation a step costs the decode step and emits 1. speedup = A * decode / step(k);
`projection_draft_kernels` is the same with the draft step's kernel time. Host work
(scheduling, the FlashInfer plan, the draft's per-request loop of today's worker) is not counted: both sides are
device time.

Snapshot (--snapshot): verify_<config>.json, config "int4-ep8" plus what differs from the headline run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from kimi.backends.experts import BACKENDS as MOE_BACKENDS
from kimi.benchmarks import snapshot
from kimi.benchmarks.emulated_rank import (
    EmulatedEP,
    breakdown,
    bytes_per_expert,
    capture_forward,
    dense_weight_bytes,
    time_ms,
)
from kimi.benchmarks.gpu import copy_bandwidth, require_gpu

# the public K2 / K2.5 EAGLE3 Llama drafts' config (docs/speculative.md, "The draft's config")
DRAFT_CONFIG = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "num_hidden_layers": 1,
    "hidden_size": 7168,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "head_dim": 128,
    "intermediate_size": 18432,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1e6,
    "draft_vocab_size": 32000,
}
_WARMUP = 3


def build_draft(cfg, embed: torch.Tensor, dev: torch.device, seed: int = 0):
    """An Eagle3Draft of DRAFT_CONFIG for the target cfg on dev: bf16 random weights made on the GPU (linear layers
    N(0, 1 / fan_in), norms 1), the target's embedding shared, d2t 0 (draft id i -> target id i)."""
    from kimi.model.eagle3 import Eagle3Config, Eagle3Draft

    dcfg = Eagle3Config.from_dict(DRAFT_CONFIG | {"vocab_size": cfg.vocab_size}, where="bench_verify DRAFT_CONFIG")
    ids = dcfg.check_target(cfg)
    draft = Eagle3Draft(dcfg, ids, embed, torch.bfloat16, dev)
    g = torch.Generator(device=dev).manual_seed(seed)
    for name, p in draft.params.items():
        if name == "d2t":
            p.zero_()
        elif name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, p.shape[1] ** -0.5, generator=g)
    draft.target_ids = torch.arange(dcfg.draft_vocab_size, device=dev)
    return draft


def time_draft(draft, B: int, ctx: int, iters: int, bw_GBps: float) -> tuple[dict, Callable[[], Any]]:
    """draft_fc and draft_step of B rows (module docstring), ms, with the weight floors and the batched estimate;
    and the step itself (for its kernel time, profiled after every timing)."""
    from kimi.model.eagle3 import DraftKV

    c = draft.cfg
    dev = draft.params["fc.weight"].device
    g = torch.Generator(device=dev).manual_seed(B)
    shape = (ctx + B + 16, c.num_key_value_heads, c.head_dim)
    kv = DraftKV(
        torch.randn(shape, generator=g, device=dev).to(torch.bfloat16),
        torch.randn(shape, generator=g, device=dev).to(torch.bfloat16),
        base=0,
        length=ctx,
    )
    aux = torch.randn((B, 3 * c.target_hidden_size), generator=g, device=dev).to(torch.bfloat16)
    ids = torch.randint(0, c.vocab_size, (B,), generator=g, device=dev)
    pos = torch.arange(ctx, ctx + B, device=dev)
    feat = draft.fuse(aux)

    def step():
        kv.truncate(ctx)
        return draft(ids, feat, pos, kv)

    with torch.inference_mode():
        fc = time_ms(lambda: draft.fuse(aux), iters, _WARMUP)
        st = time_ms(step, iters, _WARMUP)
    p = draft.params
    nbytes = lambda names: sum(p[n].numel() * p[n].element_size() for n in names)  # noqa: E731
    layer = [n for n in p if n.startswith("midlayer.")] + ["norm.weight", "lm_head.weight"]
    kv_tok = 2 * c.num_key_value_heads * c.head_dim * 2  # bytes of one position's draft K and V (bf16)
    extra_ms = (B - 1) * ctx * kv_tok / (bw_GBps * 1e9) * 1e3
    return {
        "draft_fc_ms": fc["median_ms"],
        "draft_step_ms": st["median_ms"],
        "draft_step_batched_ms": st["median_ms"] + extra_ms,
        "other_seqs_draft_kv_ms": extra_ms,
        "draft_fc_floor_ms": nbytes(["fc.weight"]) / (bw_GBps * 1e9) * 1e3,
        "draft_step_floor_ms": (nbytes(layer) + B * ctx * kv_tok) / (bw_GBps * 1e9) * 1e3,
        "draft_step_samples_ms": [round(t, 4) for t in st["samples"]],
    }, step


def projection(
    decode_ms: float, verify_ms: dict[int, float], fc_ms: float, draft_ms: float, accepted: list[float]
) -> list[dict]:
    """Per mean accepted length A and draft count k (A <= k + 1): the step time verify(k) + fc_ms + k * draft_ms,
    tokens/s per sequence with and without speculation, and the speedup (module docstring)."""
    out = []
    for A in accepted:
        for k, v in sorted(verify_ms.items()):
            if k == 0 or k + 1 < A:
                continue
            step = v + fc_ms + k * draft_ms
            out.append(
                {
                    "accepted_length": A,
                    "k": k,
                    "step_ms": round(step, 3),
                    "tokens_per_s_per_seq": round(A / step * 1e3, 1),
                    "decode_tokens_per_s_per_seq": round(1e3 / decode_ms, 1),
                    "speedup": round(A * decode_ms / step, 3),
                }
            )
    return out


def summarize(res: dict) -> dict:
    """The snapshot's table: per local batch the decode step, the verify step at each k (ms, over decode, over its
    floor), the draft step, and the speedup at each accepted length with --headline-k drafts (the published accepted
    lengths of Kimi drafts are at 3), with the draft's eager time and with its kernel time."""
    ks, hk = res["args"]["k"], res["args"]["headline_k"]

    def at_k(projection: list[dict]) -> str:
        return ", ".join(f"{p['accepted_length']:g}: {p['speedup']:.2f}x" for p in projection if p["k"] == hk)

    rows = []
    for c in res["cases"]:
        d = c["draft"]
        rows.append(
            [
                c["local_seqs"],
                f"{c['decode_ms']:.2f} ({c['over_floor']['0']:.2f})",
                " / ".join(f"{c['verify_ms'][str(k)]:.2f}" for k in ks),
                " / ".join(f"{c['verify_ms'][str(k)] / c['decode_ms']:.2f}" for k in ks),
                " / ".join(f"{c['over_floor'][str(k)]:.2f}" for k in ks),
                f"{d['draft_step_batched_ms']:.2f} / {d['draft_step_kernel_batched_ms']:.2f} / "
                f"{d['draft_step_floor_ms']:.2f}",
                at_k(c["projection"]),
                at_k(c["projection_draft_kernels"]),
            ]
        )
    return {
        "columns": [
            "local sequences",
            "decode step, ms (over floor)",
            f"verify step, k = {' / '.join(map(str, ks))} (ms)",
            "verify / decode",
            "verify / its floor",
            "draft step: eager / kernels / floor (ms)",
            f"tokens/s per sequence vs decode, k = {hk}, by accepted length",
            "the same with the draft's kernel time",
        ],
        "rows": rows,
        "notes": [
            f"copy {res['copy_GBps']:.0f} GB/s; context {res['args']['ctx']} tokens; kimi's decode graph "
            "(decode_runner) "
            + ", ".join(f"{c['local_seqs']} sequences {c['decode_runner_ms']:.2f} ms" for c in res["cases"]),
            "device time only: graph replays; the draft's PyTorch path run eagerly (CUDA events) or its kernels' "
            "time (torch.profiler), plus the other sequences' draft KV at the copy bandwidth; rejection sampling "
            "and host work not counted; every k's projection in results.cases[].projection",
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=snapshot.HelpFormatter)
    ap.add_argument("--preset", default="kimi-k2.6", help="model preset (kimi/presets)")
    ap.add_argument("--layers", type=int, default=61, help="layers of the model (61: all of K2's)")
    ap.add_argument("--seqs", default="8,32", help="local sequences per rank, comma list")
    ap.add_argument("--k", default="1,2,3,4", help="draft tokens per sequence verified, comma list")
    ap.add_argument("--accepted", default="2.0,2.5,3.0", help="mean accepted lengths of the projection")
    ap.add_argument("--headline-k", type=int, default=3, help="the draft count of the summary's speedups")
    ap.add_argument("--ctx", type=int, default=2048, help="context tokens of every sequence (verified rows included)")
    ap.add_argument("--ep-size", type=int, default=8, help="EP ranks emulated (this rank holds 1 / ep-size experts)")
    ap.add_argument("--moe-backend", default="auto", choices=MOE_BACKENDS, help="routed-expert backend")
    ap.add_argument("--block-size", type=int, default=64, help="KV cache block size (tokens)")
    ap.add_argument("--iters", type=int, default=20, help="timed replays per timing")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    ap.add_argument("--out", default=None, help="write the full JSON result here")
    snapshot.add_arguments(ap)
    args = ap.parse_args()
    require_gpu(ap.prog)

    from kimi.backends.attention.base import AttentionPlan
    from kimi.backends.attention.flashinfer import FlashInferMLA
    from kimi.config import ModelConfig
    from kimi.model.attention import build_attention_metadata
    from kimi.model.weights import load_gpu_model
    from kimi.presets import load_preset
    from kimi.worker.cuda_graph import CudaGraphRunner
    from kimi.worker.kv_cache import allocate_kv_caches

    dev = torch.device("cuda", torch.cuda.current_device())
    seqs = [int(s) for s in args.seqs.split(",")]
    ks = sorted({int(k) for k in args.k.split(",")})
    if not ks or ks[0] < 1:
        raise SystemExit("--k: draft token counts >= 1")
    accepted = [float(a) for a in args.accepted.split(",")]
    if args.headline_k not in ks:
        raise SystemExit(f"--headline-k {args.headline_k} is not in --k {ks}")
    qs = [1] + [k + 1 for k in ks]
    res: dict = {"what": __doc__.split("\n")[0], "args": vars(args) | {"k": ks, "seqs": seqs}}
    res["copy_GBps"] = bw = copy_bandwidth(4 << 30, dev)["GBps_read_plus_write"]
    print(f"copy bandwidth {bw:.0f} GB/s", flush=True)
    cfg = ModelConfig.from_dict(load_preset(args.preset)).with_overrides(num_hidden_layers=args.layers)

    def emulated(T: int) -> EmulatedEP:
        return EmulatedEP.for_model(cfg, T, args.ep_size, dev, seed=T)

    t0 = time.time()
    model = load_gpu_model(
        "",
        cfg,
        ep_rank=0,
        ep_size=args.ep_size,
        a2a=emulated(seqs[0]),
        dtype=torch.bfloat16,
        device=dev,
        moe_backend=args.moe_backend,
        load_format="dummy",
        max_positions=args.ctx + 64,
    )
    torch.cuda.synchronize()
    res["load_s"] = round(time.time() - t0, 1)
    res["experts_impl"] = type(model.layers[cfg.first_k_dense_replace].mlp.experts_impl).__name__
    print(f"model built in {res['load_s']} s ({res['experts_impl']})", flush=True)
    draft = build_draft(cfg, model.embed_tokens, dev)
    res["draft_config"] = DRAFT_CONFIG

    bs = args.block_size
    nblk = -(-args.ctx // bs)
    max_b = max(seqs)
    kv = allocate_kv_caches(cfg, max_b * nblk + 1, bs, torch.bfloat16, dev)
    gen = torch.Generator(device=dev).manual_seed(1)
    for c in kv:
        c.normal_(0, 1, generator=gen)
    res["cases"] = []
    drafts: list[tuple[dict, Callable[[], Any]]] = []  # (case, its draft step), profiled after every timing
    # bytes each step reads at least (its floor at the copy bandwidth): the weights but the embedding (of which the
    # T rows), each local expert hit once, the KV of every sequence's context
    n_local = cfg.n_routed_experts // args.ep_size
    expert_bytes = bytes_per_expert(model, n_local)
    dense_bytes = dense_weight_bytes(model)
    res["bytes_per_expert"], res["dense_weight_bytes"] = expert_bytes, dense_bytes
    for B in seqs:
        perm = (torch.randperm(max_b * nblk, generator=torch.Generator().manual_seed(B)) + 1).tolist()
        tabs = [perm[i * nblk : (i + 1) * nblk] for i in range(B)]
        case: dict = {"local_seqs": B, "ctx": args.ctx}
        variants: dict[str, tuple] = {}  # name -> (replay, keep-alive)
        pool = None
        with torch.inference_mode():
            for q in qs:
                T = B * q
                ep = emulated(T)
                ep.install(model)
                attn = build_attention_metadata([q] * B, [args.ctx] * B, tabs, bs, dev)
                fi = FlashInferMLA.for_model(
                    cfg,
                    dev,
                    use_cuda_graph=True,
                    max_batch=B,
                    max_pages=B * nblk,
                )
                fi.plan([q] * B, [args.ctx] * B, attn.block_tables, bs, causal=q > 1)
                attn.plan = AttentionPlan(fi, attn.slot_mapping, q == 1)
                ids = torch.randint(0, cfg.vocab_size, (T,), device=dev)
                positions = torch.tensor(
                    [args.ctx - q + j for _ in range(B) for j in range(q)], dtype=torch.int64, device=dev
                )
                valid = torch.ones(T, dtype=torch.int64, device=dev)
                t1 = time.time()
                g, out = capture_forward(model, kv, ids, positions, attn, valid, pool=pool)
                pool = g.pool() if pool is None else pool
                case[f"capture_s_q{q}"] = round(time.time() - t1, 1)
                hit = ep.experts_hit(0, n_local)
                case[f"experts_hit_mean_q{q}"] = statistics.mean(hit)
                kv_bytes = B * args.ctx * cfg.num_hidden_layers * cfg.kv_cache_dim * 2
                nbytes = dense_bytes + sum(hit) * expert_bytes + kv_bytes + T * cfg.hidden_size * 2
                case[f"floor_ms_q{q}"] = nbytes / (bw * 1e9) * 1e3
                variants[f"q{q}"] = (g.replay, (g, out, ep, attn, fi, ids, positions, valid))
                print(f"B={B} q_len={q}: captured in {case[f'capture_s_q{q}']} s", flush=True)
            # the product's decode graph for bucket B, replayed with a fixed plan, then the lm_head and argmax
            ep = emulated(B)
            ep.install(model)
            runner = CudaGraphRunner(model, kv, bs, B, nblk, buckets=[B])
            runner.capture()
            a = build_attention_metadata([1] * B, [args.ctx] * B, tabs, bs, dev)
            last = args.ctx - 1  # every sequence's last position: its row's token, position and cache slot
            runner.input_ids[:B] = torch.randint(0, cfg.vocab_size, (B,), device=dev)
            runner.positions[:B] = last
            runner.slot_mapping[:B] = torch.tensor([t[last // bs] * bs + last % bs for t in tabs], device=dev)
            runner._plan(B, [args.ctx] * B, a.block_tables)

            def decode_runner(r=runner, B=B):
                r.replay(B)
                return model.compute_logits(r.outputs[B]).argmax(-1)

            variants["decode_runner"] = (decode_runner, (runner, ep))
            runs: dict[str, list] = {k: [] for k in variants}
            names = list(variants)
            for rnd in range(args.rounds):
                for k in names[rnd % len(names) :] + names[: rnd % len(names)]:
                    runs[k].append(time_ms(variants[k][0], args.iters, _WARMUP))
            med = {k: statistics.median(t for r in v for t in r["samples"]) for k, v in runs.items()}
            case["round_medians_ms"] = {k: [round(r["median_ms"], 3) for r in v] for k, v in runs.items()}
            case["decode_ms"] = med["q1"]
            case["decode_runner_ms"] = med["decode_runner"]
            case["verify_ms"] = {str(q - 1): med[f"q{q}"] for q in qs[1:]}
            case["over_floor"] = {str(q - 1): med[f"q{q}"] / case[f"floor_ms_q{q}"] for q in qs}
            print(
                f"B={B}: decode {med['q1']:.2f} ms (kimi's decode graph {med['decode_runner']:.2f} ms); verify "
                + ", ".join(f"k={q - 1} {med[f'q{q}']:.2f} ms" for q in qs[1:]),
                flush=True,
            )
            variants.clear()
            del runner
            torch.cuda.empty_cache()
            case["draft"], draft_step = time_draft(draft, B, args.ctx, args.iters, bw)
            drafts.append((case, draft_step))
            d = case["draft"]
            print(
                f"B={B}: draft fc {d['draft_fc_ms']:.3f} ms, step {d['draft_step_ms']:.3f} ms "
                f"(+{d['other_seqs_draft_kv_ms']:.3f} ms for the other sequences' draft KV; floor "
                f"{d['draft_step_floor_ms']:.3f} ms)",
                flush=True,
            )
        res["cases"].append(case)
    # the draft step's kernel time (torch.profiler), after every graph timing: a profiler session slows later
    # graph launches in the process
    with torch.inference_mode():
        for case, draft_step in drafts:
            d = case["draft"]
            bd = breakdown(draft_step, steps=5)
            d["draft_step_kernel_ms"] = bd["kernel_sum_ms"]
            d["draft_step_kernel_batched_ms"] = bd["kernel_sum_ms"] + d["other_seqs_draft_kv_ms"]
            d["draft_step_kernels_by_class_ms"] = bd["by_class_ms"]
            verify = {int(k): v for k, v in case["verify_ms"].items()}
            case["projection"] = projection(
                case["decode_ms"], verify, d["draft_fc_ms"], d["draft_step_batched_ms"], accepted
            )
            case["projection_draft_kernels"] = projection(
                case["decode_ms"], verify, d["draft_fc_ms"], d["draft_step_kernel_batched_ms"], accepted
            )
            for p in case["projection"]:
                print(f"B={case['local_seqs']}: {json.dumps(p)}", flush=True)
    conds = snapshot.conditions(copy_GBps=res["copy_GBps"])
    res["conditions"] = conds
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)
    config = f"int4-ep{args.ep_size}" + (f"-L{args.layers}" if args.layers != 61 else "")
    config += f"-ctx{args.ctx}" if args.ctx != 2048 else ""
    config += f"-{args.moe_backend}" if args.moe_backend != "auto" else ""
    if args.snapshot:
        snapshot.write(
            args.snapshot, benchmark="verify", config=config, summary=summarize(res), results=res, conds=conds
        )
    print(json.dumps(summarize(res), indent=1))


if __name__ == "__main__":
    main()
