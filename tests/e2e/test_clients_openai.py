"""The openai client's own structured-output helpers and batched completions against `kimi serve --fake-workers`.

`chat.completions.parse` / `.stream` with a pydantic `response_format` (the client turns it into a strict
`json_schema` and validates the reply; a reply cut by `max_tokens` raises instead), `pydantic_function_tool` (strict
tools, parsed arguments) under `tool_choice` required and named, and `/v1/completions` with a batch of prompts and
`n` > 1, streamed with `stream_options.continuous_usage_stats`. Thinking is switched off (`chat_template_kwargs`):
the random fake model never closes `</think>`. Schemas use enums and booleans only; greedy decoding (temperature 0)
and one tool call per reply keep every constrained output short and each run the same.
"""

from __future__ import annotations

from typing import Literal

import openai
import pytest
from pydantic import BaseModel

NO_THINKING = {"chat_template_kwargs": {"thinking": False}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
PROMPTS = ["The capital of France is", "One, two, three,", "Hello", "A long time ago, in a galaxy"]


class Forecast(BaseModel):
    city: Literal["Paris", "Tokyo"]
    sunny: bool


class GetWeather(BaseModel):
    """Current weather of a city."""

    city: Literal["Paris", "Tokyo"]
    metric: bool


@pytest.fixture(scope="module")
def client(fake_srv):
    with openai.OpenAI(base_url=f"{fake_srv.base_url}/v1", api_key="dummy", max_retries=0, timeout=120) as c:
        yield c


def test_parse_with_a_pydantic_response_format(client):
    out = client.chat.completions.parse(
        model="tiny", messages=MESSAGES, response_format=Forecast, temperature=0, max_tokens=512, extra_body=NO_THINKING
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Forecast), choice.message.content


def test_stream_helper_with_a_pydantic_response_format_equals_parse(client):
    kw = dict(
        model="tiny", messages=MESSAGES, response_format=Forecast, temperature=0, max_tokens=512, extra_body=NO_THINKING
    )
    whole = client.chat.completions.parse(**kw)
    with client.chat.completions.stream(**kw) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion()
    assert isinstance(streamed.choices[0].message.parsed, Forecast)
    assert streamed.choices[0].message.content == whole.choices[0].message.content


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "GetWeather"}}])
def test_pydantic_function_tool_is_strict_and_its_arguments_parse(client, tool_choice):
    tool = openai.pydantic_function_tool(GetWeather)
    assert tool["function"]["strict"] is True
    out = client.chat.completions.parse(
        model="tiny",
        messages=MESSAGES,
        tools=[tool],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=512,
        extra_body=NO_THINKING,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "GetWeather"
    assert isinstance(call.function.parsed_arguments, GetWeather)


def test_batched_prompts_with_n_are_ordered_prompt_major(client):
    """A batch of 4 prompts with n=2: 8 choices, index = prompt * n + j, each the same as that prompt sent alone."""
    n = 2
    out = client.completions.create(model="tiny", prompt=PROMPTS, n=n, max_tokens=8, seed=7)
    assert sorted(c.index for c in out.choices) == list(range(len(PROMPTS) * n))
    by_index = {c.index: c.text for c in out.choices}
    for i, p in enumerate(PROMPTS):
        alone = client.completions.create(model="tiny", prompt=p, n=n, max_tokens=8, seed=7)
        for c in alone.choices:
            assert by_index[i * n + c.index] == c.text, (i, c.index)
    assert out.usage.completion_tokens == len(PROMPTS) * n * 8


def test_batched_prompts_streamed_with_continuous_usage_stats(client):
    stream = client.completions.create(
        model="tiny",
        prompt=PROMPTS,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    chunks = list(stream)
    assert chunks and all(c.usage is not None for c in chunks)
    completion = [c.usage.completion_tokens for c in chunks]
    assert completion == sorted(completion)  # usage so far, never decreasing
    text = dict.fromkeys(range(len(PROMPTS)), "")
    for c in chunks:
        for choice in c.choices:
            text[choice.index] += choice.text
    final = chunks[-1]
    assert final.choices == [] and final.usage.completion_tokens == len(PROMPTS) * 8
    whole = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=8, temperature=0)
    assert text == {c.index: c.text for c in whole.choices}
