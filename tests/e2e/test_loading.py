"""Requests to a real `kimi serve` whose workers are still loading (`--attach` with no worker started: `/health`
says "loading" throughout): a well-formed generation request gets the retryable loading error (OpenAI routes: 503,
Anthropic routes: 529 overloaded_error, both with Retry-After), and a request that is a 400 once the workers are
ready is a 400 now too, checked through the real openai and anthropic clients."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from conftest import REPO

from kimi.ipc import free_tcp_port

MSGS = [{"role": "user", "content": "hi"}]
LOADING = "the server is still loading the model"


@pytest.fixture(scope="module")
def loading_srv(tiny_k26, tmp_path_factory):
    """(base URL, log path) of a server that waits for attached workers that never come."""
    log_path = tmp_path_factory.mktemp("log") / "server.log"
    port = free_tcp_port()
    cmd = [sys.executable, "-m", "kimi", "serve", "--model", tiny_k26, "--port", str(port), "--attach"]
    cmd += ["--served-model-name", "tiny", "--max-model-len", "256", "--startup-timeout", "600"]
    cmd += ["--zmq-submit-addr", f"tcp://127.0.0.1:{free_tcp_port()}"]
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, cwd=REPO)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
        try:
            r = httpx.get(f"{base}/health", timeout=1)
        except httpx.HTTPError:
            time.sleep(0.2)
            continue
        assert (r.status_code, r.json()) == (503, {"status": "loading"})
        break
    yield base, log_path
    proc.terminate()
    proc.wait(30)
    assert "Traceback" not in log_path.read_text(), log_path.read_text()[-3000:]


def _raw(base: str, path: str, body: bytes) -> httpx.Response:
    return httpx.post(base + path, content=body, headers={"content-type": "application/json"}, timeout=30)


def test_openai_routes_answer_503_for_a_valid_request_and_400_for_a_bad_one(loading_srv):
    base, _ = loading_srv
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4)
    assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
    assert LOADING in e.value.message
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model="tiny", prompt="hi", max_tokens=4)
    assert e.value.status_code == 503
    # failing validation: the same 400 as once ready, naming the field
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, temperature=-1)
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt="hi", max_tokens=4, extra_body={"bogus": 1})
    assert bad.value.body["param"] == "bogus"
    # a limit known before the workers are ready (max_model_len 256)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=1000)
    assert bad.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=MSGS, max_tokens=4)
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        r = _raw(base, path, b'{"model": "tiny", "messages": [')
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    r = _raw(base, "/v1/responses", b'{"model": "tiny", "input": "hi", "max_output_tokens": 4}')
    assert r.status_code == 503 and LOADING in r.json()["error"]["message"]


def test_anthropic_routes_answer_529_overloaded_error_and_400_for_a_bad_request(loading_srv):
    base, log_path = loading_srv
    client = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0)
    with pytest.raises(anthropic.OverloadedError) as e:
        client.messages.create(model="tiny", max_tokens=4, messages=MSGS)
    assert e.value.status_code == 529 and e.value.response.headers["retry-after"] == "1"
    assert e.value.body == {"type": "error", "error": {"type": "overloaded_error", "message": LOADING}}
    # a stream is refused before its first event
    with pytest.raises(anthropic.OverloadedError), client.messages.stream(model="tiny", max_tokens=4, messages=MSGS):
        pass
    # the SDK retries a 529 (here once, after the Retry-After second), then raises
    retrying = anthropic.Anthropic(base_url=base, api_key="x", max_retries=1)
    before = len(re.findall(r'"POST /v1/messages HTTP/1.1" 529', Path(log_path).read_text()))
    t0 = time.monotonic()
    with pytest.raises(anthropic.OverloadedError):
        retrying.messages.create(model="tiny", max_tokens=4, messages=MSGS)
    assert time.monotonic() - t0 >= 0.9
    time.sleep(0.3)  # the access log line of the last answer
    assert len(re.findall(r'"POST /v1/messages HTTP/1.1" 529', Path(log_path).read_text())) == before + 2
    # failing validation, or not JSON: the 400 invalid_request_error of a ready server
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model="tiny", max_tokens=4, messages=MSGS, stop_sequences=["a"] * 5)
    assert bad.value.body["error"]["type"] == "invalid_request_error" and "stop_sequences" in str(bad.value)
    r = _raw(base, "/v1/messages", b'{"model": "tiny", "max_tokens": 4, "messages": [')
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = _raw(base, "/v1/messages", b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}')
    assert r.status_code == 400 and "'max_tokens'" in r.json()["error"]["message"]
    # count_tokens needs no worker
    assert client.messages.count_tokens(model="tiny", messages=MSGS).input_tokens > 0
