"""kimi.client's own errors: mistakes the client refuses itself, with a message naming what is wrong.

- `stream` of a request id this client never submitted, or whose stream already ended: KimiError naming the id
  (not a bare KeyError), sync and async, raised when `stream` is called;
- a prompt that is neither a str nor a list of int token ids: TypeError saying so, before anything is sent;
- a `logit_bias` that is not {int token id: number} (string keys, as in the HTTP API's JSON, bool keys,
  bool or string biases, a list): KimiError naming `logit_bias`, before anything is sent;
- a str holding a lone UTF-16 surrogate (no UTF-8 form; the prompt, a stop string): KimiError naming the field with
  the HTTP API's message, before anything is sent (it was the encoder's UnicodeEncodeError).

Most tests talk to a stand-in ROUTER socket (no server needed: it checks that nothing was sent, or answers a
request with one finished output); the last one checks the same errors against the real server, which keeps
serving.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator

import numpy as np
import pytest
import zmq

from kimi import protocol
from kimi.client import AsyncKimiClient, KimiClient, KimiError

PROMPT = [34335, 43309, 63183]
UNKNOWN = r"^unknown request id 'never-submitted': not submitted by this client, or already finished"
BAD_PROMPTS = [None, 5, 1.5, b"abc", {1: 2}, {1, 2}, [1, "2"], [1, None], [True, 2], [1.0]]
BAD_LOGIT_BIAS = [  # (logit_bias, what the message says after "'logit_bias' has the wrong type: ")
    ({"5": 1.0}, r"logit_bias keys must be int token ids, got str key '5' \(use \{5: \.\.\.\}"),
    ({5: 1.0, "x": 1.0}, r"logit_bias keys must be int token ids, got str key 'x'"),
    ({True: 1.0}, r"logit_bias keys must be int token ids, got bool key True"),
    ({1.0: 1.0}, r"logit_bias keys must be int token ids, got float key 1.0"),
    ({5: True}, r"the bias for token id 5 must be a number, got bool True"),
    ({5: "1"}, r"the bias for token id 5 must be a number, got str '1'"),
    ([5], r"it must be a dict \{token id \(int\): bias\}, got list"),
]


class FakeServer:
    """A ROUTER socket standing in for the controller: records what arrives, answers on request."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.addr = f"tcp://127.0.0.1:{port}"

    def received(self, wait_ms: int = 200) -> list[tuple[bytes, object]]:
        got = []
        while self.sock.poll(wait_ms):
            ident, data = self.sock.recv_multipart()
            got.append((ident, protocol.decode_to_controller(data)))
            wait_ms = 50
        return got

    def finish_one(self) -> protocol.SubmitRequest:
        """Receive one submission and end it with one finished output."""
        assert self.sock.poll(5000), "nothing was submitted"
        ident, data = self.sock.recv_multipart()
        msg = protocol.decode_to_controller(data)
        assert isinstance(msg, protocol.SubmitRequest)
        out = protocol.RequestOutput(
            request_id=msg.request_id, token_ids=[7], text="x", finished=True, finish_reason="length"
        )
        self.sock.send_multipart([ident, protocol.encode(out)])
        return msg

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def fake() -> Iterator[FakeServer]:
    f = FakeServer()
    yield f
    f.close()


# ---- unknown request ids ---------------------------------------------------------------------------------------
def test_stream_of_unknown_or_finished_id_names_it(fake):
    with KimiClient(fake.addr, timeout_s=5) as c:
        with pytest.raises(KimiError, match=UNKNOWN):
            c.stream("never-submitted")  # raised by the call itself, not on the first next()
        rid = c.submit(PROMPT, request_id="r1", max_tokens=1)
        fake.finish_one()
        outs = list(c.stream(rid))
        assert outs[-1].finished and outs[-1].token_ids == [7]
        with pytest.raises(KimiError, match=r"^unknown request id 'r1': .*already finished"):
            c.stream(rid)  # a second stream of a finished request
        assert not isinstance(KimiError("x"), KeyError)
    assert fake.received() == []  # no abort was sent for any of it


