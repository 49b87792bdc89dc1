"""The ZeroMQ programmatic submit API, controller side (ROUTER socket; see kimi.client for the other end).

A client sends `SubmitRequest` / `AbortRequest` (msgspec, kimi.protocol) and receives a stream of
`RequestOutput` deltas per request id, the last with `finished=True` (a finish_reason or an error).
Invalid submissions are answered with a finished output carrying the error, which names the bad field (the
HTTP API's rules and messages, kimi.controller.validation); nothing else changes.
Request ids are scoped per client connection.

Delivery: the ROUTER socket queues a client's outputs without limit (SNDHWM 0; libzmq's default of 1000
messages per peer would drop outputs silently once a slow reader falls that far behind) and, with
ROUTER_MANDATORY, fails a send to a client that has disconnected: that client's requests are then aborted, so
a vanished client's generation stops instead of running to max_tokens.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator

import msgspec
import zmq
import zmq.asyncio

from kimi import protocol
from kimi.controller.admission import admission_message
from kimi.controller.engine import AdmissionError, Engine, EngineDead
from kimi.controller.offload import run_sized
from kimi.controller.params import MAX_LOGPROBS, RequestParams, sampling_params
from kimi.controller.validation import BadRequest, Fields, check_prompt_text_fits
from kimi.protocol import RequestOutput
from kimi.structured_output.request import completion_grammar, constrain
from kimi.tokenizer import KimiTokenizer

log = logging.getLogger(__name__)

_SUBMIT_TAG = protocol.SubmitRequest.__struct_config__.tag
_SUBMIT_FIELDS = protocol.SubmitRequest.__struct_fields__  # position i + 1 on the wire (the tag is at 0)
_FIELD_AT = re.compile(r"`\$\[(\d+)\]")  # msgspec's error path, e.g. "... - at `$[12]`" or "`$[15][0]`"
_WIRE_PATH = re.compile(r" - at `\$[^`]*`")  # that path in the message: wire positions mean nothing to a user


def _submit_id(data: bytes) -> str | None:
    """The request id of a msgpack SubmitRequest read from the message's first bytes alone (an array whose first
    two items are the struct's tag and a UTF-8 string), or None: for messages that do not decode as a whole."""
    if not data:
        return None
    b0, i = data[0], 1
    if 0x90 <= b0 <= 0x9F:
        n = b0 & 0x0F
    elif b0 in (0xDC, 0xDD):
        w = 2 if b0 == 0xDC else 4
        n, i = int.from_bytes(data[1 : 1 + w], "big"), 1 + w
    else:
        return None
    if n < 2 or i >= len(data) or data[i] != _SUBMIT_TAG:  # the tag: a positive fixint (30)
        return None
    i += 1
    if i >= len(data):
        return None
    h = data[i]
    if 0xA0 <= h <= 0xBF:
        size, i = h & 0x1F, i + 1
    elif h in (0xD9, 0xDA, 0xDB):
        w = {0xD9: 1, 0xDA: 2, 0xDB: 4}[h]
        size, i = int.from_bytes(data[i + 1 : i + 1 + w], "big"), i + 1 + w
    else:
        return None
    if i + size > len(data):
        return None
    try:
        return data[i : i + size].decode("utf-8")
    except UnicodeDecodeError:
        return None


