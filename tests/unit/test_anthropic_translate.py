"""kimi.controller.http.anthropic: the Messages body -> chat body translation and the tool-use id mapping."""

from __future__ import annotations

import pytest

from kimi.controller.chat import validate_messages
from kimi.controller.http.anthropic import _renamed, kimi_call_id, to_chat_body, tool_use_id
from kimi.controller.validation import BadRequest


def test_tool_use_ids_round_trip_and_fit_anthropic_pattern():
    for cid in ("functions.get_weather:0", "functions.ns:tool-v2.x:17"):
        tid = tool_use_id(cid)
        assert tid.startswith("toolu_") and all(ch.isalnum() or ch in "_-" for ch in tid)
        assert kimi_call_id(tid) == cid
    assert kimi_call_id("toolu_01A09q90qw90lq917835lq9") == "toolu_01A09q90qw90lq917835lq9"
    assert kimi_call_id("call_abc") == "call_abc"


def test_history_translation_keeps_the_models_own_ids():
    tid = tool_use_id("functions.get_weather:3")
    body = {
        "max_tokens": 10,
        "system": [{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": ""},
                    {"type": "text", "text": "calling"},
                    {"type": "tool_use", "id": tid, "name": "get_weather", "input": {"city": "Oslo"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": tid, "content": "sunny"},
                    {"type": "text", "text": "ok?"},
                ],
            },
        ],
        "stop_sequences": ["END"],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
    }
    with pytest.raises(BadRequest) as e:  # budget_tokens must stay below max_tokens
        to_chat_body(body)
    assert e.value.param == "thinking.budget_tokens"
    chat, shown = to_chat_body({**body, "max_tokens": 2000})
    assert shown and chat["stop"] == ["END"] and chat["chat_template_kwargs"] == {"thinking": True}
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    msgs = validate_messages(chat["messages"])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "user"]
    assert msgs[2]["reasoning_content"] == "hmm" and msgs[2]["content"] == "calling"
    assert msgs[2]["tool_calls"][0]["id"] == "functions.get_weather:3"
    assert msgs[3]["tool_call_id"] == "functions.get_weather:3" and msgs[3]["content"] == "sunny"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"max_tokens": 1, "messages": []}, "messages"),
        ({"max_tokens": 1, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        (
            {"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
            "messages[0].content[0].type",
        ),
        (
            {
                "max_tokens": 1,
                "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b"}]}],
            },
            "messages[0].content[0].type",
        ),
        ({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 1}, "top_logprobs"),
        (
            {"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "thinking": {"type": "on"}},
            "thinking.type",
        ),
        (
            {
                "max_tokens": 1,
                "messages": [{"role": "user", "content": "x"}],
                "output_config": {"format": {"type": "x"}},
            },
            "output_config.format.type",
        ),
        (
            {"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "any"}},
            "tool_choice",
        ),
    ],
)
def test_bad_fields_are_named(body, param):
    with pytest.raises(BadRequest) as e:
        to_chat_body(body)
    assert e.value.param == param and f"'{param}'" in e.value.message


def test_chat_field_errors_are_renamed():
    e = _renamed(BadRequest("'stop' must have at most 4 strings", "stop"))
    assert e.param == "stop_sequences" and e.message == "'stop_sequences' must have at most 4 strings"
    e = _renamed(BadRequest("'response_format.json_schema.schema' is bad", "response_format.json_schema.schema"))
    assert e.param == "output_config.format.schema" and "'output_config.format.schema'" in e.message
