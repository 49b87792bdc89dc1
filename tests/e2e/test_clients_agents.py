"""The OpenAI Agents SDK (openai-agents) against `kimi serve --fake-workers`, through its Chat Completions model.

What an Agents SDK user runs: an Agent whose tools are default `@function_tool`s (the SDK sends every one with
`"strict": true` and a closed schema), and an Agent with an `output_type` (sent as a strict `json_schema`
`response_format`). The fake workers' tokens follow the request's grammar, so a forced call carries arguments the
SDK validates against the tool's schema before it runs the function, and the structured reply validates into the
pydantic model. Schemas use enums and booleans only and one call is asked for (`parallel_tool_calls` false), so every
constrained output ends within `max_tokens`; greedy decoding (temperature 0) makes each run the same.

The tiny K2.6 checkpoint is a thinking model and the random fake model never closes `</think>`: requests switch
thinking off (`chat_template_kwargs`, through ModelSettings.extra_body), so the constraint covers the whole reply.
Tracing is disabled (it would export to OpenAI); the client has a dummy key and never retries.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    RunResult,
    RunResultStreaming,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI, DefaultAsyncHttpxClient
from pydantic import BaseModel

set_tracing_disabled(True)

NO_THINKING = {"chat_template_kwargs": {"thinking": False}}
CITIES = ("Paris", "Tokyo")


class Forecast(BaseModel):
    city: Literal["Paris", "Tokyo"]
    sunny: bool


def _weather_tool(calls: list[tuple[str, bool]]) -> Any:
    @function_tool
    def get_weather(city: Literal["Paris", "Tokyo"], metric: bool) -> str:
        """Current weather of a city.

        Args:
            city: the city.
            metric: report in metric units.
        """
        calls.append((city, metric))
        return f"sunny in {city}"

    return get_weather


def _model(base_url: str, sent: list[dict[str, Any]]) -> OpenAIChatCompletionsModel:
    """The SDK's Chat Completions model on a client that appends each request body it sends to `sent`."""

    async def record(request: Any) -> None:
        sent.append(json.loads(request.content))

    http = DefaultAsyncHttpxClient(event_hooks={"request": [record]})
    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="dummy", max_retries=0, timeout=120, http_client=http)
    return OpenAIChatCompletionsModel(model="tiny", openai_client=client)


def _settings(**kw: Any) -> ModelSettings:
    return ModelSettings(temperature=0, parallel_tool_calls=False, max_tokens=512, extra_body=NO_THINKING, **kw)


def _run(agent: Agent[Any], prompt: str, *, stream: bool, max_turns: int) -> RunResult | RunResultStreaming:
    async def go() -> RunResult | RunResultStreaming:
        if not stream:
            return await Runner.run(agent, prompt, max_turns=max_turns)
        streamed = Runner.run_streamed(agent, prompt, max_turns=max_turns)
        async for _ in streamed.stream_events():
            pass
        return streamed

    return asyncio.run(go())


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_strict_function_tool_forced_by_tool_choice_required(fake_srv, stream):
    """tool_choice required: the model must call the strict tool; its arguments validate and the SDK runs it."""
    calls: list[tuple[str, bool]] = []
    sent: list[dict[str, Any]] = []
    agent = Agent(
        name="weather",
        instructions="Answer with the get_weather tool.",
        tools=[_weather_tool(calls)],
        model=_model(fake_srv.base_url, sent),
        model_settings=_settings(tool_choice="required"),
        tool_use_behavior="stop_on_first_tool",
    )
    result = _run(agent, "What is the weather in Paris?", stream=stream, max_turns=2)
    function = sent[0]["tools"][0]["function"]
    assert function["strict"] is True and function["parameters"]["additionalProperties"] is False
    assert sent[0]["tool_choice"] == "required" and sent[0]["parallel_tool_calls"] is False
    assert len(calls) == 1, fake_srv.log()
    city, metric = calls[0]
    assert city in CITIES and isinstance(metric, bool)
    assert result.final_output == f"sunny in {city}"


def test_named_tool_then_answer_with_the_tool_result_in_history(fake_srv):
    """tool_choice names the tool: one forced call, then (the SDK resets tool_choice) a second turn whose history
    holds the assistant's tool call and the tool's result, answered in text."""
    calls: list[tuple[str, bool]] = []
    sent: list[dict[str, Any]] = []
    agent = Agent(
        name="weather",
        instructions="Use get_weather, then answer.",
        tools=[_weather_tool(calls)],
        model=_model(fake_srv.base_url, sent),
        model_settings=_settings(tool_choice="get_weather"),
    )
    result = _run(agent, "What is the weather in Tokyo?", stream=False, max_turns=3)
    assert sent[0]["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert len(calls) == 1, fake_srv.log()
    assert calls[0][0] in CITIES
    assert isinstance(result.final_output, str)
    assert len(sent) == 2  # the forced call, then the answer
    assert sent[1].get("tool_choice") is None  # reset after the call: the model may answer in text
    call_message, tool_message = sent[1]["messages"][-2:]
    assert call_message["role"] == "assistant" and call_message["tool_calls"][0]["function"]["name"] == "get_weather"
    assert tool_message == {
        "role": "tool",
        "tool_call_id": call_message["tool_calls"][0]["id"],
        "content": f"sunny in {calls[0][0]}",
    }


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_output_type_returns_a_validated_object(fake_srv, stream):
    """output_type: a strict json_schema response_format; the reply validates into the pydantic model."""
    sent: list[dict[str, Any]] = []
    agent = Agent(
        name="forecaster",
        instructions="Give the forecast.",
        model=_model(fake_srv.base_url, sent),
        model_settings=_settings(),
        output_type=Forecast,
    )
    result = _run(agent, "Forecast for Paris?", stream=stream, max_turns=1)
    response_format = sent[0]["response_format"]
    assert response_format["type"] == "json_schema" and response_format["json_schema"]["strict"] is True
    assert isinstance(result.final_output, Forecast), result.final_output
    assert result.final_output.city in CITIES


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_tools_and_output_type_together(fake_srv, stream):
    """The SDK's commonest agent shape: strict tools and an output_type in one request (tool_choice auto,
    response_format json_schema). Each turn is a valid tool call (the SDK runs it) or a validated answer, and the run
    ends with a Forecast."""
    calls: list[tuple[str, bool]] = []
    sent: list[dict[str, Any]] = []
    agent = Agent(
        name="forecaster",
        instructions="Use get_weather, then give the forecast.",
        tools=[_weather_tool(calls)],
        model=_model(fake_srv.base_url, sent),
        model_settings=_settings(),
        output_type=Forecast,
    )
    result = _run(agent, "Forecast for Paris?", stream=stream, max_turns=6)
    assert sent[0]["tools"][0]["function"]["strict"] is True and sent[0]["response_format"]["type"] == "json_schema"
    assert "tool_choice" not in sent[0] or sent[0]["tool_choice"] == "auto"
    assert isinstance(result.final_output, Forecast), result.final_output
    assert all(city in CITIES and isinstance(metric, bool) for city, metric in calls)
