"""OpenAI-compatible HTTP routes (Starlette), served by uvicorn inside the controller's event loop.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (both non-streaming and SSE streaming ending
with `data: [DONE]`), `GET /v1/models`, `GET /metrics` (Prometheus), `GET /health` ("loading" with 503
until the workers are ready). Every accepted field, its range and what is rejected: docs/api.md.

- Honor or reject: every request field is implemented or rejected with a 400 in the OpenAI error schema
  whose `param` names it (kimi.controller.validation); an accepted request always ends with a
  finish_reason or an error.
- `n > 1` runs n sibling requests with the same prompt (ids `<id>-0` .. `<id>-{n-1}`); the prefix cache
  shares the prompt's KV between them. With a seed, sibling i uses seed + i.
- A client that disconnects (streaming or not) has all its requests aborted at once (their KV blocks are
  freed before the next step is planned).
- `api_key`: every route but /health needs `Authorization: Bearer <key>` (401 otherwise).
- Request bodies larger than `max_body_bytes` get a 413 (read no further).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import math
import re
import sys
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from json.encoder import encode_basestring  # what json.dumps(ensure_ascii=False) uses for every str (C)
from typing import Any

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import kimi
from kimi.controller.admission import admission_message, admission_param
from kimi.controller.chat import encode_chat, no_other_keys, validate_tools
from kimi.controller.engine import AdmissionError, Engine, EngineDead
from kimi.controller.metrics import CONTENT_TYPE, Metrics
from kimi.controller.offload import run_sized
from kimi.controller.params import MAX_LOGPROBS, sampling_params
from kimi.controller.parsers import MARKER_TEXT, OutputParser, ParserConfig, ParserDelta, ReleasedTextFeeder
from kimi.controller.request import OutputStream, Request, StopParams
from kimi.controller.validation import BadRequest, Fields, check_prompt_text_fits, first_path, json_path
from kimi.protocol import RequestOutput, SamplingParams
from kimi.tokenizer import IncrementalDetokenizer, KimiTokenizer

MAX_BODY_BYTES = 32 << 20
MAX_N = 16
# fields one endpoint takes and the other does not: a 400 for one of them names the endpoint that takes it
CHAT_ONLY_FIELDS = frozenset(
    {
        "messages",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "top_logprobs",
        "response_format",
        "chat_template_kwargs",
        "modalities",
    }
)
COMPLETIONS_ONLY_FIELDS = frozenset({"prompt", "suffix"})
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")  # OpenAI's values
LOGPROB_FLOOR = -9999.0  # -inf logprobs are reported as this (JSON has no infinity), as vLLM does
RAW_SEND = "kimi.raw_send"  # scope key: the server's own ASGI `send`, set by _Auth (see _SSE)

log = logging.getLogger("kimi.http")


def error_response(e: BadRequest, headers: dict[str, str] | None = None) -> JSONResponse:
    """The OpenAI error body with e.status."""
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def _finite(x: float | None) -> float | None:
    if x is None:
        return None
    if math.isnan(x):
        return LOGPROB_FLOOR
    return max(x, LOGPROB_FLOOR) if x != math.inf else 0.0


@dataclass
class GenerationArgs:
    """The validated, model-facing part of a completions / chat request."""

    prompt_token_ids: list[int]
    sampling: SamplingParams
    stop: StopParams
    skip_special_tokens: bool
    stream: bool
    include_usage: bool
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (with include_usage): usage on every chunk
    return_token_ids: bool = False  # vLLM: prompt_token_ids and each choice's token_ids in the response
    priority: int = 0  # the scheduler's order under --scheduling-policy priority (lower first)
    cache_salt: str | None = None  # prefix-cache isolation (vLLM): blocks are shared only under the same salt
    n: int = 1
    logprobs: int | None = None  # completions: top-k count; chat: top_logprobs count (None = off)
    echo: bool = False
    max_tokens_field: str = "max_tokens"  # the request field max_tokens came from, named in errors about it
    # /v1/completions batches: every prompt's token ids ([prompt_token_ids] when empty); choice i is prompt i // n
    prompts: list[list[int]] = field(default_factory=list)

    @property
    def all_prompts(self) -> list[list[int]]:
        """The prompts' token ids, one list per prompt (one prompt unless a /v1/completions batch)."""
        return self.prompts or [self.prompt_token_ids]


@dataclass
class _Choice:
    """Accumulated state of one choice (one sibling request)."""

    index: int
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top_ids: list[list[int] | None] = field(default_factory=list)
    top_logprobs: list[list[float] | None] = field(default_factory=list)
    last: RequestOutput | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_ids: list[list[int] | None] | None = None
    prompt_top_logprobs: list[list[float] | None] | None = None
    parser: OutputParser | None = None
    outputs: list[RequestOutput] = field(default_factory=list)
    request: Request | None = None  # the engine's request (chat: its stop_held attributes held-back text)
    feeder: ReleasedTextFeeder | None = None

    @property
    def final(self) -> RequestOutput:
        """The last output; set for every choice once `_collect` has returned None."""
        assert self.last is not None, "the choice has no output yet"
        return self.last

    def add(self, o: RequestOutput) -> None:
        self.last = o
        self.outputs.append(o)
        self.token_ids.extend(o.token_ids)
        self.text.append(o.text)
        for j in range(len(o.token_ids)):
            self.logprobs.append(o.logprobs[j] if o.logprobs else None)
            self.top_ids.append(o.top_ids[j] if o.top_ids else None)
            self.top_logprobs.append(o.top_logprobs[j] if o.top_logprobs else None)
        if o.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_top_ids, self.prompt_top_logprobs = (
                o.prompt_logprobs,
                o.prompt_top_ids,
                o.prompt_top_logprobs,
            )

    def parse(self, o: RequestOutput) -> ParserDelta:
        """Chat: feed output o (one token) to the parser; with stop strings, text the controller held back and
        released with a later token goes to the parser with the token that produced it (ReleasedTextFeeder)."""
        assert self.parser is not None
        held = self.request.stop_held if self.request is not None else None
        if held is None:
            return self.parser.feed(o.token_ids[0], o.text)
        if self.feeder is None:
            self.feeder = ReleasedTextFeeder(self.parser)
        k = o.num_output_tokens
        return self.feeder.feed(o.token_ids[0], o.text, held[k - 2] if k >= 2 else 0, held[k - 1], last=o.finished)

    def note(self, o: RequestOutput) -> None:
        """Streaming: keep only what later chunks need (the last output, the prompt logprobs); the streamed
        deltas are not accumulated (`add` does that for non-streaming responses)."""
        self.last = o
        if o.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_top_ids, self.prompt_top_logprobs = (
                o.prompt_logprobs,
                o.prompt_top_ids,
                o.prompt_top_logprobs,
            )


def _token_logprobs(o: RequestOutput) -> tuple[list[float | None], list[list[int] | None], list[list[float] | None]]:
    """Per token of `o`: its logprob, top ids and top logprobs (None where not reported), as `_Choice.add`
    accumulates them."""
    n = len(o.token_ids)
    lps: list[float | None] = list(o.logprobs) if o.logprobs else [None] * n
    tops: list[list[int] | None] = list(o.top_ids) if o.top_ids else [None] * n
    top_lps: list[list[float] | None] = list(o.top_logprobs) if o.top_logprobs else [None] * n
    return lps, tops, top_lps


def sse_event(chunk: dict[str, Any]) -> bytes:
    """One SSE event: `data: <json>` and a blank line (json.dumps defaults, non-ASCII kept as UTF-8)."""
    return b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n"


_SLOT = "\x00kimi-slot\x00"


