"""No request compiles on a warmed GPU server (issue #40 item 1): `kimi serve --device cuda` (K2.6's config cut to
2 layers, dummy weights, CUDA graphs up to 32 sequences) reports healthy only after its warm-up; then
kimi.benchmarks.startup.probe_compiles' requests (prompts of every warmed size and of sizes between them, a prompt
chunked over cached context, prompt logprobs, a JSON-constrained request, 32 concurrent streams with every sampling
option) add no file to any kernel library's cache folder (kimi.cache_dir: kimi's CUDA extensions, FlashInfer, humming,
Triton), i.e. nothing compiles. The start-up parts the log states go to $KIMI_GPU_REPORT.
"""

from __future__ import annotations

import os

import pytest
from test_gpu_model import report

from kimi.benchmarks.startup import parse_log, probe_compiles, start
from kimi.ipc import free_tcp_port

pytestmark = pytest.mark.gpu

MAX_SEQS = 32
BUDGET = 2048
VOCAB = 163840


def test_serving_after_the_warm_up_compiles_nothing(tmp_path):
    serve = ["--device", "cuda", "--model", "preset:kimi-k2.6", "--load-format", "dummy", "--num-hidden-layers", "2"]
    serve += ["--max-num-seqs", str(MAX_SEQS), "--token-budget", str(BUDGET), "--max-model-len", "8192"]
    serve += ["--zmq-submit-addr", f"tcp://127.0.0.1:{free_tcp_port()}"]
    cache = os.environ.get("KIMI_CACHE_DIR", str(tmp_path / "cache"))
    s = start(serve, tmp_path / "server.log", cache, free_tcp_port(), timeout_s=900)
    try:
        log = s.log()
        assert "rank0 INFO warm-up in" in log  # /health said ok only after the warm-up
        new = probe_compiles(s, BUDGET, MAX_SEQS, VOCAB, 8192)
    finally:
        rc = s.stop()
    parts = parse_log(s.log())
    report({"test": "warmup_gpu", "ready_s": round(s.ready_s, 1), **parts, "new_files_after_ready": len(new)})
    assert rc == 0, s.log()[-4000:]
    assert {"weights_s", "graphs_s", "warmup_s", "compiled_files"} <= set(parts), parts
    assert not new, f"{len(new)} files compiled after the warm-up, e.g. {new[:10]}"
