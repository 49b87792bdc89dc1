#!/usr/bin/env python
"""Load generator for any OpenAI-compatible server (kimi, vLLM, SGLang): streaming /v1/completions.

    python tools/bench_serving.py --base-url http://127.0.0.1:8000/v1 --model tiny-k2.6 \\
        --num-requests 256 --concurrency 64 --input-len 512 --output-len 128 [--request-rate 8] \\
        [--input-dist fixed|uniform|normal] [--output-dist ...] [--prompt-kind tokens|words] \\
        [--shared-prefix-ratio 0.5 --num-prefixes 4] [--cases 1x1x8,1024x64,...] [--api-key KEY] [--out result.json]
        [--snapshot]

(`make serve` serves `tiny-k2.6` at http://127.0.0.1:8000.) The base URL may end in /v1 (as the OpenAI client takes
it) or not. --api-key defaults to $OPENAI_API_KEY. Without --model the server's only model is used (GET /v1/models;
several are an error naming them).

Prompts are distinct (identical prompts under-measure MoE decode: every row would route to the same
experts): random token ids (`tokens`, ids in [1000, 100000), sent as a token-id list) or random words
(`words`, text from a fixed word list; the server tokenizes, so the length in tokens is approximate).
With `--shared-prefix-ratio r`, the first r * input_len tokens of each prompt come from one of
`--num-prefixes` shared prefixes (prefix-cache workloads); the rest is random.
Lengths: `fixed` = the given length; `uniform` = U[(1 - spread) L, (1 + spread) L]; `normal` = N(L, (spread L)^2)
clipped to >= 1 (`--spread`, default 0.25). Every request sets `ignore_eos` (so output lengths are the asked
ones on servers that honour it) and `stream_options.include_usage`.
Arrivals: all at once bounded by `--concurrency` (closed loop), or a Poisson process of `--request-rate`
requests/s (open loop; still capped by --concurrency).

Metrics per request (time.perf_counter): TTFT = first content chunk - send; ITL = gaps between content
chunks; TPOT = (last chunk - first chunk) / (output tokens - 1). Reported: p50 / p90 / p99 / mean of each,
request throughput (completed / wall s), output token throughput (usage.completion_tokens summed / wall s),
errors (HTTP status or error chunk, with the first messages). A chunk may carry several tokens (the server
may merge deltas), so ITL is per chunk; TPOT uses the token count from usage.

Output: one summary line (requests, errors, throughput, TTFT p50, TPOT p50), then the JSON report (also to --out).
The exit status is 1 if any request failed. Snapshot (--snapshot): <device>/serving_<config>.json, the device from
--snapshot-device (default: this machine's GPU as nvidia-smi names it, else cpu), the config from --snapshot-config
(default in<input-len>-out<output-len>-c<concurrency>).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

from kimi.benchmarks import snapshot
from kimi.benchmarks.serving import auth_headers, default_api_key, normalize_base_url, served_model, summary_line
from kimi.benchmarks.smi import query_gpu

WORDS = [  # prompt words of --prompt-kind words
    *["time", "year", "people", "way", "day", "man", "thing", "woman", "life", "child"],
    *["world", "school", "state", "family", "student", "group", "country", "problem", "hand", "part"],
    *["place", "case", "week", "company", "system", "program", "question", "work", "government", "number"],
    *["night", "point", "home", "water", "room", "mother", "area", "money", "story", "fact"],
    *["month", "lot", "right", "study", "book", "eye", "job", "word", "business", "issue"],
    *["side", "kind", "head", "house", "service", "friend", "father", "power", "hour", "game"],
    *["line", "end", "member", "law", "car", "city", "community", "name"],
]


@dataclass
class Result:
    """One request's outcome. Times in seconds (perf_counter), relative to the benchmark start."""

    ok: bool
    input_len: int
    output_tokens: int = 0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float | None = None
    error: str | None = None
    cached_tokens: int = 0


def lengths(n: int, mean: int, dist: str, spread: float, rng: random.Random) -> list[int]:
    """n lengths >= 1 around `mean` with distribution `dist` (fixed / uniform / normal). Raises ValueError."""
    if dist == "fixed":
        return [mean] * n
    if dist == "uniform":
        lo, hi = max(1, round(mean * (1 - spread))), max(1, round(mean * (1 + spread)))
        return [rng.randint(lo, hi) for _ in range(n)]
    if dist == "normal":
        return [max(1, round(rng.gauss(mean, spread * mean))) for _ in range(n)]
    raise ValueError(f"unknown distribution {dist!r}")


