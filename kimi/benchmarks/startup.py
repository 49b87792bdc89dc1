"""Start-up of a real `kimi serve`: the time from launch to `/health` ok, the parts the server logs (weights, decode
CUDA graphs, the warm-up's phases, the controller's warm-up, the files each kernel library compiled), and whether
serving after that compiles anything (`probe_compiles`: requests of many prompt sizes, a chunked prompt, prompt
logprobs, a JSON-constrained request and concurrent streams with every sampling option, then the files that appeared in
the kernel cache folders, kimi.cache_dir). Used by tools/bench_startup.py and tests/gpu/test_warmup_gpu.py.
"""

from __future__ import annotations

import concurrent.futures
import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kimi import cache_dir
from kimi.errors import KimiError
from kimi.worker.warmup import prefill_sizes

__all__ = ["ServeFailed", "Startup", "parse_log", "probe_compiles", "start", "timeline", "wait_healthy"]

REPO = Path(__file__).resolve().parents[2]


class ServeFailed(KimiError, RuntimeError):
    """The measured server did not become ready, or one of the probe's requests failed."""


@dataclass
class Startup:
    """A started server: its process, base URL, log file and the seconds from launch to `/health` ok."""

    proc: subprocess.Popen
    base_url: str
    log_path: Path
    ready_s: float
    cache_dirs: dict[str, Path] = field(default_factory=dict)
    launched_at: float = 0.0  # time.time() at launch

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout_s: float = 60) -> int:
        """SIGTERM, then wait; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.terminate()
        return self.proc.wait(timeout_s)


def start(serve_args: list[str], log_path: Path, cache: str, port: int, timeout_s: float = 1800) -> Startup:
    """Launch `kimi serve SERVE_ARGS --port PORT --cache-dir CACHE` (output to log_path) and wait for `/health` ok.
    Raises ServeFailed with the log's tail when the server exits or is not ready within timeout_s."""
    cmd = [sys.executable, "-m", "kimi", "serve", *serve_args, "--port", str(port), "--cache-dir", cache]
    t0, launched_at = time.monotonic(), time.time()
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, cwd=REPO)
    base = f"http://127.0.0.1:{port}"
    wait_healthy(proc, base, log_path, timeout_s, t0)
    return Startup(proc, base, log_path, time.monotonic() - t0, cache_dir.library_dirs(cache), launched_at)