class _EventTemplate:
    """The bytes of `sse_event(chunk)` around one string field (or several fields holding the same string), for
    chunks that differ only in that string.

    `template(i)` is the chunk for choice i with `_SLOT` as the variable string; `fill(i, text)` returns
    exactly `sse_event(template(i) with text in the slot)`: the prefix and suffix bytes are cut from the
    encoded template once per choice index and the string is escaped by json's own encoder, so a streamed
    token costs one C call and two concatenations instead of a dict copy and a json.dumps
    (tests/unit/test_controller_fast_paths.py checks byte equality).
    """

    def __init__(self, template: Any) -> None:
        self.template = template
        self._parts: dict[int, tuple[bytes, bytes]] = {}
        self._many: dict[int, list[bytes]] = {}  # templates with the slot in several fields: the bytes around them

    def _split(self, i: int) -> tuple[bytes, bytes]:
        raw = sse_event(self.template(i))
        pieces = raw.split(encode_basestring(_SLOT).encode())
        if len(pieces) > 2:
            self._many[i] = pieces
        pre, post = pieces[0], pieces[-1]
        self._parts[i] = (pre, post)
        return pre, post

    def parts(self, i: int) -> tuple[bytes, bytes]:
        """The bytes before and after the string for choice i (a template with one slot)."""
        return self._parts.get(i) or self._split(i)

    def fill(self, i: int, text: str) -> bytes:
        pre, post = self._parts.get(i) or self._split(i)
        many = self._many.get(i)
        if many is not None:  # the same string in several fields
            return encode_basestring(text).encode().join(many)
        return pre + encode_basestring(text).encode() + post


class _Siblings:
    """n engine streams merged into one async iterator of (choice index, list of RequestOutput).

    Each stream is an `Engine.generate_batches` iterator (the deltas of one engine step come as one list);
    `outputs` are the requests' OutputStreams, in the same order.
    `close()` aborts every sibling that has not finished (client gone, error) and is idempotent.
    """

    def __init__(
        self,
        engine: Engine,
        ids: list[str],
        streams: list[AsyncGenerator[list[RequestOutput], None]],
        outputs: list[OutputStream] | None = None,
        requests: list[Request] | None = None,
    ) -> None:
        self.engine = engine
        self.ids = ids
        self.streams = streams
        self.outputs = outputs or []  # the requests' OutputStreams (for _SSE's synchronous sink)
        self.requests = requests or []  # the engine's Request objects, in the same order
        self.queue: asyncio.Queue[tuple[int, list[RequestOutput] | None]] = asyncio.Queue()
        self.tasks: list[asyncio.Task[None]] = []
        self.closed = False

    async def _pump(self, i: int) -> None:
        try:
            async for batch in self.streams[i]:
                self.queue.put_nowait((i, batch))
        finally:
            self.queue.put_nowait((i, None))

    async def __aiter__(self) -> AsyncIterator[tuple[int, list[RequestOutput]]]:
        if len(self.streams) == 1:  # the common case: no merge queue, no pump task (one hop less per step)
            async for batch in self.streams[0]:
                yield 0, batch
            return
        self.tasks = [asyncio.ensure_future(self._pump(i)) for i in range(len(self.streams))]
        live = len(self.streams)
        while live:
            i, got = await self.queue.get()
            if got is None:
                live -= 1
                continue
            yield i, got

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for rid in self.ids:
            self.engine.abort(rid)
        for t in self.tasks:
            if not t.done():
                t.cancel()
        for s in self.streams:
            try:
                await s.aclose()
            except Exception:
                pass


