"""kimi.controller.http.responses: the Responses body -> chat body translation and the response store."""

from __future__ import annotations

import pytest

from kimi.controller.http.responses import ResponseStore, to_chat_body
from kimi.controller.validation import BadRequest


def test_store_evicts_the_least_recently_used():
    s = ResponseStore(size=2)
    s.put("a", [{"role": "user", "content": "1"}])
    s.put("b", [{"role": "user", "content": "2"}])
    assert s.get("a") == [{"role": "user", "content": "1"}]  # a is now the most recent
    s.put("c", [])
    assert s.get("b") is None and s.get("a") is not None and s.get("c") == [] and len(s) == 2


def test_items_group_into_assistant_turns():
    chat, start = to_chat_body(
        {
            "instructions": "sys",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "q"}]},
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "t"}],
                },
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]},
                {"type": "function_call", "call_id": "functions.f:0", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "functions.f:0", "output": "r"},
            ],
            "max_output_tokens": 5,
            "reasoning": {"effort": "none"},
            "text": {"format": {"type": "json_object"}},
        },
        [{"role": "user", "content": "old"}],
    )
    assert start == 2
    assert chat["messages"] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "old"},
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "a",
            "reasoning_content": "t",
            "tool_calls": [{"id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "functions.f:0", "content": "r"},
    ]
    assert chat["max_tokens"] == 5 and chat["chat_template_kwargs"] == {"thinking": False}
    assert chat["response_format"] == {"type": "json_object"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include"),
        ({"input": "x", "truncation": "auto"}, "truncation"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0].type"),
        ({"input": "x", "metadata": {"k": 1}}, "metadata"),
    ],
)
def test_bad_fields_name_the_field(body, param):
    with pytest.raises(BadRequest) as ei:
        to_chat_body(body, [])
    assert ei.value.param == param
