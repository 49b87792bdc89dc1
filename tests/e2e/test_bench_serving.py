"""tools/bench_serving.py against a real `kimi serve --fake-workers` that requires an API key: a base URL with or
without /v1, the key from --api-key or $OPENAI_API_KEY, the model taken from GET /v1/models when --model is not
given, and the one-line summary before the JSON report. The tool runs as a command line, as a user runs it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# the e2e conftest's server helpers, by path (another conftest may hold the name `conftest` in a full run)
_spec = importlib.util.spec_from_file_location("kimi_e2e_conftest", Path(__file__).with_name("conftest.py"))
_conftest = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _conftest
_spec.loader.exec_module(_conftest)
start_server, stop_server, REPO = _conftest.start_server, _conftest.stop_server, _conftest.REPO

TOOL = REPO / "tools" / "bench_serving.py"
KEY = "bench-key"


@pytest.fixture(scope="module")
def keyed_srv(tiny_k26, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("log") / "bench_serving_server.log")
    srv = start_server(tiny_k26, log, "--fake-workers", "--api-key", KEY, "--max-num-seqs", "8")
    yield srv
    assert stop_server(srv) == 0, srv.log()


def bench(*args: str, env_key: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    if env_key is not None:
        env["OPENAI_API_KEY"] = env_key
    small = ["--num-requests", "4", "--concurrency", "2", "--input-len", "8", "--output-len", "4", "--no-progress"]
    return subprocess.run(
        [sys.executable, str(TOOL), *small, *args], capture_output=True, text=True, timeout=120, env=env, cwd=REPO
    )


@pytest.mark.parametrize("suffix", ["", "/v1", "/v1/"])
def test_base_url_with_or_without_v1_and_the_served_model_by_default(keyed_srv, suffix):
    r = bench("--base-url", keyed_srv.base_url + suffix, "--api-key", KEY)
    assert r.returncode == 0, r.stderr[-2000:]
    first, _, rest = r.stdout.partition("\n")
    assert first.startswith("4 requests, 0 errors: ") and "TTFT p50" in first and "TPOT p50" in first, first
    rep = json.loads(rest)
    assert rep["completed"] == 4 and rep["errors"] == 0 and rep["total_output_tokens"] == 16
    assert rep["config"]["model"] == keyed_srv.model and "api_key" not in rep["config"]


def test_the_key_comes_from_openai_api_key_and_a_wrong_one_is_a_one_line_error(keyed_srv):
    r = bench("--base-url", keyed_srv.base_url + "/v1", env_key=KEY)
    assert r.returncode == 0, r.stderr[-2000:]
    r = bench("--base-url", keyed_srv.base_url + "/v1", env_key="wrong")
    assert r.returncode == 2
    err = r.stderr.strip()
    assert err.startswith("bench_serving.py: GET ") and "HTTP 401" in err and "\n" not in err, err
    # with --model given, the requests themselves are refused: every one an error, exit status 1
    r = bench("--base-url", keyed_srv.base_url, "--model", keyed_srv.model, "--api-key", "wrong")
    assert r.returncode == 1
    rep = json.loads(r.stdout.partition("\n")[2])
    assert rep["errors"] == 4 and "HTTP 401" in rep["error_examples"][0]


def test_cases_run_one_after_another_with_a_snapshot_row_each(keyed_srv, tmp_path):
    r = bench(
        "--base-url", keyed_srv.base_url, "--api-key", KEY, "--cases", "8x1x2,16x3",
        "--snapshot", str(tmp_path), "--snapshot-device", "cpu", "--snapshot-config", "cases",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert lines[0].startswith("8-token prompts, 1 at a time: 2 requests, 0 errors: "), lines[0]
    assert lines[1].startswith("16-token prompts, 3 at a time: 3 requests, 0 errors: "), lines[1]
    cases = json.loads("\n".join(lines[2:]))["cases"]
    assert [(c["config"]["input_len"], c["config"]["concurrency"], c["completed"]) for c in cases] == [
        (8, 1, 2),
        (16, 3, 3),
    ]
    assert all(c["total_output_tokens"] == 4 * c["completed"] for c in cases)
    snap = json.loads((tmp_path / "cpu" / "serving_cases.json").read_text())
    rows = snap["summary"]["rows"]
    assert [row[:4] for row in rows] == [[2, 0, 1, "8 / 4"], [3, 0, 3, "16 / 4"]]
    assert "TTFT p99 (ms)" in snap["summary"]["columns"]


def test_a_malformed_case_is_a_usage_error():
    r = bench("--cases", "1024x")
    assert r.returncode == 2 and "--cases: '1024x' is not INPUTxCONCURRENCY" in r.stderr, r.stderr