def test_async_stream_of_unknown_or_finished_id_names_it(fake):
    async def go():
        async with AsyncKimiClient(fake.addr) as c:
            with pytest.raises(KimiError, match=UNKNOWN):
                c.stream("never-submitted")
            with pytest.raises(KimiError, match=UNKNOWN):
                async for _ in c.stream("never-submitted"):
                    pass
            rid = await c.submit(PROMPT, request_id="r1", max_tokens=1)
            await asyncio.to_thread(fake.finish_one)
            outs = [o async for o in c.stream(rid)]
            assert outs[-1].finished and outs[-1].token_ids == [7]
            with pytest.raises(KimiError, match=r"^unknown request id 'r1': .*already finished"):
                c.stream(rid)
            # generate() still works (its stream is closed by aclosing)
            agen = c.generate(PROMPT, request_id="r2", max_tokens=1)
            first = asyncio.ensure_future(agen.__anext__())
            await asyncio.to_thread(fake.finish_one)
            assert (await first).finished
            await agen.aclose()

    asyncio.run(asyncio.wait_for(go(), 30))
    assert fake.received() == []


# ---- prompts ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", BAD_PROMPTS, ids=repr)
def test_bad_prompt_is_a_clear_type_error_before_sending(fake, prompt):
    with KimiClient(fake.addr, timeout_s=5) as c:
        with pytest.raises(TypeError, match=r"^prompt must be a str \(text\) or a list of int token ids"):
            c.generate(prompt, max_tokens=1)
        with pytest.raises(TypeError, match=r"^prompt must be a str \(text\) or a list of int token ids"):
            c.submit(prompt, request_id="bad")
        assert c._pending == {}  # nothing left waiting: the id can be used again

    async def go():
        async with AsyncKimiClient(fake.addr) as ac:
            with pytest.raises(TypeError, match=r"^prompt must be a str \(text\) or a list of int token ids"):
                async for _ in ac.generate(prompt, max_tokens=1):
                    pass

    asyncio.run(go())
    assert fake.received() == []


def test_good_prompts_still_go_out(fake):
    with KimiClient(fake.addr, timeout_s=5) as c:
        for prompt, want in (
            ("Hello", ("Hello", None)),
            (PROMPT, (None, PROMPT)),
            (tuple(PROMPT), (None, PROMPT)),
            (np.array(PROMPT), (None, PROMPT)),
            (range(3), (None, [0, 1, 2])),
        ):
            rid = c.submit(prompt, max_tokens=1)
            msg = fake.finish_one()
            assert (msg.prompt, msg.prompt_token_ids) == want and msg.request_id == rid
            assert list(c.stream(rid))[-1].finished


def test_unknown_parameter_is_a_clear_error_before_sending(fake):
    """An HTTP-only option (n) or a misspelt field is a KimiError naming it, and nothing is sent."""
    with KimiClient(fake.addr, timeout_s=5) as c:
        with pytest.raises(KimiError, match=r"^unknown submit parameter\(s\) 'n', 'temprature'; "):
            c.submit(PROMPT, max_tokens=1, n=2, temprature=0.5)
        assert c._pending == {}
        rid = c.submit(PROMPT, max_tokens=1, temperature=0.5)  # the known field still goes out
        assert fake.finish_one().request_id == rid


@pytest.mark.parametrize(
    "params,field",
    [
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"stop_token_ids": [1, 2**70]}, "stop_token_ids"),
        ({"logit_bias": {2**64: 1.0}}, "logit_bias"),
        ({"max_tokens": 10**30}, "max_tokens"),
    ],
)
def test_int_outside_the_wire_range_names_the_field_before_sending(fake, params, field):
    """msgpack carries integers in [-2**63, 2**64): one outside is a KimiError naming its field (not msgspec's
    OverflowError), nothing is sent, and the client keeps working."""
    with KimiClient(fake.addr, timeout_s=5) as c:
        with pytest.raises(KimiError, match=rf"^'{field}' holds an integer outside the 64-bit range"):
            c.submit(PROMPT, **params)
        assert c._pending == {}
        rid = c.submit(PROMPT, max_tokens=1)
        assert fake.finish_one().request_id == rid
    with KimiClient(fake.addr, timeout_s=5) as c, pytest.raises(KimiError, match="'prompt' holds an integer outside"):
        c.submit([1, 2**64], max_tokens=1)


