"""Speculative decoding end to end (docs/speculative.md): `kimi serve --speculative-config` with the tiny EAGLE3
draft, real CPU torchrun workers, HTTP on a loopback port.

- the tiny K2.6 model: 16 concurrent greedy requests, some with stop strings, under KV pressure (preemption), give
  the same text, finish reasons, token counts and logprobs with speculation as without it, on one rank and on two
  (DP x EP); the Prometheus counters show the verified drafts (the tiny random draft is almost never right, so
  these runs check verification and rejection; the fake workers below check acceptance);
- `--fake-workers` (the fake model's draft is right about 70% of the time, so several tokens come back per verify
  step): the same requests give the same outputs with and without speculation, stop strings met inside an accepted
  run cut the output there, and the per-position acceptance counters add up;
- guided (json_schema) requests, which never speculate, in the same batches as speculating ones: every request
  finishes (a step planned ahead of a verify step's result must not hold that result back), the guided replies
  match the schema, the others are unchanged;
- a draft that does not fit the target is refused at start-up naming the field or the tensor.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file, save_file

from kimi.ipc import free_tcp_port
from kimi.tiny_checkpoint import make_tiny_eagle3_draft

_spec = importlib.util.spec_from_file_location("kimi_e2e_conftest_spec", Path(__file__).with_name("conftest.py"))
_conftest = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _conftest
_spec.loader.exec_module(_conftest)
start_server, stop_server, REPO = _conftest.start_server, _conftest.stop_server, _conftest.REPO

K = 3
COMMON = ("--block-size", "16", "--max-num-seqs", "16", "--max-model-len", "256", "--token-budget", "256")


@pytest.fixture(scope="module")
def draft(tmp_path_factory) -> str:
    return make_tiny_eagle3_draft(tmp_path_factory.mktemp("draft") / "eagle3", "k2.6", seed=0)


def _spec_flag(draft: str, k: int = K) -> tuple[str, str]:
    return ("--speculative-config", json.dumps({"method": "eagle3", "model": draft, "num_speculative_tokens": k}))


def _bodies(max_tokens: int, seeded: bool = False) -> list[dict]:
    """16 completions: greedy (seeded: every fifth one sampled with a seed instead), a third with stop strings."""
    out = []
    for i in range(16):
        b = {
            "model": "tiny",
            "prompt": f"request {i}: " + "tell me about speculative decoding " * (1 + i % 3),
            "max_tokens": max_tokens - (i % 4),
            "temperature": 0,
            "logprobs": 1,
        }
        if seeded and i % 5 == 3:
            b |= {"temperature": 0.8, "seed": 1000 + i}
        if i % 3 == 1:
            b["stop"] = ["e", "a"]
        if i % 6 == 4:
            b["include_stop_str_in_output"] = True
        out.append(b)
    return out


async def _run_all(url: str, bodies: list[dict]) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        rs = await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))
    for r in rs:
        assert r.status_code == 200, r.text
    return [r.json() for r in rs]


def _outputs(srv, bodies: list[dict]) -> tuple[list[tuple], dict]:
    res = asyncio.run(_run_all(srv.base_url, bodies))
    metrics = {
        s.name + str(sorted(s.labels.items())): s.value
        for f in text_string_to_metric_families(httpx.get(srv.base_url + "/metrics").text)
        for s in f.samples
    }
    out = []
    for r in res:
        ch = r["choices"][0]
        lps = ch["logprobs"]["token_logprobs"] if ch.get("logprobs") else None
        out.append((ch["text"], ch["finish_reason"], r["usage"]["completion_tokens"], lps))
    return out, metrics


def _serve(model: str, log: str, *extra: str):
    srv = start_server(model, log, *COMMON, *extra)
    return srv


def _assert_same(got: list[tuple], ref: list[tuple], lp_tol: float) -> None:
    for i, (g, r) in enumerate(zip(got, ref)):
        assert g[:3] == r[:3], (i, g[:3], r[:3])
        assert g[3] is not None and r[3] is not None and len(g[3]) == len(r[3])
        assert g[3] == pytest.approx(r[3], abs=lp_tol), i


@pytest.fixture(scope="module")
def tiny_ref(tiny_k26, tmp_path_factory) -> tuple[list[tuple], dict]:
    """The 16 requests' outputs and /metrics without speculation (24 blocks of 16 tokens: they preempt)."""
    srv = _serve(tiny_k26, str(tmp_path_factory.mktemp("log") / "ref.log"), "--num-blocks", "24")
    try:
        return _outputs(srv, _bodies(20))
    finally:
        assert stop_server(srv) == 0, srv.log()


@pytest.mark.parametrize("nproc", [1, 2])
def test_greedy_equal_with_speculation_tiny_model(tiny_k26, draft, tiny_ref, tmp_path, nproc) -> None:
    """One rank, and two (DP attention x EP MoE over gloo: each rank verifies its own requests, the MoE all-to-all
    carries every rank's verify rows)."""
    ref, ref_m = tiny_ref
    log = tmp_path / "spec.log"
    srv = _serve(tiny_k26, str(log), "--num-blocks", "24", "--nproc", str(nproc), *_spec_flag(draft))
    try:
        got, m = _outputs(srv, _bodies(20))
    finally:
        assert stop_server(srv) == 0, srv.log()
    _assert_same(got, ref, 1e-3)
    assert any(r[1] == "stop" for r in ref) and any(r[1] == "length" for r in ref)
    assert ref_m["kimi:num_preemptions_total[]"] > 0
    if nproc == 1:
        assert m["kimi:num_preemptions_total[]"] > 0
    assert m["kimi:spec_decode_num_drafts_total[]"] > 0
    assert m["kimi:spec_decode_num_draft_tokens_total[]"] >= m["kimi:spec_decode_num_drafts_total[]"]
    assert "spec_decode_num_drafts_total[]" not in str(ref_m)  # exported only with speculation on
    assert log.read_text().count("speculative decoding:") == nproc  # each rank's exit line


