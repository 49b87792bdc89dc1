"""The parts of the OpenAI server that its endpoint modules share (kimi.controller.http)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import msgspec
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse

from kimi.controller.admission import admission_message, admission_param
from kimi.controller.body_errors import invalid_utf8_path
from kimi.controller.chat import no_other_keys, validate_tools
from kimi.controller.engine import AdmissionError, Engine, EngineDead
from kimi.controller.http.body import _SURROGATE_ESCAPE_BYTES, _decode_body
from kimi.controller.http.protocol import CHAT_FIELDS, COMPLETION_FIELDS, NOOP_VALUES, NULL_ONLY, decode_struct
from kimi.controller.http.streaming import _Siblings, until_disconnect
from kimi.controller.metrics import Metrics
from kimi.controller.params import MAX_LOGPROBS, sampling_params
from kimi.controller.parsers import OutputParser, ParserDelta, ReleasedTextFeeder
from kimi.controller.request import OutputStream, Request, StopParams
from kimi.controller.validation import BadRequest, Fields
from kimi.protocol import RequestOutput, SamplingParams
from kimi.tokenizer import KimiTokenizer

MAX_BODY_BYTES = 32 << 20
MAX_N = 16
# fields one endpoint takes and the other does not: a 400 for one of them names the endpoint that takes it
CHAT_ONLY_FIELDS = CHAT_FIELDS - COMPLETION_FIELDS
COMPLETIONS_ONLY_FIELDS = COMPLETION_FIELDS - CHAT_FIELDS
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")  # OpenAI's values
LOGPROB_FLOOR = -9999.0  # -inf logprobs are reported as this (JSON has no infinity), as vLLM does


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


def with_parser_tail(p: OutputParser, o: RequestOutput, d: ParserDelta | None) -> ParserDelta | None:
    """`d` (the parsed delta of output `o`, or None) and, when `o` is the last output, what the parser still held
    (`OutputParser.finish`: text of an unclosed section, held-back whitespace) appended to it."""
    if not o.finished:
        return d
    tail = p.finish("" if o.token_ids else o.text)
    if d is None:
        return tail
    d.content += tail.content
    d.reasoning_content += tail.reasoning_content
    d.tool_calls += tail.tool_calls
    return d


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


def _decode_or_none(tokenizer: KimiTokenizer, token_id: int) -> str | None:
    """The text of one token id, or None when the vocabulary has no such id."""
    try:
        return tokenizer.decode([token_id])
    except ValueError:
        return None


def _replace(sp: SamplingParams, **changes: Any) -> SamplingParams:
    import msgspec

    return msgspec.structs.replace(sp, **changes)


# bodies from this size on decode faster through the route's Struct (msgspec) than through json.loads (a prompt of
# token ids: 2.5x at 7 KiB); below it json.loads is as fast or faster
STRUCT_DECODE_MIN_BYTES = 1024


class ServerBase:
    """What every endpoint module of the OpenAI server shares (kimi.controller.http.server.OpenAIServer sets the
    attributes): reading and checking the body, the fields common to both generation routes, admitting the
    choices, collecting a non-streamed response, usage, and the chat request readers that /tokenize uses too."""

    engine: Engine
    tokenizer: KimiTokenizer
    model_name: str
    model_root: str
    vocab_size: int
    max_body_bytes: int
    body_timeout_s: float
    thinking_model: bool
    chat_max_tokens: int | None
    created: int
    metrics: Metrics
    _marker_text: tuple[tuple[int, str], ...] | None

    # ---- shared parsing ---------------------------------------------------------------------------------------
    async def _body(self, request: HTTPRequest, struct: type[msgspec.Struct] | None = None) -> Fields:
        """The request's JSON object (size, time and model checked). struct: the route's request Struct
        (kimi.controller.http.protocol.decode_struct), which decodes a well-formed body of STRUCT_DECODE_MIN_BYTES
        or more; smaller bodies (Python's json is as fast there), bodies it refuses and bodies with a UTF-16
        surrogate escape go through `_decode_body`. The readers check every value after either, so the outcome is
        the same. The engine's state is not looked at: a body that is a 400 when the workers are ready is a 400
        while they load too; the 503 of a loading or failed engine comes at admission (`_start`)."""
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
        body = None
        if struct is not None and len(raw) >= STRUCT_DECODE_MIN_BYTES and not _SURROGATE_ESCAPE_BYTES.search(raw):
            body = decode_struct(raw, struct)
        if body is None:
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                path = invalid_utf8_path(raw)
                raise BadRequest(
                    f"{f'{path!r} in ' if path else ''}the request body is not valid UTF-8: {e}", path
                ) from None
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
            priority=rp.priority,
            cache_salt=rp.cache_salt,
            n=n,
            logprobs=logprobs,
            max_tokens_field=rp.max_tokens_field,
        )

    @staticmethod
    def _extensions(f: Fields, fields: frozenset[str]) -> None:
        """The vLLM / SGLang extensions a route declares (`fields`) that kimi accepts at their no-op value only
        (protocol.NOOP_VALUES) or as null only (protocol.NULL_ONLY): any other value is a 400 naming the field."""
        for name, allowed in NOOP_VALUES.items():
            if name in fields:
                f.noop(name, allowed)
        for name, why in NULL_ONLY.items():
            if name in fields and f._get(name) is not None:
                raise BadRequest(f"'{name}' is not supported ({why}); send null or leave it out", name)

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
