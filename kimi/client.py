"""kimi's ZeroMQ programmatic API (client side): submit text or token ids, iterate over outputs, abort.

    from kimi.client import KimiClient
    with KimiClient("tcp://127.0.0.1:8001") as c:
        for out in c.generate("The capital of France is", max_tokens=16, temperature=0):
            print(out.text, end="", flush=True)

`AsyncKimiClient` is the asyncio twin (`async for out in client.generate(...)`). Every output is a
`kimi.protocol.RequestOutput` delta (token_ids, text); the last has `finished=True` and a `finish_reason`
("stop", "length", "abort") or an `error`. Several requests may be in flight on one client.

Parameters (keyword arguments of `submit` / `generate`, the fields of `kimi.protocol.SubmitRequest`): the
HTTP API's per-request controls with the same names, ranges and meaning (docs/api.md): `max_tokens`,
`temperature`, `top_p`, `top_k`, `min_p`, `seed`, `presence_penalty`, `frequency_penalty`,
`repetition_penalty`, `logit_bias` ({token id: bias}, int keys), `min_tokens`, `stop` (a string or up to 4),
`include_stop_str_in_output`, `stop_token_ids`, `ignore_eos`, `skip_special_tokens`, `logprobs`. The last
output's `stop_reason` is the stop string or stop token id that ended the request. A bad value ends the
request with `KimiError`, whose message names the field (the HTTP 400's message for a value out of range).
Some mistakes are refused by `submit` itself, before anything is sent: a prompt that is neither a str nor a
list of int token ids (TypeError), a `request_id` that is not a str (TypeError; None or "" picks a new id), and a
`logit_bias` that is not a dict of int token ids to numbers
(KimiError naming `logit_bias`; the HTTP API's string keys are JSON's, here the keys are ints). `stream` of a
request id this client did not submit, or whose stream already ended, raises KimiError naming the id.
`submit` and `abort` on a closed client raise KimiError.

Request lifetime: a stream left before its last output (a `break`, an exception, a generator that is closed)
aborts its request on the server, and closing the client (leaving its `with` / `async with` block) aborts
every request it submitted that has not finished, so none runs on to max_tokens for nobody. A `request_id`
still in use by an unfinished request of the same client is refused by `submit` (KimiError, nothing is
sent): the running request and its stream are left alone. Submitting the id of a request whose stream was left
early waits until the server's last output for the aborted request has arrived (KimiClient: within its
timeout_s; AsyncKimiClient: DRAIN_TIMEOUT_S), so the two requests' outputs never mix. An AsyncKimiClient
`generate()` left by `break` aborts when the async generator is closed: at once inside
`contextlib.aclosing(...)`, else when its finalizer runs on the event loop.
"""

from __future__ import annotations

import collections
import contextlib
import operator
import uuid
from collections.abc import AsyncGenerator, Iterable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any, cast

import zmq
import zmq.asyncio

from kimi import protocol
from kimi.errors import KimiError as KimiError  # re-exported: the name users catch
from kimi.protocol import RequestOutput

if TYPE_CHECKING:
    import asyncio


class ClientError(KimiError, RuntimeError):
    """The server answered a request with an error (bad parameters, engine failure), `submit` refused a
    request (a request id already in use on this client, a malformed `logit_bias`), or `stream` was given a
    request id that this client has no unfinished request for. `except KimiError` (kimi.errors' base class,
    exported here) catches it."""


ABORT_LINGER_MS = 1000  # how long closing a client may wait for its abort messages to leave
DRAIN_TIMEOUT_S = 60.0  # AsyncKimiClient: how long a submission waits for an aborted request of its id to end


def _take_request_id(params: dict[str, Any]) -> str:
    """Pop `request_id` from a submit's params: a str is used as given, None or "" gets a new uuid4 hex id.
    Raises TypeError for any other type (the server could not answer under it, and the stream would wait)."""
    rid = params.pop("request_id", None)
    if rid is None or rid == "":
        return uuid.uuid4().hex
    if not isinstance(rid, str):
        raise TypeError(f"request_id must be a str, got {type(rid).__name__} {rid!r:.40}")
    return rid


def _check_open(sock: Any) -> None:
    if sock.closed:
        raise ClientError("this client is closed; create a new one")


def _check_new_id(rid: str, outstanding: Any) -> None:
    if rid in outstanding:
        raise ClientError(
            f"request id {rid!r} is already in use by an unfinished request of this client; "
            "the new submission is refused (the running request is not affected)"
        )