def make_prompts(args: argparse.Namespace, rng: random.Random) -> list[tuple[list[int] | str, int, int]]:
    """(prompt, input length in tokens (approximate for words), max_tokens) per request."""
    ins = lengths(args.num_requests, args.input_len, args.input_dist, args.spread, rng)
    outs = lengths(args.num_requests, args.output_len, args.output_dist, args.spread, rng)
    n_pref = round(args.shared_prefix_ratio * args.input_len)
    if args.prompt_kind == "tokens":
        prefixes = [[rng.randrange(1000, 100000) for _ in range(n_pref)] for _ in range(args.num_prefixes)]
    else:
        prefixes = [[rng.choice(WORDS) for _ in range(n_pref)] for _ in range(args.num_prefixes)]
    res = []
    for i, (li, lo) in enumerate(zip(ins, outs)):
        pre = prefixes[i % args.num_prefixes][: min(n_pref, li - 1)] if n_pref else []
        if args.prompt_kind == "tokens":
            p = pre + [rng.randrange(1000, 100000) for _ in range(li - len(pre))]
        else:
            p = " ".join(pre + [rng.choice(WORDS) for _ in range(li - len(pre))])
        res.append((p, li, lo))
    return res


async def one(client: httpx.AsyncClient, args, prompt, in_len: int, max_tokens: int, t0: float) -> Result:
    body = {
        "model": args.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    r = Result(ok=False, input_len=in_len)
    start = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", f"{args.root}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                c = json.loads(data)
                if "error" in c:
                    r.error = str(c["error"].get("message"))[:200]
                    return r
                if c.get("usage"):
                    r.output_tokens = c["usage"].get("completion_tokens", 0)
                    r.cached_tokens = (c["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
                if c.get("choices") and c["choices"][0].get("text"):
                    now = time.perf_counter()
                    if last is None:
                        r.ttft = now - start
                    else:
                        r.itl.append(now - last)
                    last = now
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        r.error = f"{type(e).__name__}: {e}"[:200]
        return r
    r.latency = time.perf_counter() - start
    r.ok = True
    return r


def pct(xs: list[float], q: float) -> float | None:
    """The q-quantile (0..1) of xs by linear interpolation; None when empty."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q
    f = math.floor(k)
    c = min(f + 1, len(s) - 1)
    return s[f] + (s[c] - s[f]) * (k - f)


def summary(xs: list[float]) -> dict[str, float | None]:
    """p50 / p90 / p99 / mean in milliseconds."""
    ms = [x * 1000 for x in xs]
    return {
        "p50_ms": pct(ms, 0.5),
        "p90_ms": pct(ms, 0.9),
        "p99_ms": pct(ms, 0.99),
        "mean_ms": sum(ms) / len(ms) if ms else None,
    }


async def run(args: argparse.Namespace) -> dict:
    """Send every request, gather Results, return the report dict."""
    rng = random.Random(args.seed)
    prompts = make_prompts(args, rng)
    sem = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency + 8, max_keepalive_connections=args.concurrency + 8)
    bar = tqdm(total=len(prompts), desc="requests", disable=args.no_progress)
    results: list[Result] = []
    headers = auth_headers(args.api_key)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits, headers=headers) as client:
        t0 = time.perf_counter()

        async def task(p, li, lo):
            async with sem:
                res = await one(client, args, p, li, lo, t0)
            results.append(res)
            bar.update(1)

        tasks = []
        for p, li, lo in prompts:
            tasks.append(asyncio.create_task(task(p, li, lo)))
            if args.request_rate > 0:
                await asyncio.sleep(rng.expovariate(args.request_rate))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    bar.close()
    ok = [r for r in results if r.ok]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.ttft is not None and r.output_tokens > 1]
    errors = [r.error for r in results if not r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "api_key", "root")},
        "num_requests": len(results),
        "completed": len(ok),
        "errors": len(errors),
        "error_examples": sorted(set(errors))[:5],
        "wall_s": wall,
        "request_throughput_per_s": len(ok) / wall,
        "output_token_throughput_per_s": out_tokens / wall,
        "total_output_tokens": out_tokens,
        "total_input_tokens": sum(r.input_len for r in ok),
        "cached_prompt_tokens": sum(r.cached_tokens for r in ok),
        "ttft": summary([r.ttft for r in ok if r.ttft is not None]),
        "tpot": summary(tpot),
        "itl": summary([x for r in ok for x in r.itl]),
        "e2e_latency": summary([r.latency for r in ok]),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=snapshot.HelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, with or without /v1")
    p.add_argument("--api-key", default=default_api_key(), help="sent as a Bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--model", default=None, help="the model to ask for (None: the server's only model)")
    p.add_argument("--num-requests", type=int, default=256, help="requests in all")
    p.add_argument("--concurrency", type=int, default=64, help="max requests in flight")
    p.add_argument("--request-rate", type=float, default=0.0, help="Poisson arrivals per second; 0 = all at once")
    p.add_argument("--input-len", type=int, default=512, help="prompt tokens (mean)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens (mean; ignore_eos)")
    p.add_argument("--input-dist", default="fixed", choices=["fixed", "uniform", "normal"], help="prompt lengths")
    p.add_argument("--output-dist", default="fixed", choices=["fixed", "uniform", "normal"], help="output lengths")
    p.add_argument("--spread", type=float, default=0.25, help="relative spread of uniform / normal lengths")
    p.add_argument("--prompt-kind", default="tokens", choices=["tokens", "words"], help="token ids or words")
    p.add_argument(
        "--shared-prefix-ratio", type=float, default=0.0, help="fraction of each prompt from a shared prefix"
    )
    p.add_argument("--num-prefixes", type=int, default=1, help="distinct shared prefixes")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every request")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrivals")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request HTTP timeout, s")
    p.add_argument(
        "--cases",
        default=None,
        help="comma list of INPUTxCONCURRENCY[xREQUESTS] run one after another on the same server, each with its "
        "own report and one snapshot row (e.g. 1024x1x8,1024x64: 8 lone 1024-token prompts, then a burst of 64); "
        "overrides --input-len, --concurrency and --num-requests (default REQUESTS: the concurrency)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--out", default=None, help="write the JSON report here")
    snapshot.add_arguments(p)
    p.add_argument("--snapshot-device", default=None, help="the snapshot's device folder (None: see above)")
    p.add_argument("--snapshot-config", default=None, help="the snapshot's configuration name (None: see above)")
    p.add_argument("--server-note", default=None, help="how the server was started, recorded in the snapshot")
    a = p.parse_args(argv)
    if not 0.0 <= a.shared_prefix_ratio < 1.0:
        p.error("--shared-prefix-ratio must be in [0, 1)")
    if a.num_prefixes < 1 or a.concurrency < 1 or a.num_requests < 1:
        p.error("--num-prefixes, --concurrency and --num-requests must be >= 1")
    try:
        a.root = normalize_base_url(a.base_url)
        a.case_list = parse_cases(a.cases) if a.cases else None
    except ValueError as e:
        p.error(str(e))
    return a


def parse_cases(spec: str) -> list[tuple[int, int, int]]:
    """'1024x1x8,1024x64' -> [(input_len, concurrency, num_requests), ...] (num_requests defaults to the
    concurrency). Raises ValueError naming a malformed or non-positive entry."""
    out = []
    for c in [c for c in spec.split(",") if c]:
        try:
            v = [int(x) for x in c.split("x")]
        except ValueError:
            v = []
        if len(v) not in (2, 3) or min(v) < 1:
            raise ValueError(f"--cases: {c!r} is not INPUTxCONCURRENCY[xREQUESTS] of positive integers")
        out.append((v[0], v[1], v[2] if len(v) == 3 else v[1]))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.model is None:
        try:
            args.model = served_model(args.root, args.api_key)
        except ValueError as e:
            print(f"bench_serving.py: {e}", file=sys.stderr)
            return 2
    reps = []
    for case in args.case_list or [(args.input_len, args.concurrency, args.num_requests)]:
        args.input_len, args.concurrency, args.num_requests = case
        reps.append(asyncio.run(run(args)))
        head = f"{case[0]}-token prompts, {case[1]} at a time: " if args.case_list else ""
        print(head + summary_line(reps[-1]), flush=True)
    rep: dict = reps[0] if args.case_list is None else {"cases": reps}
    text = json.dumps(rep, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    if args.snapshot:
        gpu = (query_gpu("name") or {}).get("name")
        config = args.snapshot_config or (
            f"cases-out{args.output_len}"
            if args.case_list
            else f"in{args.input_len}-out{args.output_len}-c{args.concurrency}"
        )
        conds = snapshot.conditions(server=args.server_note, model=args.model)
        snapshot.write(
            args.snapshot,
            benchmark="serving",
            config=config,
            summary=summarize(reps),
            results=rep,
            conds=conds,
            device=args.snapshot_device or snapshot.device_key(gpu),
        )
    return 0 if all(r["errors"] == 0 for r in reps) else 1


def summarize(reps: list[dict]) -> dict:
    """The snapshot's table: one row of headline numbers per report (per case)."""

    def r1(v: float | None) -> float | None:
        return None if v is None else round(v, 1)

    return {
        "columns": [
            "requests",
            "errors",
            "concurrency",
            "input / output tokens",
            "output tok/s",
            "TTFT p50 (ms)",
            "TTFT p99 (ms)",
            "TPOT p50 (ms)",
            "ITL p50 (ms)",
            "TPOT p90 (ms)",
        ],
        "rows": [
            [
                rep["num_requests"],
                rep["errors"],
                rep["config"]["concurrency"],
                f"{rep['config']['input_len']} / {rep['config']['output_len']}",
                round(rep["output_token_throughput_per_s"]),
                r1(rep["ttft"]["p50_ms"]),
                r1(rep["ttft"]["p99_ms"]),
                r1(rep["tpot"]["p50_ms"]),
                r1(rep["itl"]["p50_ms"]),
                r1(rep["tpot"]["p90_ms"]),
            ]
            for rep in reps
        ],
    }


if __name__ == "__main__":
    sys.exit(main())
