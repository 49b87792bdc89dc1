"""One decode step of one rank of Kimi-K2.6 under DP8 x EP8, emulated on one GPU (kimi/model/gpu_forward.py).

    python tools/bench_decode.py [--seqs 8,32] [--quant fp8 --ep-size 16] [--ab control0,...] [--snapshot]

The rank: the real K2.6 text config (kimi/presets/kimi-k2.6.json), all 61 layers at full width, random weights
generated on the GPU (`--load-format dummy`: INT4 experts as random int32 words + bf16 scales; with `--quant fp8`
K2-Instruct's FP8 128 x 128 experts instead, kept FP8 by humming, and with --fp8-dense its FP8 dense projections,
kept FP8 by kimi.kernels.triton.linear_fp8), EP rank 0 of 8 (--ep-size: its 384 / ep_size local experts per MoE layer,
run by
the chosen MoE backend), B local sequences at CTX tokens of context (FlashInfer MLA decode over the paged
[num_blocks, 64, 576] cache, blocks randomly permuted).

EP emulation (kimi.benchmarks.emulated_rank.EmulatedEP, the all-to-all seam of kimi.model.moe): the MoE of every layer
sees the 8 * B tokens of all ranks (this rank's B rows plus 7 * B fixed random rows standing for the other ranks'
tokens), each routed to top-8 of all 384 experts by fixed random routing drawn per layer (distinct experts per
token); only pairs landing on the 48 local experts are computed, as that rank would; combine keeps this rank's rows.
The router still runs on the local rows (its cost counts); its choice is replaced by the drawn routing so the bytes
touched are known exactly. No communication is timed (single GPU).

Step = FlashInfer plan (host) + forward (embedding .. final norm) + lm_head logits + argmax. "eager" launches from
Python; "graph" replays the CUDA graph of the bucket B (kimi/worker/cuda_graph.py). Each timed step is the next decode
step of the same B sequences, as in a server: every context length grows by one token per step, so the graph
runner's plan ahead (KimiForCausalLM.plan_ahead) applies as it would when serving. Every timing (eager, each
graph variant, each round) restarts at the same step: 3 warm-up steps, then the timed ones at contexts
CTX - ITERS/2 .. CTX + ITERS/2 - 1 (DecodeSteps).
graph_pipelined: the headline graph's steps issued as the worker issues them under async scheduling
(ModelRunner.launch): step i + 1's host work, replay, logits and argmax are queued before the host waits for step
i's ids (copied to pinned memory), step i + 1's input ids taken from step i's argmax on the device; ms per step over
--iters steps, median of 3 rounds. With the host's work hidden this is the step time a server sees.
A/B variants (--ab, a comma list of AB_VARIANTS; --overlap) are captured next to the headline graph and all are timed
in --rounds interleaved rounds of --iters steps each, the order rotating by one each round; each reports the median
over all its samples and the rounds' medians (compare variants by their per-round differences; `control0` is the
headline captured again, the noise between identical captures).
Floor = bytes touched / copy bandwidth measured in the same run (4 GiB device copy, read + write counted):
non-expert weights (all but the embedding, of which B rows), distinct local experts hit per layer x 24.8 MB,
KV read at the mean timed context (CTX - 0.5 for an even ITERS; B * that * 61 * 1152 bytes).
Per-op breakdown: CUDA kernel time of one eager step from torch.profiler, by kernel-name class, taken after all
timings (a profiler session slows later CUDA-graph launches in the same process).
cuda_gemm_layers: how many MoE layers run kimi's CUDA expert GEMM at decode sizes (--moe-backend cuda: all; auto:
those whose humming tensors it can read, see kimi.backends.experts.HummingInt4Experts).
gpu_clock (every graph timing and graph_pipelined): nvidia-smi's SM clock / power samples during it
(kimi.benchmarks.smi.GpuSampler; the H200 runs this step at its 700 W power cap, and the clock there differs by
machine).
host_forward_decode_us: host time of the whole graph decode call (forward_decode, plan ahead included);
host_until_replay_us: its part before the replay is launched (the GPU idles through it when each step waits
for the previous one, as a server's steps do).

Snapshot (--snapshot): decode_<config>.json, config = the experts' format and EP size ("int4-ep8", "fp8-ep16") and
whatever else differs from the headline run (config_name).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time

import torch

from kimi import envs
from kimi.backends.experts import BACKENDS as MOE_BACKENDS
from kimi.benchmarks import snapshot
from kimi.benchmarks.emulated_rank import (
    KERNEL_CLASSES,
    EmulatedEP,
    breakdown,
    bytes_per_expert,
    dense_weight_bytes,
    time_ms,
)
from kimi.benchmarks.gpu import copy_bandwidth, require_gpu
from kimi.benchmarks.smi import GpuSampler
from kimi.kernels.cuda.moe_w4a16 import CONFIGS as MOE_CUDA_CONFIGS
from kimi.model.sampling import start_host_copy

# The A/B variants (--ab): each flips one switch of the product as it runs today, or applies a tuner's output, for a
# graph captured and timed next to the headline. name: (what it changes, apply(model), undo(model)); applied before
# the variant's capture and while it is timed, undone after.
_saved: dict = {}
_LPG: list[int | None] = [None]  # layers per graph segment of the captures (None: cuda_graph.LAYERS_PER_GRAPH)


def _set_lpg(v: int | None) -> None:
    _saved["lpg"] = _LPG[0]
    _LPG[0] = v


def _set_attn(m, backend: str) -> None:
    _saved["decode_attention"] = m.decode_attention
    m.decode_attention = backend


def _swap_humming_table(m, table_file: str | None, on: bool) -> None:
    """humming_table_off (table_file None: humming's heuristic schedules) / humming_table_alt (the table in
    $KIMI_HUMMING_TABLE_ALT) instead of kimi/kernels/tuning/humming.json ($KIMI_HUMMING_TABLE); on=False restores.
    The experts' cached schedules are dropped either way."""
    from kimi.backends.experts import humming

    if on:
        table = humming.load_humming_table(table_file) if table_file else {"gpu": None, "entries": {}, "scope": {}}
        _saved["humming_table"] = humming.use_humming_table(table)
    else:
        humming.use_humming_table(_saved["humming_table"])
    for impl in _experts_impls(m):  # chosen again at the next capture
        if hasattr(impl, "_tuning"):
            impl._tuning.clear()