def _unknown_id(rid: str) -> ClientError:
    return ClientError(
        f"unknown request id {rid!r}: not submitted by this client, or already finished (its stream "
        "ended, or the client was closed)"
    )


def _prompt_token_ids(prompt: Any) -> list[int]:
    """A non-str prompt -> its token ids; TypeError unless it is an iterable of ints (bool is not a token id)."""
    what = "prompt must be a str (text) or a list of int token ids"
    if isinstance(prompt, (bytes, bytearray, memoryview, Mapping, AbstractSet)) or not isinstance(prompt, Iterable):
        raise TypeError(f"{what}, got {type(prompt).__name__}")
    ids = []
    for i, t in enumerate(prompt):
        try:
            if isinstance(t, bool):
                raise TypeError
            ids.append(operator.index(t))  # int, or an int-like such as numpy.int64
        except TypeError:
            raise TypeError(f"{what}; item {i} is {type(t).__name__} {t!r:.40}") from None
    return ids


def _logit_bias(lb: Any) -> dict[int, Any] | None:
    """Check `logit_bias` against the wire type (dict[int, float]) before sending: the server's decode error
    would name msgspec internals, and the HTTP API's string keys ("5") do not apply here."""
    if lb is None:
        return None
    wrong = "'logit_bias' has the wrong type:"
    if not isinstance(lb, Mapping):
        raise ClientError(f"{wrong} it must be a dict {{token id (int): bias}}, got {type(lb).__name__}")
    out = {}
    for k, v in lb.items():
        try:
            if isinstance(k, bool):
                raise TypeError
            tid = operator.index(k)
        except TypeError:
            raise ClientError(
                f"{wrong} logit_bias keys must be int token ids, got {type(k).__name__} key {k!r:.40}"
                + (
                    f" (use {{{k}: ...}}, not the HTTP API's JSON string key)"
                    if isinstance(k, str) and k.isascii() and k.isdigit()
                    else ""
                )
            ) from None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ClientError(f"{wrong} the bias for token id {tid} must be a number, got {type(v).__name__} {v!r:.40}")
        out[tid] = v if type(v) in (int, float) else float(v)  # numpy.float64 etc. as a plain float
    return out


def _unencodable(v: Any) -> bool:
    """A str with no UTF-8 form (it holds a lone surrogate)."""
    if not isinstance(v, str):
        return False
    try:
        v.encode()
    except UnicodeEncodeError:
        return True
    return False


def _submit_msg(request_id: str, prompt: str | list[int], params: dict[str, Any]) -> bytes:
    if "logit_bias" in params:
        params = {**params, "logit_bias": _logit_bias(params["logit_bias"])}
    unknown = sorted(set(params) - set(protocol.SubmitRequest.__struct_fields__))
    if unknown:
        raise ClientError(
            f"unknown submit parameter(s) {', '.join(map(repr, unknown))}; the ZeroMQ API takes the fields "
            "of kimi.protocol.SubmitRequest (n, echo and the other HTTP-only options are not among them)"
        )
    if isinstance(prompt, str):
        msg = protocol.SubmitRequest(request_id=request_id, prompt=prompt, **params)
    else:
        msg = protocol.SubmitRequest(request_id=request_id, prompt_token_ids=_prompt_token_ids(prompt), **params)
    try:
        return protocol.encode(msg)
    except UnicodeEncodeError:  # a lone UTF-16 surrogate (U+D800..U+DFFF) has no UTF-8 form: name the field, as HTTP
        from kimi.controller.validation import first_path, json_path

        parts = first_path({"request_id": request_id, "prompt": prompt, **params}, _unencodable)
        if not parts:
            raise
        raise ClientError(f"'{json_path(parts)}' contains a lone UTF-16 surrogate (U+D800..U+DFFF)") from None
    except OverflowError:  # msgpack carries integers in [-2**63, 2**64): name the field holding one outside
        fields = {"prompt": prompt, **params}
        bad = next((name for name, v in fields.items() if _int_out_of_range(v)), None)
        if bad is None:
            raise
        raise ClientError(
            f"'{bad}' holds an integer outside the 64-bit range the ZeroMQ API carries [-2**63, 2**64)"
        ) from None


