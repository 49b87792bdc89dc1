"""Tool-call round trips of the agent front-ends on tokens a real worker generated: /v1/messages through the
`anthropic` SDK and /v1/responses through the `openai` SDK, against `kimi serve` on the chain checkpoint
(tests/e2e/chain_checkpoint.py: after `<|im_middle|>` greedy decoding generates `<think> I think</think>OK` and a
kimi_k2 tool section calling `functions.get_weather:0 {"city":"Paris"}`, call after call).

A forced single call (`tool_choice` any / required, parallel calls off) makes the reply exactly that one call; its
id, sent back with its result, is rendered to the model as Kimi's `functions.get_weather:0`."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from kimi.tokenizer import default_tokenizer_source

if default_tokenizer_source() is None:
    pytest.skip(
        "the chain checkpoint's token ids are those of the real Kimi vocabulary, which is absent "
        "(../shared/kimi-tokenizer or $KIMI_TOKENIZER_DIR)",
        allow_module_level=True,
    )

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chain_checkpoint import make_chain_checkpoint
from conftest import start_server, stop_server

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
A_TOOL = {"name": "get_weather", "description": "weather of a city", "input_schema": SCHEMA}
R_TOOL = {"type": "function", "name": "get_weather", "description": "weather of a city", "parameters": SCHEMA}
CHAT_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "weather of a city", "parameters": SCHEMA},
}
CALL_ID = "functions.get_weather:0"
ASK = "weather in Paris?"
# the rendered call and its result, as the model was trained on them
RENDERED_CALL = (
    '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city":"Paris"}<|tool_call_end|>'
)
RENDERED_RESULT = "## Return of functions.get_weather:0\nsunny"


@pytest.fixture(scope="module")
def srv(tiny_k26, tmp_path_factory):
    d = make_chain_checkpoint(tiny_k26, str(tmp_path_factory.mktemp("chain") / "chain"))
    log = str(tmp_path_factory.mktemp("log") / "agent_chain.log")
    s = start_server(
        d, log, "--block-size", "16", "--num-blocks", "200", "--max-model-len", "2048", "--reasoning", "on"
    )
    yield s
    assert stop_server(s) == 0, s.log()


@pytest.fixture(scope="module")
def aclient(srv):
    return anthropic.Anthropic(base_url=srv.base_url, api_key="dummy", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def oclient(srv):
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="dummy", max_retries=0, timeout=300)


def _rendered(srv, messages: list[dict[str, Any]], thinking: bool) -> tuple[int, str]:
    """(token count, text) of chat `messages` with the weather tool, rendered by the server's /tokenize."""
    r = httpx.post(
        srv.base_url + "/tokenize",
        json={"messages": messages, "tools": [CHAT_TOOL], "chat_template_kwargs": {"thinking": thinking}},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    text = httpx.post(srv.base_url + "/detokenize", json={"tokens": ids}, timeout=60).json()["prompt"]
    return len(ids), text


def _messages_create(aclient, stream: bool, **kw: Any) -> Any:
    if not stream:
        return aclient.messages.create(**kw)
    with aclient.messages.stream(**kw) as s:
        kinds = [e.type for e in s]
        msg = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    return msg


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("thinking", [False, True])
def test_messages_tool_use_then_tool_result(srv, aclient, thinking, stream):
    th = {"type": "enabled", "budget_tokens": 1024} if thinking else {"type": "disabled"}
    kw: dict[str, Any] = dict(
        model="tiny",
        max_tokens=1100,
        tools=[A_TOOL],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        thinking=th,
        extra_body={"temperature": 0},
    )
    first = _messages_create(aclient, stream, messages=[{"role": "user", "content": ASK}], **kw)
    assert first.stop_reason == "tool_use", first
    call = first.content[-1]
    assert [b.type for b in first.content] == (["thinking", "tool_use"] if thinking else ["tool_use"])
    if thinking:
        assert first.content[0].thinking == " I think"
    assert call.name == "get_weather" and call.input == {"city": "Paris"} and call.id.startswith("toolu_")
    jsonschema.validate(call.input, SCHEMA)
    # the forced section: section begin, one call, section end, <|im_end|> (+4 reasoning tokens)
    assert first.usage.output_tokens == (21 if thinking else 17)

    history = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}]},
    ]
    n = aclient.messages.count_tokens(model="tiny", messages=history, tools=[A_TOOL], thinking=th).input_tokens
    chat_history: list[dict[str, Any]] = [
        {"role": "user", "content": ASK},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": CALL_ID,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": CALL_ID, "content": "sunny"},
    ]
    if thinking:
        chat_history[1]["reasoning_content"] = " I think"
    count, text = _rendered(srv, chat_history, thinking)
    assert count == n and RENDERED_CALL in text and RENDERED_RESULT in text and "toolu_" not in text

    second = _messages_create(aclient, stream, messages=history, **kw)
    assert second.usage.input_tokens + (second.usage.cache_read_input_tokens or 0) == n
    # the chain model answers the result with the same call again
    assert second.model_dump(exclude={"id", "usage"}) == first.model_dump(exclude={"id", "usage"})
    assert second.usage.output_tokens == first.usage.output_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_responses_function_call_then_output(srv, oclient, stream):
    kw: dict[str, Any] = dict(
        model="tiny",
        tools=[R_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=200,
        temperature=0,
    )

    def create(input_: Any) -> Any:
        if not stream:
            return oclient.responses.create(input=input_, **kw)
        kinds = []
        final = None
        for ev in oclient.responses.create(input=input_, stream=True, **kw):
            kinds.append(ev.type)
            if ev.type == "response.completed":
                final = ev.response
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
        assert final is not None
        return final

    first = create(ASK)
    assert first.status == "completed", first
    assert [o.type for o in first.output] == ["reasoning", "function_call"]
    assert first.output[0].content[0].text == " I think"
    call = first.output[1]
    assert call.name == "get_weather" and call.call_id == CALL_ID and json.loads(call.arguments) == {"city": "Paris"}
    assert first.usage is not None and first.usage.output_tokens == 21
    assert first.usage.output_tokens_details.reasoning_tokens == 2  # " I", " think" (not the two markers)

    items = [
        {"role": "user", "content": ASK},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ]
    second = create(items)
    count, text = _rendered(
        srv,
        [
            {"role": "user", "content": ASK},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": CALL_ID,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": CALL_ID, "content": "sunny"},
        ],
        True,
    )
    assert RENDERED_CALL in text and RENDERED_RESULT in text
    assert second.usage is not None and second.usage.input_tokens == count
    assert second.status == "completed" and [o.type for o in second.output] == ["reasoning", "function_call"]
    again = second.output[1]
    assert (again.name, again.call_id, again.arguments) == (call.name, call.call_id, call.arguments)