def _experts_impls(m) -> list:
    """Every MoE layer's routed-expert module (kimi.backends.experts), in layer order."""
    impls = (getattr(getattr(layer, "mlp", None), "experts_impl", None) for layer in m.layers)
    return [x for x in impls if x is not None]


def _set_attrs(key: str, targets: list[tuple[object, str]], value) -> None:
    """Set attribute a of every (module, a) in targets to value, saving the old values under _saved[key]; value None
    puts the saved ones back."""
    if value is not None:
        _saved[key] = [getattr(x, a) for x, a in targets]
        for x, a in targets:
            setattr(x, a, value)
    else:
        for (x, a), old in zip(targets, _saved[key]):
            setattr(x, a, old)


def _cuda_gemm_impls(m, attr: str) -> list[tuple[object, str]]:
    """(module, attribute) of every MoE layer running kimi's CUDA GEMM: CudaInt4Experts' attr (config13 / config2 /
    glu) and, under --moe-backend auto, HummingInt4Experts' cuda_<attr>."""
    from kimi.backends.experts.cuda_w4a16 import CudaInt4Experts
    from kimi.backends.experts.humming import HummingInt4Experts

    return [
        (x, attr) if isinstance(x, CudaInt4Experts) else (x, "cuda_" + attr)
        for x in _experts_impls(m)
        if isinstance(x, CudaInt4Experts) or (isinstance(x, HummingInt4Experts) and x.cuda_max_pairs)
    ]


def _moe_cuda_config(m, attr: str, cfg) -> None:
    """moe_cuda_{gate_up,down}_c{NT}{KW}{S}: the launch configuration of one of kimi's CUDA expert GEMMs (attr
    config13 / config2, see _cuda_gemm_impls; None: kimi.kernels.cuda.moe_w4a16.config_for's pick by step size) set to
    cfg; cfg None restores the saved ones."""
    _set_attrs(attr, _cuda_gemm_impls(m, attr), cfg)


def _auto_max_pairs(m, n: int | None) -> None:
    """auto_humming: under --moe-backend auto, every HummingInt4Experts' cuda_max_pairs set to n (0: humming's GEMM
    at every size); n None restores the saved ones."""
    from kimi.backends.experts.humming import HummingInt4Experts

    _set_attrs(
        "cuda_max_pairs", [(x, "cuda_max_pairs") for x in _experts_impls(m) if isinstance(x, HummingInt4Experts)], n
    )


def _small_tuned(on: bool) -> None:
    """small_tuned: the small_kernels table of $KIMI_SMALL_KERNELS_TABLE_ALT (tools/sweep_small_kernels.py
    --table-out) as the launch of kimi.kernels.triton.fused and of moe_w4a16's combine (their use_launch /
    use_combine_launch); off puts the previous ones back."""
    from kimi.kernels import tuning
    from kimi.kernels.triton import fused
    from kimi.kernels.triton import moe_w4a16 as mi

    if on:
        table = tuning.load("small_kernels", envs.KIMI_SMALL_KERNELS_TABLE_ALT.require())
        launch = tuning.launch_configs(table, fused.LAUNCH_FIELDS)
        combine = tuning.launch_configs(table, mi.COMBINE_LAUNCH_FIELDS)["combine"]
        _saved["small"] = (fused.use_launch(launch), mi.use_combine_launch(combine))
        print(f"small_tuned: {json.dumps(launch | {'combine': combine})}", flush=True)
    else:
        fused.use_launch(_saved["small"][0])
        mi.use_combine_launch(_saved["small"][1])


def _setter_switch(name: str, what: str, setter: str, value) -> dict:
    """One variant that calls setter(value) (a function "module:name" returning the previous value) while it is
    captured and timed, then setter(previous)."""

    def _call(v):
        import importlib

        module, fn = setter.split(":")
        return getattr(importlib.import_module(module), fn)(v)

    return {
        name: (
            what,
            lambda m, value=value: _saved.__setitem__(setter, _call(value)),
            lambda m: _call(_saved[setter]),
        )
    }


