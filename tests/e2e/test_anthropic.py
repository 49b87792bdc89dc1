"""The Anthropic Messages API (/v1/messages, /v1/messages/count_tokens) driven by the real `anthropic` SDK against
`kimi serve --fake-workers` on the tiny K2.6 checkpoint (an API key set: the SDK sends `x-api-key`)."""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import jsonschema
import pytest
from conftest import start_server, stop_server, worker_pids
from prometheus_client.parser import text_string_to_metric_families

KEY = "sk-anthropic-test"
NO_THINK = {"type": "disabled"}
WEATHER = {
    "name": "get_weather",
    "description": "Weather of a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}, "days": {"type": "integer"}},
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}
TIME = {
    "name": "get_time",
    "input_schema": {
        "type": "object",
        "properties": {"utc": {"type": "boolean"}},
        "required": ["utc"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def srv(tiny_k26, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("log") / "server.log")
    s = start_server(
        tiny_k26, log, "--fake-workers", "--max-model-len", "2048", "--num-blocks", "400", "--api-key", KEY
    )
    yield s
    assert stop_server(s) == 0, s.log()
    deadline = time.monotonic() + 10
    while worker_pids(tiny_k26) and time.monotonic() < deadline:
        time.sleep(0.2)


@pytest.fixture(scope="module")
def client(srv):
    return anthropic.Anthropic(base_url=srv.base_url, api_key=KEY, max_retries=0)


def _metrics(srv) -> dict[str, float]:
    text = httpx.get(f"{srv.base_url}/metrics", headers={"x-api-key": KEY}).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name + ("" if not s.labels else json.dumps(s.labels, sort_keys=True))] = s.value
    return out


def _post(srv, path: str, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(
        srv.base_url + path, json=body, headers={"x-api-key": KEY, "anthropic-version": "2023-06-01", **headers}
    )


def _text(msg) -> str:
    return "".join(b.text for b in msg.content if b.type == "text")


def test_create_text_system_and_multi_turn(client, srv):
    before = _metrics(srv)['kimi:http_requests_total{"endpoint": "/v1/messages"}']
    msg = client.messages.create(
        model="tiny",
        max_tokens=8,
        system="You are terse.",
        messages=[{"role": "user", "content": "hello"}],
        thinking=NO_THINK,
        extra_body={"temperature": 0},
    )
    assert msg.type == "message" and msg.role == "assistant" and msg.model == "tiny"
    assert msg.id.startswith("msg_")
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in msg.content] == ["text"]
    assert 1 <= msg.usage.output_tokens <= 8
    n_prompt = msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    # the system text as blocks (with a cache_control marker) renders the same prompt
    turns = [
        {"role": "user", "content": [{"type": "text", "text": "hello", "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": [{"type": "text", "text": _text(msg)}]},
        {"role": "user", "content": "and again"},
    ]
    again = client.messages.create(
        model="tiny",
        max_tokens=4,
        system=[{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}],
        messages=turns,
        thinking=NO_THINK,
        metadata={"user_id": "u1"},
        extra_body={"temperature": 0, "top_k": 1, "top_p": 1.0},
    )
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens > n_prompt
    assert again.usage.output_tokens >= 1
    count = client.messages.count_tokens(
        model="tiny",
        system=[{"type": "text", "text": "You are terse."}],
        messages=turns,
        thinking=NO_THINK,
    )
    assert count.input_tokens == again.usage.input_tokens + again.usage.cache_read_input_tokens
    after = _metrics(srv)['kimi:http_requests_total{"endpoint": "/v1/messages"}']
    assert after == before + 2


def test_greedy_is_deterministic_and_stop_sequences(client):
    kw = dict(model="tiny", max_tokens=12, messages=[{"role": "user", "content": "x"}], thinking=NO_THINK)
    a = client.messages.create(**kw, extra_body={"temperature": 0})
    b = client.messages.create(**kw, extra_body={"temperature": 0})
    assert _text(a) == _text(b)
    text = _text(a)
    if len(text) >= 4:  # stop at a substring the greedy reply is known to contain
        stop = text[2:4]
        c = client.messages.create(**kw, stop_sequences=[stop], extra_body={"temperature": 0})
        assert c.stop_reason == "stop_sequence" and c.stop_sequence == stop
        assert stop not in _text(c)


def test_stream_usage_splits_the_prompt_by_the_cache_hit_from_message_start(client):
    # a prompt of many blocks, sent twice: the streamed one reads most of it from the prefix cache, and
    # message_start already says so, with the same split as message_delta
    words = " ".join(f"w{i}" for i in range(300))
    kw = dict(model="tiny", max_tokens=4, messages=[{"role": "user", "content": words}], thinking=NO_THINK)
    client.messages.create(**kw, extra_body={"temperature": 0})
    start = delta = None
    with client.messages.stream(**kw, extra_body={"temperature": 0}) as s:
        for ev in s:
            if ev.type == "message_start":
                start = ev.message.usage
            elif ev.type == "message_delta":
                delta = ev.usage
    assert start is not None and delta is not None
    assert start.output_tokens == 0 and start.cache_read_input_tokens > 0
    assert (start.input_tokens, start.cache_read_input_tokens) == (delta.input_tokens, delta.cache_read_input_tokens)
    assert delta.output_tokens == 4


@pytest.mark.parametrize("thinking", [NO_THINK, {"type": "enabled", "budget_tokens": 1024}, {"type": "adaptive"}])
def test_stream_reassembles_to_the_non_streamed_reply(srv, client, thinking):
    kw = dict(
        model="tiny",
        max_tokens=1100 if thinking.get("budget_tokens") else 24,
        messages=[{"role": "user", "content": "think"}],
        thinking=thinking,
        stop_sequences=[],
        extra_body={"temperature": 0},
    )
    full = client.messages.create(**kw)
    kinds = []
    with client.messages.stream(**kw) as s:
        for ev in s:
            kinds.append(ev.type)
        streamed = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "message_delta" in kinds and "content_block_start" in kinds and "content_block_stop" in kinds
    # the same content, stop reason and token counts (the second request may hit the prefix cache)
    assert streamed.model_dump(exclude={"id", "usage"}) == full.model_dump(exclude={"id", "usage"})
    u, v = streamed.usage, full.usage
    assert u.output_tokens == v.output_tokens
    assert u.input_tokens + u.cache_read_input_tokens == v.input_tokens + v.cache_read_input_tokens
    types = [b.type for b in full.content]
    if thinking["type"] == "disabled":
        assert "thinking" not in types
    else:
        # the reply starts with a thinking block exactly when the chat route, given the same prompt with thinking on,
        # reasons (the K2.6 template opens the reasoning when the vocabulary has Kimi's think tokens; K2-Instruct's
        # vocabulary, which tests may serve, has none)
        chat = httpx.post(
            srv.base_url + "/v1/chat/completions",
            headers={"Authorization": f"Bearer {KEY}"},
            json={
                "messages": kw["messages"],
                "max_tokens": kw["max_tokens"],
                "temperature": 0,
                "chat_template_kwargs": {"thinking": True},
            },
            timeout=120,
        ).json()["choices"][0]["message"]
        if chat.get("reasoning_content"):
            assert types[0] == "thinking" and full.content[0].thinking
        else:
            assert "thinking" not in types and full.content[0].text == chat["content"]


def test_stream_raw_events(srv):
    body = {
        "model": "tiny",
        "max_tokens": 5,
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
        "thinking": NO_THINK,
    }
    with httpx.stream(
        "POST", srv.base_url + "/v1/messages", json=body, headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    names = [e.split("\n")[0].removeprefix("event: ") for e in events]
    assert names[:2] == ["message_start", "ping"]
    assert names[-2:] == ["message_delta", "message_stop"]
    for e in events:
        name, data = e.split("\n")
        assert json.loads(data.removeprefix("data: "))["type"] == name.removeprefix("event: ")
    assert "[DONE]" not in raw
    final = json.loads(events[-2].split("\n")[1].removeprefix("data: "))
    assert final["delta"]["stop_reason"] == "max_tokens" and final["usage"]["output_tokens"] == 5


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_any_and_tool_force_valid_calls(client, stream):
    schemas = {t["name"]: t["input_schema"] for t in (WEATHER, TIME)}
    for choice in (
        {"type": "any"},
        {"type": "tool", "name": "get_time"},
        {"type": "any", "disable_parallel_tool_use": True},
    ):
        kw = dict(
            model="tiny",
            max_tokens=400,
            messages=[{"role": "user", "content": "weather?"}],
            tools=[WEATHER, TIME],
            tool_choice=choice,
            thinking=NO_THINK,
            extra_body={"temperature": 0},  # greedy: a random model sampling freely may open call after call
        )
        if stream:
            with client.messages.stream(**kw) as s:
                msg = s.get_final_message()
        else:
            msg = client.messages.create(**kw)
        calls = [b for b in msg.content if b.type == "tool_use"]
        assert calls and msg.stop_reason == "tool_use", msg
        for c in calls:
            assert c.id.startswith("toolu_")
            jsonschema.validate(c.input, schemas[c.name])
        if choice["type"] == "tool":
            assert {c.name for c in calls} == {"get_time"} and len(calls) == 1
        if choice.get("disable_parallel_tool_use"):
            assert len(calls) == 1


def _sse_events(srv, body: dict) -> list[dict]:
    with httpx.stream(
        "POST",
        srv.base_url + "/v1/messages",
        json={**body, "stream": True},
        headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
        timeout=120,
    ) as r:
        assert r.status_code == 200
        raw = r.read().decode()
    return [json.loads(e.split("\n")[1].removeprefix("data: ")) for e in raw.strip().split("\n\n")]


def test_a_call_cut_by_max_tokens_is_no_tool_use_block(srv, client):
    """A forced call cut inside its arguments (max_tokens 50, greedy: in the city's value): stop_reason max_tokens
    and no tool_use block (its input would not be the call's object), streamed or not; a tool with
    eager_input_streaming streams the cut call's input as generated (Anthropic's fine-grained streaming: the input
    may end mid-value)."""
    kw = dict(
        model="tiny",
        max_tokens=50,
        messages=[{"role": "user", "content": "weather?"}],
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        thinking=NO_THINK,
        extra_body={"temperature": 0},
    )
    msg = client.messages.create(**kw)
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 50
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == "", msg
    with client.messages.stream(**kw) as s:
        streamed = s.get_final_message()
    assert streamed.stop_reason == "max_tokens" and [b.type for b in streamed.content] == ["text"], streamed
    body = {k: v for k, v in kw.items() if k != "extra_body"} | {"temperature": 0}
    events = _sse_events(srv, body)
    assert not [e for e in events if e["type"] == "content_block_start" and e["content_block"]["type"] == "tool_use"]
    # the same output with the tool's input streamed eagerly: the call was cut after its head, inside its input
    eager = _sse_events(srv, {**body, "tools": [{**WEATHER, "eager_input_streaming": True}]})
    starts = [e for e in eager if e["type"] == "content_block_start"]
    assert [e["content_block"]["type"] for e in starts] == ["tool_use"]
    partial = "".join(e["delta"]["partial_json"] for e in eager if e["type"] == "content_block_delta")
    assert partial.startswith("{")
    with pytest.raises(ValueError):
        json.loads(partial)
    assert [e["delta"]["stop_reason"] for e in eager if e["type"] == "message_delta"] == ["max_tokens"]
    # given room, the same call completes: one tool_use block, streamed whole once complete
    done = _sse_events(srv, {**body, "max_tokens": 400})
    blocks = [e for e in done if e["type"].startswith("content_block")]
    assert [e["type"] for e in blocks] == ["content_block_start", "content_block_delta", "content_block_stop"]
    jsonschema.validate(json.loads(blocks[1]["delta"]["partial_json"]), WEATHER["input_schema"])
    assert [e["delta"]["stop_reason"] for e in done if e["type"] == "message_delta"] == ["tool_use"]


def test_tool_result_round_trip_and_none(client):
    first = client.messages.create(
        model="tiny",
        max_tokens=200,
        messages=[{"role": "user", "content": "weather?"}],
        tools=[WEATHER],
        tool_choice={"type": "any"},
        thinking=NO_THINK,
    )
    call = next(b for b in first.content if b.type == "tool_use")
    history = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": "sunny"},
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_01Other",
                    "content": [{"type": "text", "text": "x"}],
                    "is_error": True,
                },
                {"type": "text", "text": "thanks"},
            ],
        },
    ]
    n = client.messages.count_tokens(model="tiny", messages=history, tools=[WEATHER], thinking=NO_THINK).input_tokens
    assert n > 0
    reply = client.messages.create(
        model="tiny", max_tokens=6, messages=history, tools=[WEATHER], tool_choice={"type": "none"}, thinking=NO_THINK
    )
    assert reply.stop_reason in ("end_turn", "max_tokens")
    assert all(b.type != "tool_use" for b in reply.content)
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == n


def test_output_config_json_schema(client):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
        "additionalProperties": False,
    }
    msg = client.messages.create(
        model="tiny",
        max_tokens=300,
        messages=[{"role": "user", "content": "json"}],
        thinking=NO_THINK,
        output_config={"format": {"type": "json_schema", "schema": schema}, "effort": "low"},
    )
    assert msg.stop_reason == "end_turn", msg
    jsonschema.validate(json.loads(_text(msg)), schema)


