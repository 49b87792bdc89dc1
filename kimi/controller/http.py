"""OpenAI-compatible HTTP routes (Starlette), served by uvicorn inside the controller's event loop.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (both non-streaming and SSE streaming ending
with `data: [DONE]`), `GET /v1/models`, `GET /health` ("loading" with 503 until the workers are ready).
Bad input gets a 400 in the OpenAI error schema naming the field (kimi.controller.validation); an accepted
request always ends with a finish_reason or an error.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kimi.controller.chat import encode_chat
from kimi.controller.engine import AdmissionError, Engine, EngineDead
from kimi.controller.request import StopParams
from kimi.controller.validation import BadRequest, Fields
from kimi.protocol import RequestOutput, SamplingParams
from kimi.tokenizer import KimiTokenizer

MAX_BODY_BYTES = 32 << 20


def error_response(e: BadRequest) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


@dataclass
class GenerationArgs:
    """The validated, model-facing part of a completions / chat request."""

    prompt_token_ids: list[int]
    sampling: SamplingParams
    stop: StopParams
    skip_special_tokens: bool
    stream: bool
    include_usage: bool


class OpenAIServer:
    """Builds the Starlette app around an Engine."""

    def __init__(self, engine: Engine, tokenizer: KimiTokenizer, served_model_name: str, vocab_size: int) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = served_model_name
        self.vocab_size = vocab_size
        self.created = int(time.time())
        self.app = Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            ],
            exception_handlers={404: self._not_found, 405: self._not_allowed},
        )

    # ---- small routes -----------------------------------------------------------------------------------
    async def _not_found(self, request: HTTPRequest, exc: Exception) -> JSONResponse:
        return error_response(BadRequest(f"no route {request.method} {request.url.path}", None, status=404))

    async def _not_allowed(self, request: HTTPRequest, exc: Exception) -> JSONResponse:
        return error_response(BadRequest(f"method {request.method} not allowed on {request.url.path}", None, status=405))

    async def health(self, request: HTTPRequest) -> Response:
        if self.engine.fatal_error is not None:
            return JSONResponse({"status": "error", "error": self.engine.fatal_error}, status_code=503)
        if not self.engine.ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def models(self, request: HTTPRequest) -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model_name,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "kimi",
                        "max_model_len": self.engine.max_model_len,
                    }
                ],
            }
        )

    # ---- shared parsing ---------------------------------------------------------------------------------------
    async def _body(self, request: HTTPRequest) -> Fields:
        if not self.engine.ready or self.engine.fatal_error is not None:
            msg = self.engine.fatal_error or "the server is still loading the model"
            raise BadRequest(msg, None, status=503)
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise BadRequest(f"request body larger than {MAX_BODY_BYTES} bytes", None, status=413)
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"the request body is not valid JSON: {e}", None) from e
        f = Fields(body)
        model = f.str("model", required=True)
        if model != self.model_name:
            raise BadRequest(f"the model '{model}' does not exist; this server serves '{self.model_name}'", "model", code="model_not_found")
        return f

    def _common(self, f: Fields, prompt_token_ids: list[int], max_tokens_default: int | None) -> GenerationArgs:
        temperature = f.float("temperature", 1.0, lambda v: 0.0 <= v <= 2.0, "in [0, 2]")
        top_p = f.float("top_p", 1.0, lambda v: 0.0 < v <= 1.0, "in (0, 1]")
        top_k = f.int("top_k", 0, lo=-1)
        if top_k == -1:
            top_k = 0
        seed = f.int("seed", None, lo=-(2**63), hi=2**63 - 1)
        f.noop("n", (1,), "> 1 is not supported yet")
        f.noop("best_of", (1,), "> 1 is not supported")
        f.noop("presence_penalty", (0, 0.0), "is not supported yet")
        f.noop("frequency_penalty", (0, 0.0), "is not supported yet")
        f.noop("repetition_penalty", (1, 1.0), "is not supported yet")
        f.noop("min_p", (0, 0.0), "is not supported yet")
        f.noop("min_tokens", (0,), "is not supported yet")
        f.noop("logit_bias", ({},), "is not supported yet")
        f.noop("stop", ([], ""), "(stop strings) is not supported yet; use stop_token_ids")
        f.noop("include_stop_str_in_output", (False,), "is not supported yet")
        f.accept("user")
        stream = f.bool("stream", False)
        so = f._get("stream_options")
        include_usage = False
        if so is not None:
            if not stream:
                raise BadRequest("'stream_options' is only allowed with stream=true", "stream_options")
            sof = Fields(so, "stream_options")
            include_usage = sof.bool("include_usage", False)
            sof.noop("continuous_usage_stats", (False,), "is not supported")
            try:
                sof.reject_unknown()
            except BadRequest as e:
                raise BadRequest(e.message, f"stream_options.{e.param}") from None
        stop_ids = f.int_list("stop_token_ids", 0, self.vocab_size)
        ignore_eos = f.bool("ignore_eos", False)
        skip_special = f.bool("skip_special_tokens", True)
        n = len(prompt_token_ids)
        if max_tokens_default is None:
            max_tokens_default = max(1, self.engine.max_model_len - n)
        max_tokens = f.int("max_tokens", None, lo=1)
        if f.has("max_completion_tokens"):
            max_tokens = f.int("max_completion_tokens", None, lo=1)
        else:
            f.accept("max_completion_tokens")
        if max_tokens is None:
            max_tokens = max_tokens_default
        return GenerationArgs(
            prompt_token_ids=prompt_token_ids,
            sampling=SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, num_logprobs=-1),
            stop=StopParams(max_tokens=max_tokens, stop_token_ids=frozenset(stop_ids), ignore_eos=ignore_eos),
            skip_special_tokens=skip_special,
            stream=stream,
            include_usage=include_usage,
        )

    async def _start(self, request_id: str, g: GenerationArgs) -> AsyncIterator[RequestOutput]:
        try:
            return await self.engine.generate(request_id, g.prompt_token_ids, g.sampling, g.stop, g.skip_special_tokens)
        except AdmissionError as e:
            raise BadRequest(str(e), e.param) from None
        except EngineDead as e:
            raise BadRequest(str(e), None, status=503) from None

    @staticmethod
    def _usage(n_prompt: int, n_out: int) -> dict[str, int]:
        return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}

    async def _collect(self, request: HTTPRequest, stream: AsyncIterator[RequestOutput]) -> tuple[list[RequestOutput], str | None]:
        """Run a non-streaming request to its end; abort it if the client goes away first."""
        outs: list[RequestOutput] = []

        async def consume() -> None:
            async for o in stream:
                outs.append(o)

        task = asyncio.ensure_future(consume())
        try:
            while not task.done():
                done, _ = await asyncio.wait({task}, timeout=0.5)
                if not done and await request.is_disconnected():
                    task.cancel()
                    await stream.aclose()
                    return outs, "client disconnected"
            task.result()
        finally:
            if not task.done():
                task.cancel()
        err = outs[-1].error if outs else "no output"
        return outs, err

    def _sse(self, chunks: AsyncIterator[dict[str, Any]], stream: AsyncIterator[RequestOutput]) -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            try:
                async for c in chunks:
                    yield b"data: " + json.dumps(c, ensure_ascii=False).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"
            finally:
                await stream.aclose()  # aborts the request if it has not finished (client gone)

        return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @staticmethod
    def _error_chunk(message: str) -> dict[str, Any]:
        return {"error": {"message": message, "type": "server_error", "param": None, "code": None}}

    # ---- /v1/completions ----------------------------------------------------------------------------------------
    async def completions(self, request: HTTPRequest) -> Response:
        try:
            f = await self._body(request)
            prompt = f._get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]  # a batch of one
            if isinstance(prompt, str):
                if prompt == "":
                    raise BadRequest("'prompt' must not be empty", "prompt")
                ids = self.tokenizer.encode(prompt)
            elif isinstance(prompt, list) and prompt and all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
                ids = list(prompt)
                bad = [x for x in ids if not 0 <= x < self.vocab_size]
                if bad:
                    raise BadRequest(f"'prompt' holds token id {bad[0]}, outside [0, {self.vocab_size})", "prompt")
            elif prompt is None:
                raise BadRequest("'prompt' is required", "prompt")
            elif isinstance(prompt, list) and not prompt:
                raise BadRequest("'prompt' must not be empty", "prompt")
            elif isinstance(prompt, list):
                raise BadRequest("'prompt' must be a string, a list of token ids, or a batch of one of those", "prompt")
            else:
                raise BadRequest("'prompt' must be a string or a list of token ids", "prompt")
            f.noop("echo", (False,), "is not supported yet")
            f.noop("logprobs", (), "is not supported yet")
            f.noop("suffix", ("",), "is not supported")
            g = self._common(f, ids, max_tokens_default=16)
            f.reject_unknown()
            rid = f"cmpl-{uuid.uuid4().hex}"
            stream = await self._start(rid, g)
        except BadRequest as e:
            return error_response(e)
        created = int(time.time())
        base = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name}
        n_prompt = len(g.prompt_token_ids)

        if not g.stream:
            outs, err = await self._collect(request, stream)
            if err is not None:
                return error_response(BadRequest(err, None, status=500))
            last = outs[-1]
            text = "".join(o.text for o in outs)
            return JSONResponse(
                {
                    **base,
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason}],
                    "usage": self._usage(n_prompt, last.num_output_tokens),
                }
            )

        async def chunks() -> AsyncIterator[dict[str, Any]]:
            n_out = 0
            async for o in stream:
                n_out = o.num_output_tokens
                if o.error is not None:
                    yield self._error_chunk(o.error)
                    return
                if o.text or o.finished:
                    yield {**base, "choices": [{"index": 0, "text": o.text, "logprobs": None, "finish_reason": o.finish_reason}]}
            if g.include_usage:
                yield {**base, "choices": [], "usage": self._usage(n_prompt, n_out)}

        return self._sse(chunks(), stream)

    # ---- /v1/chat/completions ------------------------------------------------------------------------------------
    async def chat_completions(self, request: HTTPRequest) -> Response:
        try:
            f = await self._body(request)
            messages = f._get("messages")
            tools = f._get("tools")
            if tools is not None:
                raise BadRequest("'tools' is not supported yet", "tools")
            f.noop("tool_choice", ("none",), "is not supported yet (no tools)")
            f.noop("parallel_tool_calls", (True, False), "")
            f.noop("logprobs", (False,), "is not supported yet")
            f.noop("top_logprobs", (0,), "is not supported yet")
            rf = f._get("response_format")
            if rf is not None and rf != {"type": "text"}:
                raise BadRequest("'response_format' other than {'type': 'text'} is not supported", "response_format")
            kwargs = f._get("chat_template_kwargs")
            if kwargs is not None and not isinstance(kwargs, dict):
                raise BadRequest("'chat_template_kwargs' must be an object", "chat_template_kwargs")
            ids = encode_chat(self.tokenizer, messages, None, kwargs or {})
            g = self._common(f, ids, max_tokens_default=None)
            f.reject_unknown()
            rid = f"chatcmpl-{uuid.uuid4().hex}"
            stream = await self._start(rid, g)
        except BadRequest as e:
            return error_response(e)
        created = int(time.time())
        base = {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name}
        n_prompt = len(g.prompt_token_ids)

        if not g.stream:
            outs, err = await self._collect(request, stream)
            if err is not None:
                return error_response(BadRequest(err, None, status=500))
            last = outs[-1]
            text = "".join(o.text for o in outs)
            return JSONResponse(
                {
                    **base,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": text},
                            "logprobs": None,
                            "finish_reason": last.finish_reason,
                        }
                    ],
                    "usage": self._usage(n_prompt, last.num_output_tokens),
                }
            )

        chunk_base = {**base, "object": "chat.completion.chunk"}

        async def chunks() -> AsyncIterator[dict[str, Any]]:
            yield {**chunk_base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}
            n_out = 0
            async for o in stream:
                n_out = o.num_output_tokens
                if o.error is not None:
                    yield self._error_chunk(o.error)
                    return
                if o.text:
                    yield {**chunk_base, "choices": [{"index": 0, "delta": {"content": o.text}, "logprobs": None, "finish_reason": None}]}
                if o.finished:
                    yield {**chunk_base, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": o.finish_reason}]}
            if g.include_usage:
                yield {**chunk_base, "choices": [], "usage": self._usage(n_prompt, n_out)}

        return self._sse(chunks(), stream)
