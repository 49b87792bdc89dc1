"""The OpenAI Responses API (/v1/responses) driven by the real `openai` SDK and the OpenAI Agents SDK's default
model class (OpenAIResponsesModel) against `kimi serve --fake-workers` on the tiny K2.6 checkpoint.

The tiny checkpoint is a thinking model whose random fake model never closes `</think>`: requests switch thinking
off (`reasoning.effort` "none"), so guided decoding covers the whole reply. Greedy decoding (temperature 0) makes
a streamed and a non-streamed run of the same request the same."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    Runner,
    function_tool,
    set_default_openai_api,
    set_default_openai_client,
    set_tracing_disabled,
)
from conftest import start_server, stop_server, worker_pids
from openai import AsyncOpenAI, OpenAI
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel

NO_THINK = {"effort": "none"}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather of a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}, "metric": {"type": "boolean"}},
        "required": ["city", "metric"],
        "additionalProperties": False,
    },
    "strict": True,
}
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tiny_thinking(tmp_path_factory) -> str:
    """The tiny K2.6 checkpoint with the built-in vocabulary, which has Kimi's think tokens whatever real vocabulary
    the machine holds (K2-Instruct's has none): the thinking tests then always reason."""
    from kimi.tiny_checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-k2.6", tokenizer_source=None)


@pytest.fixture(scope="module")
def srv(tiny_thinking, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("log") / "server.log")
    s = start_server(tiny_thinking, log, "--fake-workers", "--max-model-len", "2048", "--num-blocks", "400")
    yield s
    assert stop_server(s) == 0, s.log()
    deadline = time.monotonic() + 10
    while worker_pids(tiny_thinking) and time.monotonic() < deadline:
        time.sleep(0.2)


@pytest.fixture(scope="module")
def client(srv):
    return OpenAI(base_url=f"{srv.base_url}/v1", api_key="dummy", max_retries=0, timeout=120)


def test_string_input_with_instructions(client):
    r = client.responses.create(
        model="tiny", input="Say hi.", instructions="Be brief.", max_output_tokens=8, temperature=0, reasoning=NO_THINK
    )
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "tiny"
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in r.output] == ["message"]
    msg = r.output[0]
    assert msg.role == "assistant" and msg.content[0].type == "output_text"
    assert r.output_text == msg.content[0].text and r.output_text
    assert r.usage is not None and r.usage.output_tokens == 8 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + 8
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.instructions == "Be brief."


def test_item_input_messages_and_parts(client):
    r = client.responses.create(
        model="tiny",
        input=[
            {"role": "developer", "content": "Answer in French."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello"}]},
            {"role": "assistant", "content": "Bonjour"},
            {"role": "user", "content": "Again?"},
        ],
        max_output_tokens=4,
        temperature=0,
        reasoning=NO_THINK,
        metadata={"k": "v"},
        store=False,
    )
    assert r.status == "incomplete" and r.usage is not None and r.usage.output_tokens == 4
    assert r.metadata == {"k": "v"} and r.store is False
    # not stored: a later request cannot continue from it
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="x", previous_response_id=r.id, max_output_tokens=2)


def test_thinking_on_returns_a_reasoning_item(client):
    r = client.responses.create(model="tiny", input="Think.", max_output_tokens=6, temperature=0)
    assert [o.type for o in r.output] == ["reasoning"]
    item = r.output[0]
    assert item.summary == [] and item.content is not None and item.content[0].type == "reasoning_text"
    assert item.content[0].text
    assert r.usage is not None and 0 < r.usage.output_tokens_details.reasoning_tokens <= 6


def test_function_tool_round_trip_with_tool_choice_required(client):
    r = client.responses.create(
        model="tiny",
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=200,
        temperature=0,
        reasoning=NO_THINK,
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1, r.output
    call = calls[0]
    assert call.name == "get_weather" and call.call_id.startswith("functions.get_weather:")
    args = json.loads(call.arguments)
    jsonschema.validate(args, WEATHER["parameters"])
    # the call and its result go back as items: the model answers in text
    r2 = client.responses.create(
        model="tiny",
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
        ],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=5,
        temperature=0,
        reasoning=NO_THINK,
    )
    assert [o.type for o in r2.output] == ["message"] and r2.output_text
    # more prompt than the first turn: the call and its output are in it
    assert r2.usage is not None and r.usage is not None and r2.usage.input_tokens > r.usage.input_tokens


def test_named_tool_choice(client):
    r = client.responses.create(
        model="tiny",
        input="Weather?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=200,
        temperature=0,
        reasoning=NO_THINK,
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])


