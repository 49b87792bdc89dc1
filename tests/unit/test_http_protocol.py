"""kimi.controller.http.protocol (the routes' request Structs) and kimi.controller.http.openapi: the declarations
decode what clients send and refuse out-of-range values by type, /openapi.json is generated from them, every
extension kimi accepts only at a no-op value is declared, and docs/api.md names every declared field."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import msgspec
import pytest

from kimi.controller.http import protocol as p
from kimi.controller.http.openapi import openapi_document

DOCS = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()


def test_structs_decode_what_vllm_and_openai_clients_send():
    body = b"""{"model": "m", "prompt": ["a", [1, 2]], "n": 2, "temperature": 0, "stream": true,
        "stream_options": {"include_usage": true, "continuous_usage_stats": true}, "use_beam_search": false,
        "return_token_ids": true, "priority": -3, "cache_salt": "s", "logprobs": 1, "echo": true}"""
    r = msgspec.json.decode(body, type=p.CompletionRequest)
    assert r.prompt == ["a", [1, 2]] and r.stream_options is not None and r.stream_options.continuous_usage_stats
    chat = msgspec.json.decode(
        b'{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5, "reasoning_effort": "low",'
        b' "separate_reasoning": false, "chat_template_kwargs": {"thinking": false}}',
        type=p.ChatCompletionRequest,
    )
    assert chat.max_completion_tokens == 5 and not chat.separate_reasoning and chat.temperature == 1.0


@pytest.mark.parametrize(
    "body, where",
    [
        (b'{"prompt": "a", "temperature": 2.5}', "$.temperature"),
        (b'{"prompt": "a", "top_p": 0}', "$.top_p"),
        (b'{"prompt": "a", "n": 17}', "$.n"),
        (b'{"prompt": "a", "max_tokens": 1.0}', "$.max_tokens"),
        (b'{"prompt": "a", "logprobs": 21}', "$.logprobs"),
        (b'{"prompt": "a", "cache_salt": ""}', "$.cache_salt"),
        (b'{"prompt": "a", "stream_options": {"bogus": 1}}', "$.stream_options"),
        (b'{"prompt": "a", "seed": 9223372036854775808}', "$.seed"),
    ],
)
def test_ranges_and_types_are_in_the_declarations(body, where):
    with pytest.raises(msgspec.ValidationError) as e:
        msgspec.json.decode(body, type=p.CompletionRequest)
    assert where in str(e.value)


def test_noop_and_null_only_extensions_are_declared_with_an_accepted_default():
    structs = (p.CompletionRequest, p.ChatCompletionRequest)
    for name, allowed in p.NOOP_VALUES.items():
        owners = [s for s in structs if name in s.__struct_fields__]
        assert owners, name
        for s in owners:
            default = s.__struct_defaults__[s.__struct_fields__.index(name) - len(s.__struct_fields__)]
            assert default is None or default in allowed, (name, default)
    for name in p.NULL_ONLY:
        owners = [s for s in structs if name in s.__struct_fields__]
        assert owners, name
        for s in owners:
            assert s.__struct_defaults__[s.__struct_fields__.index(name) - len(s.__struct_fields__)] is None, name


def test_openapi_document_is_generated_from_the_structs():
    doc = openapi_document("tiny")
    assert doc["openapi"].startswith("3.1")
    schemas = doc["components"]["schemas"]
    for route, name in (
        ("/v1/completions", "CompletionRequest"),
        ("/v1/chat/completions", "ChatCompletionRequest"),
        ("/tokenize", "TokenizeRequest"),
        ("/detokenize", "DetokenizeRequest"),
    ):
        body = doc["paths"][route]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{name}"}
        assert set(schemas[name]["properties"]) == set(getattr(p, name).__struct_fields__)
    temp = schemas["CompletionRequest"]["properties"]["temperature"]
    assert (temp["minimum"], temp["maximum"], temp["default"]) == (0.0, 2.0, 1.0)
    assert schemas["CompletionRequest"]["required"] == ["prompt"]
    assert schemas["ChatCompletionRequest"]["required"] == ["messages"]


def test_openapi_document_lists_every_route_of_the_app():
    from kimi.controller.http.anthropic import MESSAGES_FIELDS
    from kimi.controller.http.server import OpenAIServer

    doc = openapi_document("tiny")
    # the routes as the server declares them (its Starlette app is built in __init__; read the source's Route lines)
    src = inspect.getsource(OpenAIServer)
    declared = {(m, path) for path, m in re.findall(r'Route\("([^"]+)", [^,]+, methods=\["([A-Z]+)"\]\)', src)}
    assert len(declared) >= 15
    for method, path in declared:
        if path == "/openapi.json":
            continue
        path = path.replace(":path}", "}")
        assert method.lower() in doc["paths"].get(path, {}), (method, path)
    msg = doc["paths"]["/v1/messages"]["post"]
    body = msg["requestBody"]["content"]["application/json"]["schema"]
    assert set(body["properties"]) == MESSAGES_FIELDS and body["required"] == ["model", "max_tokens", "messages"]
    assert msg["responses"]["400"]["content"]["application/json"]["schema"]["properties"]["type"] == {"const": "error"}


def test_docs_name_every_declared_field():
    named = set(re.findall(r"`([a-z_]+)`", DOCS))
    for s in (p.CompletionRequest, p.ChatCompletionRequest, p.TokenizeRequest, p.DetokenizeRequest, p.StreamOptions):
        missing = [f for f in s.__struct_fields__ if f not in named]
        assert not missing, (s.__name__, missing)


def test_decode_struct_fills_every_declared_field_or_refuses():
    body = p.decode_struct(
        b'{"prompt": [1, 2], "temperature": 0, "stream": true, "stream_options": {"include_usage": true}}',
        p.CompletionRequest,
    )
    assert body is not None and set(body) == set(p.CompletionRequest.__struct_fields__)
    assert body["prompt"] == [1, 2] and body["temperature"] == 0.0 and body["n"] == 1
    assert body["stream_options"] == {"include_usage": True}  # a plain dict, only the fields sent
    for bad in (
        b'{"prompt": "a", "frobnicate": 1}',  # undeclared: the readers name it (unknown field)
        b'{"prompt": "a", "max_tokens": true}',  # a boolean is not an integer
        b'{"prompt": "a", "top_k": 1.0}',
        b'{"prompt": "a", "temperature": NaN}',  # json accepts the literal; the reader then says "not finite"
        b'{"prompt": "a", "stop_token_ids": [-1]}',
        b'{"prompt": "a"',  # malformed
        b'{"messages": []}',  # chat's field on /v1/completions
    ):
        assert p.decode_struct(bad, p.CompletionRequest) is None, bad
    assert p.decode_struct(b'{"messages": []}', p.ChatCompletionRequest) is None  # min_length 1
    chat = p.decode_struct(b'{"messages": [{"role": "user", "content": "hi"}]}', p.ChatCompletionRequest)
    assert chat is not None and chat["messages"] == [{"role": "user", "content": "hi"}]
    assert chat["parallel_tool_calls"] is True and chat["add_generation_prompt"] is True
