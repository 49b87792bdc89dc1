"""End to end: admission limits and request-validation edges, on one real server with tight limits.

The server: --max-waiting 2, --max-model-len 1024 but a KV cache of 19 usable 16-token blocks (304 tokens),
and an API key. Checked here: `n` beyond the queue capacity (400, not a 503 retried forever), the default
max_tokens clamped to the KV cache, integer fields that refuse floats and booleans, canonical logit_bias
keys, a case-insensitive `Bearer` scheme, `GET /v1/models/{id}`, chat_template_kwargs errors, and the
ZeroMQ client's lifetime rules (closing or leaving a stream aborts; a duplicate request id is refused).
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import openai
import pytest
from conftest import raw_dealer, start_server, stop_server
from prometheus_client.parser import text_string_to_metric_families

from kimi import protocol
from kimi.client import AsyncKimiClient, KimiClient, KimiError

KEY = "edge-key"
KV_TOKENS = 19 * 16  # --num-blocks 20 (block 0 is the null block) x --block-size 16
MSGS = [{"role": "user", "content": "What is 1+1?"}]


@pytest.fixture(scope="module")
def srv(tiny_k26, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("log") / "edges.log")
    s = start_server(
        tiny_k26,
        log,
        "--max-model-len",
        "1024",
        "--num-blocks",
        "20",
        "--block-size",
        "16",
        "--max-waiting",
        "2",
        "--api-key",
        KEY,
    )
    yield s
    assert stop_server(s) == 0, s.log()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key=KEY, max_retries=0, timeout=120)


def _post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{srv.base_url}/v1/{path}", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def _bad(r: httpx.Response, param: str, status: int = 400) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    return err["message"]


def test_a_field_of_the_other_endpoint_names_that_endpoint(srv):
    """A chat field sent to /v1/completions (tools, top_logprobs, ...) or a completions field sent to
    /v1/chat/completions (suffix; `echo` is a field of both, as in vLLM) is a 400 naming the field and the endpoint
    that takes it (it said "not supported by this server", which the server does support, on the other endpoint);
    other unknown fields keep the plain message."""
    tools = [{"type": "function", "function": {"name": "f"}}]
    for field, value in (
        ("tools", tools),
        ("top_logprobs", 2),
        ("chat_template_kwargs", {}),
        ("parallel_tool_calls", True),
    ):
        msg = _bad(_post(srv, "completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2, field: value}), field)
        assert msg == f"'{field}' is not supported on this endpoint; it is a field of /v1/chat/completions", msg
    for field, value in (("suffix", "x"),):
        msg = _bad(
            _post(
                srv,
                "chat/completions",
                {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value},
            ),
            field,
        )
        assert msg == f"'{field}' is not supported on this endpoint; it is a field of /v1/completions", msg
    msg = _bad(
        _post(srv, "completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2, "frobnicate": 1}), "frobnicate"
    )
    assert msg == "'frobnicate' is not supported by this server"


# ---- 1. n beyond --max-waiting ---------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [3, 4])
def test_n_beyond_queue_capacity_is_a_400_not_a_503(srv, n):
    for path, body in (
        ("completions", {"prompt": "Hi", "max_tokens": 2}),
        ("chat/completions", {"messages": MSGS, "max_tokens": 2}),
    ):
        r = _post(srv, path, {"model": "tiny", "n": n, **body})
        msg = _bad(r, "n")
        assert "retry-after" not in r.headers
        assert "queue capacity" in msg and f"({n})" in msg and "2" in msg


def test_n_at_queue_capacity_runs(client):
    r = client.completions.create(model="tiny", prompt="Hi", max_tokens=2, n=2, temperature=0)
    assert sorted(c.index for c in r.choices) == [0, 1]


def test_zmq_request_is_admitted_by_an_idle_server(srv):
    with KimiClient(srv.zmq_addr, timeout_s=60) as c:  # one request per submission: never beyond max_waiting >= 1
        outs = list(c.generate("Hi", max_tokens=2, temperature=0.0, ignore_eos=True))
    assert outs[-1].finish_reason == "length"


# ---- 2. the default max_tokens fits the KV cache ---------------------------------------------------------------
def test_chat_default_max_tokens_is_clamped_to_the_kv_cache(client):
    def prompt_tokens(n: int) -> int:
        r = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "word " * n}], temperature=0, max_tokens=1
        )
        return r.usage.prompt_tokens

    # a prompt that leaves a few tokens of the 304-token KV cache, whatever the vocabulary (the real one or the
    # byte-level fallback): measure tokens per "word " first
    p10, p20 = prompt_tokens(10), prompt_tokens(20)
    per_word = (p20 - p10) / 10
    n = int((KV_TOKENS - 20 - (p10 - 10 * per_word)) / per_word)
    long = [{"role": "user", "content": "word " * n}]
    r = client.chat.completions.create(model="tiny", messages=long, temperature=0, extra_body={"ignore_eos": True})
    room = KV_TOKENS - r.usage.prompt_tokens
    assert 0 < room < 60
    assert r.usage.completion_tokens == room and r.choices[0].finish_reason == "length"
    r = client.chat.completions.create(model="tiny", messages=MSGS, temperature=0, max_tokens=3)  # short prompt too
    assert r.usage.completion_tokens <= 3


def test_completions_default_max_tokens_is_clamped_too(client):
    r = client.completions.create(
        model="tiny", prompt=[7] * (KV_TOKENS - 5), temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


def test_explicit_max_tokens_beyond_the_kv_cache_is_still_a_400(srv):
    msg = _bad(_post(srv, "chat/completions", {"model": "tiny", "messages": MSGS, "max_tokens": 900}), "max_tokens")
    assert "KV cache capacity of 304" in msg
    msg = _bad(_post(srv, "completions", {"model": "tiny", "prompt": [7] * 400}), "prompt")  # default: no room at all
    assert "KV cache capacity" in msg and "no room for a generated token" in msg
    # a chat prompt that leaves no room names the chat field, messages
    long_msgs = [{"role": "user", "content": "word " * 400}]
    msg = _bad(_post(srv, "chat/completions", {"model": "tiny", "messages": long_msgs}), "messages")
    assert "no room for a generated token" in msg


# ---- 3. integers only --------------------------------------------------------------------------------------------
INT_FIELDS = {
    "completions": ["max_tokens", "max_completion_tokens", "n", "best_of", "top_k", "seed", "min_tokens", "logprobs"],
    "chat/completions": ["max_tokens", "max_completion_tokens", "n", "top_k", "seed", "min_tokens", "top_logprobs"],
}


@pytest.mark.parametrize("path", list(INT_FIELDS))
@pytest.mark.parametrize("value", [1.0, True, "1"])
def test_integer_fields_refuse_floats_and_booleans(srv, path, value):
    base = (
        {"model": "tiny", "prompt": "Hi"}
        if path == "completions"
        else {"model": "tiny", "messages": MSGS, "logprobs": True}
    )
    for name in INT_FIELDS[path]:
        msg = _bad(_post(srv, path, {**base, name: value}), name)
        assert "integer" in msg, msg
    # the same values as integers are accepted
    ok = _post(srv, path, {**base, **{k: 1 for k in INT_FIELDS[path] if k != "max_completion_tokens"}})
    assert ok.status_code == 200, ok.text


def test_boolean_noop_fields_refuse_integers(srv):
    r = _post(
        srv,
        "completions",
        {
            "model": "tiny",
            "prompt": "Hi",
            "max_tokens": 1,
            "stream": True,
            "stream_options": {"continuous_usage_stats": 0},
        },
    )
    _bad(r, "stream_options.continuous_usage_stats")  # nested fields are named by their path


def test_zmq_integer_fields_refuse_floats_and_booleans(srv):
    with KimiClient(srv.zmq_addr, timeout_s=60) as c:
        for name in ("max_tokens", "top_k", "seed", "min_tokens", "logprobs"):
            for value in (1.0, True):
                with pytest.raises(KimiError, match=f"'{name}'"):
                    list(c.generate([1, 2, 3], **{name: value}))
        with pytest.raises(KimiError, match="'logit_bias'"):
            list(c.generate([1, 2, 3], max_tokens=1, logit_bias={"05": 1.0}))


# ---- 4. logit_bias keys ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "key", [" 5", "5 ", "+5", "-5", "-0", "05", "00", "\u0665", "1_0", "5.0", "0x5", "", "5\n", "9" * 5000]
)
def test_logit_bias_keys_must_be_canonical_decimal_ids(srv, key):
    r = _post(srv, "completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 1, "logit_bias": {key: 1}})
    _bad(r, "logit_bias")


def test_logit_bias_canonical_keys_are_accepted(client):
    r = client.completions.create(
        model="tiny", prompt="Hi", max_tokens=1, temperature=0, logit_bias={"0": 0, "5": 1, "163839": -1, "5000": 100}
    )
    assert r.choices[0].text is not None
    r = client.completions.create(model="tiny", prompt="Hi", max_tokens=1, temperature=0, logit_bias={"5000": 100})
    assert r.choices[0].logprobs is None and r.usage.completion_tokens == 1


# ---- 4b. logprobs.text_offset with multi-byte characters -------------------------------------------------------------
# The rule (LLMServer._completion_logprobs / _prompt_offsets / _piece_offsets in kimi/controller/http/completions.py):
# text_offset[i] is the character offset, in the whole returned text (echoed prompt + completion), where the piece
# of text that token i completes starts; a token ending mid-character completes nothing and sits where the
# character starts.
def _check_offsets(text: str, lp: dict) -> None:
    toks, offs = lp["tokens"], lp["text_offset"]
    assert len(offs) == len(toks)
    assert offs == sorted(offs) and all(0 <= o <= len(text) for o in offs), (text, lp)
    for t, o in zip(toks, offs):
        if t and "\ufffd" not in t:  # a whole-character token's string is the text at its offset
            assert text[o:].startswith(t), (text, lp)


def test_completion_text_offset_counts_characters_of_the_echoed_text(srv):
    prompt = "\u00e9\U0001f600x"  # 2 + 4 + 1 bytes, 3 characters
    r = _post(
        srv,
        "completions",
        {"model": "tiny", "prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 0, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    text, lp = c["text"], c["logprobs"]
    assert text.startswith(prompt)
    _check_offsets(text, lp)
    n = len(lp["tokens"]) - 1  # the prompt's tokens, then the one generated token
    offs = lp["text_offset"]
    assert offs[0] == 0 and sorted(set(offs[:n])) == [0, 1, 2]  # each token sits at the character it is part of
    assert lp["tokens"][n - 1] == "x" and offs[n - 1] == 2
    assert offs[n] == len(prompt)  # the completion starts after the echoed prompt


def _stream_completion(srv, body: dict) -> tuple[str, dict]:
    text, lp = "", {"tokens": [], "text_offset": [], "token_logprobs": []}
    with httpx.stream(
        "POST",
        f"{srv.base_url}/v1/completions",
        json={**body, "stream": True},
        timeout=120,
        headers={"Authorization": f"Bearer {KEY}"},
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for ch in json.loads(line[6:])["choices"]:
                if ch["logprobs"] is not None:
                    part = ch["logprobs"]
                    # each chunk's tokens sit at or after the text returned so far (past its own text only where
                    # text is held back for a stop string), within it in the last chunk
                    last = ch["finish_reason"] is not None
                    assert all(
                        len(text) <= o and (not last or o <= len(text) + len(ch["text"])) for o in part["text_offset"]
                    ), ch
                    for k in lp:
                        lp[k] += part[k]
                text += ch["text"]
    return text, lp


@pytest.mark.parametrize("echo", [False, True])
@pytest.mark.parametrize("bias", ["240", "134750"])  # byte tokens / a token ending mid-character (vocab-dependent)
def test_streamed_text_offsets_equal_the_non_streaming_ones(srv, echo, bias):
    body = {
        "model": "tiny",
        "prompt": "\u00e9\U0001f600x",
        "max_tokens": 4,
        "logprobs": 1,
        "temperature": 0,
        "echo": echo,
        "logit_bias": {bias: 100},
    }
    r = _post(srv, "completions", body)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    text, lp = _stream_completion(srv, body)
    assert text == c["text"]
    _check_offsets(text, c["logprobs"])
    for k in ("tokens", "text_offset"):
        assert lp[k] == c["logprobs"][k], k
    n = len(lp["tokens"]) - r.json()["usage"]["completion_tokens"]  # the echoed prompt's tokens, if any
    assert lp["text_offset"][n] == (3 if echo else 0)  # the completion starts after the echoed 3 characters


def test_text_held_back_for_a_stop_string_does_not_move_the_offsets(srv):
    """A stop string that never completes but whose prefix spans the end of token j and all of token j + 1 holds
    that text back until a later token breaks the match; text_offset stays the tokens' cumulative lengths (as
    vLLM's), streamed and not, the same as without the stop string."""
    body = {"model": "tiny", "prompt": "Hello world", "max_tokens": 8, "logprobs": 0, "temperature": 0}
    r = _post(srv, "completions", body)
    assert r.status_code == 200, r.text
    ref = r.json()["choices"][0]
    toks = ref["logprobs"]["tokens"]
    j = next((i for i in range(len(toks) - 2) if all(t and "\ufffd" not in t for t in toks[i : i + 3])), None)
    if j is None:
        pytest.skip(f"no two whole-character tokens in a row to hold back: {toks}")
    stop = toks[j][-1] + toks[j + 1] + "\u0007\u0007"
    assert stop not in ref["text"]
    body = {**body, "stop": [stop]}
    r = _post(srv, "completions", body)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["text"] == ref["text"] and c["logprobs"]["tokens"] == toks
    assert c["logprobs"]["text_offset"] == ref["logprobs"]["text_offset"], (stop, toks)
    text, lp = _stream_completion(srv, body)
    assert text == ref["text"] and lp["text_offset"] == ref["logprobs"]["text_offset"]