def test_text_format_json_schema(client):
    r = client.responses.create(
        model="tiny",
        input="Forecast?",
        text={"format": {"type": "json_schema", "name": "forecast", "schema": SCHEMA, "strict": True}},
        max_output_tokens=200,
        temperature=0,
        reasoning=NO_THINK,
    )
    assert r.status == "completed", r.output
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.text.format.type == "json_schema"


def test_previous_response_id_continues_and_unknown_id_is_404(client, srv):
    r1 = client.responses.create(model="tiny", input="First.", max_output_tokens=4, temperature=0, reasoning=NO_THINK)
    r2 = client.responses.create(
        model="tiny",
        input="Second.",
        previous_response_id=r1.id,
        max_output_tokens=4,
        temperature=0,
        reasoning=NO_THINK,
    )
    assert r2.previous_response_id == r1.id
    # the same conversation sent as items has the same prompt
    r3 = client.responses.create(
        model="tiny",
        input=[
            {"role": "user", "content": "First."},
            {"role": "assistant", "content": r1.output_text},
            {"role": "user", "content": "Second."},
        ],
        max_output_tokens=4,
        temperature=0,
        reasoning=NO_THINK,
    )
    assert r2.usage is not None and r3.usage is not None and r1.usage is not None
    assert r2.usage.input_tokens == r3.usage.input_tokens > r1.usage.input_tokens
    assert r2.output_text == r3.output_text
    with pytest.raises(openai.NotFoundError) as ei:
        client.responses.create(model="tiny", input="x", previous_response_id="resp_nope", max_output_tokens=2)
    err = ei.value.body
    assert isinstance(err, dict) and err["param"] == "previous_response_id"


