"""`POST /v1/completions`: string, token-id and batched prompts, echo, legacy logprobs, streaming."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from kimi.controller.http.common import (
    CHAT_ONLY_FIELDS,
    GenerationArgs,
    ServerBase,
    _Choice,
    _finite,
    _token_logprobs,
    error_response,
)
from kimi.controller.http.protocol import COMPLETION_FIELDS, CompletionRequest
from kimi.controller.http.streaming import _SLOT, _SSE, _EventTemplate, _Siblings, sse_event
from kimi.controller.offload import run_sized
from kimi.controller.params import MAX_LOGPROBS
from kimi.controller.validation import BadRequest, check_prompt_text_fits
from kimi.protocol import RequestOutput
from kimi.structured_output.request import COMMON_FIELDS, completion_grammar, constrain
from kimi.tokenizer import IncrementalDetokenizer


class CompletionsAPI(ServerBase):
    """The /v1/completions route (a mixin of OpenAIServer)."""

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
            f = await self._body(request, struct=CompletionRequest)
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
            guided = completion_grammar(f.body)  # guided decoding (kimi.structured_output)
            f.accept(*COMMON_FIELDS)
            self._extensions(f, COMPLETION_FIELDS)
            f.reject_unknown(("/v1/chat/completions", CHAT_ONLY_FIELDS), COMPLETION_FIELDS)
            g.sampling = await constrain(self.engine.grammars, guided, g.sampling)
            rid = f"cmpl-{uuid.uuid4().hex}"
            sib = await self._start(rid, g)
            self.metrics.on_request("/v1/completions")
        except BadRequest as e:
            return error_response(e, {"Retry-After": "1"} if e.status == 503 else None)
        created = int(time.time())
        base = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name}
        choices = [_Choice(i, r) for i, r in enumerate(sib.ids)]
        out = _CompletionOutput(self, g, base, choices, prompt_texts, k_echo, k_prompt)
        if not g.stream:
            err = await self._collect(request, sib, choices)
            if err is not None:  # an error ending a request because the server shuts down is retryable
                return error_response(BadRequest(err, None, status=503 if err == self.engine.closing else 500))
            return JSONResponse({**base, "choices": out.choices_json(), "usage": self._usage_of(g, choices)})
        return out.stream(sib)


class _CompletionOutput:
    """The response of one /v1/completions request: the choices of the JSON body once every choice finished
    (`choices_json`), or the SSE stream of its chunks (`stream`).

    `base` holds the fields of every body / chunk (id, object, created, model); choice i answers prompt
    `i // g.n` (`g.prompts`, text `prompt_texts`). `k_echo`: the top-k of the echoed prompt's logprobs (-1:
    none); `k_prompt`: vLLM's prompt_logprobs (None: not asked).
    """

    def __init__(
        self,
        api: CompletionsAPI,
        g: GenerationArgs,
        base: dict[str, Any],
        choices: list[_Choice],
        prompt_texts: list[str],
        k_echo: int,
        k_prompt: int | None,
    ) -> None:
        self.api = api
        self.g = g
        self.base = base
        self.choices = choices
        self.prompts = g.prompts
        self.prompt_texts = prompt_texts
        self.n = g.n
        self.echo = g.echo
        self.k_echo = k_echo
        self.k_prompt = k_prompt

    def echo_logprobs(self, c: _Choice) -> dict[str, Any]:
        """Legacy logprobs of choice c's echoed prompt (top-k cut to `k_echo`)."""
        k_echo, k_prompt = self.k_echo, self.k_prompt
        ids = self.prompts[c.index // self.n]
        k = len(ids)
        plp = c.prompt_logprobs or [None] * k
        ptid = c.prompt_top_ids or [None] * k
        ptlp = c.prompt_top_logprobs or [None] * k
        if k_echo < max(k_echo, k_prompt or 0):  # the worker sent prompt_logprobs' larger top-k
            ptid = [None if t is None else t[:k_echo] for t in ptid]
            ptlp = [None if t is None else t[:k_echo] for t in ptlp]
        return self.api._completion_logprobs(
            ids, plp, ptid, ptlp, self.api._prompt_offsets(ids, self.prompt_texts[c.index // self.n])
        )

    def choices_json(self) -> list[dict[str, Any]]:
        """The `choices` of the non-streaming body, every choice finished."""
        api, g, echo, n = self.api, self.g, self.echo, self.n
        out = []
        for c in self.choices:
            prompt_text = self.prompt_texts[c.index // n]
            text = "".join(c.text)
            lp = None
            if g.logprobs is not None:
                pos = len(prompt_text) if echo else 0
                place = api._piece_offsets(g.skip_special_tokens, pos)
                offs: list[int] = []
                for o in c.outputs:  # the same offsets as the streamed chunks (see _prompt_offsets)
                    offs.extend(place(o, pos))
                    pos += len(o.text)
                lp = api._completion_logprobs(c.token_ids, c.logprobs, c.top_ids, c.top_logprobs, offs)
                if echo:
                    prompt_lp = self.echo_logprobs(c)
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
            if self.k_prompt is not None:
                choice["prompt_logprobs"] = api._vllm_prompt_logprobs(
                    self.prompts[c.index // n], c.prompt_logprobs, c.prompt_top_ids, c.prompt_top_logprobs
                )
            if g.return_token_ids:
                choice["prompt_token_ids"] = self.prompts[c.index // n]
                choice["token_ids"] = c.token_ids
            out.append(choice)
        return out

    def stream(self, sib: _Siblings) -> _SSE:
        """The SSE response of the request's siblings `sib`."""
        g, base, choices, n = self.g, self.base, self.choices, self.n
        if g.include_usage:  # OpenAI: with include_usage every chunk has "usage", null until the last one
            base["usage"] = None
        self.text_event = _EventTemplate(
            lambda i: {
                **base,
                "choices": [{"index": i, "text": _SLOT, "logprobs": None, "finish_reason": None, "stop_reason": None}],
            }
        )
        self.offsets = [len(self.prompt_texts[i // n]) if self.echo else 0 for i in range(len(choices))]
        self.echoed = [False] * len(choices)
        # chunks that differ only in their text
        self.plain = g.logprobs is None and not g.continuous_usage and not g.return_token_ids
        self.started = [False] * len(choices)
        self.places = (
            [self.api._piece_offsets(g.skip_special_tokens, self.offsets[i]) for i in range(len(choices))]
            if g.logprobs is not None
            else []
        )
        single = self.plain and not self.echo and len(choices) == 1
        text_only = (choices[0], self.text_event) if single else None
        return _SSE(sib, self.render, b"", self.tail, text_only)

    def _chunk(self, i: int, o: RequestOutput | None, ch: dict[str, Any]) -> bytes:
        if self.g.return_token_ids:  # vLLM: the prompt's ids with a choice's first chunk, every chunk's new ids
            if not self.started[i]:
                self.started[i] = True
                ch["prompt_token_ids"] = self.prompts[i // self.n]
            ch["token_ids"] = o.token_ids if o is not None else []
        if self.g.continuous_usage:
            usage = self.api._chunk_usage(len(self.prompts[i // self.n]), o)
            return sse_event({**self.base, "choices": [ch], "usage": usage})
        return sse_event({**self.base, "choices": [ch]})

    def render(self, i: int, o: RequestOutput) -> tuple[bytes, bool]:
        """SSE events for output o of choice i, and whether the stream ends with it (see _SSE)."""
        c = self.choices[i]
        if o.prompt_logprobs is None:
            c.last = o  # _Choice.note, inlined
        else:
            c.note(o)
        if o.error is not None:
            return sse_event(self.api._error_chunk(o.error)), True
        if (
            self.plain and not o.finished and (self.echoed[i] or not self.echo)
        ):  # the common chunk: only the text varies
            return (self.text_event.fill(i, o.text) if o.text else b""), False
        events: list[bytes] = []
        logprobs = self.g.logprobs is not None
        if self.echo and not self.echoed[i]:
            self.echoed[i] = True
            lp = self.echo_logprobs(c) if logprobs else None
            head = {
                "index": i,
                "text": self.prompt_texts[i // self.n],
                "logprobs": lp,
                "finish_reason": None,
                "stop_reason": None,
            }
            events.append(self._chunk(i, None, head))
        lp = None
        if logprobs and o.token_ids:
            lp = self.api._completion_logprobs(o.token_ids, *_token_logprobs(o), self.places[i](o, self.offsets[i]))
        self.offsets[i] += len(o.text)
        if o.text or o.finished or lp is not None:
            ch: dict[str, Any] = {
                "index": i,
                "text": o.text,
                "logprobs": lp,
                "finish_reason": o.finish_reason,
                "stop_reason": o.stop_reason if o.finished else None,
            }
            events.append(self._chunk(i, o, ch))
        return b"".join(events), False

    def tail(self) -> bytes:
        """The usage chunk after the last output (include_usage), else b""."""
        if self.g.include_usage:
            return sse_event({**self.base, "choices": [], "usage": self.api._usage_of(self.g, self.choices)})
        return b""
