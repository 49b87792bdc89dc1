"""`GET /openapi.json`: an OpenAPI 3.1 document generated from the request Structs (kimi.controller.http.protocol)."""

from __future__ import annotations

from typing import Any

import msgspec

import kimi
from kimi.controller.http.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

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


def _post(summary: str, body_ref: dict[str, Any], streams: bool) -> dict[str, Any]:
    ok: dict[str, Any] = {"application/json": {"schema": {"type": "object"}}}
    if streams:
        ok["text/event-stream"] = {"schema": {"type": "string", "description": "`data: <chunk>` events, `[DONE]`"}}
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


def _get(summary: str) -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {"200": {"description": "OK"}}}}


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
            "/tokenize": _post("token ids of a prompt or of chat messages (vLLM)", tokenize, False),
            "/detokenize": _post("the text of token ids (vLLM)", detokenize, False),
            "/v1/models": _get("the served model"),
            "/v1/models/{model_id}": _get("the served model by id"),
            "/tokenizer_info": _get("the tokenizer's configuration (vLLM)"),
            "/version": _get("kimi's version"),
            "/health": _get("ok, loading (503) or error (503)"),
            "/metrics": _get("Prometheus metrics"),
        },
        "components": {"schemas": {**components, "Error": _ERROR}},
    }
