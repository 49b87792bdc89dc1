"""guidellm (`guidellm run`) against `kimi serve --fake-workers`: a short synchronous run on synthetic prompts.

guidellm streams every request with `stream_options.continuous_usage_stats: true` and reads the token counts from
the usage it carries; a request that fails is counted as errored while the run itself still "completes" (exit
status 0). So the check is on its JSON report: every request successful, none errored or incomplete, and each with
the output length guidellm asked for (`max_tokens` with `ignore_eos`). The synthetic prompts are sized with the
tiny checkpoint's own tokenizer files (transformers reads its tiktoken.model), offline.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import offline_client_env

NUM_REQUESTS = 5
PROMPT_TOKENS = 32
OUTPUT_TOKENS = 8


@pytest.mark.parametrize("request_format", ["/v1/chat/completions", "/v1/completions"])
def test_guidellm_short_run_has_no_errors(fake_srv, tmp_path, request_format):
    report = tmp_path / "benchmarks.json"
    cmd = [
        sys.executable,
        "-m",
        "guidellm",
        "run",
        "--backend",
        f"kind=openai_http,target={fake_srv.base_url},model={fake_srv.model},request_format={request_format}",
        "--profile",
        "kind=synchronous",
        "--constraint",
        f"kind=max_requests,count={NUM_REQUESTS}",
        "--tokenizer",
        f"kind=hf_auto,model={fake_srv.model_dir}",
        "--data",
        f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
        "--output",
        f"kind=json,path={report}",
        "--disable-console-interactive",
    ]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=offline_client_env(tmp_path), capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (bench,) = json.loads(report.read_text())["benchmarks"]
    totals = bench["metrics"]["request_totals"]
    errors = [r.get("error") for r in bench["requests"]["errored"]]
    assert totals["errored"] == 0 and totals["incomplete"] == 0, (errors[:2], fake_srv.log())
    assert totals["successful"] == NUM_REQUESTS
    done = bench["requests"]["successful"]
    assert len(done) == NUM_REQUESTS
    for r in done:
        assert r["output_tokens"] == OUTPUT_TOKENS, r
        assert r["prompt_tokens"] > 0, r