def _anthropic_error(r: httpx.Response, status: int, kind: str, needle: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    assert needle in body["error"]["message"], body


def test_errors_are_anthropic_error_objects(srv, client):
    msgs = [{"role": "user", "content": "hi"}]
    _anthropic_error(
        _post(srv, "/v1/messages", {"model": "tiny", "messages": msgs}), 400, "invalid_request_error", "'max_tokens'"
    )
    bad_block = {
        "model": "tiny",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
    }
    _anthropic_error(
        _post(srv, "/v1/messages", bad_block), 400, "invalid_request_error", "'messages[0].content[0].type'"
    )
    _anthropic_error(
        _post(srv, "/v1/messages", {"model": "claude-x", "max_tokens": 4, "messages": msgs}),
        404,
        "not_found_error",
        "claude-x",
    )
    _anthropic_error(
        _post(srv, "/v1/messages", {"max_tokens": 4, "messages": msgs, "stop_sequences": ["a"] * 5}),
        400,
        "invalid_request_error",
        "'stop_sequences'",
    )
    _anthropic_error(
        _post(srv, "/v1/messages", {"max_tokens": 4, "messages": msgs, "container": "c"}),
        400,
        "invalid_request_error",
        "'container'",
    )
    _anthropic_error(
        _post(
            srv,
            "/v1/messages",
            {"max_tokens": 4, "messages": msgs, "tools": [{"type": "web_search_20250305", "name": "w"}]},
        ),
        400,
        "invalid_request_error",
        "'tools[0].type'",
    )
    _anthropic_error(
        _post(srv, "/v1/messages", {"max_tokens": 4, "messages": msgs}, **{"x-api-key": "wrong"}),
        401,
        "authentication_error",
        "API key",
    )
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="tiny", max_tokens=4, messages=msgs, extra_body={"temperature": 7.0})
    assert "'temperature'" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=msgs)
    # Authorization: Bearer works as well as x-api-key
    r = httpx.post(
        srv.base_url + "/v1/messages",
        json={"max_tokens": 2, "messages": msgs, "thinking": NO_THINK},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] >= 1
    assert _metrics(srv)["kimi:num_requests_running"] == 0


