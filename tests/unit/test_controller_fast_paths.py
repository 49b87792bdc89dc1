"""The controller's per-token fast paths give exactly what the plain code gave.

- SSE chunk templates (`kimi.controller.http.streaming._EventTemplate`) == `json.dumps` of the whole chunk, byte for
  byte;
- `FastDetokenizer` == `kimi.tokenizer.IncrementalDetokenizer`, delta for delta (built-in and, when
  ../shared holds it, the real Kimi vocabulary);
- `OutputStream`: order, one wake-up per batch, the synchronous sink only while the reader waits;
- `LatencyHistogram` exposes what prometheus_client's Histogram did;
- `_BodyWriter` engages on the installed uvicorn (h11, HTTP/1.1 chunked) and its bytes interleave correctly
  with ASGI `send`; it stays off for HTTP/1.0.
"""

from __future__ import annotations

import asyncio
import json
import random
import re

import httpx
import pytest
import uvicorn

from kimi.controller.http.streaming import _SLOT, _BodyWriter, _EventTemplate, sse_event
from kimi.controller.metrics import LatencyHistogram
from kimi.controller.output import FastDetokenizer
from kimi.controller.request import OutputStream
from kimi.ipc import free_tcp_port
from kimi.server import _Server
from kimi.tokenizer import IncrementalDetokenizer, KimiTokenizer, default_tokenizer_source, write_tokenizer_files

AWKWARD = [
    "",
    " tok123",
    'a"b\\c',
    "\n\r\t\b\f",
    "\x00\x01\x1f\x7f",
    "é中文🙂",
    "\u2028\u2029",
    "\ufffd",
    "</script>",
    "'single'",
    "\\u0000",
    "x" * 300,
]


def _random_text(rng: random.Random) -> str:
    alphabet = ["a", " ", '"', "\\", "\n", "\t", "\x00", "\x1f", "\x7f", "é", "中", "🙂", "\u2028", "/", "'"]
    return "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 12)))


@pytest.mark.parametrize("model", ["tiny", 'fä"ke/mödel\\x', "中文"])
def test_event_template_is_json_dumps_byte_for_byte(model):
    base = {"id": "cmpl-0123", "object": "text_completion", "created": 1700000000, "model": model}
    tmpl = _EventTemplate(
        lambda i: {**base, "choices": [{"index": i, "text": _SLOT, "logprobs": None, "finish_reason": None}]}
    )
    chat = _EventTemplate(
        lambda i: {
            **base,
            "choices": [{"index": i, "delta": {"content": _SLOT}, "logprobs": None, "finish_reason": None}],
        }
    )
    both = _EventTemplate(
        lambda i: {
            **base,
            "choices": [{"index": i, "delta": {"reasoning": _SLOT, "reasoning_content": _SLOT}, "logprobs": None}],
        }
    )
    rng = random.Random(0)
    for text in AWKWARD + [_random_text(rng) for _ in range(300)]:
        for i in (0, 1, 15):
            want = (
                b"data: "
                + json.dumps(
                    {**base, "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": None}]},
                    ensure_ascii=False,
                ).encode()
                + b"\n\n"
            )
            assert tmpl.fill(i, text) == want
            assert (
                sse_event({**base, "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": None}]})
                == want
            )
            pre, post = tmpl.parts(i)
            assert pre + json.dumps(text, ensure_ascii=False).encode() + post == want
            want_chat = sse_event(
                {**base, "choices": [{"index": i, "delta": {"content": text}, "logprobs": None, "finish_reason": None}]}
            )
            assert chat.fill(i, text) == want_chat
            delta = {"reasoning": text, "reasoning_content": text}  # one string in two fields
            want_both = sse_event({**base, "choices": [{"index": i, "delta": delta, "logprobs": None}]})
            assert both.fill(i, text) == want_both


def _tokenizers(tmp_path) -> list[KimiTokenizer]:
    write_tokenizer_files(tmp_path / "builtin")
    toks = [KimiTokenizer.from_dir(tmp_path / "builtin")]
    src = default_tokenizer_source()
    if src is not None:
        write_tokenizer_files(tmp_path / "real", src)
        toks.append(KimiTokenizer.from_dir(tmp_path / "real"))
    return toks


def test_fast_detokenizer_equals_incremental_detokenizer(tmp_path):
    rng = random.Random(1)
    for tok in _tokenizers(tmp_path):
        n = len(tok._table)
        specials = sorted(tok.special_ids)
        partial = [i for i, b in enumerate(tok._table) if b and i < 300000 and b[-1] >= 0x80][:2000]
        for skip in (True, False):
            texts = FastDetokenizer.texts(tok, skip)
            for _trial in range(200):
                ids = []
                for _ in range(rng.randrange(1, 40)):
                    r = rng.random()
                    if r < 0.3 and partial:
                        ids.append(rng.choice(partial))  # ends mid-character (or is a lone continuation byte)
                    elif r < 0.4:
                        ids.append(rng.choice(specials))
                    elif r < 0.45:
                        ids.append(rng.choice([-1, n, n + 5, 10**9]))  # outside the vocabulary: empty text
                    elif r < 0.6:
                        ids.append(rng.randrange(0, 256))
                    else:
                        ids.append(rng.randrange(0, n))
                ref = IncrementalDetokenizer(tok, skip_special_tokens=skip)
                fast = FastDetokenizer(tok, texts, skip_special_tokens=skip)
                for t in ids:
                    assert fast.push(t) == ref.push(t), (ids, t)
                assert fast.flush() == ref.flush()


