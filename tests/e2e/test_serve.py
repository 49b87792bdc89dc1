"""End to end: the real server driven by the official `openai` client and by kimi's ZeroMQ client."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import openai
import pytest
from conftest import raw_dealer, start_server, stop_server

from kimi.client import AsyncKimiClient, KimiClient, KimiError


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_health_and_models(server, client):
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_completion(client):
    r = client.completions.create(model="tiny", prompt="Hello world", max_tokens=7, temperature=0)
    c = r.choices[0]
    assert c.finish_reason in ("length", "stop")
    assert r.usage.completion_tokens == (7 if c.finish_reason == "length" else r.usage.completion_tokens)
    assert 1 <= r.usage.completion_tokens <= 7
    assert r.usage.prompt_tokens >= 2 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # Greedy is deterministic: the same request gives the same text.
    r2 = client.completions.create(model="tiny", prompt="Hello world", max_tokens=7, temperature=0)
    assert r2.choices[0].text == c.text


def test_completion_streaming_equals_non_streaming(client):
    kw = dict(model="tiny", prompt=[11, 22, 33, 44, 55], max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    full = client.completions.create(**kw)
    assert full.choices[0].text == text
    assert full.usage.completion_tokens == 10 and full.usage.prompt_tokens == 5


def test_chat(client):
    msgs = [{"role": "user", "content": "What is 1+1?"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0)
    m = r.choices[0].message
    thought = (m.model_extra or {}).get("reasoning_content")
    # text, or (a thinking vocabulary: all 6 tokens reasoning) null content beside the reasoning
    assert m.role == "assistant" and (isinstance(m.content, str) or (m.content is None and thought)), m
    assert r.choices[0].finish_reason in ("length", "stop")
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0, stream=True)
    parts, roles, reasons = [], [], []
    for ch in stream:
        d = ch.choices[0].delta
        if d.role:
            roles.append(d.role)
        if d.content:
            parts.append(d.content)
        if ch.choices[0].finish_reason:
            reasons.append(ch.choices[0].finish_reason)
    assert roles == ["assistant"]
    assert reasons == [r.choices[0].finish_reason]
    assert "".join(parts) == (m.content or "")


def test_chat_user_text_never_becomes_control_tokens(server, client):
    """A user's literal '<|im_end|>' is text: the prompt is longer than the one-token control version."""
    a = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x<|im_end|>"}], max_tokens=1, temperature=0
    )
    b = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=1, temperature=0
    )
    assert a.usage.prompt_tokens > b.usage.prompt_tokens + 1


def _prompts() -> list[list[int]]:
    rng = random.Random(1234)
    lengths = [1, 3, 9, 17, 30, 47, 64, 130]  # beyond the 48-token budget: chunked prefill, many 16-token blocks
    return [[rng.randrange(0, 160000) for _ in range(n)] for n in lengths]


def test_concurrent_greedy_requests_match_alone(server, client):
    prompts = _prompts()
    max_tokens = [12, 5, 9, 16, 3, 11, 7, 14]
    alone = [
        client.completions.create(model="tiny", prompt=p, max_tokens=m, temperature=0, extra_body={"ignore_eos": True})
        for p, m in zip(prompts, max_tokens)
    ]

    async def together():
        ac = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(
                *[
                    ac.completions.create(
                        model="tiny", prompt=p, max_tokens=m, temperature=0, extra_body={"ignore_eos": True}
                    )
                    for p, m in zip(prompts, max_tokens)
                ]
            )
        finally:
            await ac.close()

    both = asyncio.run(together())
    for a, b, m in zip(alone, both, max_tokens):
        assert a.usage.completion_tokens == m == b.usage.completion_tokens
        assert a.choices[0].text == b.choices[0].text

    # The ZeroMQ client sees the same tokens (and their text) as HTTP.
    with KimiClient(server.zmq_addr, timeout_s=120) as zc:
        for p, m, a in zip(prompts, max_tokens, alone):
            outs = list(zc.generate(p, max_tokens=m, temperature=0.0, ignore_eos=True))
            ids = [t for o in outs for t in o.token_ids]
            assert len(ids) == m
            assert outs[-1].finished and outs[-1].finish_reason == "length"
            assert "".join(o.text for o in outs) == a.choices[0].text