def wait_healthy(proc: subprocess.Popen, base_url: str, log_path: Path, timeout_s: float, t0: float) -> None:
    """Poll base_url/health until it answers 200. Raises ServeFailed with the log's tail when proc exits or timeout_s
    passes after t0 (time.monotonic()); the process is killed in the latter case."""
    with httpx.Client() as client:
        while True:
            if proc.poll() is not None or time.monotonic() - t0 > timeout_s:
                if proc.poll() is None:
                    proc.kill()
                raise ServeFailed(f"kimi serve not ready (rc {proc.poll()}):\n{log_path.read_text()[-4000:]}")
            try:
                if client.get(f"{base_url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)


# (event, the first log line that marks it) for `timeline`, in start-up order
TIMELINE = (
    ("controller logging", r""),
    ("workers launched", r"HTTP on http"),
    ("rank 0 logging", r" rank0 "),
    ("rank 0 distributed init", r"rank0 INFO rank 0 of \d+: all-to-all backend"),
    ("rank 0 weights loaded", r"rank0 INFO rank 0: weights loaded"),
    ("rank 0 graphs captured", r"rank0 INFO captured \d+ decode CUDA graphs"),
    ("rank 0 warm-up done", r"rank0 INFO warm-up in"),
    ("every rank ready", r"rank \d+ ready: \d+ KV blocks"),
    ("ready", r"INFO ready: model"),
)
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def timeline(log: str, launched_at: float) -> dict[str, float]:
    """Seconds from launch (launched_at: time.time() when the server was started) to the first log line of each
    TIMELINE event (lines start with logging's asctime, local time); events the log lacks are left out."""
    out: dict[str, float] = {}
    for line in log.splitlines():
        m = _STAMP.match(line)
        if m is None:
            continue
        t = time.mktime(time.strptime(m[1][:19], "%Y-%m-%d %H:%M:%S")) + int(m[1][20:]) / 1000
        for event, rx in TIMELINE:
            if event not in out and re.search(rx, line):
                out[event] = round(t - launched_at, 1)
    return out


def parse_log(log: str) -> dict[str, Any]:
    """The start-up parts a server log states: weights_s, graphs_s and graph_buckets, warmup_s and warmup_phases
    {phase: (seconds, steps)}, controller_warmup_s, compiled_files {library: files}; absent parts are left out."""
    out: dict[str, Any] = {}
    if m := re.search(r"weights loaded in ([\d.]+) s", log):
        out["weights_s"] = float(m[1])
    if m := re.search(r"captured \d+ decode CUDA graphs \(buckets \[([\d, ]*)\]\) in ([\d.]+) s", log):
        out["graph_buckets"] = [int(b) for b in m[1].split(",") if b.strip()]
        out["graphs_s"] = float(m[2])
    if m := re.search(r"rank0 INFO warm-up in ([\d.]+) s: (.*)", log):
        out["warmup_s"] = float(m[1])
        out["warmup_phases"] = {
            p[1]: (float(p[2]), int(p[3])) for p in re.finditer(r"([a-z ]+?) ([\d.]+) s \((\d+) steps\)", m[2])
        }
        out["warmup_phases"] = {k.strip(", "): v for k, v in out["warmup_phases"].items()}
    if m := re.search(r"controller warm-up in ([\d.]+) s", log):
        out["controller_warmup_s"] = float(m[1])
    if m := re.search(r"start-up compiled (.*?) \(kernel cache", log):
        out["compiled_files"] = {p[1]: int(p[2]) for p in re.finditer(r"(\w+) (\d+) files", m[1])}
    return out


def _files(dirs: dict[str, Path]) -> set[str]:
    return set().union(*(cache_dir.files(d) for d in dirs.values()))


def _complete(client: httpx.Client, base: str, n_prompt: int, prompt_seed: int, vocab: int, **kw: Any) -> None:
    rng = random.Random(prompt_seed)
    body: dict[str, Any] = {"prompt": [rng.randrange(0, vocab) for _ in range(n_prompt)], "max_tokens": 4}
    body.update({"ignore_eos": True, "temperature": 0, **kw})
    r = client.post(f"{base}/v1/completions", json=body, timeout=600)
    if r.status_code != 200:
        raise ServeFailed(f"request of {n_prompt} tokens: HTTP {r.status_code}: {r.text[:500]}")


def probe_compiles(s: Startup, token_budget: int, max_num_seqs: int, vocab: int, max_model_len: int) -> list[str]:
    """Requests of every warmed prompt size and of sizes between them, a prompt chunked over cached context, prompt
    logprobs, a JSON-constrained request and max_num_seqs concurrent streams with every sampling option, one after
    another; returns the files that appeared meanwhile in the kernel libraries' cache folders (compiles). Raises
    ServeFailed when a request fails."""
    before = _files(s.cache_dirs)
    sizes = prefill_sizes(token_budget, max_model_len - 16, "cuda")
    sizes += [
        n for n in (3, 100, 300, 777, 1000, 1500, token_budget - 1, 2 * token_budget + 904) if n < max_model_len - 16
    ]
    variants: list[dict[str, Any]] = [
        dict(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05),
        dict(temperature=1.0, seed=5, logprobs=3),
        dict(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1),
        dict(logit_bias={"5": 2.0}, min_tokens=4),
        {},
    ]
    with httpx.Client() as client:
        for i, n in enumerate(sizes):  # alone: each its own prefill step (the longest chunked over cached context)
            _complete(client, s.base_url, n, i, vocab)
        _complete(client, s.base_url, 40, 99, vocab, prompt_logprobs=2)
        _complete(
            client, s.base_url, 30, 98, vocab, response_format={"type": "json_object"}, max_tokens=8, ignore_eos=False
        )
        with concurrent.futures.ThreadPoolExecutor(max_num_seqs) as pool:  # decode batches of every size
            jobs = [
                pool.submit(
                    _complete, client, s.base_url, 20 + 7 * j, 1000 + j, vocab, max_tokens=8 + j, **variants[j % 5]
                )
                for j in range(max_num_seqs)
            ]
            for job in jobs:
                job.result()
    return sorted(_files(s.cache_dirs) - before)
