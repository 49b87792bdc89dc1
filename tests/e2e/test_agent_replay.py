"""A Claude-Code-shaped session replayed through the real `anthropic` SDK against `kimi serve --fake-workers` on the
tiny K2.6 checkpoint.

tests/e2e/data/claude_code_session.json holds four successive /v1/messages bodies of one coding session as Claude
Code sends them (system prompt as cached text blocks, 16 tools with JSON-Schema inputs, metadata.user_id, thinking
with budget_tokens, stream, max_tokens 32000; assistant turns with signed thinking, text and `toolu_01...` tool_use
blocks; user turns with string, block and is_error tool_result content) and the headers it sends with them
(anthropic-version, anthropic-beta, x-app). Each body is sent as recorded except `model` (the served name) and
`max_tokens` / `thinking.budget_tokens` (lowered for CPU speed, the budget still below max_tokens)."""

from __future__ import annotations

import base64
import copy
import itertools
import json
import time
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from conftest import start_server, stop_server, worker_pids
from prometheus_client.parser import text_string_to_metric_families

SESSION = json.loads((Path(__file__).parent / "data" / "claude_code_session.json").read_text())
MAX_TOKENS, BUDGET = 1100, 1024
STOP_REASONS = {"end_turn", "max_tokens", "stop_sequence", "tool_use", "pause_turn", "refusal"}
SDK_FIELDS = {
    "model",
    "max_tokens",
    "messages",
    "system",
    "tools",
    "tool_choice",
    "metadata",
    "thinking",
    "stop_sequences",
}
DELTA_OF = {"text": {"text_delta"}, "thinking": {"thinking_delta", "signature_delta"}, "tool_use": {"input_json_delta"}}


@pytest.fixture(scope="module")
def srv(tiny_k26, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("log") / "server.log")
    s = start_server(tiny_k26, log, "--fake-workers", "--max-model-len", "16384", "--num-blocks", "4000")
    yield s
    assert stop_server(s) == 0, s.log()
    deadline = time.monotonic() + 10
    while worker_pids(tiny_k26) and time.monotonic() < deadline:
        time.sleep(0.2)


@pytest.fixture(scope="module")
def client(srv):
    return anthropic.Anthropic(base_url=srv.base_url, api_key="dummy", max_retries=0, timeout=300)


def _body(i: int) -> dict[str, Any]:
    """Recorded request i with the served model name and the lowered token limits (stream left to the caller)."""
    b = copy.deepcopy(SESSION["requests"][i])
    assert b.pop("stream") is True and b["max_tokens"] == 32000 and b["thinking"]["budget_tokens"] < 32000
    b["model"] = "tiny"
    b["max_tokens"] = MAX_TOKENS
    b["thinking"]["budget_tokens"] = BUDGET
    return b


def _kw(body: dict[str, Any]) -> dict[str, Any]:
    """SDK keyword arguments for `body`: the fields this SDK types as arguments, the others (temperature) in
    extra_body, and the recorded headers."""
    kw = {k: v for k, v in body.items() if k in SDK_FIELDS}
    return {
        **kw,
        "extra_body": {k: v for k, v in body.items() if k not in SDK_FIELDS},
        "extra_headers": SESSION["headers"],
    }


def _gauges(srv) -> dict[str, float]:
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(f"{srv.base_url}/metrics").text):
        for s in fam.samples:
            if not s.labels:
                out[s.name] = s.value
    return out


def _check_event_order(events: list[Any], final: Any) -> None:
    """message_start, then content blocks each opened, delta'd (deltas of its kind) and closed in index order 0, 1,
    ..., then one message_delta and message_stop last; ping anywhere in between."""
    kinds = [e.type for e in events if e.type != "ping"]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    assert kinds.count("message_start") == kinds.count("message_delta") == kinds.count("message_stop") == 1
    open_block: tuple[int, str] | None = None
    next_index = 0
    for e in events:
        if e.type == "content_block_start":
            assert open_block is None and e.index == next_index, (e, open_block)
            open_block = (e.index, e.content_block.type)
            next_index += 1
        elif e.type == "content_block_delta":
            assert open_block is not None and e.index == open_block[0]
            assert e.delta.type in DELTA_OF[open_block[1]], (e.delta.type, open_block)
        elif e.type == "content_block_stop":
            assert open_block is not None and e.index == open_block[0]
            open_block = None
        elif e.type in ("message_delta", "message_stop"):
            assert open_block is None
    assert next_index == len(final.content)
    delta = next(e for e in events if e.type == "message_delta")
    assert delta.delta.stop_reason == final.stop_reason and delta.usage.output_tokens == final.usage.output_tokens


def _check_message(msg: Any, body: dict[str, Any]) -> None:
    assert msg.type == "message" and msg.role == "assistant" and msg.model == "tiny" and msg.id.startswith("msg_")
    assert msg.stop_reason in STOP_REASONS and msg.content
    assert 1 <= msg.usage.output_tokens <= body["max_tokens"]
    assert msg.usage.input_tokens >= 0 and (msg.usage.cache_read_input_tokens or 0) >= 0
    schemas = {t["name"]: t["input_schema"] for t in body["tools"]}
    for b in msg.content:
        assert b.type in ("text", "thinking", "tool_use"), b
        if b.type == "tool_use":
            assert b.id.startswith("toolu_") and b.name in schemas
            if msg.stop_reason == "tool_use":
                jsonschema.validate(b.input, schemas[b.name])