def test_a_prompt_surely_too_long_is_refused_before_tokenizing(srv):
    """The server's max_model_len is 1024: 300k bytes are at least 300000 / (the longest token's bytes) tokens, so
    the prompt is refused without being tokenized, over HTTP and ZeroMQ with the same message."""
    from kimi.client import KimiClient, KimiError

    prompt = "ab" * 150000
    r = _post(srv, "completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    msg = r.json()["error"]["message"]
    assert "maximum context length is 1024 tokens; the prompt has at least" in msg, msg
    with KimiClient(srv.zmq_addr, timeout_s=30) as c, pytest.raises(KimiError) as e:
        list(c.generate(prompt, max_tokens=1))
    assert str(e.value) == msg
    # chat: the messages' text together (two halves here) bounds the prompt; it was tokenized in full first (a
    # newcomer's 30 MB message took ~10 s of CPU before its 400 gave the exact count)
    msgs = [
        {"role": "system", "content": "ab" * 75000},
        {"role": "user", "content": [{"type": "text", "text": "ab" * 75000}]},
    ]
    r = _post(srv, "chat/completions", {"model": "tiny", "messages": msgs, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert "maximum context length is 1024 tokens; the messages' text has at least" in r.json()["error"]["message"]
    r = _post(
        srv, "chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    )
    assert r.status_code == 200, r.text


def test_openai_platform_fields_at_their_defaults_are_accepted(srv):
    ok = {"store": False, "service_tier": "auto", "metadata": {"team": "a"}}
    r = _post(
        srv,
        "chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}],
            "max_tokens": 1,
            **ok,
        },
    )
    assert r.status_code == 200, r.text
    for body, param in [
        ({"store": True}, "store"),
        ({"service_tier": "flex"}, "service_tier"),
        ({"metadata": "x"}, "metadata"),
    ]:
        r = _post(srv, "completions", {"model": "tiny", "prompt": "hi", "max_tokens": 1, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ---- 5. Authorization scheme, any case -------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_bearer_scheme_is_case_insensitive(srv, scheme):
    r = httpx.get(f"{srv.base_url}/v1/models", headers={"Authorization": f"{scheme} {KEY}"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("value", [f"Basic {KEY}", f"Bearer {KEY}x", KEY, f"Bearer{KEY}", f"Bearer  x{KEY}", ""])
def test_wrong_credentials_are_still_a_401(srv, value):
    r = httpx.get(f"{srv.base_url}/v1/models", headers={"Authorization": value} if value else {})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_model_may_be_left_out(srv, path):
    """Without `model`, or with null or "", the request runs on the served model (as vLLM); another name or a
    non-string is a 400 naming `model`, another name a 404 (as OpenAI and vLLM)."""
    base = {"prompt": "Hi"} if path == "completions" else {"messages": MSGS}
    for extra in ({}, {"model": None}, {"model": ""}):
        r = _post(srv, path, {**base, **extra, "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "tiny"
    msg = _bad(_post(srv, path, {**base, "model": "gpt-4o", "max_tokens": 2}), "model", status=404)
    assert "does not exist" in msg
    for bad in (5, ["tiny"]):
        assert "must be a string" in _bad(_post(srv, path, {**base, "model": bad, "max_tokens": 2}), "model")


def test_placeholder_character_in_tools_is_a_400_not_a_500(srv, client):
    """U+F0000 in a tool's description (the chat encoder's placeholder marker) was an IndexError and a plain-text
    500; it is a 400 naming the field by its path, and the server keeps serving."""
    mark = "\U000f0000"
    tools = [{"type": "function", "function": {"name": "f", "description": f"x{mark}99{mark}y"}}]
    r = _post(srv, "chat/completions", {"model": "tiny", "messages": MSGS, "max_tokens": 2, "tools": tools})
    assert "U+F0000" in _bad(r, "tools[0].function.description")
    assert client.completions.create(model="tiny", prompt="Hi", max_tokens=1).choices[0].finish_reason in (
        "length",
        "stop",
    )


def test_placeholder_character_is_refused_only_where_a_chat_template_renders_it(srv):
    """U+F0000 is refused in chat text (the template's placeholder), named by path; a completion's prompt, stop
    strings and user are never rendered through the template and take it like any other character: the prompt
    comes back unchanged under `echo`."""
    mark = "\U000f0000"
    msgs = [{"role": "user", "content": f"a{mark}b"}]
    r = _post(srv, "chat/completions", {"model": "tiny", "messages": msgs, "max_tokens": 2})
    assert "U+F0000" in _bad(r, "messages[0].content")
    r = _post(
        srv,
        "chat/completions",
        {"model": "tiny", "messages": MSGS, "max_tokens": 2, "chat_template_kwargs": {"thinking": False, "x": mark}},
    )
    assert "U+F0000" in _bad(r, "chat_template_kwargs.x")
    prompt = f"Hi {mark} there"
    r = _post(
        srv,
        "completions",
        {"model": "tiny", "prompt": prompt, "max_tokens": 2, "echo": True, "stop": [mark], "user": mark},
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"].startswith(prompt) and choice["finish_reason"] in ("length", "stop")


# ---- 6. GET /v1/models/{id} ------------------------------------------------------------------------------------------
def test_models_retrieve(client, srv):
    m = client.models.retrieve("tiny")
    assert m.id == "tiny" and m.object == "model"
    assert m.model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.status_code == 404
    assert e.value.body["code"] == "model_not_found" and e.value.body["type"] == "invalid_request_error"
    assert httpx.get(f"{srv.base_url}/v1/models/tiny").status_code == 401  # behind the key like the list
    assert (
        httpx.get(f"{srv.base_url}/v1/models/org/name", headers={"Authorization": f"Bearer {KEY}"}).status_code == 404
    )


# ---- 7. chat_template_kwargs -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["bos_token", "eos_token"])
def test_chat_template_kwargs_may_not_set_the_tokenizer_tokens(srv, name):
    r = _post(
        srv,
        "chat/completions",
        {"model": "tiny", "messages": MSGS, "max_tokens": 1, "chat_template_kwargs": {name: {"x": 1}}},
    )
    msg = _bad(r, "chat_template_kwargs")
    assert name in msg and "TypeError" not in msg


def test_chat_template_kwargs_are_still_passed_to_the_template(client):
    r = client.chat.completions.create(
        model="tiny",
        messages=MSGS,
        max_tokens=1,
        temperature=0,
        extra_body={"chat_template_kwargs": {"thinking": False}},
    )
    assert r.usage.completion_tokens == 1


def test_chat_template_kwargs_thinking_must_be_a_boolean(srv):
    for value in ("maybe", 1, None, {}):
        r = _post(
            srv,
            "chat/completions",
            {"model": "tiny", "messages": MSGS, "max_tokens": 1, "chat_template_kwargs": {"thinking": value}},
        )
        assert "boolean" in _bad(r, "chat_template_kwargs.thinking")
    for value in (True, False):
        r = _post(
            srv,
            "chat/completions",
            {"model": "tiny", "messages": MSGS, "max_tokens": 1, "chat_template_kwargs": {"thinking": value}},
        )
        assert r.status_code == 200, r.text


# ---- 7b. string fields -----------------------------------------------------------------------------------------------
def _post_raw(srv, path: str, body: dict) -> httpx.Response:
    """Posts json.dumps(body) as is: a lone surrogate travels as the JSON escape "\\ud800"."""
    return httpx.post(
        f"{srv.base_url}/v1/{path}",
        content=json.dumps(body).encode(),
        timeout=120,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "path,body,param",
    [
        ("completions", {"prompt": "a\ud800b", "echo": True}, "prompt"),
        ("completions", {"prompt": "Hi", "stop": ["x", "\udfff"]}, "stop[1]"),
        ("completions", {"prompt": ["a\udc00"]}, "prompt[0]"),
        ("chat/completions", {"messages": [MSGS[0], {"role": "user", "content": "a\ud800"}]}, "messages[1].content"),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
            "messages[0].content[0].text",
        ),
        ("chat/completions", {"messages": MSGS, "stop": "\ud800"}, "stop"),
        ("chat/completions", {"messages": MSGS, "user": "\ud800"}, "user"),
        ("chat/completions", {"messages": MSGS, "chat_template_kwargs": {"x": "\ud800"}}, "chat_template_kwargs.x"),
    ],
)
def test_lone_surrogates_are_a_400_naming_the_field(srv, path, body, param, stream):
    r = _post_raw(srv, path, {"model": "tiny", "max_tokens": 1, "stream": stream, **body})
    assert "surrogate" in _bad(r, param)


def test_surrogate_pairs_are_still_accepted(srv):
    r = _post_raw(srv, "completions", {"model": "tiny", "prompt": "a\U0001f600b", "max_tokens": 1, "echo": True})
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("a\U0001f600b"), r.text


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_user_must_be_a_string(srv, path):
    base = {"model": "tiny", "max_tokens": 1, **({"prompt": "Hi"} if path == "completions" else {"messages": MSGS})}
    for value in (5, True, ["u"], {"id": "u"}):
        assert "string" in _bad(_post(srv, path, {**base, "user": value}), "user")
    for value in ("user-1", None):
        r = _post(srv, path, {**base, "user": value})
        assert r.status_code == 200, r.text


# ---- 8. ZeroMQ client lifetime ---------------------------------------------------------------------------------------
def _aborts(srv) -> float:
    text = httpx.get(f"{srv.base_url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "kimi:request_success_total" and s.labels.get("finished_reason") == "abort":
                return s.value
    return 0.0


def _running(srv) -> float:
    text = httpx.get(f"{srv.base_url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "kimi:num_requests_running":
                return s.value
    raise AssertionError("no kimi:num_requests_running")


def _wait_aborted(srv, before: float, count: int = 1) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if _aborts(srv) >= before + count and _running(srv) == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"not aborted: aborts {_aborts(srv)} (before {before}), running {_running(srv)}")


LONG = dict(max_tokens=KV_TOKENS - 4, temperature=0.0, ignore_eos=True)


def test_closing_the_client_aborts_its_streaming_requests(srv):
    before = _aborts(srv)
    with KimiClient(srv.zmq_addr, timeout_s=60) as c:
        it = c.generate([1, 2, 3], **LONG)
        next(it)  # streaming; `it` stays referenced (not closed) when the block is left
    _wait_aborted(srv, before)
    del it


def test_leaving_a_stream_early_aborts_its_request(srv):
    before = _aborts(srv)
    with KimiClient(srv.zmq_addr, timeout_s=60) as c:
        for _ in c.generate([1, 2, 3], **LONG):
            break
        _wait_aborted(srv, before)  # while the client is still open
        outs = list(c.generate("Hi", max_tokens=2, temperature=0.0, ignore_eos=True))  # the client still works
        assert outs[-1].finish_reason == "length"


def test_closing_the_async_client_aborts_its_streaming_requests(srv):
    before = _aborts(srv)

    async def go():
        async with AsyncKimiClient(srv.zmq_addr) as c:
            gen = c.generate([1, 2, 3], **LONG)
            await gen.__anext__()
            rid = await c.submit([4, 5, 6], **LONG)  # submitted, never streamed
            return gen, rid

    _gen, _ = asyncio.run(go())
    _wait_aborted(srv, before, 2)


def test_a_duplicate_request_id_is_refused_and_the_running_request_continues(srv):
    with KimiClient(srv.zmq_addr, timeout_s=60) as c:
        c.submit([1, 2, 3], request_id="dup", max_tokens=30, temperature=0.0, ignore_eos=True)
        with pytest.raises(KimiError, match="already in use"):
            c.submit([4, 5, 6], request_id="dup", max_tokens=2)
        outs = list(c.stream("dup"))
        assert outs[-1].finish_reason == "length" and sum(len(o.token_ids) for o in outs) == 30
        assert c.submit([4, 5, 6], request_id="dup", max_tokens=2) == "dup"  # free again once finished
        assert list(c.stream("dup"))[-1].finish_reason == "length"

    async def go():
        async with AsyncKimiClient(srv.zmq_addr) as c:
            await c.submit([1, 2, 3], request_id="adup", max_tokens=30, temperature=0.0, ignore_eos=True)
            with pytest.raises(KimiError, match="already in use"):
                await c.submit([4, 5, 6], request_id="adup", max_tokens=2)
            return [o async for o in c.stream("adup")]

    outs = asyncio.run(go())
    assert outs[-1].finish_reason == "length" and sum(len(o.token_ids) for o in outs) == 30


@pytest.mark.parametrize("rid", [5, b"abc", ["x"], 1.5])
def test_a_request_id_that_is_not_a_string_is_refused_by_submit(srv, rid):
    """A non-str request_id was sent; the server can answer only under a str id, so the stream waited until the
    client's timeout (KimiClient) or forever (AsyncKimiClient). Now submit raises TypeError and sends nothing; the
    client keeps working, and None or "" still picks an id."""
    with KimiClient(srv.zmq_addr, timeout_s=10) as c:
        with pytest.raises(TypeError, match="request_id must be a str"):
            c.submit("Hi", request_id=rid, max_tokens=2)
        assert not c._pending
        for auto in (None, ""):
            outs = list(c.generate("Hi", request_id=auto, max_tokens=2, ignore_eos=True))
            assert outs[-1].finish_reason == "length" and len(outs[-1].request_id) == 32

    async def go():
        async with AsyncKimiClient(srv.zmq_addr) as c:
            with pytest.raises(TypeError, match="request_id must be a str"):
                await c.submit("Hi", request_id=rid, max_tokens=2)
            return [o async for o in c.generate("Hi", max_tokens=2, ignore_eos=True)]

    assert asyncio.run(go())[-1].finish_reason == "length"


def test_a_closed_client_says_so(srv):
    """submit and abort on a closed client raise KimiError (they raised zmq's 'Socket operation on non-socket')."""
    c = KimiClient(srv.zmq_addr, timeout_s=10)
    c.close()
    with pytest.raises(KimiError, match="closed"):
        c.submit("Hi", max_tokens=2)
    with pytest.raises(KimiError, match="closed"):
        c.abort("x")
    c.close()  # closing again is harmless

    async def go():
        a = AsyncKimiClient(srv.zmq_addr)
        await a.close()
        with pytest.raises(KimiError, match="closed"):
            await a.submit("Hi", max_tokens=2)
        with pytest.raises(KimiError, match="closed"):
            await a.abort("x")

    asyncio.run(go())


def test_old_format_submit_still_decodes(srv):
    """Nothing on the wire changed: a raw SubmitRequest still round-trips through the server."""
    with raw_dealer(srv.zmq_addr) as s:
        s.send(protocol.encode(protocol.SubmitRequest(request_id="raw", prompt_token_ids=[1, 2], max_tokens=1)))
        assert s.poll(60000)
        out = protocol.decode_output(s.recv())
        while not out.finished:
            out = protocol.decode_output(s.recv())
        assert out.request_id == "raw" and out.finish_reason == "length"


# ---- 9. shutdown -----------------------------------------------------------------------------------------------------
def test_sigterm_ends_in_flight_non_streaming_requests_with_a_503(tiny_k26, tmp_path):
    """Shutting down is not a server fault: an in-flight non-streaming request gets a (retryable) 503."""
    s = start_server(tiny_k26, str(tmp_path / "server.log"), "--block-size", "16", "--num-blocks", "256")
    got: dict[str, httpx.Response] = {}
    bodies = {"completions": {"prompt": [1, 2, 3]}, "chat/completions": {"messages": MSGS}}

    def go(path: str) -> None:
        got[path] = httpx.post(
            f"{s.base_url}/v1/{path}",
            timeout=60,
            json={"model": "tiny", "max_tokens": 3000, "temperature": 0, "ignore_eos": True, **bodies[path]},
        )

    threads = [threading.Thread(target=go, args=(p,)) for p in bodies]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if _running(s) >= 2:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the requests never ran")
        s.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        for path in bodies:
            r = got[path]
            assert r.status_code == 503, (path, r.status_code, r.text)
            err = r.json()["error"]
            assert err["type"] == "server_error" and err["message"] == "the server is shutting down", err
        assert s.proc.wait(30) == 0, s.log()
    finally:
        stop_server(s)


# ---- huge prompts are tokenized off the event loop ------------------------------------------------------------------
def _health_latency_while(srv, work) -> tuple[float, float]:
    """Run work() in a thread; poll /health until it returns. -> (work's seconds, the slowest /health answer)."""
    took: list[float] = []

    def run() -> None:
        t0 = time.monotonic()
        work()
        took.append(time.monotonic() - t0)

    th = threading.Thread(target=run)
    th.start()
    worst = 0.0
    while th.is_alive():
        t0 = time.monotonic()
        assert httpx.get(f"{srv.base_url}/health", timeout=60).status_code == 200
        worst = max(worst, time.monotonic() - t0)
        time.sleep(0.02)
    th.join()
    return took[0], worst


@pytest.mark.parametrize("api", ["completions", "chat/completions", "zmq"])
def test_a_huge_prompt_does_not_stall_the_server(srv, api):
    """A 24 MB prompt (about 4M tokens) is refused naming the prompt while /health answers. A chat prompt is
    rendered and tokenized in a worker thread (kimi.controller.offload), then refused (longer than --max-model-len,
    before the engine's per-id check); before, the loop was held for the tokenization and that check: with a 12 MB
    prompt /health waited 1.03-1.08 s of a 1.08-1.12 s request (the check needs the request to take long enough to
    mean something). The chat case puts the text in a tool's description: text in the messages is now refused
    before tokenizing, from its length in bytes, like a completions / ZeroMQ text prompt (check_prompt_text_fits),
    while a tool declaration, which a template may render in any form, is not bounded that way."""
    text = "hello world " * 2_000_000
    out: dict = {}

    def work() -> None:
        if api == "completions":
            out["r"] = _post(srv, "completions", {"model": "tiny", "prompt": text, "max_tokens": 1})
        elif api == "chat/completions":
            tools = [{"type": "function", "function": {"name": "f", "description": text}}]
            out["r"] = _post(
                srv,
                "chat/completions",
                {"model": "tiny", "max_tokens": 1, "tools": tools, "messages": [{"role": "user", "content": "hi"}]},
            )
        else:
            with KimiClient(srv.zmq_addr, timeout_s=120) as c:
                try:
                    list(c.generate(text, max_tokens=1))
                except KimiError as e:
                    out["e"] = str(e)

    tries = []
    for _ in range(2):  # a second try only when the first missed the bound: one noisy moment on a shared 2-core
        # machine (seen once: 0.63 s of a 2.48 s request, where 0.05-0.15 s is usual) is not the stall this checks,
        # which held /health for the whole request every time
        out.clear()
        took, worst = _health_latency_while(srv, work)
        print(f"{api}: request {took:.2f} s, slowest /health {worst:.3f} s")
        if api == "zmq":
            assert "the prompt has at least" in out.get("e", ""), out
        else:
            msg = _bad(out["r"], "messages" if api == "chat/completions" else "prompt")
            assert api != "completions" or "the prompt has at least" in msg, msg
        if api != "chat/completions":  # refused without tokenizing: nothing long to measure /health against
            # generous for a loaded CI machine: tokenizing this prompt on the loop would hold /health for seconds
            assert worst < 1.5, f"/health waited {worst:.2f} s"
            return
        assert took >= 0.5, f"the request took {took:.2f} s: too short for the latency check to mean anything"
        tries.append((worst, took))
        if worst < max(0.5, 0.5 * took):
            break
    assert any(w < max(0.5, 0.5 * t) for w, t in tries), "; ".join(
        f"/health waited {w:.2f} s while a {t:.2f} s request was tokenized" for w, t in tries
    )