def test_zmq_async_client_and_abort(server):
    async def go():
        async with AsyncKimiClient(server.zmq_addr) as c:
            text = ""
            async for o in c.generate("Hello world", max_tokens=5, temperature=0.0):
                text += o.text
            rid = await c.submit([1, 2, 3], max_tokens=400, temperature=0.0, ignore_eos=True)
            got = []
            async for o in c.stream(rid):
                got.append(o)
                if len(got) == 2:
                    await c.abort(rid)
                if o.finished:
                    break
            return text, got

    text, got = asyncio.run(go())
    http = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": "tiny", "prompt": "Hello world", "max_tokens": 5, "temperature": 0},
    ).json()
    assert text == http["choices"][0]["text"]
    assert got[-1].finished and got[-1].finish_reason == "abort"
    assert len(got) < 50


def test_zmq_bad_submission_is_an_error(server):
    with KimiClient(server.zmq_addr, timeout_s=60) as c:
        with pytest.raises(KimiError, match="top_p"):
            list(c.generate("hi", max_tokens=3, top_p=0.0))
        with pytest.raises(KimiError, match="max_tokens"):
            list(c.generate("hi", max_tokens=0))


BAD = [
    ({"model": "tiny", "prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"model": "tiny", "prompt": ""}, "prompt"),
    ({"model": "tiny", "prompt": []}, "prompt"),
    ({"model": "tiny", "prompt": 5}, "prompt"),
    ({"model": "tiny", "prompt": [1, -3]}, "prompt"),
    ({"model": "tiny", "prompt": [7] * 600}, "prompt"),
    ({"model": "tiny", "prompt": [7] * 500, "max_tokens": 100}, "max_tokens"),
    ({"model": "tiny", "prompt": "hi", "temperature": -1}, "temperature"),
    ({"model": "tiny", "prompt": "hi", "top_p": 0}, "top_p"),
    ({"model": "tiny", "prompt": "hi", "n": 0}, "n"),
    ({"model": "tiny", "prompt": "hi", "frobnicate": 1}, "frobnicate"),
    ({"model": "tiny", "prompt": "hi", "stream": "yes"}, "stream"),
    ({"model": 5, "prompt": "hi"}, "model"),  # absent / null / "": the served model (test_api_edges)
    ({"model": "tiny", "prompt": "hi", "top_k": 2**70}, "top_k"),  # would not fit the 64-bit wire format
    ({"model": "tiny", "prompt": "hi", "seed": -(2**64)}, "seed"),
    ({"model": "tiny", "prompt": ["a", ""]}, "prompt[1]"),  # a batch names the prompt (tests/e2e/test_vllm_fields.py)
    # integers beyond the float range in float fields (JSON numbers have no size limit)
    ({"model": "tiny", "prompt": "hi", "temperature": 10**400}, "temperature"),
    ({"model": "tiny", "prompt": "hi", "presence_penalty": -(10**400)}, "presence_penalty"),
    ({"model": "tiny", "prompt": "hi", "logit_bias": {"5": 10**400}}, "logit_bias"),
    # nested fields are named with their path
    (
        {"model": "tiny", "prompt": "hi", "stream": True, "stream_options": {"include_usage": 1}},
        "stream_options.include_usage",
    ),
    ({"model": "tiny", "prompt": "hi", "stream": True, "stream_options": {"foo": True}}, "stream_options.foo"),
    # a field that must be an object, given something else
    ({"model": "tiny", "prompt": "hi", "stream": True, "stream_options": []}, "stream_options"),
    ({"model": "tiny", "prompt": "hi", "stream": True, "stream_options": "x"}, "stream_options"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[p for _, p in BAD])
def test_bad_completion_requests_are_400(server, body, param):
    r = httpx.post(f"{server.base_url}/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


def test_an_unknown_model_is_404(server):
    """As OpenAI and vLLM: the openai client raises NotFoundError; the error still names `model`."""
    r = httpx.post(f"{server.base_url}/v1/completions", json={"model": "nope", "prompt": "hi"})
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["param"] == "model" and err["code"] == "model_not_found" and err["type"] == "invalid_request_error"


def test_prompt_list_errors_say_what_is_wrong(server):
    """A list prompt of non-integers is refused as such (not as a batch of prompts), naming the item, also when a
    string or list follows token ids; a list of strings (or lists) is a batch (tests/e2e/test_vllm_fields.py)."""
    for prompt, words in (
        ([1.0, 2], "integer token ids"),
        ([True, False], "integer token ids"),
        ([1, "a"], "integer token ids; it holds 'a'"),
        ([1, [2]], "it holds [2]"),
    ):
        r = httpx.post(f"{server.base_url}/v1/completions", json={"model": "tiny", "prompt": prompt})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "prompt" and words in err["message"], (prompt, err)


BAD_CHAT = [
    ({"model": "tiny"}, "messages"),
    ({"model": "tiny", "messages": []}, "messages"),
    ({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"model": "tiny", "messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    (
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}],
        },
        "messages[0].content[0]",
    ),
    (
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -2},
        "max_completion_tokens",
    ),
    (
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "max_completion_tokens": 3},
        "max_completion_tokens",
    ),
    # an assistant message's tool calls in the history: each must be an object, its function an object, its type
    # "function"
    ({"model": "tiny", "messages": [{"role": "assistant", "tool_calls": ["x"]}]}, "messages[0].tool_calls[0]"),
    (
        {"model": "tiny", "messages": [{"role": "assistant", "tool_calls": [{"id": "a", "function": "x"}]}]},
        "messages[0].tool_calls[0].function",
    ),
    (
        {
            "model": "tiny",
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "a", "type": "xx", "function": {"name": "f", "arguments": "{}"}}],
                }
            ],
        },
        "messages[0].tool_calls[0].type",
    ),
]