def test_output_stream_batches_and_order():
    async def main():
        s = OutputStream()
        s.put(1)
        s.put(2)
        assert s.qsize() == 2
        assert await s.get_batch() == [1, 2]
        reader = asyncio.ensure_future(s.get_batch())
        await asyncio.sleep(0)
        s.put(3)
        s.put(4)  # same wake-up
        assert await reader == [3, 4]
        # cancel-safe: a cancelled reader leaves the stream usable and loses nothing
        reader = asyncio.ensure_future(s.get_batch())
        await asyncio.sleep(0)
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        s.put(5)
        assert await s.get_batch() == [5]

    asyncio.run(main())


def test_output_stream_sink_only_while_the_reader_waits():
    async def main():
        s = OutputStream()
        got: list = []
        s.sink = lambda o: (o % 2 == 0) and (got.append(o) or True)  # takes even numbers
        s.put(2)  # nobody waiting: queued, not sunk (the reader has not caught up)
        assert s.qsize() == 1 and got == []
        assert await s.get_batch() == [2]
        reader = asyncio.ensure_future(s.get_batch())
        await asyncio.sleep(0)
        s.put(4)  # reader idle: the sink takes it, the reader stays asleep
        assert got == [4] and not reader.done()
        s.put(5)  # declined: queued and the reader woken
        s.put(6)  # reader woken but not run yet: must queue behind 5 (order)
        assert await reader == [5, 6] and got == [4]

        def broken(o):
            raise ValueError("boom")

        s.sink = broken  # a failing sink is dropped; the output still reaches the reader
        reader = asyncio.ensure_future(s.get_batch())
        await asyncio.sleep(0)
        s.put(8)
        assert await reader == [8] and s.sink is None

    asyncio.run(main())


def test_latency_histogram_exposition_matches_prometheus_client():
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    buckets = (0.001, 0.01, 0.1, 1.0, 10.0)
    values = [0.0, 0.001, 0.0010001, 0.05, 0.1, 3.0, 10.0, 11.0, 1e9]
    reg_a, reg_b = CollectorRegistry(auto_describe=False), CollectorRegistry(auto_describe=False)
    a = Histogram("kimi:x_seconds", "Some latency (s).", buckets=buckets, registry=reg_a)
    b = LatencyHistogram("kimi:x_seconds", "Some latency (s).", buckets, reg_b)
    for v in values:
        a.observe(v)
        b.observe(v)
    norm = lambda t: re.sub(rb"_created \S+", b"_created T", t)
    assert norm(generate_latest(reg_a)) == norm(generate_latest(reg_b))
    assert b.count == len(values)


async def _serve(app, http: str = "h11"):
    port = free_tcp_port()
    server = _Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off", http=http))
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    return server, task, port


def test_body_writer_engages_on_uvicorn_and_interleaves_with_send():
    attached: list[bool] = []

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        w = _BodyWriter.attach(send)
        attached.append(w is not None)
        if w is None:
            await send({"type": "http.response.body", "body": b"plain", "more_body": False})
            return
        assert w.ready()
        w.write(b"hello ")
        await send({"type": "http.response.body", "body": b"wor", "more_body": True})
        w.write(b"")  # nothing (an empty chunk would end the body)
        w.write(b"ld\r\n0\r\n")  # bytes that look like framing are data
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def main():
        server, task, port = await _serve(app)
        try:
            async with httpx.AsyncClient() as c:
                r = await c.get(f"http://127.0.0.1:{port}/")
                assert r.status_code == 200 and r.content == b"hello world\r\n0\r\n"
                assert r.headers.get("transfer-encoding") == "chunked"
                r = await c.get(f"http://127.0.0.1:{port}/")  # keep-alive: the connection serves another
                assert r.content == b"hello world\r\n0\r\n"
            # HTTP/1.0: no chunked framing, so no writer
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.0\r\nHost: x\r\n\r\n")
            raw = await reader.read()
            writer.close()
            assert raw.endswith(b"\r\n\r\nplain")
        finally:
            server.should_exit = True
            await task
        assert attached == [True, True, False]

    asyncio.run(main())


def test_body_writer_refuses_foreign_send():
    async def send(message):
        pass

    assert _BodyWriter.attach(send) is None
    assert _BodyWriter.attach(print) is None