AB_VARIANTS = {
    **{
        f"control{i}": (
            "the headline again, nothing changed (the spread between identical captures: the A/B noise)",
            lambda m: None,
            lambda m: None,
        )
        for i in range(4)
    },
    "attn_triton": (
        "decode attention by kimi.kernels.triton.mla_decode (no host plan)",
        lambda m: _set_attn(m, "triton"),
        lambda m: setattr(m, "decode_attention", _saved["decode_attention"]),
    ),
    "attn_flashinfer": (
        "decode attention by FlashInfer's MLA (fa3, host plan per step)",
        lambda m: _set_attn(m, "flashinfer"),
        lambda m: setattr(m, "decode_attention", _saved["decode_attention"]),
    ),
    **{
        f"lpg{n}": (
            f"CUDA graph segments of {n} layers (kimi.worker.cuda_graph.LAYERS_PER_GRAPH)",
            lambda m, n=n: _set_lpg(n),
            lambda m: _LPG.__setitem__(0, _saved["lpg"]),
        )
        for n in (1, 2, 4, 8, 16)
    },
    "prologue_on": (
        "RMSNorm / SiLU*up fused into the q_b / down GEMMs' loads (KimiForCausalLM.set_fuse_prologue)",
        lambda m: m.set_fuse_prologue(True),
        lambda m: m.set_fuse_prologue(False),
    ),
    **_setter_switch(
        "pdl_off",
        "no programmatic dependent launch (kimi.kernels.triton.pdl.set_enabled(False))",
        "kimi.kernels.triton.pdl:set_enabled",
        False,
    ),
    **{
        k: v
        for n in (0, 1, 4, 8)
        for k, v in _setter_switch(
            f"pf{n}",
            f"with PDL, {n} W tiles per program prefetched to L2 before the wait (linear_small_m.PREFETCH_TILES)",
            "kimi.kernels.triton.linear_small_m:set_prefetch_tiles",
            n,
        ).items()
    },
    "plan_ahead_off": (
        "FlashInfer planned before each replay (no plan ahead: KimiForCausalLM.plan_ahead False)",
        lambda m: _set_attrs("plan_ahead", [(m, "plan_ahead")], False),
        lambda m: _set_attrs("plan_ahead", [(m, "plan_ahead")], None),
    ),
    **{
        f"moe_cuda_pdl_{mode}": (
            f"kimi's CUDA expert GEMMs with PDL mode {mode} (cuda_experts_forward's pdl_mode)",
            lambda m, mode=mode: _set_attrs("pdl_mode", _cuda_gemm_impls(m, "pdl_mode"), mode),
            lambda m: _set_attrs("pdl_mode", _cuda_gemm_impls(m, "pdl_mode"), None),
        )
        for mode in ("early", "late", "off")
    },
    **{
        f"moe_cuda_{gemm}_c{c[0]}{c[1]}{c[2]}": (
            f"kimi's CUDA {gemm} GEMM (--moe-backend cuda / auto) with launch configuration {c}",
            lambda m, attr=attr, c=c: _moe_cuda_config(m, attr, c),
            lambda m, attr=attr: _moe_cuda_config(m, attr, None),
        )
        for gemm, attr in (("gate_up", "config13"), ("down", "config2"))
        for c in MOE_CUDA_CONFIGS
    },
    "down_waits_first": (
        "kimi's CUDA down GEMM reads its expert and loads weights only after griddepcontrol.wait "
        "(cuda_experts_forward's early_weights False)",
        lambda m: _set_attrs("early_weights", _cuda_gemm_impls(m, "early_weights"), False),
        lambda m: _set_attrs("early_weights", _cuda_gemm_impls(m, "early_weights"), None),
    ),
    "pads_token0": (
        "kimi's CUDA expert GEMMs read token 0's row for an align block's pad rows instead of zero-filling them "
        "(cuda_experts_forward's zero_pads False)",
        lambda m: _set_attrs("zero_pads", _cuda_gemm_impls(m, "zero_pads"), False),
        lambda m: _set_attrs("zero_pads", _cuda_gemm_impls(m, "zero_pads"), None),
    ),
    "glu_unfused": (
        "kimi's CUDA gate_up GEMM writes its plain outputs and the silu_mul_rows kernel computes SiLU(gate) * up "
        "(same weights; the GEMMs' glu switch off)",
        lambda m: _set_attrs("glu", _cuda_gemm_impls(m, "glu"), False),
        lambda m: _set_attrs("glu", _cuda_gemm_impls(m, "glu"), None),
    ),
    "auto_humming": (
        "--moe-backend auto with humming's expert GEMMs at every size (as --moe-backend humming, same weights)",
        lambda m: _auto_max_pairs(m, 0),
        lambda m: _auto_max_pairs(m, None),
    ),
    "humming_table_off": (
        "humming's heuristic schedules for the expert GEMMs (no measured table)",
        lambda m: _swap_humming_table(m, None, True),
        lambda m: _swap_humming_table(m, None, False),
    ),
    "humming_table_alt": (
        "the humming schedule table of $KIMI_HUMMING_TABLE_ALT (tools/bench_humming_sweep.py --table-out)",
        lambda m: _swap_humming_table(m, envs.KIMI_HUMMING_TABLE_ALT.require(), True),
        lambda m: _swap_humming_table(m, None, False),
    ),
    "small_tuned": (
        "small-kernel launch table of tools/sweep_small_kernels.py --table-out ($KIMI_SMALL_KERNELS_TABLE_ALT)",
        lambda m: _small_tuned(True),
        lambda m: _small_tuned(False),
    ),
}


_WARMUP = 3  # untimed steps before each timing (time_ms's warmup)


class DecodeSteps:
    """Context lengths of successive decode steps of B sequences, every sequence at the same length, one token more
    per step (as a server's decode steps). `restart()` goes back to the first step: each timing restarts, so every
    variant times the same lengths, ctx - iters // 2 .. ctx + iters - iters // 2 - 1 after its _WARMUP warm-up
    steps (mean ctx - 0.5 for an even iters)."""

    def __init__(self, ctx: int, batch: int, iters: int):
        self.first = ctx - _WARMUP - iters // 2
        self.batch, self.i = batch, 0

    def restart(self) -> DecodeSteps:
        self.i = 0
        return self

    def next(self) -> list[int]:
        n = self.first + self.i
        self.i += 1
        return [n] * self.batch


def time_pipelined(launch, iters: int = 20, warmup: int = 3, rounds: int = 3, restart=None) -> dict:
    """Steps issued the way the worker issues them under async scheduling (kimi.worker.runner.ModelRunner.launch):
    step i + 1 is launched, its host work included, before the host waits for step i's sampled ids. `launch(prev)`
    starts one step (prev: the last step's handle or None) and returns (handle, event after its device->host
    copy). Per round (each after `restart()` when given: the same steps every round): wall time from before the
    first timed launch to the last step's copy / iters (events on the stream); the median over rounds and each
    round's value, in ms per step."""
    per = []
    for _ in range(rounds):
        if restart is not None:
            restart()
        prev = None
        for _ in range(warmup):
            prev = launch(prev)[0]
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        prev, ev_prev = None, None
        for _ in range(iters):
            cur, ev = launch(prev)
            if ev_prev is not None:
                ev_prev.synchronize()  # the host waits for step i's tokens only once step i + 1 is queued
            prev, ev_prev = cur, ev
        ev_prev.synchronize()
        e.record()
        e.synchronize()
        per.append(s.elapsed_time(e) / iters)
    return {"median_ms": statistics.median(per), "round_ms": per, "iters": iters, "rounds": rounds}


def host_profile(call, steps, iters: int) -> str:
    """cProfile of `iters` calls call(lens) for the next steps of the batch, each after a device sync: the
    functions with the most own time (where a graph decode step's host time goes)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    for _ in range(iters):
        torch.cuda.synchronize()
        lens = steps.next()
        prof.enable()
        call(lens)
        prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(16)
    return out.getvalue()


def pooled(runs: list[dict]) -> dict:
    """time_ms results of several rounds -> one: median / min / max over all samples, the rounds' medians."""
    ts = [t for r in runs for t in r["samples"]]
    return {
        "median_ms": statistics.median(ts),
        "min_ms": min(ts),
        "max_ms": max(ts),
        "iters": len(ts),
        "round_medians_ms": [round(r["median_ms"], 3) for r in runs],
    }


