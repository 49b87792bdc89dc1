"""Guided decoding end to end: the openai client and kimi.client against `kimi serve --fake-workers` on the tiny K2.6
checkpoint. The fake workers guide their rows with the real matchers (kimi.worker.fake: among the allowed tokens),
so every constrained reply must parse and validate; the server's exit log says how many matchers were still held
(none may be)."""

from __future__ import annotations

import json
import re
import time

import httpx
import jsonschema
import openai
import pytest
from conftest import start_server, stop_server, worker_pids

from kimi.client import KimiClient, KimiError

NO_THINK = {"chat_template_kwargs": {"thinking": False}}
ASK = [{"role": "user", "content": "answer in JSON"}]
SCHEMAS = [
    {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "green"]}}, "required": ["color"]},
    {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}}, "required": ["n", "ok"]},
    {
        "type": "object",
        "properties": {
            "pos": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
        },
        "required": ["pos", "tags"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}, "days": {"type": "integer"}},
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"utc": {"type": "boolean"}},
                "required": ["utc"],
                "additionalProperties": False,
            },
        },
    },
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def srv(tiny_k26, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("log") / "server.log")
    s = start_server(tiny_k26, log, "--fake-workers", "--max-model-len", "2048", "--num-blocks", "400")
    yield s
    assert stop_server(s) == 0, s.log()
    deadline = time.monotonic() + 10
    while worker_pids(tiny_k26) and time.monotonic() < deadline:
        time.sleep(0.2)
    held = re.findall(r"guided decoding: (\d+) constrained requests, (\d+) still held", open(log).read())
    assert held and int(held[-1][0]) > 20 and held[-1][1] == "0", held  # nothing left behind


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0)


def _schema_format(schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": strict}}


def test_json_schema_replies_validate_chat_and_completions(client):
    for schema in SCHEMAS:
        for seed in (None, 1, 2):
            kw = dict(temperature=0.0) if seed is None else dict(temperature=1.0, seed=seed)
            r = client.chat.completions.create(
                model="tiny",
                messages=ASK,
                max_tokens=400,
                response_format=_schema_format(schema),
                extra_body=NO_THINK,
                **kw,
            )
            c = r.choices[0]
            assert c.finish_reason == "stop", (schema, c)
            jsonschema.validate(json.loads(c.message.content), schema)
            t = client.completions.create(
                model="tiny",
                prompt="JSON:",
                max_tokens=400,
                extra_body={"response_format": _schema_format(schema)},  # on /v1/completions too
                **kw,
            ).choices[0]
            assert t.finish_reason == "stop", t
            jsonschema.validate(json.loads(t.text), schema)


def test_json_object_and_n_choices(client):
    r = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        max_tokens=400,
        temperature=1.0,
        seed=3,
        n=3,
        response_format={"type": "json_object"},
        extra_body=NO_THINK,
    )
    assert len(r.choices) == 3
    for c in r.choices:
        # json_object is open-ended: over the real vocabulary a random model can still be inside a string at
        # max_tokens. A finished reply is a JSON object; a cut one is the start of one.
        assert c.finish_reason in ("stop", "length"), c
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict), c
        else:
            assert c.message.content.lstrip(" \t\r\n").startswith("{"), c
            with pytest.raises(json.JSONDecodeError):
                json.loads(c.message.content)