def test_fake_workers_accept_several_tokens_per_step(tiny_k26, draft, tmp_path) -> None:
    bodies = _bodies(40, seeded=True)  # the fake model's seeded tokens do not depend on how many come per step
    srv = _serve(tiny_k26, str(tmp_path / "fref.log"), "--fake-workers", "--num-blocks", "20")
    try:
        ref, _ = _outputs(srv, bodies)
    finally:
        assert stop_server(srv) == 0, srv.log()
    srv = _serve(tiny_k26, str(tmp_path / "fspec.log"), "--fake-workers", "--num-blocks", "20", *_spec_flag(draft, 4))
    try:
        got, m = _outputs(srv, bodies)
    finally:
        assert stop_server(srv) == 0, srv.log()
    _assert_same(got, ref, 0.0)
    assert any(r[1] == "stop" for r in ref)
    drafts = m["kimi:spec_decode_num_drafts_total[]"]
    accepted = m["kimi:spec_decode_num_accepted_tokens_total[]"]
    assert drafts > 0 and 0 < accepted < m["kimi:spec_decode_num_draft_tokens_total[]"]
    per_pos = [m[f"kimi:spec_decode_num_accepted_tokens_per_pos_total[('position', '{i}')]"] for i in range(4)]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True) and per_pos[1] > 0
    assert m["kimi:num_preemptions_total[]"] > 0


def _serve_fails(model: str, *extra: str) -> tuple[int, str]:
    port = free_tcp_port()
    zmq = f"tcp://127.0.0.1:{free_tcp_port()}"
    cmd = [sys.executable, "-m", "kimi", "serve", "--model", model, "--port", str(port), "--zmq-submit-addr", zmq]
    cmd += [*COMMON, *extra]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout + p.stderr


def test_mismatched_draft_is_refused_at_start_up(tiny_k26, draft, tmp_path) -> None:
    bad_vocab = tmp_path / "vocab"
    bad_vocab.mkdir()
    cfg = json.loads((Path(draft) / "config.json").read_text())
    (bad_vocab / "config.json").write_text(json.dumps({**cfg, "vocab_size": 32000}))
    rc, log = _serve_fails(tiny_k26, *_spec_flag(str(bad_vocab)))
    assert rc == 2 and "vocab_size 32000" in log, log

    rc, log = _serve_fails(
        tiny_k26, "--speculative-config", '{"method": "ngram", "model": "x", "num_speculative_tokens": 2}'
    )
    assert rc == 2 and "method 'ngram'" in log, log

    bad_shape = tmp_path / "shape"
    bad_shape.mkdir()
    (bad_shape / "config.json").write_text(json.dumps(cfg))
    t = load_file(str(Path(draft) / "model.safetensors"))
    t["midlayer.self_attn.q_proj.weight"] = t["midlayer.self_attn.q_proj.weight"][:, :128].contiguous()
    save_file(t, str(bad_shape / "model.safetensors"))
    rc, log = _serve_fails(tiny_k26, *_spec_flag(str(bad_shape)))
    assert rc != 0 and "midlayer.self_attn.q_proj.weight" in log, log


GUIDED_SCHEMA = {
    "type": "object",
    "properties": {"color": {"type": "string", "enum": ["red", "green"]}, "n": {"type": "integer"}},
    "required": ["color", "n"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("fake", [False, True])
def test_guided_requests_beside_speculating_ones(tiny_k26, draft, tmp_path, fake) -> None:
    """Guided requests do not speculate (docs/speculative.md) but run in the same batches as requests that do: all
    finish, the guided replies are valid JSON of the schema, the plain greedy ones are what they are without the
    guided neighbours."""
    plain = [b for b in _bodies(20) if "stop" not in b][:6]
    guided = [
        {
            "model": "tiny",
            "prompt": f"guided {i}: give me a color",
            "max_tokens": 200,
            "temperature": 0 if i % 2 else 0.9,
            "seed": i,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": GUIDED_SCHEMA}},
        }
        for i in range(4)
    ]
    mode = ("--fake-workers",) if fake else ()
    srv = _serve(tiny_k26, str(tmp_path / "ref.log"), *mode)
    try:
        ref, _ = _outputs(srv, plain)
    finally:
        assert stop_server(srv) == 0, srv.log()
    srv = _serve(tiny_k26, str(tmp_path / "spec.log"), *mode, *_spec_flag(draft))
    try:
        mixed = [b for pair in zip(plain, guided + guided[:2]) for b in pair]  # interleaved: same batches
        res = asyncio.run(_run_all(srv.base_url, mixed))
    finally:
        assert stop_server(srv) == 0, srv.log()
    got = []
    for b, r in zip(mixed, res):
        ch = r["choices"][0]
        if "response_format" in b:
            assert ch["finish_reason"] == "stop", ch
            obj = json.loads(ch["text"])
            assert obj["color"] in ("red", "green") and isinstance(obj["n"], int) and set(obj) == {"color", "n"}
        else:
            got.append(
                (ch["text"], ch["finish_reason"], r["usage"]["completion_tokens"], ch["logprobs"]["token_logprobs"])
            )
    _assert_same(got, ref, 1e-3 if not fake else 0.0)
