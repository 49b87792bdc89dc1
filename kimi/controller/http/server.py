"""The OpenAI server's Starlette app: its routes, authentication and the small routes."""

from __future__ import annotations

import hmac
import time
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kimi.controller.engine import Engine
from kimi.controller.http.anthropic import AnthropicAPI, anthropic_error
from kimi.controller.http.common import MAX_BODY_BYTES, _decode_or_none, error_response
from kimi.controller.http.completions import CompletionsAPI
from kimi.controller.http.models import ModelsAPI
from kimi.controller.http.openapi import openapi_document
from kimi.controller.http.responses import ResponsesAPI, ResponseStore
from kimi.controller.http.streaming import RAW_SEND
from kimi.controller.http.tokenize import TokenizeAPI
from kimi.controller.metrics import CONTENT_TYPE, Metrics
from kimi.controller.parsers import MARKER_TEXT
from kimi.controller.validation import BadRequest
from kimi.tokenizer import KimiTokenizer


class _Auth:
    """The outermost ASGI app: records the server's `send` in the scope (RAW_SEND, for _SSE); with an api_key,
    every HTTP route but /health needs `Authorization: Bearer <key>` (the scheme in any case, RFC 7235) or
    Anthropic's `x-api-key: <key>`; the /v1/messages routes answer a missing key with Anthropic's error body."""

    def __init__(self, app: Any, api_key: str | None) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope[RAW_SEND] = send  # streaming bodies bypass Starlette's send wrappers (_SSE)
        if self.api_key and scope["type"] == "http" and scope["path"] != "/health":
            got = x_api_key = b""
            for k, v in scope.get("headers", []):
                if k == b"authorization":
                    got = v
                elif k == b"x-api-key":
                    x_api_key = v
            # `<scheme> 1*SP <credentials>`; the scheme is case-insensitive (RFC 7235 section 2.1)
            scheme, _, cred = got.strip().partition(b" ")
            key = self.api_key.encode()
            key_ok = hmac.compare_digest(cred.lstrip(b" "), key) and scheme.lower() == b"bearer"
            if x_api_key:  # Anthropic's header
                key_ok = key_ok or hmac.compare_digest(x_api_key.strip(), key)
            if not key_ok:
                msg = "missing or invalid API key (send 'Authorization: Bearer <key>' or 'x-api-key: <key>')"
                if scope["path"].startswith("/v1/messages"):
                    resp = anthropic_error(msg, 401)
                else:
                    resp = JSONResponse(
                        {
                            "error": {
                                "message": msg,
                                "type": "invalid_request_error",
                                "param": None,
                                "code": "invalid_api_key",
                            }
                        },
                        status_code=401,
                    )
                resp.headers["WWW-Authenticate"] = "Bearer"
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


class OpenAIServer(CompletionsAPI, AnthropicAPI, ResponsesAPI, TokenizeAPI, ModelsAPI):
    """Builds the Starlette app around an Engine (`.app` is the ASGI app to serve).

    api_key: None = no authentication. max_body_bytes: larger request bodies get a 413. body_timeout_s: a body
    not fully received this many seconds after the headers gets a 408 (a client that sends fewer bytes than its
    Content-Length holds no request slot or KV, but would otherwise hold a connection forever). thinking_model:
    chat output starts in reasoning (`reasoning_content`) unless `chat_template_kwargs.thinking` is false.
    chat_max_tokens: the `max_tokens` of a chat request that sends none (generation_config.json's
    `max_new_tokens`); None: the rest of the context. Either is clamped to what the context leaves.
    model_root: what `/v1/models` reports as the model's `root` (the `--model` path, as vLLM; default: the name).
    Attaches a `Metrics` to the engine (`engine.observer`).
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer: KimiTokenizer,
        served_model_name: str,
        vocab_size: int,
        *,
        api_key: str | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
        body_timeout_s: float = 30.0,
        thinking_model: bool = False,
        chat_max_tokens: int | None = None,
        model_root: str | None = None,
    ) -> None:
        self.engine = engine
        self.model_root = model_root or served_model_name
        self.chat_max_tokens = chat_max_tokens
        self.tokenizer = tokenizer
        self.model_name = served_model_name
        self.vocab_size = vocab_size
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.thinking_model = thinking_model
        # the served vocabulary's text of the reasoning / tool marker ids, where it is not the parser's default
        # (K2-Instruct's names 163606 / 163607 <|reserved_token_...|>): left out of the fields with skip_special_tokens
        # false as well
        self._marker_text = (
            tuple(
                (t, x)
                for t, x in ((t, _decode_or_none(tokenizer, t)) for t in MARKER_TEXT)
                if x is not None and x != MARKER_TEXT[t]
            )
            or None
        )
        self.created = int(time.time())
        self._openapi: dict[str, Any] | None = None
        self.response_store = ResponseStore()
        self.metrics = Metrics(engine)
        engine.observer = self.metrics
        self.starlette = Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics_route, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/messages", self.messages, methods=["POST"]),
                Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
                Route("/v1/responses", self.responses, methods=["POST"]),
                Route("/v1/responses/{response_id}", self.get_response, methods=["GET"]),
                Route("/v1/responses/{response_id}", self.delete_response, methods=["DELETE"]),
                Route("/v1/responses/{response_id}/input_items", self.response_input_items, methods=["GET"]),
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"]),
                Route("/tokenizer_info", self.tokenizer_info, methods=["GET"]),
                Route("/version", self.version, methods=["GET"]),
                Route("/openapi.json", self.openapi, methods=["GET"]),
            ],
            exception_handlers={404: self._not_found, 405: self._not_allowed},
        )
        self.app = _Auth(self.starlette, api_key)

    # ---- small routes -----------------------------------------------------------------------------------
    async def _not_found(self, request: HTTPRequest, exc: Exception) -> JSONResponse:
        return self._route_error(request, f"no route {request.method} {request.url.path}", 404)

    async def _not_allowed(self, request: HTTPRequest, exc: Exception) -> JSONResponse:
        return self._route_error(request, f"method {request.method} not allowed on {request.url.path}", 405)

    @staticmethod
    def _route_error(request: HTTPRequest, message: str, status: int) -> JSONResponse:
        """A routing refusal in the path's error schema: Anthropic's under /v1/messages, else OpenAI's."""
        if request.url.path.startswith("/v1/messages"):
            return anthropic_error(message, status)
        return error_response(BadRequest(message, None, status=status))

    async def health(self, request: HTTPRequest) -> Response:
        if self.engine.fatal_error is not None:
            return JSONResponse({"status": "error", "error": self.engine.fatal_error}, status_code=503)
        if not self.engine.ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def openapi(self, request: HTTPRequest) -> Response:
        """`GET /openapi.json`, generated from the request Structs once (kimi.controller.http.openapi)."""
        if self._openapi is None:
            self._openapi = openapi_document(self.model_name)
        return JSONResponse(self._openapi)

    async def metrics_route(self, request: HTTPRequest) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)
