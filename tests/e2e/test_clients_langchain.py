"""langchain-openai's ChatOpenAI against `kimi serve --fake-workers`: structured output and strict tools.

`with_structured_output` in its three methods (json_schema: a strict `json_schema` response_format; json_mode:
`json_object`; function_calling: a tool forced by name) and `bind_tools(strict=True)` with a named and a required
`tool_choice`. The fake workers' tokens follow the request's grammar, so every parsed object validates. Schemas use
enums and booleans only and tool calls are asked for one at a time (`parallel_tool_calls` false), so every constrained
output ends within `max_tokens`.

The tiny K2.6 checkpoint is a thinking model and the random fake model never closes `</think>`: requests switch
thinking off (`chat_template_kwargs` in `extra_body`), so the constraint covers the whole reply. Greedy decoding
(temperature 0) makes a streamed reply comparable to the same request not streamed.
"""

from __future__ import annotations

from typing import Literal

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

NO_THINKING = {"chat_template_kwargs": {"thinking": False}}
CITIES = ("Paris", "Tokyo")
PROMPT = "What is the weather in Paris?"


class Forecast(BaseModel):
    """The forecast for a city."""

    city: Literal["Paris", "Tokyo"]
    sunny: bool


@tool
def get_weather(city: Literal["Paris", "Tokyo"], metric: bool) -> str:
    """Current weather of a city."""
    return f"sunny in {city}"


@pytest.fixture(scope="module")
def llm(fake_srv) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=f"{fake_srv.base_url}/v1",
        api_key="dummy",
        model="tiny",
        temperature=0,
        max_tokens=512,
        max_retries=0,
        timeout=120,
        extra_body=NO_THINKING,
    )


def _check_call(call: dict) -> None:
    """A tool call as langchain parsed it: get_weather, with exactly the declared arguments, of the right types."""
    assert call["name"] == "get_weather"
    assert set(call["args"]) == {"city", "metric"}
    assert get_weather.invoke(call["args"]) == f"sunny in {call['args']['city']}"  # validated by its args_schema
    assert isinstance(call["args"]["metric"], bool)


def test_with_structured_output_json_schema(llm):
    out = llm.with_structured_output(Forecast, method="json_schema", include_raw=True).invoke(PROMPT)
    assert out["parsing_error"] is None, out["raw"]
    assert isinstance(out["parsed"], Forecast) and out["parsed"].city in CITIES
    assert out["raw"].response_metadata["finish_reason"] == "stop"


def test_with_structured_output_json_mode(llm):
    out = llm.with_structured_output(None, method="json_mode", include_raw=True).invoke(
        "Reply with a JSON object describing the weather in Paris."
    )
    assert out["parsing_error"] is None, out["raw"]
    assert isinstance(out["parsed"], dict)
    assert out["raw"].response_metadata["finish_reason"] == "stop"


@pytest.mark.parametrize("strict", [None, True], ids=["default", "strict"])
def test_with_structured_output_function_calling(llm, strict):
    out = llm.with_structured_output(Forecast, method="function_calling", strict=strict, include_raw=True).invoke(
        PROMPT
    )
    assert out["parsing_error"] is None, out["raw"]
    assert isinstance(out["parsed"], Forecast), out["raw"]
    assert out["parsed"].city in CITIES


@pytest.mark.parametrize("tool_choice", ["get_weather", "required"])
def test_bind_tools_strict(llm, tool_choice):
    msg = llm.bind_tools([get_weather], strict=True, tool_choice=tool_choice, parallel_tool_calls=False).invoke(PROMPT)
    assert isinstance(msg, AIMessage)
    assert len(msg.tool_calls) == 1, msg  # parallel_tool_calls false: one call
    assert msg.invalid_tool_calls == []
    _check_call(msg.tool_calls[0])


def test_bind_tools_strict_streamed_equals_not_streamed(llm):
    bound = llm.bind_tools([get_weather], strict=True, tool_choice="get_weather", parallel_tool_calls=False)
    whole = bound.invoke(PROMPT)
    chunks = list(bound.stream(PROMPT))
    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    streamed = chunks[0]
    for c in chunks[1:]:
        streamed = streamed + c
    assert len(whole.tool_calls) == 1, whole
    _check_call(whole.tool_calls[0])
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(c["name"], c["args"]) for c in whole.tool_calls]
