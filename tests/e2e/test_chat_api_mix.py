"""64 concurrent requests mixing the three chat APIs (/v1/chat/completions, /v1/messages, /v1/responses), streamed
and not, plain, with a forced tool call, with a guided JSON schema, against one `kimi serve --fake-workers` on the
tiny K2.6 checkpoint (raw HTTP through httpx, so the wire's terminal events are checked as sent).

Every stream ends with its API's terminal event, every non-streamed reply is complete and valid for its variant;
8 streams are dropped by the client mid-generation. Afterwards /metrics shows no request running or waiting, no KV
block in use, and every request counted once by endpoint and once by finish reason (the 8 dropped: `abort`)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx
import jsonschema
import pytest
from conftest import start_server, stop_server, worker_pids
from prometheus_client.parser import text_string_to_metric_families

N = 64
APIS = ("/v1/chat/completions", "/v1/messages", "/v1/responses")
VARIANTS = ("plain", "tools", "json", "long")
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
    "additionalProperties": False,
}
PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
CHAT_STOPS = {"stop", "length", "tool_calls"}
MESSAGE_STOPS = {"end_turn", "max_tokens", "tool_use", "stop_sequence"}
RESPONSE_ENDS = {"response.completed", "response.incomplete", "response.failed"}


@dataclass
class Spec:
    i: int
    api: str
    stream: bool
    variant: str

    @property
    def drop(self) -> bool:
        """Streamed `long` requests: the client disconnects after the first content delta."""
        return self.stream and self.variant == "long"

    @property
    def max_tokens(self) -> int:
        return {"plain": 24, "tools": 400, "json": 300, "long": 4000 if self.stream else 64}[self.variant]


SPECS = [Spec(i, APIS[i % 3], i % 2 == 0, VARIANTS[(i // 2) % 4]) for i in range(N)]


@pytest.fixture(scope="module")
def srv(tiny_k26, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("log") / "mix.log")
    s = start_server(
        tiny_k26,
        log,
        "--fake-workers",
        "--block-size",
        "16",
        "--num-blocks",
        "4000",
        "--max-model-len",
        "8192",
        "--max-num-seqs",
        "64",
    )
    yield s
    assert stop_server(s) == 0, s.log()
    deadline = time.monotonic() + 10
    while worker_pids(tiny_k26) and time.monotonic() < deadline:
        time.sleep(0.2)


def _body(s: Spec) -> dict[str, Any]:
    guided = s.variant in ("tools", "json")
    prompt = f"request {s.i}: the weather?"
    b: dict[str, Any]
    if s.api == "/v1/chat/completions":
        b = {
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": s.max_tokens,
            "chat_template_kwargs": {"thinking": False},
        }
        if s.stream:
            b["stream_options"] = {"include_usage": True}
        if s.variant == "tools":
            fn = {"name": "get_weather", "parameters": PARAMS}
            b.update(tools=[{"type": "function", "function": fn}], tool_choice="required", parallel_tool_calls=False)
        elif s.variant == "json":
            b["response_format"] = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA}}
    elif s.api == "/v1/messages":
        b = {
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": s.max_tokens,
            "thinking": {"type": "disabled"},
        }
        if s.variant == "tools":
            b["tools"] = [{"name": "get_weather", "input_schema": PARAMS}]
            b["tool_choice"] = {"type": "any", "disable_parallel_tool_use": True}
        elif s.variant == "json":
            b["output_config"] = {"format": {"type": "json_schema", "schema": SCHEMA}}
    else:
        b = {"input": prompt, "max_output_tokens": s.max_tokens, "reasoning": {"effort": "none"}}
        if s.variant == "tools":
            b.update(
                tools=[{"type": "function", "name": "get_weather", "parameters": PARAMS, "strict": True}],
                tool_choice="required",
                parallel_tool_calls=False,
            )
        elif s.variant == "json":
            b["text"] = {"format": {"type": "json_schema", "name": "forecast", "schema": SCHEMA, "strict": True}}
    b["model"] = "tiny"
    b["stream"] = s.stream
    if guided:  # greedy: a random model sampling freely may open call after call
        b["temperature"] = 0
    return b


@dataclass
class Outcome:
    """A request's result in common terms: how it ended (the API's finish / stop reason or status), its text and
    its calls' (name, arguments) once whole, and whether the client dropped it."""

    end: str
    text: str = ""
    calls: list[tuple[str, Any]] | None = None
    dropped: bool = False