def pipelined_timeline(launch, restart, steps: int = 8, warmup: int = 3, top: int = 12) -> dict:
    """GPU activity (kernels and copies, torch.profiler / CUPTI) of `steps` pipelined steps issued as
    time_pipelined issues them: the span from the first activity's start to the last one's end, per step; the
    time no activity runs (idle), per step; and the largest idle gaps with the activities on either side (name
    prefixes), to find where the pipelined step loses time beyond the replay and the logits."""
    from torch.profiler import ProfilerActivity, profile

    restart()
    prev = None
    for _ in range(warmup):
        prev = launch(prev)[0]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        prev, ev_prev = None, None
        for _ in range(steps):
            cur, ev = launch(prev)
            if ev_prev is not None:
                ev_prev.synchronize()
            prev, ev_prev = cur, ev
        ev_prev.synchronize()
        torch.cuda.synchronize()
    evs = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    if not evs:
        return {"error": "no CUDA activity recorded"}
    gaps, end, end_name, idle = [], evs[0][1], evs[0][2], 0.0
    for s0, e0, name in evs[1:]:
        if s0 > end:
            idle += s0 - end
            gaps.append((s0 - end, end_name[:60], name[:60]))
        if e0 > end:
            end, end_name = e0, name
    gaps.sort(reverse=True)
    span = end - evs[0][0]
    return {
        "steps": steps,
        "span_per_step_ms": round(span / steps / 1000.0, 4),
        "idle_per_step_ms": round(idle / steps / 1000.0, 4),
        "activities": len(evs),
        "top_gaps_us": [(round(g, 1), a, b) for g, a, b in gaps[:top]],
    }


def _short(name: str) -> str:
    """A kernel's name without its parameter list (and "void", "(anonymous namespace)::"), at most 80 characters."""
    name = name.replace("(anonymous namespace)::", "").removeprefix("void ")
    return re.sub(r"\(.*", "", name)[:80]


def _pushes(events, reach: float):
    """(start, end, name, push) of each (start, end, name) of events sorted by start: push = how far the kernel moved
    the end of the timeline past reach and every earlier kernel's end (the pushes sum to the span past reach). Under
    PDL a kernel's recorded duration includes its wait; its push does not."""
    for s0, e0, name in events:
        yield s0, e0, name, max(0.0, e0 - reach)
        reach = max(reach, e0)


def graph_timeline(replay, reps: int = 3, split_us: float = 500.0) -> dict:
    """Kernel timeline of `reps` replays of a captured graph (torch.profiler: CUPTI records each kernel a graph
    launches), per replay (medians): the span from the first kernel's start to the last one's end, the time some
    kernel runs (intervals merged: side-stream kernels overlap the main stream's), the idle time between kernels,
    the kernel count, kernel time by class (not merged), idle time by transition (class of the kernel that
    ended -> class of the next one to start), largest first, and per kernel name how far its kernels pushed the end
    of the timeline (span_ms_by_kernel, the 25 largest: summed over all names it is the span); and one layer's
    kernels of the last replay (layer_30_us: name, start, end, push, us from the layer's attention kernel). Replays
    are told apart by idle gaps > split_us."""
    from torch.profiler import ProfilerActivity, profile

    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            replay()
            torch.cuda.synchronize()
    evs = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )

    def cls(name: str) -> str:
        return next((c for c, rx in KERNEL_CLASSES if re.search(rx, name)), "other")

    runs, cur = [], []
    for ev in evs:
        if cur and ev[0] - max(e[1] for e in cur[-8:]) > split_us:
            runs.append(cur)
            cur = []
        cur.append(ev)
    if cur:
        runs.append(cur)
    stats = []
    for run in runs:
        busy = idle = 0.0
        end, end_name = run[0][1], run[0][2]
        busy = end - run[0][0]
        trans: dict[str, float] = {}
        by_cls: dict[str, float] = {}
        for s0, e0, name in run:
            by_cls[cls(name)] = by_cls.get(cls(name), 0.0) + (e0 - s0)
        for s0, e0, name in run[1:]:
            if s0 > end:
                idle += s0 - end
                key = f"{cls(end_name)} -> {cls(name)}"
                trans[key] = trans.get(key, 0.0) + (s0 - end)
                busy += e0 - s0
                end, end_name = e0, name
            elif e0 > end:
                busy += e0 - end
                end, end_name = e0, name
        span_by: dict[str, float] = {}
        for _, _, name, push in _pushes(run, run[0][0]):
            span_by[_short(name)] = span_by.get(_short(name), 0.0) + push
        stats.append(
            {
                "span_us": end - run[0][0],
                "busy_us": busy,
                "idle_us": idle,
                "kernels": len(run),
                "trans": trans,
                "by_cls": by_cls,
                "span_by": span_by,
            }
        )
    if not stats:
        return {"error": "no CUDA kernel events recorded"}
    med = lambda k: round(statistics.median(x[k] for x in stats) / 1000.0, 4)  # noqa: E731

    def med_by(field: str, top: int | None = None) -> dict[str, float]:
        """ms per key of the per-replay dicts stats[*][field] (median over replays, a missing key 0), largest first"""
        keys = {k for x in stats for k in x[field]}
        m = {k: round(statistics.median(x[field].get(k, 0.0) for x in stats) / 1000.0, 4) for k in keys}
        return dict(sorted(m.items(), key=lambda kv: -kv[1])[:top])

    # one layer of the last replay, kernel by kernel: from the 30th MLA attention kernel to the 31st (start, end and
    # how far it pushed the timeline, us from the first one's start)
    run = runs[-1]
    mla = [i for i, ev in enumerate(run) if re.search(r"BatchMLA|_mla_decode_stage1", ev[2])]
    layer = []
    if len(mla) > 31:
        t0 = run[mla[30]][0]
        layer = [
            (_short(name), round(s0 - t0, 1), round(e0 - t0, 1), round(push, 1))
            for s0, e0, name, push in _pushes(run[mla[30] : mla[31]], max(e[1] for e in run[: mla[30]]))
        ]
    return {
        "replays": len(stats),
        "span_ms": med("span_us"),
        "busy_ms": med("busy_us"),
        "idle_ms": med("idle_us"),
        "span_ms_by_kernel": med_by("span_by", 25),
        "layer_30_us": layer,
        "kernels": int(statistics.median(x["kernels"] for x in stats)),
        "kernel_ms_by_class": med_by("by_cls"),
        "idle_ms_by_transition": med_by("trans", 15),
    }