def test_sdk_fields_at_no_op_values_are_accepted_and_others_named(srv, client):
    msgs = [{"role": "user", "content": "hi"}]
    tool = {
        **WEATHER,
        "eager_input_streaming": True,
        "defer_loading": False,
        "input_examples": [],
        "allowed_callers": ["direct"],
        "cache_control": {"type": "ephemeral"},
    }
    msg = client.messages.create(
        model="tiny",
        max_tokens=4,
        messages=msgs,
        tools=[tool],
        thinking=NO_THINK,
        extra_body={"speed": "standard", "inference_geo": None, "diagnostics": None, "user_profile_id": "u1"},
    )
    assert msg.stop_reason in ("max_tokens", "end_turn", "tool_use")
    n = client.messages.count_tokens(model="tiny", messages=msgs, tools=[tool], thinking=NO_THINK).input_tokens
    assert n > 0
    base = {"model": "tiny", "max_tokens": 4, "messages": msgs, "thinking": NO_THINK}
    for extra, needle in (
        ({"speed": "fast"}, "'speed'"),
        ({"inference_geo": "us"}, "'inference_geo'"),
        ({"diagnostics": {"previous_message_id": "msg_1"}}, "'diagnostics'"),
        ({"stop_sequences": "e"}, "'stop_sequences'"),
        ({"tools": [{**WEATHER, "defer_loading": True}]}, "'tools[0].defer_loading'"),
        ({"tools": [{**WEATHER, "input_examples": [{"city": "Oslo", "days": 1}]}]}, "'tools[0].input_examples'"),
        ({"tools": [{**WEATHER, "name": "has space!"}]}, "'tools[0].name'"),
        ({"tools": [WEATHER, WEATHER]}, "'tools[1].name'"),
        ({"tool_choice": {"type": "bogus"}}, "'tool_choice.type'"),
        ({"tool_choice": {"type": "any"}}, "needs 'tools'"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "'tool_choice.name' is required"),
    ):
        _anthropic_error(_post(srv, "/v1/messages", {**base, **extra}), 400, "invalid_request_error", needle)
    _anthropic_error(
        _post(srv, "/v1/messages/count_tokens", {"model": "tiny", "messages": msgs, "max_tokens": 4}),
        400,
        "invalid_request_error",
        "not a field of /v1/messages/count_tokens",
    )
    # refusals before a route runs are in Anthropic's schema on its paths too
    r = httpx.post(
        srv.base_url + "/v1/messages", content=b"hi", headers={"x-api-key": KEY, "content-type": "text/plain"}
    )
    _anthropic_error(r, 415, "invalid_request_error", "text/plain")
    _anthropic_error(
        httpx.get(srv.base_url + "/v1/messages", headers={"x-api-key": KEY}), 405, "invalid_request_error", "GET"
    )
    _anthropic_error(_post(srv, "/v1/messages/batches", base), 404, "not_found_error", "no route")
    assert "type" not in httpx.get(srv.base_url + "/v1/nope", headers={"x-api-key": KEY}).json()


