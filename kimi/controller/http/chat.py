"""`POST /v1/chat/completions`: template rendering, tool-call and reasoning parsing, logprobs, streaming."""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from kimi.controller.chat import encode_chat
from kimi.controller.http.common import (
    COMPLETIONS_ONLY_FIELDS,
    REASONING_EFFORTS,
    GenerationArgs,
    ServerBase,
    _Choice,
    _finite,
    _token_logprobs,
    error_response,
    with_parser_tail,
)
from kimi.controller.http.protocol import CHAT_FIELDS, ChatCompletionRequest
from kimi.controller.http.streaming import _SLOT, _SSE, _EventTemplate, _Siblings, sse_event
from kimi.controller.offload import run_sized
from kimi.controller.params import MAX_LOGPROBS
from kimi.controller.parsers import OutputParser, ParserConfig, ToolCall
from kimi.controller.validation import BadRequest, Fields
from kimi.protocol import RequestOutput
from kimi.structured_output.request import COMMON_FIELDS, chat_grammar, constrain


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


@dataclasses.dataclass
class _ChatRun:
    """An admitted chat request (`ChatAPI._chat_start`): its prompt ids, generation arguments, parser settings,
    the running choices and the response options read from the body."""

    ids: list[int]
    g: GenerationArgs
    pcfg: ParserConfig
    sib: _Siblings
    parallel: bool  # parallel_tool_calls
    want_lp: bool
    include_reasoning: bool
    echo_text: str
    k_prompt: int | None
    token_ids_out: bool
    rid: str


def final_message_parts(c: _Choice, parallel: bool) -> tuple[str, str, list[ToolCall]]:
    """A finished non-streamed choice's (content text, reasoning text, tool calls), parsed from its collected
    outputs as a stream of the same output carries them; not parallel: at most the first call."""
    p = c.parser
    assert p is not None
    content, reasoning = [], []
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
    calls = list(p.emitted_tool_calls)
    return "".join(content), "".join(reasoning), calls if parallel else calls[:1]


