"""ZeroMQ delivery (kimi serve --fake-workers, real sockets, kimi.client):

- a client that reads slowly still gets every output of every request, however many are queued (the ROUTER
  queues without a limit; libzmq's default of 1000 messages per peer dropped them silently);
- a client that disconnects with requests running gets them aborted (the ROUTER's send to it fails);
- a request id whose stream was left early can be submitted again at once: the new request gets its own
  outputs, never the aborted one's last output (sync and async clients).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
from conftest import raw_dealer

from kimi import protocol
from kimi.client import AsyncKimiClient, KimiClient

PROMPT = [34335, 43309, 63183]


def _metric(srv, name: str) -> float:
    for line in httpx.get(f"{srv.base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith((name + " ", name + "{")):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def _wait_idle(srv, timeout_s: float) -> float:
    """Seconds until no request runs or waits (AssertionError after timeout_s)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if _metric(srv, "kimi:num_requests_running") == 0 and _metric(srv, "kimi:num_requests_waiting") == 0:
            return time.monotonic() - t0
        time.sleep(0.2)
    raise AssertionError(f"requests still running after {timeout_s} s")


def test_a_slow_reader_gets_every_output(fake_srv):
    """40 requests x 400 tokens with 20 logprobs each (16000 outputs of ~1 KB) all finish on the server before
    the client reads one output; then every stream is read whole and ends with finish_reason length."""
    with KimiClient(fake_srv.zmq_addr, timeout_s=60) as c:
        rids = [c.submit(PROMPT, max_tokens=400, ignore_eos=True, logprobs=20) for _ in range(40)]
        time.sleep(1.0)
        _wait_idle(fake_srv, 120)  # everything generated and sent while nobody reads
        for rid in rids:
            outs = list(c.stream(rid))
            assert outs[-1].finished and outs[-1].finish_reason == "length", outs[-1]
            assert sum(len(o.token_ids) for o in outs) == 400


def test_a_client_that_disconnects_gets_its_requests_aborted(fake_srv):
    """A raw DEALER submits two long requests, reads one output, and closes: the server aborts both at its next
    send (far sooner than the 20000 tokens would take) and counts them as aborted."""
    aborted0 = _metric(fake_srv, 'kimi:request_success_total{finished_reason="abort"}')
    with raw_dealer(fake_srv.zmq_addr) as s:
        for i in range(2):
            s.send(
                protocol.encode(
                    protocol.SubmitRequest(
                        request_id=f"long{i}", prompt_token_ids=PROMPT, max_tokens=20000, ignore_eos=True
                    )
                )
            )
        assert s.poll(30000), "no output"
        s.recv()
    took = _wait_idle(fake_srv, 60)
    assert _metric(fake_srv, 'kimi:request_success_total{finished_reason="abort"}') == aborted0 + 2
    assert _metric(fake_srv, "kimi:kv_cache_used_blocks") == 0
    print(f"aborted {took:.1f} s after the disconnect")


def test_reusing_an_id_after_leaving_its_stream_early(fake_srv):
    with KimiClient(fake_srv.zmq_addr, timeout_s=60) as c:
        for _ in range(3):
            for i, _out in enumerate(c.generate(PROMPT, max_tokens=5000, ignore_eos=True, request_id="same")):
                if i == 3:
                    break
            outs = list(c.generate(PROMPT, max_tokens=30, temperature=0.0, request_id="same"))
            assert outs[-1].finish_reason == "length" and sum(len(o.token_ids) for o in outs) == 30, outs[-1]
    _wait_idle(fake_srv, 60)


def test_async_reusing_an_id_after_leaving_its_stream_early(fake_srv):
    async def main():
        async with AsyncKimiClient(fake_srv.zmq_addr) as c:
            for _ in range(3):
                async with contextlib.aclosing(
                    c.generate(PROMPT, max_tokens=5000, ignore_eos=True, request_id="same")
                ) as outs:
                    i = 0
                    async for _out in outs:
                        i += 1
                        if i == 4:
                            break
                n, last = 0, None
                async for last in c.generate(PROMPT, max_tokens=30, temperature=0.0, request_id="same"):
                    n += len(last.token_ids)
                assert last.finish_reason == "length" and n == 30, last

    asyncio.run(asyncio.wait_for(main(), 120))
    _wait_idle(fake_srv, 60)


def test_a_raw_duplicate_id_error_names_the_clients_id(fake_srv):
    """A raw client's second submission of a running id is refused with an error naming the id it sent (not the
    controller's internal per-connection key); the running request goes on to its end."""
    with raw_dealer(fake_srv.zmq_addr) as s:
        for _ in range(2):
            s.send(
                protocol.encode(
                    protocol.SubmitRequest(request_id="dup", prompt_token_ids=PROMPT, max_tokens=50, ignore_eos=True)
                )
            )
        outs = []
        while not outs or not (outs[-1].finished and outs[-1].error is None):
            assert s.poll(30000), "no output"
            outs.append(protocol.decode_output(s.recv()))
    errors = [o.error for o in outs if o.error is not None]
    assert errors == ["request id 'dup' is already in use"], errors
    assert sum(len(o.token_ids) for o in outs) == 50 and outs[-1].finish_reason == "length"


def test_a_message_with_a_non_utf8_string_is_answered_under_its_request_id(fake_srv):
    """A raw SubmitRequest whose prompt is not UTF-8 does not decode as a whole, but its request id (read from the
    message's first bytes) still gets the error, so a raw client waiting on that id is answered (found by an
    adversarial tester: the error went to request id "")."""
    data = protocol.encode(protocol.SubmitRequest(request_id="utf8-bad", prompt="hi", max_tokens=2))
    bad = data.replace(b"\xa2hi", b"\xa2\xff\xfe")
    assert bad != data
    with raw_dealer(fake_srv.zmq_addr) as s:
        s.send(bad)
        assert s.poll(30000), "no answer"
        out = protocol.decode_output(s.recv())
    assert out.request_id == "utf8-bad" and out.finished and out.error and "malformed message" in out.error, out


def test_leaving_a_stream_whose_last_output_already_arrived_frees_its_id(fake_srv):
    """A stream left early while its request's last output already waits unread in the client (the sync client
    queued it while reading another stream; the async reader queues everything at once): no abort is needed, the
    id is free at once (it used to wait for an end that had come already: timeout_s / DRAIN_TIMEOUT_S, forever)."""
    with KimiClient(fake_srv.zmq_addr, timeout_s=10) as c:
        a = c.submit(PROMPT, max_tokens=50, ignore_eos=True)
        c.submit(PROMPT, max_tokens=3, ignore_eos=True, request_id="B")
        list(c.stream(a))  # B's outputs, its last one included, are queued meanwhile
        time.sleep(0.3)
        for _out in c.stream("B"):
            break
        t0 = time.monotonic()
        outs = list(c.generate(PROMPT, max_tokens=3, request_id="B"))
        assert outs[-1].finish_reason == "length" and time.monotonic() - t0 < 5

    async def main():
        async with AsyncKimiClient(fake_srv.zmq_addr) as c:
            await c.submit(PROMPT, max_tokens=3, ignore_eos=True, request_id="B")
            await asyncio.sleep(1.0)  # the reader has queued all of B's outputs
            async with contextlib.aclosing(c.stream("B")) as outs:
                async for _out in outs:
                    break
            t0 = time.monotonic()
            n = 0
            async for last in c.generate(PROMPT, max_tokens=3, request_id="B"):
                n += len(last.token_ids)
            assert last.finish_reason == "length" and n == 3 and time.monotonic() - t0 < 5

    asyncio.run(asyncio.wait_for(main(), 60))