def test_disconnect_mid_stream_aborts_and_frees(srv):
    body = {
        "model": "tiny",
        "max_tokens": 1500,
        "stream": True,
        "messages": [{"role": "user", "content": "long"}],
        "thinking": NO_THINK,
        "top_k": 1,
    }
    with httpx.stream("POST", srv.base_url + "/v1/messages", json=body, headers={"x-api-key": KEY}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(12)]
        assert any(x.startswith("event: content_block_delta") for x in got)
        m = _metrics(srv)
        assert m["kimi:num_requests_running"] == 1 and m["kimi:kv_cache_used_blocks"] >= 1
    deadline = time.monotonic() + 30
    while True:
        m = _metrics(srv)
        if m["kimi:num_requests_running"] == 0 and m["kimi:kv_cache_used_blocks"] == 0:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.1)


@pytest.fixture(scope="module")
def thinking_srv(tmp_path_factory):
    """A server of the tiny checkpoint with the built-in vocabulary (Kimi's think tokens on any machine): its fake
    model starts every reply in reasoning."""
    from kimi.tiny_checkpoint import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-k2.6", tokenizer_source=None)
    s = start_server(ckpt, str(tmp_path_factory.mktemp("log") / "server.log"), "--fake-workers", "--num-blocks", "200")
    yield s
    assert stop_server(s) == 0, s.log()


@pytest.mark.parametrize("display", ["summarized", "omitted"])
def test_thinking_display(thinking_srv, display):
    client = anthropic.Anthropic(base_url=thinking_srv.base_url, api_key="x", max_retries=0)
    kw: dict = dict(
        model="tiny",
        max_tokens=1030,
        messages=[{"role": "user", "content": "Think."}],
        thinking={"type": "enabled", "budget_tokens": 1024, "display": display},
        extra_body={"temperature": 0},
    )
    msg = client.messages.create(**kw)
    assert msg.content[0].type == "thinking", msg.content
    with client.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert [b.type for b in final.content] == [b.type for b in msg.content]
    deltas = [e for e in events if e.type == "content_block_delta" and e.delta.type == "thinking_delta"]
    if display == "omitted":  # the blocks stay, their text left out
        assert msg.content[0].thinking == "" and final.content[0].thinking == "" and not deltas
    else:
        assert msg.content[0].thinking and final.content[0].thinking == msg.content[0].thinking and deltas