async def until_disconnect(receive: Any) -> None:
    """Return when the ASGI `receive` callable reports that the client went away."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


class _BodyWriter:
    """Synchronous writes of response body chunks straight to the HTTP connection (no ASGI `send`).

    `attach(send)` recognises uvicorn's own `send` (a bound `RequestResponseCycle.send` of its h11 or
    httptools protocol) once the response has started with chunked transfer encoding, and returns a writer
    for it; otherwise (another server, HTTP/1.0 framing, internals that changed) it returns None and the
    caller keeps using `send`. `write(data)` frames `data` as one HTTP/1.1 chunk (`<hex len>\\r\\n<data>\\r\\n`,
    exactly what h11's ChunkedWriter and uvicorn's httptools protocol write for a body message) and hands it
    to the transport; `ready()` is False while uvicorn would make `send` wait (the client reads slowly and
    the transport paused writing) or drop the data (disconnected, response complete), and the caller must
    then go through `send`. The end of the body (`more_body: False`) always goes through `send`, so the
    server's own bookkeeping (keep-alive, the next request) is unchanged.
    """

    __slots__ = ("cycle", "flow", "transport")

    def __init__(self, cycle: Any) -> None:
        self.cycle = cycle
        self.flow = cycle.flow
        self.transport = cycle.transport

    @classmethod
    def attach(cls, send: Any) -> _BodyWriter | None:
        cycle = getattr(send, "__self__", None)
        if cycle is None or type(cycle).__name__ != "RequestResponseCycle":
            return None
        mod = type(cycle).__module__
        try:
            if not cycle.response_started or cycle.response_complete or cycle.scope["method"] == "HEAD":
                return None
            if mod == "uvicorn.protocols.http.h11_impl":
                chunked = type(cycle.conn._writer).__name__ == "ChunkedWriter"
            elif mod == "uvicorn.protocols.http.httptools_impl":
                chunked = cycle.chunked_encoding is True
            else:
                return None
            if not chunked or not hasattr(cycle.flow, "write_paused") or not hasattr(cycle, "disconnected"):
                return None
            return cls(cycle)
        except (AttributeError, KeyError, TypeError):
            return None

    def ready(self) -> bool:
        c = self.cycle
        return not (c.disconnected or c.response_complete or self.flow.write_paused)

    def write(self, data: bytes) -> None:
        if data:
            self.transport.write(b"%x\r\n%b\r\n" % (len(data), data))


class _SSE:
    """An ASGI text/event-stream response that watches for the client's disconnect while it streams.

    The events come from `render(i, output) -> (bytes, end)`: the encoded SSE events for one output of
    choice i (b"" for none) and whether the stream ends with it (an error). `first` is sent before any
    output (chat: the role chunks), `tail()` after the last (the usage chunk, or b""), then `data: [DONE]`.
    On disconnect (or any end) the requests are aborted (`siblings.close()`), so their KV blocks are freed
    at once rather than when the next chunk fails to send.

    Delivery. A task reads the engine's outputs (`Engine.generate_batches`: the deltas of one engine step
    arrive as one list, written with one `send`). For a single choice on uvicorn's HTTP/1.1 chunked
    streaming, the common outputs skip the task altogether: a sink on the request's OutputStream renders
    each non-final output and writes it to the connection synchronously (`_BodyWriter`) from the engine's
    step, as long as the task is idle (so order is kept) and the connection is writable. The final output,
    errors, a paused (slow) client and every other case take the task, which sends through the server's
    own `send` (`scope[RAW_SEND]`, set by `_Auth`, the outermost ASGI app) rather than through Starlette's
    two exception-middleware wrappers, which only record that the response started. The wire bytes are the
    same either way. An exception after the response started is logged here and the server closes the
    connection (the response is incomplete), which is what the wrappers would have led to.
    """

    def __init__(
        self,
        siblings: _Siblings,
        render: Any,
        first: bytes = b"",
        tail: Any = None,
        text_only: tuple[_Choice, _EventTemplate] | None = None,
    ) -> None:
        self.siblings = siblings
        self.render = render
        self.first = first
        self.tail = tail
        # (choice, template): every non-final output without prompt logprobs renders as template.fill(0, text)
        # (plain completions); the sink then does that itself instead of calling render
        self.text_only = text_only

    async def _chunks(self) -> AsyncGenerator[bytes, None]:
        if self.first:
            yield self.first
        render = self.render
        async for i, batch in self.siblings:
            if len(batch) == 1:
                data, end = render(i, batch[0])
            else:
                parts = []
                end = False
                for o in batch:
                    d, end = render(i, o)
                    parts.append(d)
                    if end:
                        break
                data = b"".join(parts)
            if data:
                yield data
            if end:
                return
        if self.tail is not None:
            data = self.tail()
            if data:
                yield data

    def _sink(self, writer: _BodyWriter) -> Any:
        render = self.render
        cycle, flow, write = writer.cycle, writer.flow, writer.transport.write  # _BodyWriter.ready / write, inlined

        if self.text_only is not None:
            choice, template = self.text_only
            pre, post = template.parts(0)

            def text_sink(o: RequestOutput) -> bool:  # render + sink below, fused for the commonest stream
                if (
                    o.finished
                    or o.error is not None
                    or o.prompt_logprobs is not None
                    or cycle.disconnected
                    or cycle.response_complete
                    or flow.write_paused
                ):
                    return False
                choice.last = o
                text = o.text
                if text:
                    data = pre + encode_basestring(text).encode() + post
                    write(b"%x\r\n%b\r\n" % (len(data), data))
                return True

            return text_sink

        def sink(o: RequestOutput) -> bool:
            if o.finished or o.error is not None or cycle.disconnected or cycle.response_complete or flow.write_paused:
                return False
            data, _ = render(0, o)
            if data:
                write(b"%x\r\n%b\r\n" % (len(data), data))
            return True

        return sink

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        raw = scope.get(RAW_SEND)
        started = False
        chunks = self._chunks()
        stream = self.siblings.outputs[0] if len(self.siblings.outputs) == 1 else None

        async def produce() -> None:
            nonlocal started
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"text/event-stream; charset=utf-8"),
                        (b"cache-control", b"no-cache"),
                    ],
                }
            )
            started = True
            out = raw or send
            if raw is not None and stream is not None:
                writer = _BodyWriter.attach(raw)
                if writer is not None:
                    stream.sink = self._sink(writer)
            async for data in chunks:
                await out({"type": "http.response.body", "body": data, "more_body": True})
            await out({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

        prod = asyncio.ensure_future(produce())
        watcher = asyncio.ensure_future(until_disconnect(receive))
        try:
            await asyncio.wait({prod, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if stream is not None:
                stream.sink = None
            for t in (prod, watcher):
                if not t.done():
                    t.cancel()
            await asyncio.gather(prod, watcher, return_exceptions=True)
            await self.siblings.close()
            try:
                await chunks.aclose()
            except Exception:
                pass
        exc = prod.exception() if prod.done() and not prod.cancelled() else None
        if exc is not None and not isinstance(exc, OSError):
            if raw is not None and started:
                log.error("streaming response failed after it started", exc_info=exc)
                return
            raise exc


class _Auth:
    """The outermost ASGI app: records the server's `send` in the scope (RAW_SEND, for _SSE); with an api_key,
    every HTTP route but /health needs `Authorization: Bearer <key>` (the scheme in any case, RFC 7235)."""

    def __init__(self, app: Any, api_key: str | None) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope[RAW_SEND] = send  # streaming bodies bypass Starlette's send wrappers (_SSE)
        if self.api_key and scope["type"] == "http" and scope["path"] != "/health":
            got = b""
            for k, v in scope.get("headers", []):
                if k == b"authorization":
                    got = v
            # `<scheme> 1*SP <credentials>`; the scheme is case-insensitive (RFC 7235 section 2.1)
            scheme, _, cred = got.strip().partition(b" ")
            key_ok = hmac.compare_digest(cred.lstrip(b" "), self.api_key.encode())
            if not (key_ok and scheme.lower() == b"bearer"):
                resp = JSONResponse(
                    {
                        "error": {
                            "message": "missing or invalid API key (send 'Authorization: Bearer <key>')",
                            "type": "invalid_request_error",
                            "param": None,
                            "code": "invalid_api_key",
                        }
                    },
                    status_code=401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _echo_text(messages: list[dict[str, Any]]) -> str:
    """Chat `echo` (vLLM): the final message's text when it is an assistant message (the reply continues it), else
    "". `messages` has been validated (content: a string, text parts or null)."""
    last = messages[-1]
    if last.get("role") != "assistant":
        return ""
    c = last.get("content")
    if isinstance(c, list):
        return "".join(part["text"] for part in c)
    return c or ""


def _decode_or_none(tokenizer: KimiTokenizer, token_id: int) -> str | None:
    """The text of one token id, or None when the vocabulary has no such id."""
    try:
        return tokenizer.decode([token_id])
    except ValueError:
        return None


class OpenAIServer:
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
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"]),
                Route("/tokenizer_info", self.tokenizer_info, methods=["GET"]),
                Route("/version", self.version, methods=["GET"]),
            ],
            exception_handlers={404: self._not_found, 405: self._not_allowed},
        )
        self.app = _Auth(self.starlette, api_key)

    # ---- small routes -----------------------------------------------------------------------------------
    async def _not_found(self, request: HTTPRequest, exc: Exception) -> JSONResponse:
        return error_response(BadRequest(f"no route {request.method} {request.url.path}", None, status=404))

    async def _not_allowed(self, request: HTTPRequest, exc: Exception) -> JSONResponse:
        return error_response(
            BadRequest(f"method {request.method} not allowed on {request.url.path}", None, status=405)
        )

    async def health(self, request: HTTPRequest) -> Response:
        if self.engine.fatal_error is not None:
            return JSONResponse({"status": "error", "error": self.engine.fatal_error}, status_code=503)
        if not self.engine.ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics_route(self, request: HTTPRequest) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "kimi",
            "root": self.model_root,
            "parent": None,
            "max_model_len": self.engine.max_model_len,
        }

    async def models(self, request: HTTPRequest) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: HTTPRequest) -> Response:
        """`GET /v1/models/{id}` (the openai client's `models.retrieve`): the served model, else a 404."""
        model_id = request.path_params["model_id"]
        if model_id != self.model_name:
            return error_response(
                BadRequest(
                    f"the model '{model_id}' does not exist; this server serves '{self.model_name}'",
                    None,
                    status=404,
                    code="model_not_found",
                )
            )
        return JSONResponse(self._model_card())

    async def version(self, request: HTTPRequest) -> Response:
        """`GET /version`: `{"version": kimi's package version}` (vLLM's shape)."""
        return JSONResponse({"version": kimi.__version__})

    async def tokenizer_info(self, request: HTTPRequest) -> Response:
        """`GET /tokenizer_info`: the tokenizer's configuration as vLLM serves it (lm-eval's `remote` tokenizer
        reads `eos_token`, `bos_token`, `pad_token` and `chat_template` from it)."""
        t = self.tokenizer
        return JSONResponse(
            {
                "tokenizer_class": "TikTokenTokenizer",
                "bos_token": t.bos_token,
                "eos_token": t.eos_token,
                "pad_token": t.pad_token,
                "chat_template": t.chat_template,
                "model_max_length": self.engine.max_model_len,
                "vocab_size": t.vocab_size,
            }
        )

    async def tokenize(self, request: HTTPRequest) -> Response:
        """`POST /tokenize` (vLLM's request and response): `prompt` (a string, encoded with control-token strings
        recognised, as vLLM's HF tokenizers do) or chat `messages` (rendered and encoded exactly as
        /v1/chat/completions does) -> `{count, max_model_len, tokens, token_strs}`."""
        try:
            f = await self._body(request, need_engine=False)
            has_prompt, has_messages = f.has("prompt"), f.has("messages")
            if has_prompt == has_messages:
                raise BadRequest("give exactly one of 'prompt' and 'messages'", "prompt" if has_prompt else "messages")
            f.bool("add_special_tokens", not has_messages)  # Kimi's tokenizer adds no BOS / EOS either way
            strs = f.bool("return_token_strs", False)
            if has_prompt:
                prompt = f.str("prompt")
                assert prompt is not None
                ids = await run_sized(len(prompt), self.tokenizer.encode, prompt, True)
            else:
                tools, _, _ = self._tool_args(f)
                kwargs = self._template_kwargs(f)
                add_gen, cont = self._generation_prompt_args(f)
                for name, why in (
                    ("chat_template", "the checkpoint's template is used"),
                    ("mm_processor_kwargs", "this server takes text only"),
                ):
                    if f._get(name) is not None:
                        raise BadRequest(f"'{name}' is not supported ({why}); send null or leave it out", name)
                ids = await run_sized(
                    f.body_bytes,
                    encode_chat,
                    self.tokenizer,
                    f._get("messages"),
                    tools,
                    kwargs,
                    None,
                    add_gen,
                    cont,
                )
            f.reject_unknown()
        except BadRequest as e:
            return error_response(e)
        return JSONResponse(
            {
                "count": len(ids),
                "max_model_len": self.engine.max_model_len,
                "tokens": ids,
                "token_strs": [self._token_str(t) for t in ids] if strs else None,
            }
        )

    async def detokenize(self, request: HTTPRequest) -> Response:
        """`POST /detokenize` (vLLM's request and response): `tokens` (ids in the vocabulary) -> `{prompt}`,
        special tokens included."""
        try:
            f = await self._body(request, need_engine=False)
            tokens = f._get("tokens")
            if tokens is None:
                raise BadRequest("'tokens' is required", "tokens")
            ids = f.int_list("tokens", 0, self.vocab_size)
            f.reject_unknown()
        except BadRequest as e:
            return error_response(e)
        return JSONResponse({"prompt": self.tokenizer.decode(ids)})

    # ---- shared parsing ---------------------------------------------------------------------------------------
    async def _body(self, request: HTTPRequest, need_engine: bool = True) -> Fields:
        """The request's JSON object (size, time and model checked). need_engine: a 503 until the workers are
        ready and after a failure (the generation routes; the tokenizer routes answer meanwhile)."""
        if need_engine and (not self.engine.ready or self.engine.fatal_error is not None):
            msg = self.engine.fatal_error or "the server is still loading the model"
            raise BadRequest(msg, None, status=503)
        too_big = BadRequest(f"request body larger than {self.max_body_bytes} bytes", None, status=413)
        cl = request.headers.get("content-length")
        if cl is not None and cl.isdigit() and int(cl) > self.max_body_bytes:
            raise too_big
        parts: list[bytes] = []

        async def read() -> None:
            size = 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > self.max_body_bytes:
                    raise too_big
                parts.append(chunk)

        try:
            await asyncio.wait_for(read(), self.body_timeout_s)
        except ClientDisconnect:
            raise BadRequest("the client disconnected while sending the request body", None) from None
        except asyncio.TimeoutError:
            raise BadRequest(
                f"the request body was not received within {self.body_timeout_s:g} s", None, status=408
            ) from None
        raw = b"".join(parts)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadRequest(f"the request body is not valid UTF-8: {e}", None) from None
        body = _decode_body(text)
        f = Fields(body)
        f.body_bytes = len(raw)
        model = f.str("model") or self.model_name  # absent, null or "": the served model (as vLLM)
        if model != self.model_name:
            raise BadRequest(
                f"the model '{model}' does not exist; this server serves '{self.model_name}'",
                "model",
                status=404,
                code="model_not_found",
            )  # 404 as OpenAI and vLLM (openai.NotFoundError)
        return f

    def _common(
        self,
        f: Fields,
        prompt_token_ids: list[int],
        max_tokens_default: int | None,
        logprobs: int | None,
        prompt_logprobs: int,
    ) -> GenerationArgs:
        # the HTTP-only fields, then the sampling and stop fields, read as the ZeroMQ submit API reads them
        # (kimi.controller.params.sampling_params)
        n = f.int("n", 1, lo=1, hi=MAX_N)
        f.noop("best_of", (n,), "must equal n (best-of sampling is not supported)")
        f.str("user")
        # OpenAI platform fields at their defaults change nothing here: accepted; other values are refused
        f.noop("store", (False,), "is not supported (this server stores no completions)")
        f.noop("service_tier", ("auto", "default"), "is not supported (this server has one service tier)")
        if not isinstance(f._get("metadata"), (dict, type(None))):  # informational tags (OpenAI stores them): ignored
            raise BadRequest("'metadata' must be an object", "metadata")
        stream = f.bool("stream", False)
        so = f._get("stream_options")
        include_usage = continuous_usage = False
        if so is not None:
            if not stream:
                raise BadRequest("'stream_options' is only allowed with stream=true", "stream_options")
            sof = Fields(so, "stream_options", "stream_options")
            try:  # errors name the nested field, e.g. stream_options.include_usage
                include_usage = sof.bool("include_usage", False)
                continuous_usage = sof.bool("continuous_usage_stats", False) and include_usage
                sof.reject_unknown()
            except BadRequest as e:
                raise BadRequest(
                    e.message.replace(f"'{e.param}'", f"'stream_options.{e.param}'"), f"stream_options.{e.param}"
                ) from None
        return_token_ids = f.bool("return_token_ids", False)
        priority = f.int("priority", 0)
        cache_salt = f.str("cache_salt")
        if cache_salt == "":
            raise BadRequest("'cache_salt' must be a non-empty string", "cache_salt")
        # a default max_tokens never makes a request inadmissible: it is clamped to what max_model_len and the
        # KV cache (which can be smaller) leave after this prompt (an explicit max_tokens is checked as sent)
        room = max(1, min(self.engine.max_model_len, self.engine.kv_capacity_tokens) - len(prompt_token_ids))
        rp = sampling_params(
            f,
            vocab_size=self.vocab_size,
            eos_token_ids=self.engine.eos_token_ids,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            max_tokens_default=room if max_tokens_default is None else min(max_tokens_default, room),
        )
        return GenerationArgs(
            prompt_token_ids=prompt_token_ids,
            sampling=rp.sampling,
            stop=rp.stop,
            skip_special_tokens=rp.skip_special_tokens,
            stream=stream,
            include_usage=include_usage,
            continuous_usage=continuous_usage,
            return_token_ids=return_token_ids,
            priority=priority,
            cache_salt=cache_salt,
            n=n,
            logprobs=logprobs,
            max_tokens_field=rp.max_tokens_field,
        )

    @staticmethod
    def _prompt_logprobs(f: Fields) -> int | None:
        """vLLM's `prompt_logprobs`: None (off) or k in [0, MAX_LOGPROBS], the top-k per prompt position."""
        return f.int("prompt_logprobs", None, lo=0, hi=MAX_LOGPROBS)

    @staticmethod
    def _check_stream_extras(g: GenerationArgs, k_prompt: int | None) -> None:
        """`prompt_logprobs` with `stream: true` is a 400 (vLLM refuses it too)."""
        if k_prompt is not None and g.stream:
            raise BadRequest("'prompt_logprobs' is not available with stream=true", "prompt_logprobs")

    def _vllm_prompt_logprobs(
        self,
        ids: list[int],
        lps: list[float | None] | None,
        tops: list[list[int] | None] | None,
        top_lps: list[list[float] | None] | None,
    ) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's `prompt_logprobs`: per prompt position None (the first: no context) or {token id (a JSON key):
        {logprob, rank, decoded_token}} holding the prompt's token first, then the top-k. `rank` is 1-based among
        the top-k, null for a prompt token outside them."""
        out: list[dict[str, dict[str, Any]] | None] = []
        for j, tid in enumerate(ids):
            lp = lps[j] if lps is not None and j < len(lps) else None
            if lp is None:
                out.append(None)
                continue
            alts = list(zip(tops[j] or [], top_lps[j] or [])) if tops is not None and top_lps is not None else []
            rank = next((r for r, (t, _) in enumerate(alts, 1) if t == tid), None)
            entry = {str(tid): {"logprob": _finite(lp), "rank": rank, "decoded_token": self._token_str(tid)}}
            for r, (t, v) in enumerate(alts, 1):
                entry.setdefault(str(t), {"logprob": _finite(v), "rank": r, "decoded_token": self._token_str(t)})
            out.append(entry)
        return out

    async def _start(self, request_id: str, g: GenerationArgs, prompt_field: str = "prompt") -> _Siblings:
        """Admit the n siblings of every prompt (all or none: a failure aborts those already admitted); choice
        i = prompt i // n, sibling i % n (OpenAI's order for a batch). prompt_field: the request field the prompt
        came from, named in errors about it ("messages" for chat; `prompt[i]` for prompt i of a batch).

        The choices wait in the queue together, so more than max_waiting of them could never be admitted: that is
        a 400 (not the retryable 503 of a full queue, which a client following Retry-After would retry forever)."""
        prompts = g.all_prompts
        total = g.n * len(prompts)
        if total > self.engine.max_waiting:
            what = f"'n' ({g.n})" if len(prompts) == 1 else f"{len(prompts)} prompts x 'n' ({g.n})"
            raise BadRequest(
                f"{what} exceeds this server's queue capacity of {self.engine.max_waiting} "
                f"requests (--max-waiting): the {total} choices can never be queued together; "
                f"send at most {self.engine.max_waiting} choices",
                "n" if g.n > self.engine.max_waiting or len(prompts) == 1 else "prompt",
            )
        ids: list[str] = []
        streams: list[AsyncGenerator[list[RequestOutput], None]] = []
        outputs: list[OutputStream] = []
        reqs: list[Request] = []
        pi = 0
        try:
            for pi in range(len(prompts)):
                prompt_ids = prompts[pi]
                leader: str | None = None
                for j in range(g.n):
                    sp = g.sampling
                    if g.n > 1 and sp.seed is not None:
                        sp = _replace(sp, seed=(sp.seed + j + 2**63) % 2**64 - 2**63)
                    rid = request_id if total == 1 else f"{request_id}-{len(ids)}"
                    streams.append(
                        await self.engine.generate_batches(
                            rid,
                            prompt_ids,
                            sp,
                            g.stop,
                            g.skip_special_tokens,
                            leader=leader,
                            priority=g.priority,
                            cache_salt=g.cache_salt,
                        )
                    )
                    leader = leader or rid
                    ids.append(rid)
                    reqs.append(self.engine.requests[rid])
                    outputs.append(reqs[-1].outputs)
        except AdmissionError as e:
            for rid in ids:
                self.engine.abort(rid)
            retry = getattr(e, "retry_after_s", None)
            if len(prompts) > 1 and prompt_field == "prompt":
                prompt_field = f"prompt[{pi}]"
            param = admission_param(e, prompt_field, g.max_tokens_field)
            msg = admission_message(e, g.max_tokens_field)
            if retry is not None:
                raise BadRequest(msg, param, status=503) from None
            raise BadRequest(msg, param) from None
        except EngineDead as e:
            for rid in ids:
                self.engine.abort(rid)
            raise BadRequest(str(e), None, status=503) from None
        return _Siblings(self.engine, ids, streams, outputs, reqs)

    @staticmethod
    def _usage(n_prompt: int, n_out: int, n_cached: int) -> dict[str, Any]:
        return {
            "prompt_tokens": n_prompt,
            "completion_tokens": n_out,
            "total_tokens": n_prompt + n_out,
            "prompt_tokens_details": {"cached_tokens": n_cached},
        }

    def _usage_of(self, g: GenerationArgs, choices: list[_Choice]) -> dict[str, Any]:
        """Usage of the whole request: every prompt counted once (not per choice), output tokens summed over the
        choices, cached tokens of each prompt's first choice."""
        n_out = sum(c.last.num_output_tokens if c.last else 0 for c in choices)
        firsts = [choices[i * g.n] for i in range(len(g.all_prompts)) if i * g.n < len(choices)]
        cached = sum(c.last.num_cached_tokens for c in firsts if c.last)
        return self._usage(sum(len(p) for p in g.all_prompts), n_out, cached)

    @staticmethod
    def _chunk_usage(n_prompt: int, o: RequestOutput | None) -> dict[str, int]:
        """`usage` of one streamed chunk with continuous_usage_stats (vLLM's shape): the choice's prompt and the
        tokens it has generated so far."""
        n_out = o.num_output_tokens if o is not None else 0
        return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}

    async def _collect(self, request: HTTPRequest, sib: _Siblings, choices: list[_Choice]) -> str | None:
        """Run a non-streaming request to its end; abort it at once if the client goes away first.

        Returns an error message, or None when every choice finished normally.
        """

        async def consume() -> None:
            async for i, batch in sib:
                c = choices[i]
                for o in batch:
                    c.add(o)

        task = asyncio.ensure_future(consume())
        watcher = asyncio.ensure_future(until_disconnect(request.receive))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                return "client disconnected"
            task.result()
        finally:
            for t in (task, watcher):
                if not t.done():
                    t.cancel()
            await sib.close()
        for c in choices:
            if c.last is None:
                return "no output"
            if c.last.error is not None:
                return c.last.error
        return None

    @staticmethod
    def _error_chunk(message: str) -> dict[str, Any]:
        return {"error": {"message": message, "type": "server_error", "param": None, "code": None}}

    def _token_str(self, tid: int) -> str:
        return self.tokenizer.decode([tid])

    def _token_bytes(self, tid: int) -> list[int]:
        try:
            return list(self.tokenizer.id_to_bytes(tid))
        except Exception:
            return []

    # ---- /v1/completions ----------------------------------------------------------------------------------------
    def _completion_logprobs(
        self,
        ids: list[int],
        lps: list[float | None],
        tops: list[list[int] | None],
        top_lps: list[list[float] | None],
        offsets: list[int],
    ) -> dict[str, Any]:
        """Legacy completions logprobs: tokens, token_logprobs, top_logprobs (per token a dict of the top-k
        alternatives plus the chosen token, as vLLM; None where the logprob is unknown), text_offset.

        `tokens[i]` is `tokenizer.decode([id])` (U+FFFD for a token holding only part of a UTF-8 character).
        `offsets` (one per id, from `_prompt_offsets` / `_piece_offsets`) become text_offset: see there."""
        tokens: list[str] = []
        tl: list[dict[str, float | None] | None] = []
        for j, tid in enumerate(ids):
            s = self._token_str(tid)
            tokens.append(s)
            if lps[j] is None:
                tl.append(None)
                continue
            d: dict[str, float | None] = {}
            top_ids, top_values = tops[j], top_lps[j]
            if top_ids is not None and top_values is not None:
                d = {self._token_str(t): _finite(v) for t, v in zip(top_ids, top_values)}
            d.setdefault(s, _finite(lps[j]))
            tl.append(d)
        return {
            "tokens": tokens,
            "token_logprobs": [_finite(x) for x in lps],
            "top_logprobs": tl,
            "text_offset": list(offsets),
        }

    # text_offset rule (non-streaming and streaming alike, so that the streamed chunks' text_offset lists
    # concatenate to the non-streaming one): text_offset[i] is the character offset (Python str index, i.e.
    # code points) in the whole returned text -- echoed prompt + completion, as concatenated in the response;
    # in a stream, the text of all chunks so far, echoed prompt included -- at which the piece of text that
    # token i completes starts. A token's piece is what the incremental UTF-8 detokenizer emits once that
    # token's bytes are added: a token ending mid-character has an empty piece (at the offset where the
    # character will start), the token completing it has the whole character. So offsets never decrease,
    # and wherever every token is whole characters (tokens[i] == its piece), text_offset[i] ==
    # len("".join(tokens[:i])) (+ len(prompt) for completion tokens when echoing), as vLLM's cumulative token
    # lengths. Text held back for a possible stop string does not move a token: the offset is where its piece
    # starts in the whole text (in a stream it can point past the text sent so far, until the held-back text
    # follows). The tokens of a request's last output are clamped to the final text's length (a stop string cut
    # off the text leaves its tokens at the cut), the same in a stream and out of one.
    def _prompt_offsets(self, ids: list[int], text: str) -> list[int]:
        """text_offset of the echoed prompt tokens `ids`, whose returned text is `text` (0-based)."""
        detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=False)
        out, pos, n = [], 0, len(text)
        for tid in ids:
            out.append(min(pos, n))
            pos += len(detok.push(tid))
        return out

    def _piece_offsets(self, skip_special_tokens: bool, first: int) -> Callable[[RequestOutput, int], list[int]]:
        """A function (o, start) -> text_offset of the tokens of engine output `o`, whose text delta starts at
        offset `start`, for one choice's outputs in order: each token at the end of the earlier tokens' pieces
        (`first` for the first token: 0, or the echoed prompt's length); in the last output (finished) clamped to
        start + len(o.text), the final text's length. The pieces come from an IncrementalDetokenizer with the
        request's skip_special_tokens, i.e. the engine's own text before any hold-back (see the rule above)."""
        detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=skip_special_tokens)
        pos = first

        def offsets(o: RequestOutput, start: int) -> list[int]:
            nonlocal pos
            out, end = [], start + len(o.text)
            for tid in o.token_ids:
                out.append(min(pos, end) if o.finished else pos)
                pos += len(detok.push(tid))
            return out

        return offsets

    async def _completion_prompt(self, prompt: Any, param: str) -> tuple[list[int], str]:
        """One completion prompt (a non-empty string or list of token ids) -> (token ids, its text); raises
        BadRequest naming `param` (`prompt`, or `prompt[i]` in a batch)."""
        if isinstance(prompt, str):
            if prompt == "":
                raise BadRequest(f"'{param}' must not be empty", param)
            check_prompt_text_fits(self.tokenizer, prompt, self.engine.max_model_len, param)
            ids = await run_sized(len(prompt), self.tokenizer.encode, prompt)  # large: off the event loop
            return ids, prompt
        if isinstance(prompt, list) and prompt and all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
            bad = [x for x in prompt if not 0 <= x < self.vocab_size]
            if bad:
                raise BadRequest(f"'{param}' holds token id {bad[0]}, outside [0, {self.vocab_size})", param)
            return list(prompt), self.tokenizer.decode(prompt)
        if isinstance(prompt, list) and not prompt:
            raise BadRequest(f"'{param}' must not be empty", param)
        if isinstance(prompt, list):
            item = next(x for x in prompt if not isinstance(x, int) or isinstance(x, bool))
            raise BadRequest(f"'{param}' must be a string or a list of integer token ids; it holds {item!r:.40}", param)
        raise BadRequest(f"'{param}' must be a string or a list of token ids", param)

    async def _completion_prompts(self, prompt: Any) -> tuple[list[list[int]], list[str]]:
        """`prompt`: a string, a list of token ids, or a batch (a non-empty list of either) -> (token ids, text)
        per prompt. A list whose first item is a string or a list is a batch."""
        if prompt is None:
            raise BadRequest("'prompt' is required", "prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            ids, texts = [], []
            for i, p in enumerate(prompt):
                if not isinstance(p, (str, list)):
                    raise BadRequest(
                        f"'prompt[{i}]' must be a string or a list of token ids (every prompt of a batch)",
                        f"prompt[{i}]",
                    )
                one, text = await self._completion_prompt(p, f"prompt[{i}]")
                ids.append(one)
                texts.append(text)
            return ids, texts
        one, text = await self._completion_prompt(prompt, "prompt")
        return [one], [text]

    async def completions(self, request: HTTPRequest) -> Response | _SSE:
        try:
            f = await self._body(request)
            prompts, prompt_texts = await self._completion_prompts(f._get("prompt"))
            echo = f.bool("echo", False)
            logprobs = f.int("logprobs", None, lo=0, hi=MAX_LOGPROBS)
            f.noop("suffix", ("",), "is not supported")
            k_prompt = self._prompt_logprobs(f)
            k_echo = logprobs if echo and logprobs is not None else -1
            g = self._common(
                f,
                max(prompts, key=len),  # a default max_tokens is clamped to what the longest prompt leaves
                max_tokens_default=16,
                logprobs=logprobs,
                prompt_logprobs=max(k_echo, -1 if k_prompt is None else k_prompt),
            )
            self._check_stream_extras(g, k_prompt)
            g.prompts = prompts
            g.echo = echo
            f.reject_unknown(("/v1/chat/completions", CHAT_ONLY_FIELDS))
            rid = f"cmpl-{uuid.uuid4().hex}"
            sib = await self._start(rid, g)
        except BadRequest as e:
            return error_response(e, {"Retry-After": "1"} if e.status == 503 else None)
        created = int(time.time())
        base = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name}
        choices = [_Choice(i, r) for i, r in enumerate(sib.ids)]
        n = g.n

        def echo_logprobs(c: _Choice) -> dict[str, Any]:
            ids = prompts[c.index // n]
            k = len(ids)
            plp = c.prompt_logprobs or [None] * k
            ptid = c.prompt_top_ids or [None] * k
            ptlp = c.prompt_top_logprobs or [None] * k
            if k_echo < max(k_echo, k_prompt or 0):  # the worker sent prompt_logprobs' larger top-k
                ptid = [None if t is None else t[:k_echo] for t in ptid]
                ptlp = [None if t is None else t[:k_echo] for t in ptlp]
            return self._completion_logprobs(
                ids, plp, ptid, ptlp, self._prompt_offsets(ids, prompt_texts[c.index // n])
            )

        if not g.stream:
            err = await self._collect(request, sib, choices)
            if err is not None:  # an error ending a request because the server shuts down is retryable
                return error_response(BadRequest(err, None, status=503 if err == self.engine.closing else 500))
            out = []
            for c in choices:
                prompt_text = prompt_texts[c.index // n]
                text = "".join(c.text)
                lp = None
                if g.logprobs is not None:
                    pos = len(prompt_text) if echo else 0
                    place = self._piece_offsets(g.skip_special_tokens, pos)
                    offs: list[int] = []
                    for o in c.outputs:  # the same offsets as the streamed chunks (see _prompt_offsets)
                        offs.extend(place(o, pos))
                        pos += len(o.text)
                    lp = self._completion_logprobs(c.token_ids, c.logprobs, c.top_ids, c.top_logprobs, offs)
                    if echo:
                        prompt_lp = echo_logprobs(c)
                        lp = {k: prompt_lp[k] + lp[k] for k in lp}
                if echo:
                    text = prompt_text + text
                choice: dict[str, Any] = {
                    "index": c.index,
                    "text": text,
                    "logprobs": lp,
                    "finish_reason": c.final.finish_reason,
                    "stop_reason": c.final.stop_reason,
                }
                if k_prompt is not None:
                    choice["prompt_logprobs"] = self._vllm_prompt_logprobs(
                        prompts[c.index // n], c.prompt_logprobs, c.prompt_top_ids, c.prompt_top_logprobs
                    )
                if g.return_token_ids:
                    choice["prompt_token_ids"] = prompts[c.index // n]
                    choice["token_ids"] = c.token_ids
                out.append(choice)
            return JSONResponse({**base, "choices": out, "usage": self._usage_of(g, choices)})

        if g.include_usage:  # OpenAI: with include_usage every chunk has "usage", null until the last one
            base["usage"] = None
        text_event = _EventTemplate(
            lambda i: {
                **base,
                "choices": [{"index": i, "text": _SLOT, "logprobs": None, "finish_reason": None, "stop_reason": None}],
            }
        )
        offsets = [len(prompt_texts[i // n]) if echo else 0 for i in range(len(choices))]
        echoed = [False] * len(choices)
        continuous = g.continuous_usage
        token_ids_out = g.return_token_ids
        plain = g.logprobs is None and not continuous and not token_ids_out  # chunks that differ only in their text
        started = [False] * len(choices)
        places = (
            [self._piece_offsets(g.skip_special_tokens, offsets[i]) for i in range(len(choices))]
            if g.logprobs is not None
            else []
        )

        def chunk(i: int, o: RequestOutput | None, ch: dict[str, Any]) -> bytes:
            if token_ids_out:  # vLLM: the prompt's ids with a choice's first chunk, every chunk's new ids
                if not started[i]:
                    started[i] = True
                    ch["prompt_token_ids"] = prompts[i // n]
                ch["token_ids"] = o.token_ids if o is not None else []
            if continuous:
                return sse_event({**base, "choices": [ch], "usage": self._chunk_usage(len(prompts[i // n]), o)})
            return sse_event({**base, "choices": [ch]})

        def render(i: int, o: RequestOutput) -> tuple[bytes, bool]:
            """SSE events for output o of choice i, and whether the stream ends with it (see _SSE)."""
            c = choices[i]
            if o.prompt_logprobs is None:
                c.last = o  # _Choice.note, inlined
            else:
                c.note(o)
            if o.error is not None:
                return sse_event(self._error_chunk(o.error)), True
            if plain and not o.finished and (echoed[i] or not echo):  # the common chunk: only the text varies
                return (text_event.fill(i, o.text) if o.text else b""), False
            events: list[bytes] = []
            if echo and not echoed[i]:
                echoed[i] = True
                lp = echo_logprobs(c) if g.logprobs is not None else None
                head = {
                    "index": i,
                    "text": prompt_texts[i // n],
                    "logprobs": lp,
                    "finish_reason": None,
                    "stop_reason": None,
                }
                events.append(chunk(i, None, head))
            lp = None
            if g.logprobs is not None and o.token_ids:
                lp = self._completion_logprobs(o.token_ids, *_token_logprobs(o), places[i](o, offsets[i]))
            offsets[i] += len(o.text)
            if o.text or o.finished or lp is not None:
                ch: dict[str, Any] = {
                    "index": i,
                    "text": o.text,
                    "logprobs": lp,
                    "finish_reason": o.finish_reason,
                    "stop_reason": o.stop_reason if o.finished else None,
                }
                events.append(chunk(i, o, ch))
            return b"".join(events), False

        def tail() -> bytes:
            return sse_event({**base, "choices": [], "usage": self._usage_of(g, choices)}) if g.include_usage else b""

        text_only = (choices[0], text_event) if plain and not echo and len(choices) == 1 else None
        return _SSE(sib, render, b"", tail, text_only)

    # ---- /v1/chat/completions ------------------------------------------------------------------------------------
    def _chat_logprobs(
        self, ids: list[int], lps: list[float | None], tops: list[list[int] | None], top_lps: list[list[float] | None]
    ) -> dict[str, Any]:
        content = []
        for j, tid in enumerate(ids):
            alts = []
            top_ids, top_values = tops[j], top_lps[j]
            if top_ids is not None and top_values is not None:
                alts = [
                    {"token": self._token_str(t), "logprob": _finite(v), "bytes": self._token_bytes(t)}
                    for t, v in zip(top_ids, top_values)
                ]
            content.append(
                {
                    "token": self._token_str(tid),
                    "logprob": _finite(lps[j]),
                    "bytes": self._token_bytes(tid),
                    "top_logprobs": alts,
                }
            )
        return {"content": content}

    def _tool_args(self, f: Fields) -> tuple[list[dict[str, Any]] | None, bool, bool]:
        """Validate tools / tool_choice / parallel_tool_calls -> (tools to render, parse calls?, parallel?)."""
        tools = f._get("tools")
        choice = f._get("tool_choice")
        parallel = f.bool("parallel_tool_calls", True)
        if tools is None:
            if choice not in (None, "none"):
                raise BadRequest("'tool_choice' needs 'tools'", "tool_choice")
            return None, False, parallel
        names = validate_tools(tools)
        if choice is None or choice in ("auto", "required"):
            return tools, True, parallel
        if choice == "none":
            return tools, False, parallel
        if isinstance(choice, dict):
            fn = choice.get("function")
            if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise BadRequest(
                    "'tool_choice' must be 'none', 'auto', 'required' or "
                    "{'type': 'function', 'function': {'name': ...}}",
                    "tool_choice",
                )
            no_other_keys(choice, ("type", "function"), "tool_choice")
            no_other_keys(fn, ("name",), "tool_choice.function")
            if fn["name"] not in names:
                raise BadRequest(f"'tool_choice' names function {fn['name']!r}, which is not in 'tools'", "tool_choice")
            return tools, True, parallel
        raise BadRequest("'tool_choice' must be 'none', 'auto', 'required' or a named function", "tool_choice")

    @staticmethod
    def _template_kwargs(f: Fields) -> dict[str, Any]:
        """`chat_template_kwargs`: an object of extra template variables, none of those the server sets."""
        kwargs = f._get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise BadRequest("'chat_template_kwargs' must be an object", "chat_template_kwargs")
        kwargs = dict(kwargs or {})
        for k in ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token"):
            if k in kwargs:  # set by the server (the last two from the tokenizer)
                raise BadRequest(
                    f"'chat_template_kwargs' must not set {k!r}: the server sets it", "chat_template_kwargs"
                )
        if "thinking" in kwargs and not isinstance(kwargs["thinking"], bool):
            raise BadRequest("'chat_template_kwargs.thinking' must be a boolean", "chat_template_kwargs.thinking")
        return kwargs

    @staticmethod
    def _generation_prompt_args(f: Fields) -> tuple[bool, bool]:
        """(`add_generation_prompt`, default true; `continue_final_message`, default false): not both true."""
        cont = f.bool("continue_final_message", False)
        add_gen = f.bool("add_generation_prompt", not cont)
        if cont and add_gen:
            raise BadRequest(
                "'continue_final_message' and 'add_generation_prompt' cannot both be true", "continue_final_message"
            )
        return add_gen, cont

    async def chat_completions(self, request: HTTPRequest) -> Response | _SSE:
        try:
            f = await self._body(request)
            messages = f._get("messages")
            tools, parse_tools, parallel = self._tool_args(f)
            want_lp = f.bool("logprobs", False)
            top = f.int("top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
            if top is not None and not want_lp:
                raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
            f.noop("modalities", (["text"],), "is not supported (this server outputs text only)")
            rf = f._get("response_format")
            if rf is not None and rf != {"type": "text"}:
                raise BadRequest("'response_format' other than {'type': 'text'} is not supported", "response_format")
            kwargs = self._template_kwargs(f)
            effort = f.str("reasoning_effort")
            if effort is not None:  # passed to the template as vLLM does (Kimi's templates do not read it)
                if effort not in REASONING_EFFORTS:
                    raise BadRequest(
                        f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r:.40}",
                        "reasoning_effort",
                    )
                kwargs.setdefault("reasoning_effort", effort)
            add_gen, cont = self._generation_prompt_args(f)
            include_reasoning = f.bool("include_reasoning", True)  # vLLM: false leaves the reasoning out
            separate_reasoning = f.bool("separate_reasoning", True)  # SGLang: false keeps it in the content
            echo = f.bool("echo", False)
            ids = await run_sized(
                f.body_bytes,
                encode_chat,
                self.tokenizer,
                messages,
                tools,
                kwargs,
                self.engine.max_model_len,
                add_gen,
                cont,
            )
            k_prompt = self._prompt_logprobs(f)
            g = self._common(
                f,
                ids,
                max_tokens_default=self.chat_max_tokens,
                logprobs=(top or 0) if want_lp else None,
                prompt_logprobs=-1 if k_prompt is None else k_prompt,
            )
            self._check_stream_extras(g, k_prompt)
            token_ids_out = g.return_token_ids
            f.reject_unknown(("/v1/completions", COMPLETIONS_ONLY_FIELDS))
            thinking = self.thinking_model and kwargs.get("thinking", True) is not False
            pcfg = ParserConfig.for_prompt(
                ids, tools=parse_tools, thinking_model=thinking, marker_text=self._marker_text
            )
            if not separate_reasoning:
                pcfg = dataclasses.replace(pcfg, thinking=False, prompt_ends_in_think=False)
            echo_text = _echo_text(messages) if echo else ""
            rid = f"chatcmpl-{uuid.uuid4().hex}"
            sib = await self._start(rid, g, prompt_field="messages")
        except BadRequest as e:
            return error_response(e, {"Retry-After": "1"} if e.status == 503 else None)
        created = int(time.time())
        base = {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name}
        choices = [
            _Choice(i, r, parser=OutputParser(pcfg), request=sib.requests[i] if sib.requests else None)
            for i, r in enumerate(sib.ids)
        ]

        def finish_reason(c: _Choice) -> str | None:
            base_reason = c.last.finish_reason if c.last else None
            if base_reason in ("stop", "length"):
                assert c.parser is not None, "every chat choice has a parser"
                return c.parser.finish_reason(base_reason)
            return base_reason

        if not g.stream:
            err = await self._collect(request, sib, choices)
            if err is not None:  # an error ending a request because the server shuts down is retryable
                return error_response(BadRequest(err, None, status=503 if err == self.engine.closing else 500))
            out = []
            for c in choices:
                content, reasoning = [], []
                p = c.parser
                assert p is not None
                tail = ""
                for o in c.outputs:
                    if not o.token_ids:
                        tail += o.text
                        continue
                    d = c.parse(o)
                    content.append(d.content)
                    reasoning.append(d.reasoning_content)
                d = p.finish(tail)
                content.append(d.content)
                reasoning.append(d.reasoning_content)
                calls = [t.to_openai() for t in p.emitted_tool_calls]  # as a stream of this output carries them
                if not parallel:
                    calls = calls[:1]
                text = echo_text + "".join(content)
                reasons = pcfg.starts_in_reasoning and include_reasoning
                thought = "".join(reasoning) if reasons else ""
                # no text beside tool calls or reasoning: null content (OpenAI's tool-call replies, vLLM's reasoning)
                msg: dict[str, Any] = {
                    "role": "assistant",
                    "content": text if (text or not (calls or thought)) else None,
                }
                if reasons:  # `reasoning`: current vLLM's name; `reasoning_content`: DeepSeek's and older vLLM's
                    msg["reasoning"] = msg["reasoning_content"] = thought or None
                if calls:
                    msg["tool_calls"] = calls
                lp = self._chat_logprobs(c.token_ids, c.logprobs, c.top_ids, c.top_logprobs) if want_lp else None
                choice: dict[str, Any] = {
                    "index": c.index,
                    "message": msg,
                    "logprobs": lp,
                    "finish_reason": finish_reason(c),
                    "stop_reason": c.final.stop_reason,
                }
                if token_ids_out:
                    choice["token_ids"] = c.token_ids
                out.append(choice)
            resp: dict[str, Any] = {**base, "choices": out, "usage": self._usage_of(g, choices)}
            if k_prompt is not None:
                c0 = choices[0]
                resp["prompt_logprobs"] = self._vllm_prompt_logprobs(
                    ids, c0.prompt_logprobs, c0.prompt_top_ids, c0.prompt_top_logprobs
                )
            if token_ids_out:
                resp["prompt_token_ids"] = ids
            return JSONResponse(resp)

        chunk_base = {**base, "object": "chat.completion.chunk"}
        if g.include_usage:  # OpenAI: with include_usage every chunk has "usage", null until the last one
            chunk_base["usage"] = None
        continuous = g.continuous_usage
        n_prompt = len(g.prompt_token_ids)
        fast = not (want_lp or continuous or token_ids_out)  # chunks that differ only in one text field

        content_event = _EventTemplate(
            lambda i: {
                **chunk_base,
                "choices": [
                    {
                        "index": i,
                        "delta": {"content": _SLOT},
                        "logprobs": None,
                        "finish_reason": None,
                        "stop_reason": None,
                    }
                ],
            }
        )
        reasoning_event = _EventTemplate(
            lambda i: {
                **chunk_base,
                "choices": [
                    {
                        "index": i,
                        "delta": {"reasoning": _SLOT, "reasoning_content": _SLOT},
                        "logprobs": None,
                        "finish_reason": None,
                        "stop_reason": None,
                    }
                ],
            }
        )

        def render(i: int, o: RequestOutput) -> tuple[bytes, bool]:
            """SSE events for output o of choice i, and whether the stream ends with it (see _SSE)."""
            c = choices[i]
            p = c.parser
            assert p is not None
            c.note(o)
            if o.error is not None:
                return sse_event(self._error_chunk(o.error)), True
            d = c.parse(o) if o.token_ids else None
            if d is not None and not o.finished and not d.tool_calls and fast:
                # the common chunks: only the content or only the reasoning text varies
                if not d.reasoning_content:
                    return (content_event.fill(i, d.content) if d.content else b""), False
                if not d.content:
                    return (reasoning_event.fill(i, d.reasoning_content) if include_reasoning else b""), False
            if o.finished:
                tail = p.finish("" if o.token_ids else o.text)
                if d is None:
                    d = tail
                else:
                    d.content += tail.content
                    d.reasoning_content += tail.reasoning_content
                    d.tool_calls += tail.tool_calls
            delta = d.to_openai() if d is not None else {}
            if "reasoning_content" in delta:
                if include_reasoning:
                    delta = {"reasoning": delta["reasoning_content"], **delta}
                else:
                    del delta["reasoning_content"]
            if not parallel and "tool_calls" in delta:
                delta["tool_calls"] = [t for t in delta["tool_calls"] if t["index"] == 0]
                if not delta["tool_calls"]:
                    del delta["tool_calls"]
            lp = None
            if want_lp and o.token_ids:
                lp = self._chat_logprobs(o.token_ids, *_token_logprobs(o))
            if delta or lp is not None or o.finished:
                ch: dict[str, Any] = {
                    "index": i,
                    "delta": delta,
                    "logprobs": lp,
                    "finish_reason": finish_reason(c) if o.finished else None,
                    "stop_reason": o.stop_reason if o.finished else None,
                }
                if token_ids_out:
                    ch["token_ids"] = o.token_ids
                if continuous:
                    return sse_event({**chunk_base, "choices": [ch], "usage": self._chunk_usage(n_prompt, o)}), False
                return sse_event({**chunk_base, "choices": [ch]}), False
            return b"", False

        def usage() -> bytes:
            return (
                sse_event({**chunk_base, "choices": [], "usage": self._usage_of(g, choices)})
                if g.include_usage
                else b""
            )

        first = b"".join(
            sse_event(
                {
                    **chunk_base,
                    "choices": [
                        {
                            "index": c.index,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                            "stop_reason": None,
                        }
                    ],
                    **({"usage": self._chunk_usage(n_prompt, None)} if continuous else {}),
                    **({"prompt_token_ids": ids} if token_ids_out else {}),
                }
            )
            + (
                sse_event(
                    {
                        **chunk_base,
                        "choices": [
                            {
                                "index": c.index,
                                "delta": {"content": echo_text},
                                "logprobs": None,
                                "finish_reason": None,
                                "stop_reason": None,
                            }
                        ],
                        **({"usage": self._chunk_usage(n_prompt, None)} if continuous else {}),
                    }
                )
                if echo_text
                else b""
            )
            for c in choices
        )
        return _SSE(sib, render, first, usage)


def _decode_body(text: str) -> Any:
    """A request body's JSON -> its value (Python's json module: a duplicate key keeps its last value).

    Raises BadRequest: malformed JSON; nesting too deep; a string holding a lone UTF-16 surrogate (a key holding one
    at the path of its object: the key itself cannot be echoed back); an integer literal longer than Python's
    int-conversion limit (sys.get_int_max_str_digits(), 4300 digits by default), which json.loads refuses for the
    whole body: the body is then parsed again, with a stand-in for such literals, to name the field. The plain parse
    runs first, so only that rare body pays a Python callback per integer; each walk runs only for a body that can
    hold what it looks for."""
    long_int = False
    try:
        try:
            body = json.loads(text)
        except json.JSONDecodeError:
            raise
        except ValueError:  # the digit limit
            long_int = True
            body = json.loads(text, parse_int=_parse_int)
        if _SURROGATE_ESCAPE.search(text):  # valid UTF-8 cannot hold surrogates: only a \uD8xx-style escape can
            parts = first_path(body, _holds_surrogate, _SURROGATE_RE.search)
            if parts is not None:  # not UTF-8 encodable: it would fail the response (echo, reasoning), the template
                path = json_path(parts)
                raise BadRequest(f"'{path or 'body'}' contains a lone UTF-16 surrogate (U+D800..U+DFFF)", path or None)
        parts = first_path(body, _is_long_int) if long_int else None
    except ValueError as e:  # JSONDecodeError, here or after a long literal
        raise BadRequest(f"the request body is not valid JSON: {e}", None) from e
    except RecursionError:
        raise BadRequest("the request body is nested too deeply", None) from None
    if (
        parts
    ):  # (None when a later duplicate key replaced it; [] when the body is one: Fields says it must be an object)
        path = json_path(parts)
        raise BadRequest(f"'{path}' is an integer of more than {sys.get_int_max_str_digits()} digits", path)
    return body


class _LongInt:
    """_decode_body's stand-in for an integer literal over Python's int-conversion limit."""

    __slots__ = ()


_LONG_INT = _LongInt()


def _parse_int(literal: str) -> Any:
    """json.loads's parse_int for a body holding an over-long integer: the literal's int, or _LONG_INT."""
    limit = sys.get_int_max_str_digits()
    if limit and len(literal) - literal.startswith("-") > limit:
        return _LONG_INT
    return int(literal)


def _is_long_int(v: Any) -> bool:
    return v is _LONG_INT


def _holds_surrogate(v: Any) -> bool:
    return isinstance(v, str) and _SURROGATE_RE.search(v) is not None


_SURROGATE_RE = re.compile("[\ud800-\udfff]")
# a JSON escape of a UTF-16 surrogate (\uD800-\uDFFF): the walk above runs only for bodies holding one, so long
# token-id prompts are not walked element by element
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _replace(sp: SamplingParams, **changes: Any) -> SamplingParams:
    import msgspec

    return msgspec.structs.replace(sp, **changes)
