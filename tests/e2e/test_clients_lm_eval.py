"""lm-evaluation-harness (`lm_eval run --model local-completions`) against a real `kimi serve`, batched.

lm-eval's local-completions model sends `--batch_size` prompts per /v1/completions request, as lists of token ids,
and picks its tokenizer by asking the server (`/tokenizer_info`, then `/tokenize`; `tokenizer_backend` left at its
default). Loglikelihood requests are `echo` + `logprobs: 1` + `max_tokens: 1`: they need the prompt tokens'
logprobs, which the real tiny model computes (the fake workers do not), so the multiple-choice task runs on the real
worker; generation runs on the fake workers, whose greedy tokens do not depend on the batch. Each task is a YAML file
in a temporary folder over a 5-document JSON-lines file (so with 4 per batch the last batch is partial), loaded
offline by the `datasets` json builder.

Batched results are checked against each prompt sent as a request of its own: every score and every generation
lm-eval logged (`--log_samples`) must be the server's answer for that very prompt, which a misordered or mixed-up
batch would fail. The server's KV cache and step plan are the same either way; only the HTTP batching differs.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import Server, offline_client_env, start_server, stop_server

BATCH_SIZE = 4
SEED = 1234  # lm-eval's default request seed
DOCS = [
    {"question": "What is two plus two?", "choices": ["four", "five", "twenty-two"], "answer": 0},
    {"question": "Which is a colour?", "choices": ["blue", "seven", "Tuesday"], "answer": 0},
    {"question": "What do bees make?", "choices": ["steel", "honey", "glass"], "answer": 1},
    {"question": "Where is Paris?", "choices": ["Japan", "Peru", "France"], "answer": 2},
    {"question": "How many legs has a cat?", "choices": ["four", "two", "nine"], "answer": 0},
]


@pytest.fixture(scope="module")
def real_srv(tiny_k26, tmp_path_factory):
    """`kimi serve` on the real tiny model (the CPU worker), which computes prompt logprobs."""
    log = str(tmp_path_factory.mktemp("log") / "real_worker.log")
    srv = start_server(tiny_k26, log, "--block-size", "16", "--num-blocks", "400", "--max-model-len", "1024")
    yield srv
    assert stop_server(srv) == 0, srv.log()


def _completions_alone(srv: Server, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """POST each body to /v1/completions as a request of its own (all at once); their responses, in order."""

    async def go() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=120) as client:
            rs = await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))
        for r in rs:
            r.raise_for_status()
        return [r.json() for r in rs]

    return asyncio.run(go())


def _write_task(folder: Path, name: str, body: str) -> None:
    docs = folder / "docs.jsonl"
    docs.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    head = f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {docs}\ntest_split: test\n"
    (folder / f"{name}.yaml").write_text(head + body)


def _completion_posts(srv: Server) -> int:
    """How many /v1/completions requests the server has logged (uvicorn's access log)."""
    return Path(srv.log_path).read_text(errors="replace").count('"POST /v1/completions ')


def _run_lm_eval(
    srv: Server, tmp_path: Path, task: str, num_requests: int
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run lm_eval on `task` (a YAML in tmp_path/tasks), which makes `num_requests` model requests; check that they
    reached the server in batches of BATCH_SIZE and that the remote tokenizer backend was picked; return lm-eval's
    results JSON and its logged samples."""
    posts_before = _completion_posts(srv)
    out = tmp_path / "out"
    model_args = f"base_url={srv.base_url}/v1/completions,model={srv.model},max_retries=1,timeout=120"
    cmd = [
        sys.executable,
        "-m",
        "lm_eval",
        "run",
        "--model",
        "local-completions",
        "--model_args",
        model_args,
        "--tasks",
        task,
        "--include_path",
        str(tmp_path / "tasks"),
        "--batch_size",
        str(BATCH_SIZE),
        "--output_path",
        str(out),
        "--log_samples",
    ]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=offline_client_env(tmp_path), capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + srv.log()
    assert _completion_posts(srv) - posts_before == math.ceil(num_requests / BATCH_SIZE)
    log = Path(srv.log_path).read_text(errors="replace")
    assert '"GET /tokenizer_info ' in log and '"POST /tokenize ' in log, srv.log()
    (results_file,) = out.rglob("results_*.json")
    (samples_file,) = out.rglob(f"samples_{task}_*.jsonl")
    samples = [json.loads(line) for line in samples_file.read_text().splitlines() if line.strip()]
    return json.loads(results_file.read_text()), sorted(samples, key=lambda s: s["doc_id"])


def _tokenize(srv: Server, text: str) -> list[int]:
    """The server's token ids for `text`, as lm-eval's remote tokenizer asks for them."""
    r = httpx.post(f"{srv.base_url}/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=30)
    r.raise_for_status()
    return r.json()["tokens"]


def test_loglikelihood_multiple_choice_batched(real_srv, tmp_path):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    body = (
        'output_type: multiple_choice\ndoc_to_text: "Question: {{question}}\\nAnswer:"\n'
        'doc_to_choice: "{{choices}}"\ndoc_to_target: answer\nmetric_list:\n  - metric: acc\n'
    )
    _write_task(tasks, "kimi_mc", body)
    num_requests = sum(len(d["choices"]) for d in DOCS)
    results, samples = _run_lm_eval(real_srv, tmp_path, "kimi_mc", num_requests)
    assert results["n-samples"]["kimi_mc"] == {"original": len(DOCS), "effective": len(DOCS)}
    acc = results["results"]["kimi_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0
    assert [s["doc_id"] for s in samples] == list(range(len(DOCS)))
    scored = []  # (lm-eval's score, prompt token ids, context length) per (doc, choice)
    for s in samples:
        args = [a for _, a in sorted(s["arguments"].items())]
        assert len(args) == len(s["doc"]["choices"]) == len(s["resps"])
        for a, resp in zip(args, s["resps"]):
            context, continuation = a["arg_0"], a["arg_1"]
            whole = _tokenize(real_srv, context + continuation)
            scored.append((float(resp[0][0]), whole, len(_tokenize(real_srv, context))))
    assert len(scored) == num_requests
    alone = _completions_alone(
        real_srv,
        [
            {"prompt": whole, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0, "seed": SEED}
            for _, whole, _ in scored
        ],
    )
    for (got, whole, ctxlen), out in zip(scored, alone):
        lps = out["choices"][0]["logprobs"]["token_logprobs"]
        expected = sum(lps[ctxlen : len(whole)])
        assert math.isfinite(got) and math.isclose(got, expected, rel_tol=1e-3, abs_tol=1e-2), (got, expected)


def test_generate_until_batched(fake_srv, tmp_path):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    body = (
        'output_type: generate_until\ndoc_to_text: "Q: {{question}}\\nA:"\ndoc_to_target: "{{choices[answer]}}"\n'
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 8\nmetric_list:\n  - metric: exact_match\n'
    )
    _write_task(tasks, "kimi_gen", body)
    results, samples = _run_lm_eval(fake_srv, tmp_path, "kimi_gen", num_requests=len(DOCS))
    assert results["n-samples"]["kimi_gen"] == {"original": len(DOCS), "effective": len(DOCS)}
    assert [s["doc_id"] for s in samples] == list(range(len(DOCS)))
    info = httpx.get(f"{fake_srv.base_url}/tokenizer_info", timeout=30).json()
    stop = ["\n", info["eos_token"]]
    contexts = [s["arguments"]["gen_args_0"]["arg_0"] for s in samples]
    alone = _completions_alone(
        fake_srv,
        [{"prompt": c, "max_tokens": 8, "temperature": 0, "stop": stop, "seed": SEED} for c in contexts],
    )
    for s, out in zip(samples, alone):
        assert s["resps"] == [[out["choices"][0]["text"]]], s