@pytest.mark.parametrize("body,param", BAD_CHAT, ids=[p for _, p in BAD_CHAT])
def test_bad_chat_requests_are_400(server, body, param):
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_errors_name_max_completion_tokens_when_that_was_sent_and_modalities_text_is_accepted(server):
    """max_completion_tokens that does not fit the context is a 400 naming max_completion_tokens (the field the
    client sent, not max_tokens), and so is the min_tokens message; OpenAI's default modalities ["text"] is accepted,
    any other value a 400 naming modalities."""
    url = f"{server.base_url}/v1/chat/completions"
    msgs = [{"role": "user", "content": "x"}]
    r = httpx.post(url, json={"model": "tiny", "messages": msgs, "max_completion_tokens": 10**7})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "max_completion_tokens" and "max_completion_tokens asks for" in err["message"], err
    assert "max_tokens" not in err["message"].replace("max_completion_tokens", ""), err
    r = httpx.post(url, json={"model": "tiny", "messages": msgs, "max_completion_tokens": 2, "min_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text
    assert "max_completion_tokens (2)" in r.json()["error"]["message"], r.text
    r = httpx.post(url, json={"model": "tiny", "messages": msgs, "max_tokens": 10**7})  # named as sent
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    r = httpx.post(url, json={"model": "tiny", "messages": msgs, "max_tokens": 2, "modalities": ["text"]})
    assert r.status_code == 200, r.text
    for bad in (["audio"], ["text", "audio"], "text"):
        r = httpx.post(url, json={"model": "tiny", "messages": msgs, "max_tokens": 2, "modalities": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "modalities", (bad, r.text)


def test_malformed_json_is_400_and_changes_nothing(server, client):
    r = httpx.post(
        f"{server.base_url}/v1/completions",
        content=b'{"model": "tiny", "prompt": ',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="hi", max_tokens=0)
    ok = client.completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens >= 1


def test_short_body_is_408_after_the_body_timeout_and_invalid_utf8_is_400(server, client):
    """A client that sends fewer bytes than its Content-Length gets a 408 after --request-body-timeout (2 s
    here) instead of holding the connection forever; a body that is not UTF-8 is a 400 saying so."""
    import socket
    from urllib.parse import urlparse

    u = urlparse(server.base_url)
    with socket.create_connection((u.hostname, u.port), timeout=20) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"content-length: 100\r\n\r\n" + b'{"model": "tiny"'
        )
        t0 = time.monotonic()
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = s.recv(4096)
            if not chunk:
                break
            reply += chunk
        waited = time.monotonic() - t0
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"not received within 2 s" in reply
    assert 1.5 <= waited <= 15, waited
    r = httpx.post(
        f"{server.base_url}/v1/completions",
        content=b'{"model": "tiny", "prompt": "\xff\xfe"}',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "not valid UTF-8" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "prompt"
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=1).usage.completion_tokens == 1


def test_integer_literal_over_the_parse_limit_is_400(server, client):
    """A JSON integer of more digits than Python parses (4300 by default) in any field, known or not, top-level or
    nested: a 400 naming that field (not a 500, not "malformed JSON"), and the server keeps serving. One digit
    fewer parses and meets the field's own range check."""
    cases = [
        (b'"max_tokens": ' + b"1" + b"0" * 4300, "max_tokens"),
        (b'"foo": -' + b"9" * 4301, "foo"),
        (b'"logit_bias": {"5": ' + b"9" * 5000 + b"}", "logit_bias.5"),
        (b'"prompt": [1, ' + b"2" * 4301 + b"]", "prompt[1]"),
    ]
    for fields, param in cases:
        body = b'{"model": "tiny", "prompt": "hi", ' + fields + b"}"
        r = httpx.post(f"{server.base_url}/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and "more than 4300 digits" in err["message"], err
    body = b'{"model": "tiny", "prompt": "hi", "max_tokens": ' + b"9" * 4300 + b"}"
    r = httpx.post(f"{server.base_url}/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text

    def post(body: bytes) -> httpx.Response:
        return httpx.post(
            f"{server.base_url}/v1/completions", content=body, headers={"content-type": "application/json"}
        )

    # a duplicate key keeps its last value, so a replaced long literal is no error
    r = post(b'{"model": "tiny", "prompt": "hi", "max_tokens": ' + b"9" * 4301 + b', "max_tokens": 1}')
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text
    # under a key holding a lone surrogate: the surrogate is reported (at its object's path), not a 500
    r = post(b'{"model": "tiny", "prompt": "hi", "logit_bias": {"\\udc00": ' + b"9" * 4301 + b"}}")
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
    assert "surrogate" in r.json()["error"]["message"]
    # malformed after the long literal: malformed JSON
    r = post(b'{"model": "tiny", "prompt": "hi", "foo": ' + b"9" * 4301 + b", }")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"], r.text
    # the empty key is named as such
    r = post(b'{"model": "tiny", "prompt": "hi", "": ' + b"9" * 4301 + b"}")
    assert r.status_code == 400 and r.json()["error"]["param"] == "", r.text
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=1).usage.completion_tokens == 1


def test_deeply_nested_json_is_400(server, client):
    body = b'{"model": "tiny", "prompt": "hi", "user": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = httpx.post(f"{server.base_url}/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=1).usage.completion_tokens == 1


def test_zmq_multi_frame_message_is_an_error_and_the_api_survives(server):
    from kimi import protocol

    with raw_dealer(server.zmq_addr) as s:
        s.send_multipart([b"a", b"b", b"c"])
        assert s.poll(10_000), "no answer to a multi-frame message"
        out = protocol.decode_output(s.recv())
        assert out.finished and "malformed" in out.error
    with KimiClient(server.zmq_addr, timeout_s=60) as c:
        outs = list(c.generate("hi", max_tokens=2, temperature=0.0))
        assert outs[-1].finished and outs[-1].num_output_tokens >= 1


def test_generation_config_max_new_tokens_is_the_chat_default(tmp_path):
    """generation_config.json's `max_new_tokens` (the tiny checkpoint's --max-new-tokens, which `make serve` sets) is
    the `max_tokens` of a chat request that sends none (as vLLM reads it); an explicit `max_tokens` wins, and
    completions keep OpenAI's default of 16."""
    import json

    from kimi.tiny_checkpoint import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt-max-new-tokens", max_new_tokens=7)
    assert json.loads((tmp_path / "ckpt-max-new-tokens" / "generation_config.json").read_text())["max_new_tokens"] == 7
    srv = start_server(ckpt, str(tmp_path / "server.log"), "--fake-workers")
    try:
        c = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
        msgs = [{"role": "user", "content": "Hi"}]
        r = c.chat.completions.create(model="tiny", messages=msgs, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 7 and r.choices[0].finish_reason == "length", r
        r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=3, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3, r
        r = c.completions.create(model="tiny", prompt="Hello", extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 16, r
    finally:
        assert stop_server(srv) == 0, srv.log()