def test_regex_choice_and_grammar_fields_of_vllm_and_sglang(client):
    cases = [
        (
            {"structured_outputs": {"regex": "[a-c]{2,4}-[0-9]{2}"}},
            lambda s, _f: re.fullmatch("[a-c]{2,4}-[0-9]{2}", s),
        ),
        ({"guided_regex": "(yes|no)!"}, lambda s, _f: s in ("yes!", "no!")),
        ({"regex": "x[0-9]y"}, lambda s, _f: re.fullmatch("x[0-9]y", s)),  # SGLang
        ({"structured_outputs": {"choice": ["alpha", "beta", "gamma"]}}, lambda s, _f: s in ("alpha", "beta", "gamma")),
        ({"guided_choice": ["up", "down"]}, lambda s, _f: s in ("up", "down")),
        (
            {"structured_outputs": {"grammar": 'root ::= "go " ("left" | "right")'}},
            lambda s, _f: s in ("go left", "go right"),
        ),
        ({"guided_grammar": 'root ::= [0-9] "+" [0-9]'}, lambda s, _f: re.fullmatch("[0-9][+][0-9]", s)),
        ({"ebnf": 'root ::= "ok" | "ko"'}, lambda s, _f: s in ("ok", "ko")),  # SGLang
        ({"guided_json": SCHEMAS[0]}, lambda s, _f: json.loads(s)["color"] in ("red", "green")),
        ({"json_schema": json.dumps(SCHEMAS[1])}, lambda s, _f: isinstance(json.loads(s)["ok"], bool)),  # SGLang
        ({"structured_outputs": {"json_object": True}}, _json_object_or_its_start),
    ]
    for body, ok in cases:
        open_ended = ok is _json_object_or_its_start  # may still be inside a string at max_tokens
        for seed in (4, 5):
            t = client.completions.create(
                model="tiny", prompt="x", max_tokens=300, temperature=1.0, seed=seed, extra_body=body
            ).choices[0]
            assert (t.finish_reason == "stop" or open_ended) and ok(t.text, t.finish_reason), (body, t.text)
        c = client.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=300, temperature=0.0, extra_body={**body, **NO_THINK}
        ).choices[0]
        finish = c.finish_reason
        assert (finish == "stop" or open_ended) and ok(c.message.content, finish), (body, c.message.content)


def _json_object_or_its_start(text: str, finish_reason: str) -> bool:
    """A finished json_object reply is a JSON object; one cut by max_tokens is the start of one."""
    if finish_reason == "stop":
        return isinstance(json.loads(text), dict)
    if finish_reason != "length" or not text.lstrip(" \t\r\n").startswith("{"):
        return False
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return True
    return False


def _check_calls(message, names: set[str]) -> list[tuple[str, dict]]:
    calls = []
    for t in message.tool_calls or []:
        assert t.function.name in names, t
        assert re.fullmatch(rf"functions\.{re.escape(t.function.name)}:[0-9]{{1,6}}", t.id), t.id
        args = json.loads(t.function.arguments)
        jsonschema.validate(args, PARAMS[t.function.name])
        calls.append((t.function.name, args))
    return calls


def test_forced_tool_calls_validate(client):
    for seed in (1, 2, 3):
        kw = dict(
            model="tiny", messages=ASK, tools=TOOLS, max_tokens=400, temperature=1.0, seed=seed, extra_body=NO_THINK
        )
        c = client.chat.completions.create(tool_choice="required", **kw).choices[0]
        assert c.finish_reason == "tool_calls" and _check_calls(c.message, {"get_weather", "get_time"}), c
        c = client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **kw).choices[0]
        assert c.finish_reason == "tool_calls" and len(_check_calls(c.message, {"get_weather", "get_time"})) == 1, c
        named = {"type": "function", "function": {"name": "get_time"}}
        c = client.chat.completions.create(tool_choice=named, **kw).choices[0]
        assert c.finish_reason == "tool_calls" and len(_check_calls(c.message, {"get_time"})) == 1, c


def _stream_chat(client, **kw) -> tuple[str, list, str]:
    content, calls, reason = "", {}, None
    for ch in client.chat.completions.create(stream=True, **kw):
        for c in ch.choices:
            d = c.delta
            content += d.content or ""
            for t in d.tool_calls or []:
                e = calls.setdefault(t.index, {"id": t.id, "name": None, "arguments": ""})
                if t.function.name:
                    e["name"] = t.function.name
                e["arguments"] += t.function.arguments or ""
            reason = c.finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


