"""Guided decoding cost: the CPU time per constrained token, and (CUDA) the decode step with constrained rows.

(a) cpu: B rows (B in --rows) each guided by a JSON-schema matcher (kimi.structured_output.bitmask.GuidedRequests,
    the worker's), each row replaying its own valid JSON token sequence: per step one `fill` of the batch's bitmask
    and one `accept` per row. Reports the step's CPU time and the time per constrained token (fill + accept).
(b) cuda (with --cuda and a GPU): a ModelRunner on the K2.6 preset cut to --layers layers, dummy weights, CUDA
    graphs, --batch decode rows of which 0 / 8 / 64 / 256 (--constrained) are guided by the same schema (greedy, so
    the dummy model's tokens follow the grammar); steps issued as the worker issues them (ModelRunner.launch with
    the previous step unfinished). Reports the step time and its overhead over the unconstrained step.

The vocabulary is the real Kimi one when found ($KIMI_TOKENIZER_DIR, ../shared/kimi-tokenizer), else the built-in
byte-level one (the conditions say which). Snapshot (--snapshot): <device>/structured_output.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from typing import Any

from kimi.benchmarks import snapshot

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 8},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "[0-9]{5}"}},
            "required": ["city", "zip"],
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "address", "active"],
    "additionalProperties": False,
}
SAMPLE = {
    "name": "Ada Lovelace of the analytical engine",
    "age": 36,
    "tags": ["math", "poetry", "engines", "notes", "Babbage"],
    "address": {"city": "London, Marylebone", "zip": "12345"},
    "active": True,
}


def _tokenizer() -> tuple[Any, str]:
    from kimi.tokenizer import KimiTokenizer, default_tokenizer_source, write_tokenizer_files

    src = default_tokenizer_source()
    with tempfile.TemporaryDirectory() as d:
        write_tokenizer_files(d, src)
        return KimiTokenizer.from_dir(d), ("real Kimi vocabulary" if src else "built-in byte-level vocabulary")


def bench_cpu(rows: list[int], steps: int) -> list[dict[str, Any]]:
    from kimi.structured_output.backend import GrammarBackend
    from kimi.structured_output.bitmask import GuidedRequests
    from kimi.structured_output.spec import GrammarSpec

    tok, _ = _tokenizer()
    backend = GrammarBackend(tok, 163840, [163585])
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    backend.compile(spec)
    seq = tok.encode(json.dumps(SAMPLE)) + [163586]
    out = []
    for B in rows:
        gr = GuidedRequests(lambda: backend, 163840)
        guides = [gr.add(i, spec) for i in range(B)]
        pos = [(7 * i) % (len(seq) - 1) for i in range(B)]  # rows at different places of their JSON
        for g, p in zip(guides, pos):
            for t in seq[:p]:
                g.accept(t)
        fill_s, accept_s = [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            gr.fill(list(enumerate(guides)), B)
            t1 = time.perf_counter()
            for i, g in enumerate(guides):
                if pos[i] >= len(seq):  # ended: a fresh row starts over (the batch stays constrained)
                    guides[i] = g = gr.add(i, spec)
                    pos[i] = 0
                err = g.accept(seq[pos[i]])
                assert err is None, err
                pos[i] += 1
            t2 = time.perf_counter()
            fill_s.append(t1 - t0)
            accept_s.append(t2 - t1)
        fill, acc = statistics.median(fill_s), statistics.median(accept_s)
        r = {
            "rows": B,
            "fill_ms": fill * 1e3,
            "accept_ms": acc * 1e3,
            "step_cpu_ms": (fill + acc) * 1e3,
            "us_per_constrained_token": (fill + acc) / B * 1e6,
        }
        print(json.dumps(r), flush=True)
        out.append(r)
        gr.close()
    return out


def bench_cuda(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    from kimi import protocol
    from kimi.config import CacheConfig, ModelConfig
    from kimi.presets import load_preset
    from kimi.structured_output.spec import GrammarSpec
    from kimi.worker.runner import ModelRunner

    cfg = ModelConfig.from_dict(load_preset("kimi-k2.6")).with_overrides(num_hidden_layers=args.layers)
    B, P, bs = args.batch, 32, 64
    per_req = -(-(P + args.steps + args.warmup + 2) // bs)
    runner = ModelRunner(
        "preset:kimi-k2.6",
        cfg,
        CacheConfig(block_size=bs, num_blocks=B * per_req + 2),
        device="cuda",
        dtype=torch.bfloat16,
        progress=False,
        gpu_options=dict(load_format="dummy", cuda_graph_max_bs=B),
    )
    spec = GrammarSpec("json_schema", json.dumps({"type": "array", "items": {"type": "string"}}))
    out = []
    step = 0
    for k in args.constrained:
        k = min(k, B)
        new = []
        for i in range(B):
            sp = protocol.SamplingParams(temperature=0.0, grammar=spec if i < k else None)
            blocks = list(range(1 + i * per_req, 1 + (i + 1) * per_req))
            new.append(protocol.NewRequest(i, 0, [100 + i] * P, 0, P, blocks, sp, P))
        step += 1
        pending = runner.launch(protocol.StepPlan(step, new, [], []))
        times = []
        for _ in range(args.warmup + args.steps):
            step += 1
            t0 = time.perf_counter()
            pending = runner.launch(
                protocol.StepPlan(step, [], [protocol.ContinueRequest(i, 1, []) for i in range(B)], []), pending
            )
            times.append(time.perf_counter() - t0)
        runner.finish(pending)
        torch.cuda.synchronize()
        live = sum(1 for g in runner.guided.rows.values() if not g.terminated)
        step += 1
        runner.execute(protocol.StepPlan(step, [], [], list(range(B))))  # drop them all
        ms = statistics.median(times[args.warmup :]) * 1e3
        r = {"batch": B, "constrained": k, "still_constrained_at_end": live, "step_ms": ms}
        print(json.dumps(r), flush=True)
        out.append(r)
    base = out[0]["step_ms"] if out and out[0]["constrained"] == 0 else None
    for r in out:
        r["overhead_pct"] = None if base is None else (r["step_ms"] / base - 1) * 100
    runner.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=snapshot.HelpFormatter)
    ap.add_argument("--rows", default="1,8,64,256", help="(a) constrained rows per step")
    ap.add_argument("--steps", type=int, default=40, help="timed steps per configuration")
    ap.add_argument("--warmup", type=int, default=5, help="(b) untimed steps first")
    ap.add_argument("--cuda", action="store_true", help="also run (b) on the GPU")
    ap.add_argument("--layers", type=int, default=4, help="(b) layers of the K2.6 preset")
    ap.add_argument("--batch", type=int, default=256, help="(b) decode rows")
    ap.add_argument("--constrained", default="0,8,64,256", help="(b) how many of the rows are constrained")
    snapshot.add_arguments(ap)
    args = ap.parse_args(argv)
    args.constrained = [int(x) for x in args.constrained.split(",")]
    rows = [int(x) for x in args.rows.split(",")]
    _, vocab = _tokenizer()
    results: dict[str, Any] = {"vocabulary": vocab, "cpu": bench_cpu(rows, args.steps)}
    if args.cuda:
        results["cuda"] = bench_cuda(args)
    conds = snapshot.conditions(gpu=args.cuda, vocabulary=vocab, schema="SCHEMA of tools/bench_structured_output.py")
    cols = ["constrained rows", "CPU fill + accept per step (ms)", "CPU per constrained token (us)"]
    table = [[r["rows"], round(r["step_cpu_ms"], 3), round(r["us_per_constrained_token"], 2)] for r in results["cpu"]]
    notes = [f"(a) {vocab}; the worker's GuidedRequests, one JSON-schema matcher per row"]
    if args.cuda:
        cols += ["decode step (ms)", "overhead vs none (%)"]
        by_k = {r["constrained"]: r for r in results["cuda"]}
        for row in table:
            r = by_k.get(row[0])
            row += (
                [round(r["step_ms"], 3), None if r["overhead_pct"] is None else round(r["overhead_pct"], 2)]
                if r
                else [None, None]
            )
        if 0 in by_k:
            table.insert(0, [0, 0.0, None, round(by_k[0]["step_ms"], 3), 0.0])
        notes.append(f"(b) K2.6 preset, {args.layers} layers, dummy weights, CUDA graphs, {args.batch} decode rows")
    print(json.dumps(results, indent=2))
    if args.snapshot:
        snapshot.write(
            args.snapshot,
            benchmark="structured_output",
            config="",
            summary={"columns": cols, "rows": table, "notes": notes},
            results=results,
            conds=conds,
            device=None if args.cuda else "cpu",
            command=snapshot.command_line([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