def _int_out_of_range(v: Any) -> bool:
    """Whether v (or an item, key or value in it) is an int outside [-2**63, 2**64)."""
    if isinstance(v, bool):
        return False
    if isinstance(v, int):
        return not -(2**63) <= v < 2**64
    if isinstance(v, Mapping):
        return any(_int_out_of_range(k) or _int_out_of_range(x) for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return any(_int_out_of_range(x) for x in v)
    return False


class KimiClient:
    """Blocking client. `timeout_s` bounds the wait for each output (TimeoutError)."""

    def __init__(self, addr: str, timeout_s: float = 600.0) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)  # queue outputs until read, however many (never drop one)
        if addr.startswith("tcp://["):  # an IPv6 literal; not for names (IPv6 first would turn localhost into ::1)
            self._sock.setsockopt(zmq.IPV6, 1)
        self._sock.connect(addr)
        self._timeout_ms = int(timeout_s * 1000)
        self._pending: dict[str, collections.deque[RequestOutput]] = {}
        # ids whose stream was left early: aborted, but the server's last output for them (finished) is still on
        # its way; a new submission of such an id waits for it, so the two requests' outputs never mix
        self._draining: set[str] = set()

    def submit(self, prompt: str | list[int], **params: Any) -> str:
        """Send a request (text or token ids; params: the fields of protocol.SubmitRequest, e.g. max_tokens,
        temperature, min_p, logit_bias, min_tokens, stop); returns its request id. Parameter errors come back
        as the request's only output and are raised by `stream` (KimiError)."""
        _check_open(self._sock)
        rid = _take_request_id(params)
        _check_new_id(rid, self._pending)
        msg = _submit_msg(rid, prompt, params)
        while rid in self._draining:  # an earlier request of this id was aborted: wait for its last output
            self._recv_one()
        self._pending[rid] = collections.deque()
        self._sock.send(msg)
        return rid

    def _recv_one(self) -> None:
        if not self._sock.poll(self._timeout_ms):
            raise TimeoutError("no output from the kimi server")
        out = protocol.decode_output(self._sock.recv())
        q = self._pending.get(out.request_id)
        if q is not None:
            q.append(out)
        elif out.finished:
            self._draining.discard(out.request_id)

    def stream(self, request_id: str) -> Iterator[RequestOutput]:
        """Outputs of a submitted request until it finishes. Raises KimiError if it ends with an error, and at
        once if this client has no unfinished request `request_id` (never submitted here, or its stream ended)."""
        q = self._pending.get(request_id)
        if q is None:
            raise _unknown_id(request_id)
        return self._stream(request_id, q)

    def _stream(self, request_id: str, q: collections.deque[RequestOutput]) -> Iterator[RequestOutput]:
        done = False
        try:
            while True:
                while not q:
                    self._recv_one()
                out = q.popleft()
                if out.error is not None or out.finished:
                    done = True
                if out.error is not None:
                    raise ClientError(out.error)
                yield out
                if out.finished:
                    return
        finally:
            self._pending.pop(request_id, None)
            # left early (break, exception, timeout): stop it, unless its last output is already here, unread
            if not done and not any(o.finished for o in q) and self._abort_quietly(request_id):
                self._draining.add(request_id)

    def generate(self, prompt: str | list[int], **params: Any) -> Iterator[RequestOutput]:
        """submit + stream."""
        return self.stream(self.submit(prompt, **params))

    def abort(self, request_id: str) -> None:
        """Ask the server to stop request `request_id` (its stream then ends with finish_reason "abort"); an id
        the server does not know is ignored there. Raises KimiError if this client is closed."""
        _check_open(self._sock)
        self._sock.send(protocol.encode(protocol.AbortRequest(request_id)))

    def _abort_quietly(self, request_id: str) -> bool:
        """Send an abort without blocking; False when it could not be sent (socket closed or full)."""
        if self._sock.closed:
            return False
        try:
            self._sock.send(protocol.encode(protocol.AbortRequest(request_id)), zmq.DONTWAIT)
            return True
        except zmq.ZMQError:
            return False

    def close(self) -> None:
        """Abort every unfinished request of this client, then close (waiting at most ABORT_LINGER_MS for the
        aborts to leave)."""
        if self._sock.closed:
            return
        sent = [self._abort_quietly(rid) for rid in list(self._pending)]
        self._pending.clear()
        self._draining.clear()
        self._sock.close(ABORT_LINGER_MS if any(sent) else 0)
        self._ctx.term()

    def __enter__(self) -> KimiClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncKimiClient:
    """asyncio client; one background reader routes outputs to their request's queue."""

    def __init__(self, addr: str) -> None:
        import asyncio

        self._asyncio = asyncio
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)  # queue outputs until read, however many (never drop one)
        if addr.startswith("tcp://["):  # an IPv6 literal; not for names (IPv6 first would turn localhost into ::1)
            self._sock.setsockopt(zmq.IPV6, 1)
        self._sock.connect(addr)
        self._queues: dict[str, Any] = {}
        self._draining: dict[str, Any] = {}  # as KimiClient._draining: id -> asyncio.Event set by its last output
        self._reader: Any = None

    async def _read(self) -> None:
        while True:
            out = protocol.decode_output(await self._sock.recv())
            q = self._queues.get(out.request_id)
            if q is not None:
                q.put_nowait(out)
            elif out.finished and out.request_id in self._draining:
                self._draining.pop(out.request_id).set()

    async def submit(self, prompt: str | list[int], **params: Any) -> str:
        """`KimiClient.submit`, asynchronously."""
        _check_open(self._sock)
        rid = _take_request_id(params)
        if self._reader is None:
            self._reader = self._asyncio.create_task(self._read())
        _check_new_id(rid, self._queues)
        msg = _submit_msg(rid, prompt, params)
        drained = self._draining.get(rid)
        if drained is not None:  # an earlier request of this id was aborted: wait for its last output
            try:
                await self._asyncio.wait_for(drained.wait(), DRAIN_TIMEOUT_S)
            except (TimeoutError, self._asyncio.TimeoutError):  # the same class from Python 3.11 on
                raise ClientError(
                    f"request id {rid!r}: the earlier request of this id was aborted and its end has "
                    f"not arrived in {DRAIN_TIMEOUT_S:g} s; use another id"
                ) from None
            _check_open(self._sock)  # close() ends the wait too
            _check_new_id(rid, self._queues)  # another submission of this id may have gone first meanwhile
        self._queues[rid] = self._asyncio.Queue()
        await self._sock.send(msg)
        return rid

    def stream(self, request_id: str) -> AsyncGenerator[RequestOutput, None]:
        """`KimiClient.stream` (an async iterator; an unknown request id raises KimiError at once): leaving it
        before the last output aborts the request."""
        q = self._queues.get(request_id)
        if q is None:
            raise _unknown_id(request_id)
        return self._stream(request_id, q)

    async def _stream(self, request_id: str, q: Any) -> AsyncGenerator[RequestOutput, None]:
        done = False
        try:
            while True:
                out = await q.get()
                if out.error is not None or out.finished:
                    done = True
                if out.error is not None:
                    raise ClientError(out.error)
                yield out
                if out.finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            last_here = False  # its last output already queued, unread (the reader queues outputs as they come)
            while not q.empty():
                last_here = last_here or q.get_nowait().finished
            if not done and not last_here and self._abort_quietly(request_id):
                self._draining[request_id] = self._asyncio.Event()

    async def generate(self, prompt: str | list[int], **params: Any) -> AsyncGenerator[RequestOutput, None]:
        rid = await self.submit(prompt, **params)
        async with contextlib.aclosing(self.stream(rid)) as outs:  # closing this generator closes (aborts) that one
            async for out in outs:
                yield out

    async def abort(self, request_id: str) -> None:
        """`KimiClient.abort`, asynchronously."""
        _check_open(self._sock)
        await self._sock.send(protocol.encode(protocol.AbortRequest(request_id)))

    def _abort_quietly(self, request_id: str) -> bool:
        """Send an abort now, without awaiting (also from a generator's cleanup); False if it was not sent."""
        if self._sock.closed:
            return False
        try:
            # zmq.asyncio's send returns an asyncio Future (its stub says only Awaitable)
            fut = cast(
                "asyncio.Future[Any]", self._sock.send(protocol.encode(protocol.AbortRequest(request_id)), zmq.DONTWAIT)
            )
        except zmq.ZMQError:
            return False
        if fut.done():  # DONTWAIT: it was sent, or it failed (socket full); never left pending
            return fut.exception() is None
        fut.cancel()
        return False

    async def close(self) -> None:
        """Abort every unfinished request of this client, then close (see KimiClient.close)."""
        if self._sock.closed:
            return
        sent = [self._abort_quietly(rid) for rid in list(self._queues)]
        self._queues.clear()
        for ev in self._draining.values():  # a submit waiting on one stops waiting (and finds the socket closed)
            ev.set()
        self._draining.clear()
        if self._reader is not None:
            self._reader.cancel()
        self._sock.close(ABORT_LINGER_MS if any(sent) else 0)
        self._ctx.term()

    async def __aenter__(self) -> AsyncKimiClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