def test_streamed_equals_non_streamed(client):
    for extra in (
        {"response_format": _schema_format(SCHEMAS[2])},
        {"tools": TOOLS, "tool_choice": "required"},
    ):
        kw = dict(model="tiny", messages=ASK, max_tokens=400, temperature=1.0, seed=11, extra_body=NO_THINK, **extra)
        m = client.chat.completions.create(**kw).choices[0]
        content, calls, reason = _stream_chat(client, **kw)
        assert reason == m.finish_reason
        assert content == (m.message.content or "")
        assert calls == [
            {"id": t.id, "name": t.function.name, "arguments": t.function.arguments} for t in m.message.tool_calls or []
        ]
    body = dict(
        model="tiny", prompt="p", max_tokens=300, temperature=1.0, seed=12, extra_body={"guided_json": SCHEMAS[1]}
    )
    whole = client.completions.create(**body).choices[0].text
    assert "".join(ch.choices[0].text for ch in client.completions.create(stream=True, **body) if ch.choices) == whole


def test_bad_grammars_are_400s_naming_the_field(client, srv):
    bad = [
        ({"response_format": _schema_format({"type": "nonsense"})}, "response_format"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
        ({"ebnf": "not a grammar"}, "ebnf"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
        ({"guided_regex": "a+", "min_tokens": 2}, "min_tokens"),
    ]
    for body, param in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", prompt="x", max_tokens=5, extra_body=body)
        assert e.value.body["param"] == param, (body, e.value.body)
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
    with pytest.raises(openai.BadRequestError) as e:  # a strict tool under auto and a non-JSON format
        client.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=5, tools=strict, extra_body={"guided_regex": "a+", **NO_THINK}
        )
    assert e.value.body["param"] == "guided_regex"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=ASK, max_tokens=5, tools=tools, tool_choice="required")
    assert e.value.body["param"] == "tools"
    ok = client.completions.create(model="tiny", prompt="x", max_tokens=3, temperature=0.0)  # nothing else changed
    assert ok.choices[0].finish_reason == "length"


def test_max_tokens_cut_and_abort_leave_nothing_behind(client, srv):
    c = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        max_tokens=3,
        temperature=0.0,
        response_format=_schema_format(SCHEMAS[2]),
        extra_body=NO_THINK,
    ).choices[0]
    assert c.finish_reason == "length"
    with client.chat.completions.create(
        model="tiny",
        messages=ASK,
        max_tokens=1000,
        temperature=0.0,
        stream=True,
        extra_body={"guided_regex": "[a-z]{900}", **NO_THINK},  # cannot end before max_tokens
    ) as stream:
        for i, _ in enumerate(stream):
            if i == 3:
                break  # closing the stream aborts the request
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = httpx.get(f"{srv.base_url}/metrics").text
        if re.search(r"^kimi:num_requests_running 0\.0$", m, re.M):
            break
        time.sleep(0.2)
    assert re.search(r'kimi:request_success_total\{finished_reason="abort"\} [1-9]', m), m


def test_zeromq_client_with_a_grammar(srv):
    with KimiClient(srv.zmq_addr) as kc:
        outs = list(kc.generate("x", max_tokens=100, temperature=0.0, structured_outputs={"choice": ["one", "two"]}))
        assert "".join(o.text for o in outs) in ("one", "two") and outs[-1].finish_reason == "stop"
        outs = list(kc.generate("x", max_tokens=400, seed=3, response_format=_schema_format(SCHEMAS[1])))
        assert outs[-1].finish_reason == "stop"
        jsonschema.validate(json.loads("".join(o.text for o in outs)), SCHEMAS[1])
        with pytest.raises(KimiError, match=re.escape("'structured_outputs.regex' cannot be compiled")):
            list(kc.generate("x", max_tokens=5, structured_outputs={"regex": "(unclosed"}))


def test_tools_with_a_json_answer_format_under_auto(client):
    """tools + response_format json_schema under auto: each reply is a valid tool call or a valid answer."""
    schema = SCHEMAS[1]
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
    for seed in range(4):
        c = client.chat.completions.create(
            model="tiny",
            messages=ASK,
            max_tokens=400,
            temperature=1.0,
            seed=seed,
            tools=strict,
            response_format=fmt,
            extra_body=NO_THINK,
        ).choices[0]
        if c.message.tool_calls:
            assert c.finish_reason == "tool_calls", c
            _check_calls(c.message, set(PARAMS))
        else:
            assert c.finish_reason == "stop", c
            jsonschema.validate(json.loads(c.message.content), schema)