class ChatAPI(ServerBase):
    """The /v1/chat/completions route (a mixin of OpenAIServer)."""

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

    async def _chat_start(self, f: Fields, endpoint: str = "/v1/chat/completions") -> _ChatRun:
        """Validate a chat request body (OpenAI's fields), render and tokenize its prompt, set up guided decoding
        and admit its choices: the part of the chat route that every chat-shaped API shares (the OpenAI route and
        /v1/messages, which translates its body to these fields). Raises BadRequest."""
        messages = f._get("messages")
        tools, parse_tools, parallel = self._tool_args(f)
        want_lp = f.bool("logprobs", False)
        top = f.int("top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
        if top is not None and not want_lp:
            raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        f.noop("modalities", (["text"],), "is not supported (this server outputs text only)")
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
        f.accept(*COMMON_FIELDS)  # read by chat_grammar below
        self._extensions(f, CHAT_FIELDS)
        f.reject_unknown(("/v1/completions", COMPLETIONS_ONLY_FIELDS), CHAT_FIELDS)
        thinking = self.thinking_model and kwargs.get("thinking", True) is not False
        pcfg = ParserConfig.for_prompt(ids, tools=parse_tools, thinking_model=thinking, marker_text=self._marker_text)
        if not separate_reasoning:
            pcfg = dataclasses.replace(pcfg, thinking=False, prompt_ends_in_think=False)
        guided = chat_grammar(f.body, after_think=pcfg.starts_in_reasoning)  # guided decoding
        g.sampling = await constrain(self.engine.grammars, guided, g.sampling)
        echo_text = _echo_text(messages) if echo else ""
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        sib = await self._start(rid, g, prompt_field="messages")
        self.metrics.on_request(endpoint)
        return _ChatRun(
            ids, g, pcfg, sib, parallel, want_lp, include_reasoning, echo_text, k_prompt, token_ids_out, rid
        )

    async def chat_completions(self, request: HTTPRequest) -> Response | _SSE:
        try:
            f = await self._body(request, struct=ChatCompletionRequest)
            run = await self._chat_start(f)
        except BadRequest as e:
            return error_response(e, {"Retry-After": "1"} if e.status == 503 else None)
        g, sib = run.g, run.sib
        created = int(time.time())
        base = {"id": run.rid, "object": "chat.completion", "created": created, "model": self.model_name}
        choices = [
            _Choice(i, r, parser=OutputParser(run.pcfg), request=sib.requests[i] if sib.requests else None)
            for i, r in enumerate(sib.ids)
        ]
        out = _ChatOutput(self, run, base, choices)
        if not g.stream:
            err = await self._collect(request, sib, choices)
            if err is not None:  # an error ending a request because the server shuts down is retryable
                return error_response(BadRequest(err, None, status=503 if err == self.engine.closing else 500))
            return JSONResponse(out.body())
        return out.stream()


class _ChatOutput:
    """The response of one admitted chat request (`run`): the JSON body once every choice finished (`body`), or
    the SSE stream of its chunks (`stream`). `base` holds the body's id, object, created and model."""

    def __init__(self, api: ChatAPI, run: _ChatRun, base: dict[str, Any], choices: list[_Choice]) -> None:
        self.api = api
        self.run = run
        self.g = run.g
        self.base = base
        self.choices = choices

    @staticmethod
    def finish_reason(c: _Choice) -> str | None:
        """Choice c's finish reason, "tool_calls" where its parser saw a tool call end the message."""
        base_reason = c.last.finish_reason if c.last else None
        if base_reason in ("stop", "length"):
            assert c.parser is not None, "every chat choice has a parser"
            return c.parser.finish_reason(base_reason)
        return base_reason

    def body(self) -> dict[str, Any]:
        """The non-streaming response body, every choice finished."""
        api, run, g, choices = self.api, self.run, self.g, self.choices
        out = []
        for c in choices:
            content, reasoning, tool_calls = final_message_parts(c, run.parallel)
            calls = [t.to_openai() for t in tool_calls]
            text = run.echo_text + content
            reasons = run.pcfg.starts_in_reasoning and run.include_reasoning
            thought = reasoning if reasons else ""
            # no text beside tool calls or reasoning: null content (OpenAI's tool-call replies, vLLM's reasoning)
            msg: dict[str, Any] = {
                "role": "assistant",
                "content": text if (text or not (calls or thought)) else None,
            }
            if reasons:  # `reasoning`: current vLLM's name; `reasoning_content`: DeepSeek's and older vLLM's
                msg["reasoning"] = msg["reasoning_content"] = thought or None
            if calls:
                msg["tool_calls"] = calls
            lp = api._chat_logprobs(c.token_ids, c.logprobs, c.top_ids, c.top_logprobs) if run.want_lp else None
            choice: dict[str, Any] = {
                "index": c.index,
                "message": msg,
                "logprobs": lp,
                "finish_reason": self.finish_reason(c),
                "stop_reason": c.final.stop_reason,
            }
            if run.token_ids_out:
                choice["token_ids"] = c.token_ids
            out.append(choice)
        resp: dict[str, Any] = {**self.base, "choices": out, "usage": api._usage_of(g, choices)}
        if run.k_prompt is not None:
            c0 = choices[0]
            resp["prompt_logprobs"] = api._vllm_prompt_logprobs(
                run.ids, c0.prompt_logprobs, c0.prompt_top_ids, c0.prompt_top_logprobs
            )
        if run.token_ids_out:
            resp["prompt_token_ids"] = run.ids
        return resp

    def stream(self) -> _SSE:
        """The SSE response of the request's siblings."""
        run, g = self.run, self.g
        chunk_base = {**self.base, "object": "chat.completion.chunk"}
        if g.include_usage:  # OpenAI: with include_usage every chunk has "usage", null until the last one
            chunk_base["usage"] = None
        self.chunk_base = chunk_base
        self.continuous = g.continuous_usage
        self.n_prompt = len(g.prompt_token_ids)
        # chunks that differ only in one text field
        self.fast = not (run.want_lp or self.continuous or run.token_ids_out)
        self.content_event = self._delta_template({"content": _SLOT})
        self.reasoning_event = self._delta_template({"reasoning": _SLOT, "reasoning_content": _SLOT})
        return _SSE(run.sib, self.render, self._first(), self.usage)

    def _delta_template(self, delta: dict[str, Any]) -> _EventTemplate:
        chunk_base = self.chunk_base
        return _EventTemplate(
            lambda i: {
                **chunk_base,
                "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None, "stop_reason": None}],
            }
        )

    def render(self, i: int, o: RequestOutput) -> tuple[bytes, bool]:
        """SSE events for output o of choice i, and whether the stream ends with it (see _SSE)."""
        run = self.run
        c = self.choices[i]
        p = c.parser
        assert p is not None
        c.note(o)
        if o.error is not None:
            return sse_event(self.api._error_chunk(o.error)), True
        d = c.parse(o) if o.token_ids else None
        if d is not None and not o.finished and not d.tool_calls and self.fast:
            # the common chunks: only the content or only the reasoning text varies
            if not d.reasoning_content:
                return (self.content_event.fill(i, d.content) if d.content else b""), False
            if not d.content:
                return (self.reasoning_event.fill(i, d.reasoning_content) if run.include_reasoning else b""), False
        d = with_parser_tail(p, o, d)
        delta = d.to_openai() if d is not None else {}
        if "reasoning_content" in delta:
            if run.include_reasoning:
                delta = {"reasoning": delta["reasoning_content"], **delta}
            else:
                del delta["reasoning_content"]
        if not run.parallel and "tool_calls" in delta:
            delta["tool_calls"] = [t for t in delta["tool_calls"] if t["index"] == 0]
            if not delta["tool_calls"]:
                del delta["tool_calls"]
        lp = None
        if run.want_lp and o.token_ids:
            lp = self.api._chat_logprobs(o.token_ids, *_token_logprobs(o))
        if delta or lp is not None or o.finished:
            ch: dict[str, Any] = {
                "index": i,
                "delta": delta,
                "logprobs": lp,
                "finish_reason": self.finish_reason(c) if o.finished else None,
                "stop_reason": o.stop_reason if o.finished else None,
            }
            if run.token_ids_out:
                ch["token_ids"] = o.token_ids
            if self.continuous:
                usage = self.api._chunk_usage(self.n_prompt, o)
                return sse_event({**self.chunk_base, "choices": [ch], "usage": usage}), False
            return sse_event({**self.chunk_base, "choices": [ch]}), False
        return b"", False

    def usage(self) -> bytes:
        """The usage chunk after the last output (include_usage), else b""."""
        if self.g.include_usage:
            return sse_event({**self.chunk_base, "choices": [], "usage": self.api._usage_of(self.g, self.choices)})
        return b""

    def _first(self) -> bytes:
        """Each choice's role chunk (and its echoed text chunk with echo), sent before any output."""
        run, chunk_base, continuous = self.run, self.chunk_base, self.continuous
        usage = {"usage": self.api._chunk_usage(self.n_prompt, None)} if continuous else {}
        return b"".join(
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
                    **usage,
                    **({"prompt_token_ids": run.ids} if run.token_ids_out and c.index == 0 else {}),
                }
            )
            + (
                sse_event(
                    {
                        **chunk_base,
                        "choices": [
                            {
                                "index": c.index,
                                "delta": {"content": run.echo_text},
                                "logprobs": None,
                                "finish_reason": None,
                                "stop_reason": None,
                            }
                        ],
                        **usage,
                    }
                )
                if run.echo_text
                else b""
            )
            for c in self.choices
        )
