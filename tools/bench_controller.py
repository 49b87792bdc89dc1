#!/usr/bin/env python
"""Controller + HTTP cost per engine step at 64 / 256 / 1024 running streaming requests (no model).

    python tools/bench_controller.py [--running 64 256 1024] [--output-len 256] [--input-len 64]
                                     [--step-ms MS] [--async-scheduling on,off] [--rounds R]
                                     [--out F.json] [--profile DIR] [--snapshot]

`--step-ms MS [--token-us US]` makes every fake step last at least MS milliseconds plus US microseconds per token
it computes (a stand-in for the model's time on a GPU; the worker sleeps, leaving the CPU to the controller);
`--requests R` sends R requests at concurrency N (a new one as one ends) instead of N at once;
`--async-scheduling on,off --rounds R` runs each N in both engine modes, interleaved, R times (async scheduling:
kimi.controller.engine).

For each N: starts `kimi serve --fake-workers` (real controller, real HTTP, real ZeroMQ step plans, a real
torchrun worker that runs kimi.worker.fake instead of a model) with max-num-seqs N and a token budget that
fits N decodes, then runs tools/bench_serving.py in a separate process (N concurrent streaming requests of
`--input-len` random token ids, `--output-len` tokens each, ignore_eos). The fake worker records when each
step starts and ends ($KIMI_FAKE_STATS); from the steady-state steps (all N requests decoding, one token
each) this reports:

- steps_per_s: 1 / median step period (start to next start);
- controller_ms: the gap between a step's end on the worker and the next step's start, p50 / p90 / p99:
  the controller's share of a step (apply the sampled tokens, detokenize, stream N SSE chunks through
  HTTP, schedule, build and send the next plan, plus ZeroMQ both ways);
- worker_ms: the fake worker's own time per step (plan decode is outside; this is its bookkeeping);
- controller_cpu_us_per_output_token: the controller process's CPU time (user + sys, /proc) during the
  client run divided by the output tokens delivered. The engine does not wait for HTTP: while it waits
  for a step result the event loop streams earlier tokens, and streaming can fall behind the engine
  (outputs queue up), so the step rate alone under-counts HTTP work; this number and the client's TPOT
  include it;
- the client's TTFT / TPOT / ITL from bench_serving.

Pinning (`--pin`, default on when >= 2 CPUs): the server (controller + fake worker) on CPU 0, the load
generator on CPU 1, so they do not share a core. The fake worker shares the controller's core, but it only
runs while the controller waits for its result. With `--profile DIR`, the controller runs under cProfile
(`python -m cProfile -o DIR/controller_N.prof`) and the top functions by own time are printed. With
`--py-spy DIR` (needs `pip install py-spy` in the venv), py-spy samples the controller at 250 Hz (pinned to
the client's CPU, non-blocking, GIL-holding samples only) during the client run and writes collapsed
stacks to DIR/controller_N.txt; `python tools/bench_controller.py --summarise-py-spy DIR/controller_N.txt`
prints the top functions by own and by inclusive samples. The result also splits the controller's CPU into
user and system time (`controller_cpu_user_s`, `controller_cpu_sys_s`).

Snapshot (--snapshot): cpu/controller.json for the default workload (N = 64, 256, 1024, no step time, async
scheduling on); controller_<config> for another (step time, modes, lengths, requests).
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kimi.benchmarks import snapshot
from kimi.benchmarks.startup import wait_healthy
from kimi.ipc import free_tcp_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_model_dir(path: str) -> str:
    """A folder with the tiny K2.6 config.json, generation_config.json and tokenizer files (no weights)."""
    from kimi.tiny_checkpoint import tiny_config
    from kimi.tokenizer import write_tokenizer_files

    os.makedirs(path, exist_ok=True)
    cfg, gen = tiny_config("k2.6")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(gen, f)
    write_tokenizer_files(path)
    return path


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of process `pid` so far (/proc/PID/stat fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as fh:
        f = fh.read().rsplit(")", 1)[1].split()
    tck = os.sysconf("SC_CLK_TCK")
    return int(f[11]) / tck, int(f[12]) / tck


def run_one(n: int, args, model_dir: str, tmp: str, async_scheduling: bool = True, tag: str = "") -> dict:
    """Serve with fake workers at N running requests, drive it, return the measurements."""
    port = free_tcp_port()
    stats_path = os.path.join(tmp, f"fake_steps_{n}{tag}.json")
    total_tokens = args.input_len + args.output_len
    num_blocks = n * (-(-total_tokens // 64)) + 64
    server = [sys.executable]
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        server += ["-m", "cProfile", "-o", os.path.join(args.profile, f"controller_{n}.prof")]
    server += [
        "-m",
        "kimi",
        "serve",
        "--model",
        model_dir,
        "--port",
        str(port),
        "--served-model-name",
        "fake",
        "--zmq-submit-addr",
        f"tcp://127.0.0.1:{free_tcp_port()}",
        "--fake-workers",
        "--max-num-seqs",
        str(n),
        "--max-waiting",
        str(4 * n),
        "--token-budget",
        str(max(2048, 2 * n)),
        "--num-blocks",
        str(num_blocks),
        "--max-model-len",
        str(total_tokens + 64),
        "--log-level",
        "warning",
    ]
    if not async_scheduling:
        server.append("--no-async-scheduling")
    client = [
        sys.executable,
        os.path.join(REPO, "tools", "bench_serving.py"),
        "--base-url",
        f"http://127.0.0.1:{port}",
        "--model",
        "fake",
        "--num-requests",
        str(args.requests or n),
        "--concurrency",
        str(n),
        "--input-len",
        str(args.input_len),
        "--output-len",
        str(args.output_len),
        "--no-progress",
        "--out",
        os.path.join(tmp, f"client_{n}{tag}.json"),
    ]
    if args.pin:
        server = ["taskset", "-c", "0"] + server
        client = ["taskset", "-c", "1"] + client
    env = dict(
        os.environ,
        KIMI_FAKE_STATS=stats_path,
        KIMI_FAKE_STEP_MS=str(args.step_ms),
        KIMI_FAKE_TOKEN_US=str(args.token_us),
    )
    log_path = os.path.join(tmp, f"server_{n}{tag}.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(server, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            wait_healthy(proc, f"http://127.0.0.1:{port}", Path(log_path), 120, time.monotonic())
            spy = None
            if args.py_spy:
                os.makedirs(args.py_spy, exist_ok=True)
                spy_cmd = [
                    os.path.join(os.path.dirname(sys.executable), "py-spy"),
                    "record",
                    "--pid",
                    str(proc.pid),
                    "--format",
                    "raw",
                    "--rate",
                    "250",
                    "--nonblocking",
                    "--gil",
                    "-o",
                    os.path.join(args.py_spy, f"controller_{n}.txt"),
                ]
                if args.pin:
                    spy_cmd = ["taskset", "-c", "1"] + spy_cmd
                spy = subprocess.Popen(spy_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(0.5)
            load_before = os.getloadavg()
            cpu0 = cpu_seconds(proc.pid)
            subprocess.run(client, check=True, stdout=subprocess.DEVNULL)
            cpu1 = cpu_seconds(proc.pid)
            load_after = os.getloadavg()
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                spy.wait(30)
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    deadline = time.monotonic() + 20
    while not os.path.exists(stats_path) and time.monotonic() < deadline:
        time.sleep(0.2)
    steps = json.loads(Path(stats_path).read_text())["steps"]
    rep = json.loads(Path(tmp, f"client_{n}{tag}.json").read_text())
    # steady state: n requests in the step, one token each (all decoding)
    idx = [i for i in range(len(steps) - 1) if steps[i][2] == n and steps[i][3] == n and steps[i + 1][2] == n]
    period = [steps[i + 1][0] - steps[i][0] for i in idx]
    gap = [steps[i + 1][0] - steps[i][1] for i in idx]
    work = [steps[i][1] - steps[i][0] for i in idx]
    out = {
        "running": n,
        "async_scheduling": async_scheduling,
        "steady_steps": len(idx),
        "total_steps": len(steps),
        "steps_per_s": 1.0 / statistics.median(period) if period else None,
        "output_tok_per_s_steady": n / statistics.median(period) if period else None,
        "controller_ms": {q: 1000 * pct(gap, v) for q, v in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))}
        if gap
        else None,
        "controller_us_per_request": 1e6 * statistics.median(gap) / n if gap else None,
        "worker_ms_p50": 1000 * statistics.median(work) if work else None,
        "controller_cpu_s": sum(cpu1) - sum(cpu0),
        "controller_cpu_user_s": cpu1[0] - cpu0[0],
        "controller_cpu_sys_s": cpu1[1] - cpu0[1],
        "controller_cpu_us_per_output_token": 1e6 * (sum(cpu1) - sum(cpu0)) / max(1, rep["total_output_tokens"]),
        "client": {
            k: rep[k] for k in ("completed", "errors", "wall_s", "output_token_throughput_per_s", "ttft", "tpot", "itl")
        },
        "loadavg_before_after": [load_before, load_after],
    }
    if args.profile:
        print(f"\n== controller profile, N={n} (own time) ==")
        pstats.Stats(os.path.join(args.profile, f"controller_{n}.prof")).sort_stats("tottime").print_stats(18)
    return out


def summarise_py_spy(path: str, top: int = 30) -> str:
    """Top functions of a py-spy raw (collapsed stacks) file, by own and by inclusive samples (line numbers
    dropped, so a function's lines add up)."""
    import collections
    import re

    own: collections.Counter = collections.Counter()
    incl: collections.Counter = collections.Counter()
    total = 0
    for line in Path(path).read_text().splitlines():
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]
        own[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
    out = [f"{path}: {total} samples"]
    for title, c in (("own", own), ("inclusive", incl)):
        out.append(f"-- by {title} samples --")
        out += [f"{100 * v / max(1, total):6.1f}%  {k}" for k, v in c.most_common(top)]
    return "\n".join(out)


def config_name(args: argparse.Namespace) -> str:
    """The snapshot configuration: "" for the default workload, else what differs from it."""
    parts = []
    if args.running != [64, 256, 1024]:
        parts.append("n" + "-".join(map(str, args.running)))
    if (args.input_len, args.output_len) != (64, 256):
        parts.append(f"in{args.input_len}-out{args.output_len}")
    if args.step_ms or args.token_us:
        parts.append(f"step{args.step_ms:g}ms" + (f"-{args.token_us:g}us" if args.token_us else ""))
    if args.requests:
        parts.append(f"req{args.requests}")
    if args.async_scheduling != "on":
        parts.append("async-" + args.async_scheduling.replace(",", "-"))
    return "-".join(parts)


def summarize(doc: dict) -> dict:
    """The snapshot's table: per running-request count (and engine mode), the step rate, the controller's share of
    a step, its CPU per output token and what the client saw."""
    rows = []
    for r in doc["results"]:
        c = r["client"]
        rows.append(
            [
                r["running"],
                "async" if r["async_scheduling"] else "sync",
                round(r["steps_per_s"], 1) if r["steps_per_s"] else None,
                round(r["controller_ms"]["p50"], 2) if r["controller_ms"] else None,
                round(r["controller_ms"]["p90"], 2) if r["controller_ms"] else None,
                round(r["controller_cpu_us_per_output_token"], 1),
                round(r["worker_ms_p50"], 2) if r["worker_ms_p50"] is not None else None,
                round(c["output_token_throughput_per_s"]),
                round(c["tpot"]["p50_ms"], 2) if c["tpot"]["p50_ms"] is not None else None,
            ]
        )
    return {
        "columns": [
            "running requests",
            "scheduling",
            "steps/s",
            "controller ms/step p50",
            "p90",
            "controller CPU us / output token",
            "fake worker ms/step",
            "client output tok/s",
            "client TPOT p50 (ms)",
        ],
        "rows": rows,
        "notes": [doc["conditions"]["workload"] + "; " + doc["conditions"]["pinning"]],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=snapshot.HelpFormatter)
    p.add_argument("--running", type=int, nargs="+", default=[64, 256, 1024], help="running requests N, each a run")
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=256, help="output tokens per request")
    p.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=(os.cpu_count() or 1) >= 2,
        help="server on CPU 0, client on CPU 1 (on by default with 2 or more CPUs)",
    )
    p.add_argument("--profile", default=None, help="run the controller under cProfile; .prof files go here")
    p.add_argument(
        "--py-spy",
        default=None,
        metavar="DIR",
        help="sample the controller with py-spy (from the venv, on CPU 1) during the client run; "
        "collapsed stacks go to DIR/controller_N.txt (--summarise-py-spy FILE prints the top functions)",
    )
    p.add_argument(
        "--summarise-py-spy", default=None, metavar="FILE", help="print a --py-spy file's top functions and exit"
    )
    p.add_argument(
        "--step-ms",
        type=float,
        default=0.0,
        help="each fake step lasts at least this long ($KIMI_FAKE_STEP_MS: a stand-in for the GPU's time)",
    )
    p.add_argument(
        "--token-us",
        type=float,
        default=0.0,
        help="and this many microseconds more per token computed ($KIMI_FAKE_TOKEN_US: prefill is longer)",
    )
    p.add_argument(
        "--requests",
        type=int,
        default=None,
        help="requests per run (None: N, all started at once); more than N keeps N running, "
        "a new one starting as one ends",
    )
    p.add_argument("--async-scheduling", default="on", help="on, off, or on,off: each N runs once per mode per round")
    p.add_argument("--rounds", type=int, default=1, help="repeat the modes, interleaved, this many times")
    p.add_argument("--out", default=None, help="write the full JSON result here")
    snapshot.add_arguments(p)
    args = p.parse_args(argv)
    if args.summarise_py_spy:
        print(summarise_py_spy(args.summarise_py_spy))
        return 0
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(os.path.join(tmp, "tiny-config"))
        modes = [m.strip() == "on" for m in args.async_scheduling.split(",") if m.strip()]
        for n in args.running:
            for k in range(args.rounds):
                for mode in modes:
                    r = run_one(n, args, model_dir, tmp, mode, tag=f"_{k}_{'async' if mode else 'sync'}")
                    r["round"] = k
                    print(json.dumps(r), flush=True)
                    results.append(r)
    conds = snapshot.conditions(
        gpu=False,
        pinning="server (controller + fake worker) on CPU 0, load generator on CPU 1" if args.pin else "none",
        workload=f"N concurrent streaming /v1/completions, {args.input_len} random prompt token ids, "
        f"{args.output_len} output tokens, ignore_eos, greedy; kimi serve --fake-workers",
        fake_step_ms=args.step_ms,
        fake_token_us=args.token_us,
        requests=args.requests,
        loadavg_before_after=[r["loadavg_before_after"] for r in results],
    )
    doc = {"conditions": conds, "results": results}
    text = json.dumps(doc, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    if args.snapshot:
        snapshot.write(
            args.snapshot,
            benchmark="controller",
            config=config_name(args),
            summary=summarize(doc),
            results=doc,
            conds=conds,
            device="cpu",
            command=snapshot.command_line([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