def test_retrieve_input_items_and_delete_a_stored_response(client, srv):
    r = client.responses.create(
        model="tiny",
        input=[
            {"role": "user", "content": "One."},
            {"role": "assistant", "content": "Two."},
            {"role": "user", "content": [{"type": "input_text", "text": "Three."}]},
        ],
        max_output_tokens=4,
        temperature=0,
        reasoning=NO_THINK,
    )
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.status == r.status and got.output_text == r.output_text
    assert got.usage is not None and r.usage is not None and got.usage.input_tokens == r.usage.input_tokens
    items = client.responses.input_items.list(r.id, order="asc")
    assert [(i.role, i.type) for i in items.data] == [
        ("user", "message"),
        ("assistant", "message"),
        ("user", "message"),
    ]
    assert len({i.id for i in items.data}) == 3
    newest = client.responses.input_items.list(r.id, limit=1)  # desc by default: the last input first
    assert newest.has_more and newest.data[0].id == items.data[-1].id
    rest = client.responses.input_items.list(r.id, limit=5, after=newest.data[0].id)
    assert [i.id for i in rest.data] == [i.id for i in reversed(items.data[:-1])] and not rest.has_more
    # a streamed response is stored too, with the object its last event (response.incomplete here) carried
    events = list(
        client.responses.create(
            model="tiny", input="Streamed.", max_output_tokens=4, temperature=0, reasoning=NO_THINK, stream=True
        )
    )
    final = events[-1].response
    assert events[-1].type == "response.incomplete"
    assert client.responses.retrieve(final.id).model_dump() == final.model_dump()
    client.responses.delete(r.id)
    for call in (
        lambda: client.responses.retrieve(r.id),
        lambda: client.responses.delete(r.id),
        lambda: client.responses.input_items.list(r.id),
        lambda: client.responses.create(model="tiny", input="x", previous_response_id=r.id, max_output_tokens=2),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    # store false: nothing to retrieve
    unstored = client.responses.create(model="tiny", input="x", max_output_tokens=2, store=False, reasoning=NO_THINK)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    bad = httpx.get(f"{srv.base_url}/v1/responses/{final.id}/input_items", params={"limit": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"


def test_bad_fields_are_400_naming_the_field(srv):
    def post(body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{srv.base_url}/v1/responses", json={"model": "tiny", **body}, timeout=60)

    cases = [
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": [{"type": "image_generation_call"}]}, "input[0].type"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "reasoning": {"effort": "huge"}}, "reasoning.effort"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "conversation": "c"}, "conversation"),
        ({}, "input"),
    ]
    for body, param in cases:
        r = post(body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.text)


def _reassemble(events: list[Any]) -> tuple[str, list[tuple[str, str]], Any]:
    text, calls, final = "", [], None
    args: dict[str, str] = {}
    names: dict[str, str] = {}
    seqs = [e.sequence_number for e in events]
    assert seqs == list(range(len(events)))
    for e in events:
        if e.type == "response.output_text.delta":
            text += e.delta
        elif e.type == "response.output_item.added" and e.item.type == "function_call":
            names[e.item.id] = e.item.name
            args[e.item.id] = ""
        elif e.type == "response.function_call_arguments.delta":
            args[e.item_id] += e.delta
        elif e.type == "response.function_call_arguments.done":
            assert e.arguments == args[e.item_id]
        elif e.type in ("response.completed", "response.incomplete"):
            final = e.response
    calls = [(names[k], v) for k, v in args.items()]
    return text, calls, final


def test_stream_text_matches_non_streamed(client):
    kw: dict[str, Any] = dict(
        model="tiny", input="Say something.", max_output_tokens=12, temperature=0, reasoning=NO_THINK
    )
    plain = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.incomplete"
    for t in (
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ):
        assert t in types
    text, _, final = _reassemble(events)
    assert text == plain.output_text and final.output_text == text
    assert final.usage.output_tokens == plain.usage.output_tokens == 12
    # the SDK's helper (it needs response.completed: a reply that ends, here a JSON answer)
    kw.update(
        max_output_tokens=200, text={"format": {"type": "json_schema", "name": "f", "schema": SCHEMA, "strict": True}}
    )
    plain = client.responses.create(**kw)
    assert plain.status == "completed"
    with client.responses.stream(**kw) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        done = s.get_final_response()
    assert "".join(deltas) == done.output_text == plain.output_text
    jsonschema.validate(json.loads(done.output_text), SCHEMA)


def test_stream_function_call_and_reasoning(client):
    kw: dict[str, Any] = dict(
        model="tiny",
        input="Weather?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=200,
        temperature=0,
        reasoning=NO_THINK,
    )
    plain = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    _, calls, final = _reassemble(events)
    want = [(o.name, o.arguments) for o in plain.output if o.type == "function_call"]
    assert calls == want and len(want) == 1
    assert [(o.name, o.arguments) for o in final.output if o.type == "function_call"] == want
    # thinking on: reasoning_text deltas reassemble to the non-streamed reasoning item
    kw2: dict[str, Any] = dict(model="tiny", input="Think.", max_output_tokens=6, temperature=0)
    plain2 = client.responses.create(**kw2)
    events2 = list(client.responses.create(stream=True, **kw2))
    thought = "".join(e.delta for e in events2 if e.type == "response.reasoning_text.delta")
    assert thought and thought == plain2.output[0].content[0].text
    assert "response.reasoning_text.done" in [e.type for e in events2]


# ---- the OpenAI Agents SDK with its default (Responses) model --------------------------------------------------


class Forecast(BaseModel):
    city: Literal["Paris", "Tokyo"]
    sunny: bool


def _responses_count(srv: Any) -> float:
    text = httpx.get(f"{srv.base_url}/metrics").text
    for fam in text_string_to_metric_families(text):
        for m in fam.samples:
            if m.labels.get("endpoint") == "/v1/responses" and m.name == "kimi:http_requests_total":
                return m.value
    return 0.0


def _agent_run(srv: Any, agent: Agent[Any], prompt: str, max_turns: int, stream: bool = False) -> Any:
    """Runner.run on the SDK's default client and default model class (the client is made inside the event loop
    that uses it)."""

    async def go() -> Any:
        set_tracing_disabled(True)
        set_default_openai_api("responses")
        client = AsyncOpenAI(base_url=f"{srv.base_url}/v1", api_key="dummy", max_retries=0, timeout=120)
        set_default_openai_client(client, use_for_tracing=False)
        try:
            if not stream:
                return await Runner.run(agent, prompt, max_turns=max_turns)
            streamed = Runner.run_streamed(agent, prompt, max_turns=max_turns)
            async for _ in streamed.stream_events():
                pass
            return streamed
        finally:
            await client.close()

    try:
        return asyncio.run(go())
    finally:
        set_default_openai_api("chat_completions")


def _settings(**kw: Any) -> ModelSettings:
    from openai.types.shared import Reasoning

    kw.setdefault("max_tokens", 256)
    return ModelSettings(temperature=0, parallel_tool_calls=False, reasoning=Reasoning(effort="none"), **kw)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_agents_sdk_function_tool_required(srv, stream):
    calls: list[tuple[str, bool]] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Tokyo"], metric: bool) -> str:
        """Current weather of a city.

        Args:
            city: the city.
            metric: report in metric units.
        """
        calls.append((city, metric))
        return f"sunny in {city}"

    agent = Agent(
        name="weather",
        instructions="Answer with the get_weather tool.",
        tools=[get_weather],
        model="tiny",
        model_settings=_settings(tool_choice="required"),
        tool_use_behavior="stop_on_first_tool",
    )
    before = _responses_count(srv)
    result = _agent_run(srv, agent, "Weather in Paris?", max_turns=2, stream=stream)
    assert _responses_count(srv) == before + 1  # the default model class is the Responses one
    assert len(calls) == 1
    assert result.final_output == f"sunny in {calls[0][0]}"


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_agents_sdk_output_type(srv, stream):
    agent = Agent(
        name="forecaster",
        instructions="Give a forecast.",
        model="tiny",
        model_settings=_settings(),
        output_type=Forecast,
    )
    before = _responses_count(srv)
    result = _agent_run(srv, agent, "Forecast?", max_turns=1, stream=stream)
    assert _responses_count(srv) == before + 1
    assert isinstance(result.final_output, Forecast)


def test_agents_sdk_tool_result_goes_back_as_items(srv):
    """After the forced call the SDK resets tool_choice and sends the call and its output back as input items
    (function_call with its id and status, function_call_output); the model then answers with the output_type's
    JSON (a reply that ends: the SDK takes a response.incomplete as an error)."""
    calls: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Tokyo"]) -> str:
        """Current weather of a city.

        Args:
            city: the city.
        """
        calls.append(city)
        return f"sunny in {city}"

    agent = Agent(
        name="weather",
        instructions="Use get_weather, then answer.",
        tools=[get_weather],
        model="tiny",
        model_settings=_settings(tool_choice="required"),
        output_type=Forecast,
    )
    before = _responses_count(srv)
    result = _agent_run(srv, agent, "Weather in Tokyo?", max_turns=3)
    assert _responses_count(srv) == before + 1 + len(calls) and len(calls) >= 1
    assert isinstance(result.final_output, Forecast)
    items = [i.type for i in result.new_items]
    assert items[:2] == ["tool_call_item", "tool_call_output_item"] and items[-1] == "message_output_item"


def _gauges(srv: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(f"{srv.base_url}/metrics").text):
        for m in fam.samples:
            if not m.labels:
                out[m.name] = m.value
    return out


def test_raw_events_and_disconnect_mid_stream_aborts_and_frees(srv):
    body = {
        "model": "tiny",
        "input": "long",
        "max_output_tokens": 1500,
        "stream": True,
        "reasoning": NO_THINK,
        "temperature": 0,
    }
    with httpx.stream("POST", f"{srv.base_url}/v1/responses", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        got = [next(lines) for _ in range(24)]
        events = [x.removeprefix("event: ") for x in got if x.startswith("event: ")]
        datas = [json.loads(x.removeprefix("data: ")) for x in got if x.startswith("data: ")]
        assert events[:2] == ["response.created", "response.in_progress"] and "response.output_text.delta" in events
        assert [d["type"] for d in datas] == events[: len(datas)]
        assert [d["sequence_number"] for d in datas] == list(range(len(datas)))
        rid = datas[0]["response"]["id"]
        m = _gauges(srv)
        assert m["kimi:num_requests_running"] == 1 and m["kimi:kv_cache_used_blocks"] >= 1
    deadline = time.monotonic() + 30
    while True:
        m = _gauges(srv)
        if m["kimi:num_requests_running"] == 0 and m["kimi:kv_cache_used_blocks"] == 0:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.1)
    # an aborted response is not stored
    r2 = httpx.post(
        f"{srv.base_url}/v1/responses",
        json={"model": "tiny", "input": "x", "previous_response_id": rid, "max_output_tokens": 2},
        timeout=60,
    )
    assert r2.status_code == 404 and r2.json()["error"]["param"] == "previous_response_id"


def test_shutdown_mid_stream_ends_it_with_response_failed(tiny_k26, tmp_path):
    """An error after the stream started (here: the server shutting down) is a response.failed event with the
    error, the stream's last."""
    s = start_server(tiny_k26, str(tmp_path / "server.log"), "--fake-workers", "--num-blocks", "400")
    try:
        body = {"model": "tiny", "input": "long", "max_output_tokens": 1800, "stream": True, "reasoning": NO_THINK}
        client = OpenAI(base_url=f"{s.base_url}/v1", api_key="dummy", max_retries=0, timeout=60)
        events = []
        for e in client.responses.create(**body):
            events.append(e)
            if len(events) == 6:
                s.proc.send_signal(signal.SIGTERM)
        assert events[-1].type == "response.failed", [e.type for e in events[-3:]]
        failed = events[-1].response
        assert failed.status == "failed" and failed.error is not None and "shutting down" in failed.error.message
        assert [e.sequence_number for e in events] == list(range(len(events)))
    finally:
        assert stop_server(s) == 0, s.log()