@pytest.mark.parametrize(
    "prompt,params,field",
    [
        ("\ud800", {}, "prompt"),
        ("a\udfffb", {}, "prompt"),
        ("hi", {"stop": ["ok", "\udc00"]}, "stop[1]"),
        ("hi", {"stop": "x\ud83d"}, "stop"),
    ],
)
def test_lone_surrogate_names_the_field_before_sending(fake, prompt, params, field):
    """A str holding a lone UTF-16 surrogate has no UTF-8 form: a KimiError naming its field with HTTP's message
    (not the encoder's UnicodeEncodeError), nothing is sent, and the client (sync and async) keeps working."""
    want = "^" + re.escape(f"'{field}' contains a lone UTF-16 surrogate (U+D800..U+DFFF)") + "$"
    with KimiClient(fake.addr, timeout_s=5) as c:
        with pytest.raises(KimiError, match=want):
            c.submit(prompt, max_tokens=1, **params)
        assert c._pending == {}
        assert fake.received() == []
        rid = c.submit(PROMPT, max_tokens=1)
        assert fake.finish_one().request_id == rid

    async def run() -> None:
        async with AsyncKimiClient(fake.addr) as c:
            with pytest.raises(KimiError, match=want):
                async for _ in c.generate(prompt, max_tokens=1, **params):
                    pass

    asyncio.run(run())
    assert not [m for _, m in fake.received() if isinstance(m, protocol.SubmitRequest)]  # (the sync client's close
    # aborted its request above, whose finished output it never read)


# ---- logit_bias ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lb,msg", BAD_LOGIT_BIAS, ids=lambda x: repr(x)[:30])
def test_bad_logit_bias_names_the_field_before_sending(fake, lb, msg):
    with KimiClient(fake.addr, timeout_s=5) as c:
        with pytest.raises(KimiError, match=r"^'logit_bias' has the wrong type: " + msg):
            c.generate(PROMPT, max_tokens=1, logit_bias=lb)
        assert c._pending == {}

    async def go():
        async with AsyncKimiClient(fake.addr) as ac:
            with pytest.raises(KimiError, match=r"^'logit_bias' has the wrong type: " + msg):
                await ac.submit(PROMPT, max_tokens=1, logit_bias=lb)

    asyncio.run(go())
    assert fake.received() == []


def test_int_logit_bias_keys_still_go_out(fake):
    with KimiClient(fake.addr, timeout_s=5) as c:
        for lb, want in (
            ({5: 1.0, 7: -2}, {5: 1.0, 7: -2.0}),
            ({np.int64(5): np.float64(3.0)}, {5: 3.0}),
            (None, None),
            ({}, {}),
        ):
            rid = c.submit(PROMPT, max_tokens=1, logit_bias=lb)
            assert fake.finish_one().logit_bias == want
            assert list(c.stream(rid))[-1].finished


# ---- against the real server -----------------------------------------------------------------------------------
def test_client_errors_against_the_server(server):
    with KimiClient(server.zmq_addr, timeout_s=30) as c:
        with pytest.raises(KimiError, match=UNKNOWN):
            c.stream("never-submitted")
        rid = c.submit(PROMPT, max_tokens=2, temperature=0.0)
        outs = list(c.stream(rid))
        assert outs[-1].finished and outs[-1].num_output_tokens == 2
        with pytest.raises(KimiError, match=f"^unknown request id '{rid}'"):
            list(c.stream(rid))
        with pytest.raises(KimiError, match=r"^'logit_bias' has the wrong type: logit_bias keys must be int"):
            list(c.generate(PROMPT, max_tokens=2, logit_bias={"5": 1.0}))
        for bad in (None, 5):
            with pytest.raises(TypeError, match=r"^prompt must be a str \(text\) or a list of int token ids"):
                list(c.generate(bad, max_tokens=2))
        # the same request with an int key goes through, and the server kept serving this connection
        outs = list(c.generate(PROMPT, max_tokens=2, temperature=0.0, logit_bias={5: 100.0}))
        assert outs[-1].finished and outs[-1].error is None and [t for o in outs for t in o.token_ids] == [5, 5]
