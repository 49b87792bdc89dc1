"""Streaming wire format under the controller's fast paths (kimi serve --fake-workers, real HTTP).

Most streamed chunks are written synchronously from the engine's step with pre-encoded bytes (kimi.controller
.http: _EventTemplate, _BodyWriter, the OutputStream sink); the rest go through the ASGI send. Whichever
way a chunk goes, the stream must be what `json.dumps` of each chunk gives, in order, ending with
`data: [DONE]`, and carry the same text as the non-streaming answer. Checked here for plain, logprobs,
echo, n > 1, stop strings, usage and chat (content and reasoning), alone and with 48 streams at once; every
streamed choice carries `stop_reason` (null until its final chunk), as vLLM's chunks do.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

MODEL = "tiny"


def _events(raw: bytes) -> list[dict]:
    """The SSE events of a response body; each must be exactly json.dumps of itself (key order kept)."""
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
    events = []
    for block in raw.split(b"\n\n")[:-2]:
        assert block.startswith(b"data: "), block
        payload = block[len(b"data: ") :].decode()
        obj = json.loads(payload)
        assert json.dumps(obj, ensure_ascii=False) == payload
        events.append(obj)
    return events


def _stop_reason_in_every_choice(events: list[dict], plain: dict) -> None:
    """Every streamed choice carries stop_reason, as vLLM's chunks do: null until the choice's final chunk, whose
    value is the non-streamed answer's (the stop string, or null)."""
    for e in events:
        for ch in e["choices"]:
            assert "stop_reason" in ch, e
            if ch["finish_reason"] is None:
                assert ch["stop_reason"] is None, e
            else:
                assert ch["stop_reason"] == plain["choices"][ch["index"]]["stop_reason"], (e, plain)


COMPLETIONS = [
    {},
    {"stream_options": {"include_usage": True}},
    {"logprobs": 2},
    {"echo": True},
    {"n": 2, "seed": 3, "temperature": 0.8},
    {"stop": ["1", "\n"]},
    {"stop": ["2"], "include_stop_str_in_output": True},
    {"max_tokens": 1},
    {"prompt": 'h\u00e9llo "w\u00f6rld"\t\u4e2d'},
]


@pytest.mark.parametrize("extra", COMPLETIONS)
def test_completions_stream_is_json_dumps_and_matches_non_streaming(fake_srv, extra):
    body = {"model": MODEL, "prompt": [5, 6, 7, 300, 301], "max_tokens": 24, "temperature": 0, **extra}
    with httpx.Client(base_url=fake_srv.base_url, timeout=60) as c:
        raw = c.post("/v1/completions", json={**body, "stream": True}).content
        plain = c.post("/v1/completions", json={k: v for k, v in body.items() if k != "stream_options"}).json()
    events = _events(raw)
    n = body.get("n", 1)
    if not body.get("temperature"):  # greedy: the streamed text is the non-streaming text
        for i in range(n):
            text = "".join(ch["text"] for e in events for ch in e["choices"] if ch["index"] == i)
            assert text == plain["choices"][i]["text"]
    finals = [ch for e in events for ch in e["choices"] if ch["finish_reason"] is not None]
    assert len(finals) == n
    _stop_reason_in_every_choice(events, plain)
    if "stream_options" in body:
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 24
        assert all(e["usage"] is None for e in events[:-1])  # OpenAI: every other chunk has "usage": null
    else:
        assert all("usage" not in e for e in events)


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"logprobs": True, "top_logprobs": 2},
        {"stop": ["3"]},
        {"stream_options": {"include_usage": True}},
        {"chat_template_kwargs": {"thinking": True}},
    ],
)
def test_chat_stream_is_json_dumps_and_matches_non_streaming(fake_srv, extra):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi \u00e9\u4e2d"}],
        "max_tokens": 20,
        "temperature": 0,
        **extra,
    }
    with httpx.Client(base_url=fake_srv.base_url, timeout=60) as c:
        raw = c.post("/v1/chat/completions", json={**body, "stream": True}).content
        plain = c.post("/v1/chat/completions", json={k: v for k, v in body.items() if k != "stream_options"}).json()
    events = _events(raw)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [ch["delta"] for e in events for ch in e["choices"]]
    msg = plain["choices"][0]["message"]
    assert "".join(d.get("content", "") for d in deltas) == (msg["content"] or "")
    assert "".join(d.get("reasoning_content", "") for d in deltas) == (msg.get("reasoning_content") or "")
    _stop_reason_in_every_choice(events, plain)
    if "stream_options" in body:
        assert events[-1]["choices"] == [] and all(e["usage"] is None for e in events[:-1])
    else:
        assert all("usage" not in e for e in events)


def test_many_concurrent_streams_each_get_their_own_tokens_in_order(fake_srv):
    async def one(c: httpx.AsyncClient, i: int) -> tuple[str, str]:
        body = {"model": MODEL, "prompt": [7, 8, 9, 1000 + i], "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            raw = b"".join([chunk async for chunk in r.aiter_bytes()])
        plain = (await c.post("/v1/completions", json=body)).json()["choices"][0]["text"]
        return "".join(e["choices"][0]["text"] for e in _events(raw)), plain

    async def main():
        async with httpx.AsyncClient(
            base_url=fake_srv.base_url, timeout=120, limits=httpx.Limits(max_connections=100)
        ) as c:
            return await asyncio.gather(*[one(c, i) for i in range(48)])

    results = asyncio.run(main())
    assert all(streamed == plain for streamed, plain in results)
    assert len({plain for _, plain in results}) == 48  # distinct prompts, distinct texts