class SubmitServer:
    def __init__(self, engine: Engine, tokenizer: KimiTokenizer, addr: str, vocab_size: int) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.ctx = zmq.asyncio.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)  # queue a slow reader's outputs; never drop them (see the module doc)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a peer that left raises EHOSTUNREACH
        if addr.startswith("tcp://["):  # an IPv6 literal; not for names (IPv6 first would turn localhost into ::1)
            self.sock.setsockopt(zmq.IPV6, 1)
        self.sock.bind(addr)
        self.addr = addr
        self._tasks: set[asyncio.Task[None]] = set()

    def _key(self, ident: bytes, request_id: str) -> str:
        return f"zmq-{ident.hex()}-{request_id}"

    async def _reply(self, ident: bytes, out: RequestOutput) -> bool:
        """Send out to the client; False when the client has disconnected (nothing was sent)."""
        try:
            await self.sock.send_multipart([ident, protocol.encode(out)])
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            return False
        return True

    def _error(self, request_id: str, msg: str) -> RequestOutput:
        return RequestOutput(request_id=request_id, token_ids=[], text="", finished=True, error=msg)

    def _validate(self, r: protocol.SubmitRequest, prompt_ids: list[int] | None) -> tuple[list[int], RequestParams]:
        """The request's prompt ids and RequestParams; raises BadRequest naming the bad field.
        prompt_ids: r.prompt tokenized (by _admit, off the event loop for a large prompt) when it is a non-empty
        string, else unused.

        The fields go through the HTTP API's own rules (kimi.controller.validation: the same checks, in the
        same order, with the same messages) and become SamplingParams / StopParams the way the HTTP routes
        make them (`generation_params`: min_tokens' blocked ids, stop strings), so the same request gives
        the same tokens and text over HTTP and ZeroMQ.
        """
        if r.prompt is not None and r.prompt_token_ids is None:
            if not r.prompt:
                raise BadRequest("'prompt' must not be empty", "prompt")
            assert prompt_ids is not None, "_admit tokenizes a non-empty string prompt"
            ids = prompt_ids
        elif r.prompt_token_ids is not None and r.prompt is None:
            ids = list(r.prompt_token_ids)
            if not ids:
                raise BadRequest("'prompt_token_ids' must not be empty", "prompt_token_ids")
            bad = [x for x in ids if not 0 <= x < self.vocab_size]
            if bad:
                raise BadRequest(
                    f"'prompt_token_ids' holds token id {bad[0]}, outside [0, {self.vocab_size})", "prompt_token_ids"
                )
        else:
            raise BadRequest("give exactly one of 'prompt' and 'prompt_token_ids'", "prompt")
        f = Fields(msgspec.structs.asdict(r), "message")
        logprobs = f.int("logprobs", None, lo=0, hi=MAX_LOGPROBS)  # where /v1/completions reads it
        rp = sampling_params(
            f,
            vocab_size=self.vocab_size,
            eos_token_ids=self.engine.eos_token_ids,
            logprobs=logprobs,
            prompt_logprobs=-1,
            max_tokens_default=16,
        )
        return ids, rp

    async def _admit(self, ident: bytes, r: protocol.SubmitRequest) -> AsyncIterator[RequestOutput] | None:
        """Validate and admit a submission, in the receive loop itself (`Engine.generate` admits without
        suspending), so an AbortRequest that follows it on the socket always finds it admitted. Returns its
        output stream, or None after answering it with its error. A large prompt is tokenized in a worker thread
        (kimi.controller.offload): the receive loop waits for it, so the order with a following abort holds, while
        the rest of the server goes on."""
        try:
            if r.prompt and r.prompt_token_ids is None:
                check_prompt_text_fits(self.tokenizer, r.prompt, self.engine.max_model_len)
            pre = await run_sized(len(r.prompt), self.tokenizer.encode, r.prompt) if r.prompt else None
            ids, rp = self._validate(r, pre)
            guided = completion_grammar(
                {"response_format": r.response_format, "structured_outputs": r.structured_outputs}
            )
            sampling = await constrain(self.engine.grammars, guided, rp.sampling)
            return await self.engine.generate(
                self._key(ident, r.request_id),
                ids,
                sampling,
                rp.stop,
                r.skip_special_tokens,
                priority=rp.priority,
                cache_salt=rp.cache_salt,
            )
        except BadRequest as e:
            await self._reply(ident, self._error(r.request_id, e.message))
        except AdmissionError as e:  # written with the client's request id (the engine's key is internal)
            await self._reply(ident, self._error(r.request_id, admission_message(e, request_id=r.request_id)))
        except (ValueError, EngineDead) as e:
            await self._reply(ident, self._error(r.request_id, str(e)))
        return None

    async def _forward(self, ident: bytes, request_id: str, stream: AsyncIterator[RequestOutput]) -> None:
        """Send the request's outputs to its client; when the client has gone, abort the request (its outputs
        until the end are dropped)."""
        gone = False
        async for out in stream:
            if not gone and not await self._reply(ident, msgspec.structs.replace(out, request_id=request_id)):
                gone = True
                log.info("ZeroMQ client %s disconnected: aborting its request %r", ident.hex(), request_id)
                self.engine.abort(self._key(ident, request_id))

    @staticmethod
    def _undecodable(data: bytes, e: Exception) -> RequestOutput:
        """The error answer to a message that does not decode. When it is a SubmitRequest whose request id can
        be read (a field of the wrong type, say), the answer goes to that request id and names the field, so
        the client's request ends instead of waiting; otherwise the request id is ""."""
        rid, msg = "", f"malformed message: {e}"
        try:
            raw = msgspec.msgpack.decode(data)
        except Exception:  # not msgpack at all, a map with unhashable keys, or a string that is not UTF-8
            raw = None
            head = _submit_id(data)  # the request id may still be readable (the bad string is a later field)
            if head is not None:
                rid = head
        if isinstance(raw, list) and len(raw) >= 2 and raw[0] == _SUBMIT_TAG and isinstance(raw[1], str):
            rid = raw[1]
            m = _FIELD_AT.search(str(e))
            if m is not None and 1 <= int(m.group(1)) <= len(_SUBMIT_FIELDS):
                name = _SUBMIT_FIELDS[int(m.group(1)) - 1]
                what = _WIRE_PATH.sub("", str(e))  # msgspec's "Expected `int`, got `float` - at `$[4]`"
                msg = f"'{name}' has the wrong type: {what[:1].lower()}{what[1:]}"
        return RequestOutput(request_id=rid, token_ids=[], text="", finished=True, error=msg)

    async def serve(self) -> None:
        """Receive submissions until cancelled."""
        while True:
            frames = await self.sock.recv_multipart()
            ident = frames[0]
            if len(frames) != 2:  # a DEALER sends one frame per message; anything else is malformed
                await self._reply(ident, self._error("", f"malformed message: {len(frames) - 1} frames, expected 1"))
                continue
            data = frames[1]
            try:
                msg = protocol.decode_to_controller(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                await self._reply(ident, self._undecodable(data, e))
                continue
            if isinstance(msg, protocol.AbortRequest):
                self.engine.abort(self._key(ident, msg.request_id))
                continue
            stream = await self._admit(ident, msg)
            if stream is None:
                continue
            t = asyncio.create_task(self._forward(ident, msg.request_id, stream))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        self.sock.close(0)