def _sse(lines: list[str]) -> list[tuple[str | None, str]]:
    """SSE lines -> [(event name or None, data)]."""
    out, name = [], None
    for line in lines:
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            out.append((name, line.removeprefix("data: ")))
            name = None
    return out


def _chat_stream(events: list[tuple[str | None, str]]) -> Outcome:
    assert events and events[-1][1] == "[DONE]", events[-3:]
    chunks = [json.loads(d) for _, d in events[:-1]]
    assert not any("error" in c for c in chunks), chunks
    text, args, names, ends = [], {}, {}, []
    for c in chunks:
        for ch in c["choices"]:
            d = ch.get("delta") or {}
            text.append(d.get("content") or "")
            for tc in d.get("tool_calls") or []:
                if tc.get("function", {}).get("name"):
                    names[tc["index"]] = tc["function"]["name"]
                args[tc["index"]] = args.get(tc["index"], "") + (tc.get("function", {}).get("arguments") or "")
            if ch.get("finish_reason"):
                ends.append(ch["finish_reason"])
    assert len(ends) == 1 and ends[0] in CHAT_STOPS, ends
    assert chunks[-1]["usage"]["completion_tokens"] >= 1  # include_usage: the last chunk carries the usage
    calls = [(names[k], json.loads(args[k])) for k in sorted(names)] if ends[0] == "tool_calls" else None
    return Outcome(ends[0], "".join(text), calls)


def _messages_stream(events: list[tuple[str | None, str]]) -> Outcome:
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-1] == "message_stop", names
    text, blocks, stop = [], {}, None
    for n, d in events:
        e = json.loads(d)
        assert e["type"] == n
        if n == "content_block_start" and e["content_block"]["type"] == "tool_use":
            blocks[e["index"]] = [e["content_block"]["name"], ""]
        elif n == "content_block_delta":
            if e["delta"]["type"] == "text_delta":
                text.append(e["delta"]["text"])
            elif e["delta"]["type"] == "input_json_delta":
                blocks[e["index"]][1] += e["delta"]["partial_json"]
        elif n == "message_delta":
            stop = e["delta"]["stop_reason"]
            assert e["usage"]["output_tokens"] >= 1
    assert stop in MESSAGE_STOPS, events[-3:]
    calls = [(nm, json.loads(a)) for nm, a in blocks.values()] if stop == "tool_use" else None
    return Outcome(stop, "".join(text), calls)


def _response_outcome(r: dict[str, Any]) -> Outcome:
    assert r["object"] == "response" and r["status"] in ("completed", "incomplete"), r
    assert r["usage"]["output_tokens"] >= 1
    text = "".join(
        p["text"] for o in r["output"] if o["type"] == "message" for p in o["content"] if p["type"] == "output_text"
    )
    calls = [(o["name"], json.loads(o["arguments"])) for o in r["output"] if o["type"] == "function_call"]
    return Outcome(r["status"], text, calls if r["status"] == "completed" and calls else None)


def _responses_stream(events: list[tuple[str | None, str]]) -> Outcome:
    names = [n for n, _ in events]
    assert names[0] == "response.created" and names[-1] in RESPONSE_ENDS, names
    assert sum(n in RESPONSE_ENDS for n in names) == 1
    final = json.loads(events[-1][1])
    assert final["type"] == names[-1]
    return _response_outcome(final["response"])


def _reply(s: Spec, r: dict[str, Any]) -> Outcome:
    if s.api == "/v1/chat/completions":
        c = r["choices"][0]
        assert c["finish_reason"] in CHAT_STOPS and r["usage"]["completion_tokens"] >= 1, r
        calls = c["message"].get("tool_calls")
        got = [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in calls] if calls else None
        return Outcome(c["finish_reason"], c["message"].get("content") or "", got)
    if s.api == "/v1/messages":
        assert r["type"] == "message" and r["stop_reason"] in MESSAGE_STOPS and r["usage"]["output_tokens"] >= 1, r
        text = "".join(b["text"] for b in r["content"] if b["type"] == "text")
        uses = [(b["name"], b["input"]) for b in r["content"] if b["type"] == "tool_use"]
        return Outcome(r["stop_reason"], text, uses if r["stop_reason"] == "tool_use" else None)
    return _response_outcome(r)


