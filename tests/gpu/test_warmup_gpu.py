"""No request compiles on a warmed GPU server (issue #40 item 1): `kimi serve --device cuda` (K2.6's config cut to
2 layers, dummy weights, CUDA graphs up to 32 sequences) reports healthy only after its warm-up; then prompts of every
warmed size and of sizes between them, a prompt chunked over cached context, concurrent decodes at every batch size up
to 32, every sampling option, prompt logprobs and a JSON-constrained request add no file to any kernel library's
cache folder (kimi.cache_dir: kimi's CUDA extensions, FlashInfer, humming, Triton), i.e. nothing compiles.

The start-up log's timings (weights, graph capture, warm-up phases, what it compiled) go to $KIMI_GPU_REPORT.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from test_gpu_model import report

from kimi import cache_dir
from kimi.ipc import free_tcp_port
from kimi.worker.warmup import prefill_sizes

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
MAX_SEQS = 32
BUDGET = 2048
VOCAB = 163840


def _files(dirs: dict[str, Path]) -> set[str]:
    out = set()
    for d in dirs.values():
        for root, _, files in os.walk(d):
            out.update(os.path.join(root, f) for f in files)
    return out


def _complete(client: httpx.Client, base: str, n_prompt: int, prompt_seed: int, **kw) -> dict:
    rng = random.Random(prompt_seed)
    body = {"model": "k", "prompt": [rng.randrange(0, VOCAB) for _ in range(n_prompt)], "max_tokens": 4}
    body.update({"ignore_eos": True, "temperature": 0, **kw})
    r = client.post(f"{base}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_serving_after_the_warm_up_compiles_nothing(tmp_path):
    port = free_tcp_port()
    log_path = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "kimi", "serve", "--device", "cuda", "--model", "preset:kimi-k2.6"]
    cmd += ["--load-format", "dummy", "--num-hidden-layers", "2", "--max-num-seqs", str(MAX_SEQS)]
    cmd += ["--token-budget", str(BUDGET), "--max-model-len", "8192", "--served-model-name", "k"]
    cmd += ["--port", str(port), "--zmq-submit-addr", f"tcp://127.0.0.1:{free_tcp_port()}"]
    cmd += ["--cache-dir", os.environ.get("KIMI_CACHE_DIR", str(tmp_path / "cache"))]
    base = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        with httpx.Client() as client:
            while True:
                assert proc.poll() is None and time.monotonic() - t0 < 900, log_path.read_text()[-4000:]
                try:
                    if client.get(f"{base}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            ready_s = time.monotonic() - t0
            log = log_path.read_text()
            dirs = cache_dir.library_dirs(cmd[cmd.index("--cache-dir") + 1])
            before = _files(dirs)
            sizes = prefill_sizes(BUDGET, 8191, "cuda") + [3, 100, 300, 777, 1000, 1500, 2047, 5000]
            for i, n in enumerate(sizes):  # alone: each is its own prefill step (5000: chunked over cached context)
                _complete(client, base, n, i)
            _complete(client, base, 40, 99, prompt_logprobs=2)
            _complete(client, base, 30, 98, response_format={"type": "json_object"}, max_tokens=8, ignore_eos=False)
            variants = [
                dict(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05),
                dict(temperature=1.0, seed=5, logprobs=3),
                dict(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1),
                dict(logit_bias={"5": 2.0}, min_tokens=4),
                {},
            ]
            with concurrent.futures.ThreadPoolExecutor(MAX_SEQS) as pool:  # decode batches of every size <= 32
                jobs = [
                    pool.submit(_complete, client, base, 20 + 7 * j, 1000 + j, max_tokens=8 + j, **variants[j % 5])
                    for j in range(MAX_SEQS)
                ]
                for job in jobs:
                    job.result()
            new = sorted(_files(dirs) - before)
    finally:
        proc.terminate()
        rc = proc.wait(60)
    timings = {
        "ready_s": round(ready_s, 1),
        "weights": re.findall(r"weights loaded in [\d.]+ s", log),
        "graphs": re.findall(r"captured \d+ decode CUDA graphs .* in [\d.]+ s", log),
        "warmup": re.findall(r"warm-up in .*", log),
        "compiled": re.findall(r"start-up compiled .*\(kernel", log),
    }
    report({"test": "warmup_gpu", **timings, "new_files_after_ready": len(new)})
    print(timings)
    assert rc == 0, log_path.read_text()[-4000:]
    assert not new, f"{len(new)} files compiled after the warm-up, e.g. {new[:10]}"
