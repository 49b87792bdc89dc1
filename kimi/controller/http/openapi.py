"""`GET /openapi.json`: an OpenAPI 3.1 document generated from the request Structs (kimi.controller.http.protocol)."""

from __future__ import annotations

from typing import Any

import msgspec

import kimi
from kimi.controller.http.anthropic import COUNT_TOKENS_FIELDS, MESSAGES_FIELDS
from kimi.controller.http.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from kimi.controller.http.responses import RESPONSES_FIELDS

_ERROR = {
    "type": "object",
    "description": "the OpenAI error schema; `param` names the offending field",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string", "enum": ["invalid_request_error", "server_error"]},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
            "required": ["message", "type", "param", "code"],
        }
    },
    "required": ["error"],
}


_CHUNKS = "`data: <chunk>` events, `[DONE]`"


def _post(summary: str, body_ref: dict[str, Any], streams: bool, events: str = _CHUNKS) -> dict[str, Any]:
    ok: dict[str, Any] = {"application/json": {"schema": {"type": "object"}}}
    if streams:
        ok["text/event-stream"] = {"schema": {"type": "string", "description": events}}
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": body_ref}}},
            "responses": {
                "200": {"description": "OK", "content": ok},
                "400": {"description": "a bad field", "content": {"application/json": {"schema": _ERROR}}},
                "404": {"description": "an unknown model", "content": {"application/json": {"schema": _ERROR}}},
            },
        }
    }


def _anthropic_post(summary: str, body: dict[str, Any], streams: bool) -> dict[str, Any]:
    route = _post(
        summary, body, streams, "`event: <type>` + `data: <object>` events, ending with message_stop or error"
    )
    for code in ("400", "404"):
        route["post"]["responses"][code]["content"]["application/json"]["schema"] = _ANTHROPIC_ERROR
    return route


def _get(summary: str) -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {"200": {"description": "OK"}}}}


_ANTHROPIC_ERROR = {
    "type": "object",
    "description": "Anthropic's error schema",
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
            "required": ["type", "message"],
        },
    },
    "required": ["type", "error"],
}


def _fields_body(fields: frozenset[str], required: list[str], doc: str) -> dict[str, Any]:
    """The schema of a body checked field by field in its route's module (the field names it accepts; their
    shapes are in docs/api.md)."""
    return {
        "type": "object",
        "description": doc,
        "properties": {k: {} for k in sorted(fields)},
        "required": required,
        "additionalProperties": False,
    }


def _stored_response(summary: str, method: str, ok: str) -> dict[str, Any]:
    return {
        method: {
            "summary": summary,
            "parameters": [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {
                "200": {"description": ok},
                "404": {"description": "not stored", "content": {"application/json": {"schema": _ERROR}}},
            },
        }
    }


def openapi_document(served_model_name: str) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the server's routes: request bodies from the Structs (their fields, JSON types,
    ranges, defaults and descriptions), the OpenAI error schema for 4xx answers."""
    refs, components = msgspec.json.schema_components(
        [CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest],
        ref_template="#/components/schemas/{name}",
    )
    completion, chat, tokenize, detokenize = refs
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "kimi",
            "version": kimi.__version__,
            "description": f"OpenAI-compatible API serving {served_model_name!r} (docs/api.md)",
        },
        "paths": {
            "/v1/completions": _post(
                "text completions; a batch of prompts gives one choice per prompt and n", completion, True
            ),
            "/v1/chat/completions": _post("chat completions", chat, True),
            "/v1/messages": _anthropic_post(
                "the Anthropic Messages API",
                _fields_body(MESSAGES_FIELDS, ["model", "max_tokens", "messages"], "an Anthropic Messages request"),
                True,
            ),
            "/v1/messages/count_tokens": _anthropic_post(
                "the input tokens of a Messages request",
                _fields_body(COUNT_TOKENS_FIELDS, ["model", "messages"], "the prompt fields of a Messages request"),
                False,
            ),
            "/v1/responses": _post(
                "the OpenAI Responses API",
                _fields_body(RESPONSES_FIELDS, ["model", "input"], "a Responses request"),
                True,
                "`event: <type>` + `data: <object>` events with a sequence_number, ending with response.completed, "
                "response.incomplete or response.failed",
            ),
            "/v1/responses/{response_id}": {
                **_stored_response("a stored response object", "get", "the response object"),
                **_stored_response("forget a stored response", "delete", "deleted"),
            },
            "/v1/responses/{response_id}/input_items": _stored_response(
                "the input items of a stored response (order, limit, after)", "get", "a list object"
            ),
            "/tokenize": _post("token ids of a prompt or of chat messages (vLLM)", tokenize, False),
            "/detokenize": _post("the text of token ids (vLLM)", detokenize, False),
            "/v1/models": _get("the served model"),
            "/v1/models/{model_id}": _get("the served model by id"),
            "/tokenizer_info": _get("the tokenizer's configuration (vLLM)"),
            "/version": _get("kimi's version"),
            "/health": _get("ok, loading (503) or error (503)"),
            "/metrics": _get("Prometheus metrics"),
        },
        "components": {"schemas": {**components, "Error": _ERROR, "AnthropicError": _ANTHROPIC_ERROR}},
    }