def _first_content(s: Spec, name: str | None, data: str) -> bool:
    """Whether an SSE event carries generated text."""
    if s.api == "/v1/chat/completions":
        return data != "[DONE]" and any((c.get("delta") or {}).get("content") for c in json.loads(data)["choices"])
    return name in ("content_block_delta", "response.output_text.delta")


async def _run(client: httpx.AsyncClient, s: Spec) -> Outcome:
    body = _body(s)
    if not s.stream:
        r = await client.post(s.api, json=body)
        assert r.status_code == 200, r.text
        return _reply(s, r.json())
    lines: list[str] = []
    async with client.stream("POST", s.api, json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name: str | None = None
        async for line in r.aiter_lines():
            lines.append(line)
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: ") and s.drop and _first_content(s, name, line.removeprefix("data: ")):
                return Outcome("dropped", dropped=True)  # leaving the block closes the connection
    events = _sse(lines)
    if s.api == "/v1/chat/completions":
        return _chat_stream(events)
    if s.api == "/v1/messages":
        return _messages_stream(events)
    return _responses_stream(events)


def _metrics(srv) -> dict[str, float]:
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(f"{srv.base_url}/metrics").text):
        for smp in fam.samples:
            key = smp.name + ("" if not smp.labels else json.dumps(smp.labels, sort_keys=True))
            out[key] = smp.value
    return out


def _success(m: dict[str, float], reason: str) -> float:
    return m["kimi:request_success_total" + json.dumps({"finished_reason": reason})]


def _admitted(m: dict[str, float], endpoint: str) -> float:
    return m["kimi:http_requests_total" + json.dumps({"endpoint": endpoint})]


def test_64_concurrent_mixed_requests_end_and_free_everything(srv):
    before = _metrics(srv)

    async def main() -> list[Outcome | BaseException]:
        limits = httpx.Limits(max_connections=N, max_keepalive_connections=N)
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=600, limits=limits) as client:
            return await asyncio.gather(*(_run(client, s) for s in SPECS), return_exceptions=True)

    results = asyncio.run(main())
    failed = [(s, r) for s, r in zip(SPECS, results, strict=True) if isinstance(r, BaseException)]
    assert not failed, failed[:3]
    outcomes = [r for r in results if isinstance(r, Outcome)]
    assert sum(o.dropped for o in outcomes) == 8
    for s, o in zip(SPECS, outcomes, strict=True):
        assert o.dropped == s.drop, (s, o)
        if s.variant == "tools":  # a forced single call, arguments matching the schema
            assert o.end in ("tool_calls", "tool_use", "completed") and o.calls is not None, (s, o)
            assert len(o.calls) == 1 and o.calls[0][0] == "get_weather", (s, o)
            jsonschema.validate(o.calls[0][1], PARAMS)
        elif s.variant == "json":
            assert o.end in ("stop", "end_turn", "completed"), (s, o)
            jsonschema.validate(json.loads(o.text), SCHEMA)
        elif not s.drop:
            assert o.end in ("length", "max_tokens", "incomplete", "stop", "end_turn", "completed"), (s, o)

    deadline = time.monotonic() + 120
    while True:
        m = _metrics(srv)
        idle = m["kimi:num_requests_running"] == 0 and m["kimi:num_requests_waiting"] == 0
        if idle and m["kimi:kv_cache_used_blocks"] == 0:
            break
        assert time.monotonic() < deadline, {k: v for k, v in m.items() if "num_requests" in k or "blocks" in k}
        time.sleep(0.2)
    for api in APIS:
        assert _admitted(m, api) - _admitted(before, api) == sum(s.api == api for s in SPECS), api
    ended = {r: _success(m, r) - _success(before, r) for r in ("stop", "length", "abort", "error")}
    assert sum(ended.values()) == N and ended["abort"] == 8 and ended["error"] == 0, ended
