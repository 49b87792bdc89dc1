#!/usr/bin/env python
"""Load generator for any OpenAI-compatible server (kimi, vLLM, SGLang): streaming /v1/completions.

    python tools/bench_serving.py --base-url http://127.0.0.1:8000 --model tiny \\
        --num-requests 256 --concurrency 64 --input-len 512 --output-len 128 [--request-rate 8] \\
        [--input-dist fixed|uniform|normal] [--output-dist ...] [--prompt-kind tokens|words] \\
        [--shared-prefix-ratio 0.5 --num-prefixes 4] [--out result.json]

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

WORDS = ["time", "year", "people", "way", "day", "man", "thing", "woman", "life", "child", "world", "school", "state", "family", "student", "group", "country", "problem", "hand", "part", "place", "case", "week", "company", "system", "program", "question", "work", "government", "number", "night", "point", "home", "water", "room", "mother", "area", "money", "story", "fact", "month", "lot", "right", "study", "book", "eye", "job", "word", "business", "issue", "side", "kind", "head", "house", "service", "friend", "father", "power", "hour", "game", "line", "end", "member", "law", "car", "city", "community", "name"]


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
        async with client.stream("POST", f"{args.base_url}/v1/completions", json=body) as resp:
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
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as client:
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
        "config": {k: v for k, v in vars(args).items() if k not in ("out",)},
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
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", required=True)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=64, help="max requests in flight")
    p.add_argument("--request-rate", type=float, default=0.0, help="Poisson arrivals per second; 0 = all at once")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--input-dist", default="fixed", choices=["fixed", "uniform", "normal"])
    p.add_argument("--output-dist", default="fixed", choices=["fixed", "uniform", "normal"])
    p.add_argument("--spread", type=float, default=0.25, help="relative spread of uniform / normal lengths")
    p.add_argument("--prompt-kind", default="tokens", choices=["tokens", "words"])
    p.add_argument(
        "--shared-prefix-ratio", type=float, default=0.0, help="fraction of each prompt from a shared prefix"
    )
    p.add_argument("--num-prefixes", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request HTTP timeout, s")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", default=None, help="write the JSON report here")
    a = p.parse_args(argv)
    if not 0.0 <= a.shared_prefix_ratio < 1.0:
        p.error("--shared-prefix-ratio must be in [0, 1)")
    if a.num_prefixes < 1 or a.concurrency < 1 or a.num_requests < 1:
        p.error("--num-prefixes, --concurrency and --num-requests must be >= 1")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rep = asyncio.run(run(args))
    text = json.dumps(rep, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0 if rep["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
