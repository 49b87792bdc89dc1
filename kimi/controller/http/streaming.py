"""Server-sent events: chunk encoding and templates, the n-sibling merge, and the ASGI streaming response that
writes most chunks straight to the connection from the engine's step."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from json.encoder import encode_basestring  # what json.dumps(ensure_ascii=False) uses for every str (C)
from typing import TYPE_CHECKING, Any

from kimi.controller.engine import Engine
from kimi.controller.request import OutputStream, Request
from kimi.protocol import RequestOutput

if TYPE_CHECKING:
    from kimi.controller.http.common import _Choice

RAW_SEND = "kimi.raw_send"  # scope key: the server's own ASGI `send`, set by server._Auth (see _SSE)

log = logging.getLogger(__name__)


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
        self._parts: dict[int, list[bytes]] = {}  # the bytes around the slot(s): 2 pieces for 1 slot, k + 1 for k

    def _split(self, i: int) -> list[bytes]:
        pieces = sse_event(self.template(i)).split(encode_basestring(_SLOT).encode())
        self._parts[i] = pieces
        return pieces

    def parts(self, i: int) -> tuple[bytes, bytes]:
        """The bytes before and after the string for choice i (a template with one slot)."""
        pieces = self._parts.get(i) or self._split(i)
        return pieces[0], pieces[-1]

    def fill(self, i: int, text: str) -> bytes:
        pieces = self._parts.get(i) or self._split(i)
        if len(pieces) == 2:
            return pieces[0] + encode_basestring(text).encode() + pieces[1]
        return encode_basestring(text).encode().join(pieces)  # the same string in several fields


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
    output (chat: the role chunks), `tail()` after the last (the usage chunk, or b""), then `done`.
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
        done: bytes = b"data: [DONE]\n\n",
    ) -> None:
        self.siblings = siblings
        self.render = render
        self.first = first
        self.tail = tail
        # (choice, template): every non-final output without prompt logprobs renders as template.fill(0, text)
        # (plain completions); the sink then does that itself instead of calling render
        self.text_only = text_only
        self.done = done  # the body's last bytes (OpenAI's `data: [DONE]`; Anthropic's streams end with none)

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
            await out({"type": "http.response.body", "body": self.done, "more_body": False})

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