def config_name(args: argparse.Namespace) -> str:
    """The snapshot configuration of a run: experts' format and EP size, then whatever differs from the headline
    (context, layers, backend, FP8 dense layers, attention, layers per graph, preset)."""
    parts = [f"{'fp8' if args.quant == 'fp8' else 'int4'}-ep{args.ep_size}"]
    if args.ctx != 2048:
        parts.append(f"ctx{args.ctx}")
    if args.layers != 61:
        parts.append(f"L{args.layers}")
    if args.moe_backend != "auto":
        parts.append(args.moe_backend)
    if args.fp8_dense != "off":
        parts.append(f"fp8dense-{args.fp8_dense}")
    if args.attn:
        parts.append(f"attn-{args.attn}")
    if args.layers_per_graph is not None:
        parts.append(f"lpg{args.layers_per_graph}")
    if args.preset != "kimi-k2.6":
        parts.append(args.preset)
    return "-".join(parts)


def summarize(res: dict) -> dict:
    """The snapshot's table: per case the floor, the graph step and the pipelined step against it, the SM clock of
    the graph timing; notes: the copy bandwidth and the experts' backend, and each A/B variant's median."""

    def clock(t: dict) -> float | None:
        c = (t or {}).get("gpu_clock")
        return c["sm_clock_MHz"]["median"] if c else None

    rows = []
    for c in res["cases"]:
        g, p = c["graph"], c["graph_pipelined"]
        rows.append(
            [
                c["local_seqs"],
                c["moe_tokens"],
                c["ctx"],
                round(c["floor_ms"], 2),
                round(g["median_ms"], 2),
                round(c["graph_over_floor"], 3),
                round(p["median_ms"], 2),
                round(c["graph_pipelined_over_floor"], 3),
                clock(g),
            ]
        )
    notes = []
    if "cuda_gemm_layers" in res:
        notes.append(
            f"experts: {res.get('experts_impl')}; kimi's CUDA GEMM at decode sizes in "
            f"{res['cuda_gemm_layers']['cuda']} of {res['cuda_gemm_layers']['moe_layers']} MoE layers"
        )
    for c in res["cases"]:
        ab = [
            f"{k.removeprefix('graph_')} {v['median_ms']:.2f} ms"
            for k, v in c.items()
            if k.startswith("graph_") and isinstance(v, dict) and "round_medians_ms" in v
        ]
        if ab:
            notes.append(f"{c['local_seqs']} sequences, A/B variants in the same rounds: {', '.join(ab)}")
    return {
        "columns": [
            "local sequences",
            "MoE tokens",
            "context",
            "floor (ms)",
            "graph step (ms)",
            "graph / floor",
            "pipelined step (ms)",
            "pipelined / floor",
            "SM clock (MHz)",
        ],
        "rows": rows,
        "notes": notes,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=snapshot.HelpFormatter)
    ap.add_argument("--preset", default="kimi-k2.6", help="model preset (kimi/presets)")
    ap.add_argument(
        "--quant",
        default=None,
        choices=["fp8"],
        help="fp8: the preset's shapes with K2-Instruct's FP8 128x128 experts (random, kept FP8 by humming); "
        "with --fp8-dense, its FP8 dense projections too",
    )
    ap.add_argument(
        "--fp8-dense",
        default="off",
        choices=["off", "triton", "humming"],
        help="--quant fp8: the dense projections kept FP8 on kimi's Triton kernel / humming, or bf16 (off)",
    )
    ap.add_argument("--layers", type=int, default=61, help="layers of the model (61: all of K2's)")
    ap.add_argument("--seqs", default="8,32", help="local sequences per rank, comma list (8 = 64 in all under DP8)")
    ap.add_argument("--ctx", type=int, default=2048, help="context tokens of every sequence at the middle timed step")
    ap.add_argument("--ep-size", type=int, default=8, help="EP ranks emulated (this rank holds 1 / ep-size experts)")
    ap.add_argument(
        "--moe-backend", default="auto", choices=MOE_BACKENDS, help="routed-expert backend, as kimi serve's flag"
    )
    ap.add_argument("--block-size", type=int, default=64, help="KV cache block size (tokens)")
    ap.add_argument("--iters", type=int, default=20, help="timed steps per timing")
    ap.add_argument("--no-profile", action="store_true", help="skip the per-kernel breakdown of an eager step")
    ap.add_argument(
        "--pipelined-timeline",
        action="store_true",
        help="also the GPU activity of the pipelined steps (pipelined_timeline): idle time and largest gaps",
    )
    ap.add_argument(
        "--graph-timeline",
        action="store_true",
        help="also a kernel timeline of the headline graph's replays (graph_timeline) at the end of each "
        "case, then of each A/B variant's graph; a profiler session slows later graph launches in "
        "the process: use one --seqs value",
    )
    ap.add_argument(
        "--overlap",
        default="on",
        help="shared expert on a side stream (on) or inline (off); a comma list times the others as graph "
        "replays too (A/B in one run), the first is the headline",
    )
    ap.add_argument(
        "--attn",
        default=None,
        choices=["triton", "flashinfer"],
        help="decode attention of the headline (None: the model's decode_attention, FlashInfer)",
    )
    ap.add_argument(
        "--ab",
        default="control0",
        help="comma list of variants also timed as graph replays against the headline (A/B in one run): "
        + ", ".join(AB_VARIANTS),
    )
    ap.add_argument(
        "--layers-per-graph",
        type=int,
        default=None,
        help="layers per CUDA graph segment of the headline (None: kimi.worker.cuda_graph.LAYERS_PER_GRAPH; "
        "0: one graph)",
    )
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds of the graph variants")
    ap.add_argument("--out", default=None, help="write the full JSON result here")
    snapshot.add_arguments(ap)
    args = ap.parse_args()
    require_gpu(ap.prog)
    _LPG[0] = args.layers_per_graph

    from kimi.config import ModelConfig
    from kimi.model.attention import build_attention_metadata
    from kimi.model.weights import load_gpu_model
    from kimi.presets import load_preset
    from kimi.worker.cuda_graph import HOST_MARKS, CudaGraphRunner
    from kimi.worker.kv_cache import allocate_kv_caches

    dev = torch.device("cuda", torch.cuda.current_device())
    what = __doc__.split("\n")[0].replace("DP8 x EP8", f"DP{args.ep_size} x EP{args.ep_size}")
    res: dict = {"what": what, "args": vars(args)}
    res["copy_GBps"] = bw = copy_bandwidth(4 << 30, dev)["GBps_read_plus_write"]  # 4 GiB copy
    print(f"copy bandwidth {bw:.0f} GB/s", flush=True)

    cfg = ModelConfig.from_dict(load_preset(args.preset)).with_overrides(num_hidden_layers=args.layers)
    if args.quant == "fp8":
        from kimi.config import QuantConfig

        cfg = cfg.with_overrides(quant=QuantConfig(method="fp8", block=(128, 128)))
    seqs = [int(s) for s in args.seqs.split(",")]
    unknown = [a for a in args.ab.split(",") if a and a not in AB_VARIANTS]
    if unknown:
        raise SystemExit(f"unknown --ab variants {unknown}; known: {', '.join(AB_VARIANTS)}")
    t0 = time.time()
    a2a = EmulatedEP.for_model(cfg, seqs[0], args.ep_size, dev)
    model = load_gpu_model(
        "",
        cfg,
        ep_rank=0,
        ep_size=args.ep_size,
        a2a=a2a,
        dtype=torch.bfloat16,
        device=dev,
        moe_backend=args.moe_backend,
        load_format="dummy",
        max_positions=args.ctx + 64,
        fp8_dense=args.fp8_dense,
    )
    torch.cuda.synchronize()
    res["load_s"] = time.time() - t0
    if args.attn:
        model.decode_attention = args.attn
    res["decode_attention"] = model.decode_attention
    from kimi.worker import cuda_graph as _cg

    res["layers_per_graph"] = _cg.LAYERS_PER_GRAPH if _LPG[0] is None else _LPG[0]
    impl = type(model.layers[cfg.first_k_dense_replace].mlp.experts_impl).__name__
    res["experts_impl"] = impl
    # the MoE layers whose decode-sized steps run kimi's CUDA GEMM (--moe-backend cuda: all; auto: those where it can
    # run, the rest humming's, with the reason logged at load)
    res["cuda_gemm_layers"] = {
        "cuda": len(_cuda_gemm_impls(model, "config13")),
        "moe_layers": len(_experts_impls(model)),
    }
    fp8_layers = [m for m in model.modules() if type(m).__name__ == "Fp8Linear"]
    # FP8 dense layers kept FP8 (--quant fp8 with --fp8-dense triton / humming), and how many of them run on humming
    res["dense_fp8_layers"] = {
        "layers": len(fp8_layers),
        "humming": sum(m.hl is not None for m in fp8_layers),
        "fp8_dense": args.fp8_dense,
    }
    from kimi.backends.experts import humming
    from kimi.kernels import tuning
    from kimi.kernels.triton import linear_small_m as _lsm
    from kimi.kernels.triton import pdl as _pdl

    res["pdl"] = {"enabled": _pdl.ENABLED, "prefetch_tiles": _lsm.PREFETCH_TILES}
    ht = humming.load_humming_table()
    res["humming_table"] = {
        "path": str(tuning.path_of("humming")),
        "gpu": ht["gpu"],
        "entries": {f"{n}x{k}": [[lo, hi] for lo, hi, *_ in v] for (n, k), v in ht["entries"].items()},
    }
    res["mem_allocated_after_load_GiB"] = round(torch.cuda.memory_allocated() / 2**30, 2)
    print(
        f"model built in {res['load_s']:.1f} s ({impl}; kimi's CUDA GEMM at decode sizes in "
        f"{res['cuda_gemm_layers']['cuda']} of {res['cuda_gemm_layers']['moe_layers']} MoE layers); "
        f"mem {res['mem_allocated_after_load_GiB']:.1f} GiB",
        flush=True,
    )
    # the SM clock / power of every graph timing (each variant's "gpu_clock"): the H200 runs the step at its power cap
    sampler = GpuSampler(dev).start()

    n_local = cfg.n_routed_experts // args.ep_size
    expert_bytes = bytes_per_expert(model, n_local)
    dense_bytes = dense_weight_bytes(model)
    res["bytes_per_expert"] = expert_bytes
    res["dense_weight_bytes"] = dense_bytes

    bs = args.block_size
    if args.ctx <= _WARMUP + args.iters // 2:
        raise SystemExit(
            f"--ctx must exceed {_WARMUP + args.iters // 2} (the timed steps start below ctx; DecodeSteps)"
        )
    nblk_seq = -(-(args.ctx + args.iters) // bs)  # room for the longest context a timing reaches
    max_b = max(seqs)
    kv = allocate_kv_caches(cfg, max_b * nblk_seq + 1, bs, torch.bfloat16, dev)
    g = torch.Generator(device=dev).manual_seed(1)
    for c in kv:
        c.normal_(0, 1, generator=g)
    res["cases"] = []
    profiles = []  # (case, install, step): profiled after every timing (a torch.profiler session slows later
    # graph launches in the same process)
    for B in seqs:
        case: dict = {"local_seqs": B, "moe_tokens": B * args.ep_size, "ctx": args.ctx}
        ep = EmulatedEP.for_model(cfg, B, args.ep_size, dev, seed=B)
        ep.install(model)
        hit = ep.experts_hit(0, n_local)
        timed = [args.ctx - args.iters // 2 + j for j in range(args.iters)]  # DecodeSteps' timed context lengths
        kv_bytes = int(B * statistics.mean(timed) * cfg.num_hidden_layers * cfg.kv_cache_dim * 2)
        wbytes = dense_bytes + sum(hit) * expert_bytes + B * cfg.hidden_size * 2
        # weight streams of a GEMM in 8- / 16-row align blocks (one per block): > experts hit where an expert has more
        # rows than a block (the floor counts each expert once)
        case["row_blocks_mean"] = {bm: statistics.mean(ep.row_blocks(0, n_local, bm)) for bm in (8, 16)}
        case.update(
            experts_hit_mean=sum(hit) / len(hit),
            expert_bytes=sum(hit) * expert_bytes,
            dense_bytes=dense_bytes,
            kv_bytes=kv_bytes,
            total_bytes=wbytes + kv_bytes,
        )
        case["floor_ms"] = floor = (wbytes + kv_bytes) / (bw * 1e9) * 1e3
        perm = (torch.randperm(max_b * nblk_seq, generator=torch.Generator().manual_seed(B)) + 1).tolist()
        tabs = [perm[i * nblk_seq : (i + 1) * nblk_seq] for i in range(B)]
        slens = [args.ctx] * B
        ids_l = torch.randint(0, cfg.vocab_size, (B,)).tolist()
        steps = DecodeSteps(args.ctx, B, args.iters)

        def step(ids_l=ids_l, tabs=tabs, steps=steps):  # the worker's decode path (ModelRunner.execute): host lists
            # -> graph replay or eager, the next step of the batch each call (this case's lists bound now: the
            # profile runs after the loop)
            lens = steps.next()
            h = model.forward_decode(ids_l, [n - 1 for n in lens], lens, tabs, bs, kv)
            return model.compute_logits(h).argmax(-1)

        with torch.inference_mode():
            ep.i = 0
            steps.restart()
            case["eager"] = time_ms(step, args.iters, _WARMUP)
            print(f"B={B}: eager {case['eager']['median_ms']:.2f} ms, floor {floor:.2f} ms", flush=True)

            def capture(overlap: bool, B: int = B, ep: EmulatedEP = ep) -> CudaGraphRunner:
                """Capture bucket B (shared expert on the side stream or inline) and install it on the model."""
                model.overlap_shared = overlap
                model.graphs = None
                kw = {} if _LPG[0] is None else {"layers_per_graph": _LPG[0]}
                r = CudaGraphRunner(model, kv, bs, B, nblk_seq, buckets=[B], **kw)
                ep.i = 0
                r.capture()
                model.graphs = r
                ep.i = 0
                return r

            # every variant's graph is captured first, with the variant applied; then all are timed in --rounds
            # interleaved rounds (A, B, C, headline; B, C, headline, A; ...), each variant applied again while it is
            # timed (for switches read at run time, e.g. by the eager lm_head), over the same steps
            # (DecodeSteps.restart): slow drifts of the GPU's speed within the run fall on every variant alike
            modes = args.overlap.split(",")
            nop = lambda m: None  # noqa: E731
            variants = []  # (key, what, runner, apply, undo); the headline last
            for mode in modes[1:]:
                variants.append(
                    (f"graph_overlap_{mode}", f"shared expert overlap {mode}", capture(mode == "on"), nop, nop)
                )
            for name in [a for a in args.ab.split(",") if a]:
                what, apply, undo = AB_VARIANTS[name]
                apply(model)
                variants.append((f"graph_{name}", what, capture(modes[0] == "on"), apply, undo))
                undo(model)
            case["overlap_shared"] = modes[0] == "on"
            t1 = time.time()
            runner = capture(case["overlap_shared"])
            case["capture_s"] = time.time() - t1
            variants.append(("graph", None, runner, nop, nop))
            planned_ahead = runner.graph_attention.plans_ahead  # the attention hooks plan ahead (FlashInfer)
            hits0 = runner.fi[B].ahead_hits if planned_ahead else 0
            runs: dict[str, list] = {v[0]: [] for v in variants}
            spans: dict[str, list] = {v[0]: [] for v in variants}  # time.time() spans of each variant's timings
            for rnd in range(args.rounds):
                # the order rotates by one variant each round, so no variant (the headline included) is always
                # timed last (a last-timed graph ran up to 0.3 ms slower than an identical capture)
                for k, _, r, apply, undo in variants[rnd % len(variants) :] + variants[: rnd % len(variants)]:
                    model.graphs = r
                    apply(model)
                    steps.restart()
                    t_0 = time.time()
                    runs[k].append(time_ms(step, args.iters, _WARMUP))
                    spans[k].append((t_0, time.time()))
                    undo(model)
            for k, what, *_ in variants:
                case[k] = pooled(runs[k]) | ({"what": what} if what else {}) | {"gpu_clock": sampler.windows(spans[k])}
                if k != "graph":
                    print(
                        f"B={B}: {k} {case[k]['median_ms']:.2f} ms (rounds {case[k]['round_medians_ms']})", flush=True
                    )
            model.graphs = runner
            if not args.graph_timeline:  # (else kept for their timelines, after the headline's measurements)
                variants.clear()  # the A/B variants' graphs are freed with their runners
                torch.cuda.empty_cache()
            assert runner.num_replays > 0
            case["plan_ahead"] = runner.plan_ahead
            if planned_ahead:
                # of rounds x (_WARMUP + iters) steps; the first of each timing follows a restart (a miss)
                case["plan_ahead_hits"] = runner.fi[B].ahead_hits - hits0
            gm = case["graph"]["median_ms"]
            case["graph_over_floor"] = gm / floor
            case["eager_over_floor"] = case["eager"]["median_ms"] / floor

            # host time of the whole decode call (plan ahead included) and of its part before the replay's launch
            # (slots, pinned copy, FlashInfer schedule, graph launch): the GPU idles through the latter when each
            # step waits for the last, as a server's steps do
            def decode(lens, ids_l=ids_l, tabs=tabs):  # the graph decode call alone (no logits)
                return model.forward_decode(ids_l, [n - 1 for n in lens], lens, tabs, bs, kv)

            hs, hr = [], []
            decode(steps.restart().next())  # a first step, planned afresh (the restart is a miss): not measured
            for _ in range(args.iters):
                torch.cuda.synchronize()
                t_h = time.perf_counter()
                decode(steps.next())
                hs.append((time.perf_counter() - t_h) * 1e6)
                hr.append(runner.host_marks)
            torch.cuda.synchronize()
            case["host_forward_decode_us"] = statistics.median(hs)
            case["host_until_replay_us"] = statistics.median(m[-1] for m in hr)
            # where it goes: us from the call's start at each of cuda_graph.HOST_MARKS (medians)
            case["host_marks_us"] = {k: round(statistics.median(m[i] for m in hr), 1) for i, k in enumerate(HOST_MARKS)}
            decode(steps.restart().next())
            case["host_profile"] = host_profile(decode, steps, args.iters)
            # the replay alone (no host planning / logits): graph of the forward only
            a = build_attention_metadata([1] * B, slens, tabs, bs, dev)
            runner._plan(B, slens, a.block_tables)
            case["graph_forward_only"] = time_ms(lambda r=runner, B=B: r.replay(B), args.iters)
            # the worker's pipelined decode (async scheduling): the next step's host work and replay are queued
            # before the host waits for this step's tokens; its input ids come from this step's argmax on the device
            rows = torch.arange(B, device=dev)

            def launch(prev, steps=steps, tabs=tabs, ids_l=ids_l, rows=rows):
                lens = steps.next()
                fill = None if prev is None else (rows, prev, rows)
                h = model.forward_decode(ids_l, [n - 1 for n in lens], lens, tabs, bs, kv, fill=fill)
                nxt = model.compute_logits(h).argmax(-1)
                return nxt, start_host_copy(nxt)[1]  # the sampler's one copy to pinned memory, and its event

            t_0 = time.time()
            case["graph_pipelined"] = time_pipelined(launch, args.iters, _WARMUP, restart=steps.restart)
            case["graph_pipelined"]["gpu_clock"] = sampler.windows([(t_0, time.time())])
            case["graph_pipelined_over_floor"] = case["graph_pipelined"]["median_ms"] / floor
            print(
                f"B={B}: graph pipelined {case['graph_pipelined']['median_ms']:.2f} ms per step "
                f"({case['graph_pipelined_over_floor']:.3f}x floor; rounds {case['graph_pipelined']['round_ms']})",
                flush=True,
            )
            if args.pipelined_timeline:
                case["pipelined_timeline"] = pipelined_timeline(launch, steps.restart)
                print(f"B={B}: pipelined timeline {json.dumps(case['pipelined_timeline'])}", flush=True)
            if args.graph_timeline:
                case["graph_timeline"] = graph_timeline(lambda r=runner, B=B: r.replay(B))
                print(f"B={B}: graph timeline {json.dumps(case['graph_timeline'])}", flush=True)
                # each A/B variant's timeline too (the headline is last), with the FlashInfer plan its last timed
                # step left (per-kernel times compare; spans are not strictly symmetric with the headline's)
                for k, _, r, apply, undo in variants[:-1]:
                    model.graphs = r
                    apply(model)
                    case[k]["graph_timeline"] = graph_timeline(lambda r=r, B=B: r.replay(B))
                    undo(model)
                    print(
                        f"B={B}: {k} timeline layer_30_us {json.dumps(case[k]['graph_timeline'].get('layer_30_us'))}",
                        flush=True,
                    )
                model.graphs = runner
                variants.clear()
                torch.cuda.empty_cache()
            clock = case["graph"]["gpu_clock"]
            print(
                f"B={B}: graph {gm:.2f} ms = {gm / floor:.2f}x floor {floor:.2f} ms (replay only "
                f"{case['graph_forward_only']['median_ms']:.2f} ms); experts hit/layer {case['experts_hit_mean']:.1f}"
                + (
                    f"; SM clock median {clock['sm_clock_MHz']['median']:.0f} MHz, power-capped "
                    f"{100 * clock['power_capped_fraction']:.0f}% of {clock['samples']} samples"
                    if clock
                    else ""
                ),
                flush=True,
            )
            model.graphs = None
            del runner
            torch.cuda.empty_cache()
        res["cases"].append(case)

        def install(ep=ep):  # this case's emulated all-to-all back on the MoE layers (for the profile below)
            ep.install(model)

        profiles.append((case, install, step))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1, default=str)
    sampler.stop()
    if not args.no_profile:
        with torch.inference_mode():
            for case, install, step in profiles:
                install()
                try:
                    case["breakdown_eager"] = breakdown(step)
                except Exception as e:
                    case["breakdown_error"] = repr(e)
    clocks = {c["local_seqs"]: (c["graph"].get("gpu_clock") or {}).get("sm_clock_MHz") for c in res["cases"]}
    conds = snapshot.conditions(sm_clock_MHz_during_graph_timing=clocks, copy_GBps=res["copy_GBps"])
    res["conditions"] = conds
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)
    if args.snapshot:
        snapshot.write(
            args.snapshot,
            benchmark="decode",
            config=config_name(args),
            summary=summarize(res),
            results=res,
            conds=conds,
        )
    print("\nB_local  moe_tok  floor_ms  eager_ms  graph_ms  graph/floor  replay_ms  pipelined_ms  pipelined/floor")
    for c in res["cases"]:
        print(
            f"{c['local_seqs']:7d}  {c['moe_tokens']:7d}  {c['floor_ms']:8.2f}  {c['eager']['median_ms']:8.2f}  "
            f"{c['graph']['median_ms']:8.2f}  {c['graph_over_floor']:11.2f}  "
            f"{c['graph_forward_only']['median_ms']:9.2f}  {c['graph_pipelined']['median_ms']:12.2f}  "
            f"{c['graph_pipelined_over_floor']:15.3f}  host {c['host_until_replay_us']:.0f} us before the replay "
            f"({c['host_forward_decode_us']:.0f} us in all)"
        )
        print(f"    host marks (us from the call's start) {c['host_marks_us']}")
        if "breakdown_eager" in c:
            print("   ", json.dumps(c["breakdown_eager"]["by_class_ms"]))


if __name__ == "__main__":
    main()