def _prompt_tokens(msg: Any) -> int:
    return msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)


def _count(client, body: dict[str, Any]) -> int:
    keep = ("model", "messages", "system", "tools", "tool_choice", "thinking")
    return client.messages.count_tokens(**{k: body[k] for k in keep if k in body}).input_tokens


def test_fixture_is_claude_code_shaped():
    reqs = SESSION["requests"]
    assert len(reqs) == 4 and all(len(r["tools"]) >= 15 for r in reqs)
    assert {"anthropic-version", "anthropic-beta"} <= set(SESSION["headers"])
    for prev, cur in itertools.pairwise(reqs):
        assert cur["messages"][: len(prev["messages"])] == prev["messages"]  # each request extends the previous
    blocks = [b for m in reqs[-1]["messages"] if isinstance(m["content"], list) for b in m["content"]]
    kinds = {b["type"] for b in blocks}
    assert {"text", "thinking", "tool_use", "tool_result"} <= kinds
    uses = {b["id"] for b in blocks if b["type"] == "tool_use"}
    results = [b for b in blocks if b["type"] == "tool_result"]
    assert all(u.startswith("toolu_01") for u in uses) and {r["tool_use_id"] for r in results} == uses
    assert any(r.get("is_error") for r in results) and any(isinstance(r["content"], list) for r in results)
    assert all(b["signature"] for b in blocks if b["type"] == "thinking")


def test_replay_streams_each_request(srv, client):
    counts = []
    for i in range(len(SESSION["requests"])):
        body = _body(i)
        with client.messages.stream(**_kw(body)) as s:
            events = list(s)
            final = s.get_final_message()
        _check_event_order(events, final)
        _check_message(final, body)
        n = _count(client, body)
        assert _prompt_tokens(final) == n
        if i:  # the long system prompt and tools are a shared prefix: found in the prefix cache
            assert final.usage.cache_read_input_tokens and final.usage.cache_read_input_tokens > 0, final.usage
        counts.append(n)
    assert counts == sorted(counts) and len(set(counts)) == len(counts), counts  # each prompt extends the last
    # the last request once more, not streamed: the same prompt, a complete message
    body = _body(len(SESSION["requests"]) - 1)
    msg = client.messages.create(**_kw(body))
    _check_message(msg, body)
    assert _prompt_tokens(msg) == counts[-1]
    deadline = time.monotonic() + 60
    while (g := _gauges(srv))["kimi:num_requests_running"] or g["kimi:kv_cache_used_blocks"]:
        assert time.monotonic() < deadline, g
        time.sleep(0.2)


def test_reply_tool_use_id_round_trips(srv, client):
    """The model's tool_use (forced with tool_choice, as a random model calls no tool by itself) has a `toolu_` id
    that encodes Kimi's `functions.NAME:IDX`; sent back in the history with its tool_result, the follow-up is
    accepted, and the model sees Kimi's id: the prompt counts the same with the id written either way."""
    body = _body(len(SESSION["requests"]) - 1)
    body["tool_choice"] = {"type": "tool", "name": "Glob", "disable_parallel_tool_use": True}
    # Glob's input narrowed to one value: the forced call of the random model then always closes within max_tokens
    glob = next(t for t in body["tools"] if t["name"] == "Glob")
    glob["input_schema"] = {
        "type": "object",
        "properties": {"pattern": {"type": "string", "enum": ["**/*.py"]}},
        "required": ["pattern"],
        "additionalProperties": False,
    }
    with client.messages.stream(**_kw(body)) as s:
        events = list(s)
        first = s.get_final_message()
    _check_event_order(events, first)
    _check_message(first, body)
    assert first.stop_reason == "tool_use", first
    calls = [b for b in first.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "Glob"
    call = calls[0]
    raw = call.id.removeprefix("toolu_")
    kimi_id = base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)).decode()
    assert kimi_id.startswith("functions.Glob:") and kimi_id.split(":")[1].isdigit(), kimi_id

    follow = _body(len(SESSION["requests"]) - 1)
    follow["tools"] = body["tools"]
    follow["messages"] += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "/home/dev/parser/parser.py"}],
        },
    ]
    with client.messages.stream(**_kw(follow)) as s:
        events = list(s)
        reply = s.get_final_message()
    _check_event_order(events, reply)
    _check_message(reply, follow)
    n = _count(client, follow)
    assert _prompt_tokens(reply) == n
    same = copy.deepcopy(follow)
    for block in same["messages"][-2]["content"]:
        if block["type"] == "tool_use":
            block["id"] = kimi_id
    same["messages"][-1]["content"][0]["tool_use_id"] = kimi_id
    assert _count(client, same) == n
