"""Streaming reasoning and tool-call parsers for Kimi-K2 chat output (token-id level, pure Python).

The controller feeds every generated token of a chat request to one `OutputParser` as a pair
`(token_id, text_delta)`, where `text_delta` is what the incremental detokenizer produced for that token.
The parser splits the output into OpenAI `reasoning_content`, `content` and `tool_calls` deltas.

Format (docs/model-format.md, Tokenizer, and docs/model-format.md, Chat and tool-call format):

    [<think>] reasoning text </think> content text
    <|tool_calls_section_begin|>
      <|tool_call_begin|> functions.NAME:IDX <|tool_call_argument_begin|> {json args} <|tool_call_end|>
      ... more calls ...
    <|tool_calls_section_end|> [more content]

Every marker is a single token (ids below), so markers are recognised by id, never by text: a marker can
not be split across deltas. The detokenized text of ordinary tokens does arrive in arbitrary pieces (a
name or a JSON argument string may come one character at a time); the parser buffers only what it must
(a call's header until `<|tool_call_argument_begin|>`).

Behaviours chosen for the ambiguous cases (each one is tested in tests/unit/test_parsers.py):

- Reasoning. When `ParserConfig.thinking` or `prompt_ends_in_think` is set the output *starts* in
  reasoning, whether or not the model emits `<think>` itself (K2-Thinking emits it; K2.5/K2.6 templates
  put it in the prompt). A `<think>` token is consumed silently wherever it appears. `</think>` ends the
  reasoning; later `</think>` tokens are dropped. With thinking off (prompt ends in `<think></think>`, or a
  non-thinking model) everything is content and stray `<think>` / `</think>` tokens are dropped. Think
  markers never appear in any field. An output cut before `</think>` is all reasoning, no content.
- Tool markers inside reasoning (tools active). Kimi-K2-Thinking / K2.5 sometimes open a tool section
  without closing `</think>` first. As in vLLM's current `kimi_k2` parser, `<|tool_calls_section_begin|>`
  (or a bare `<|tool_call_begin|>`) ends the reasoning and starts a real tool section; after that section
  the output is content.
- Tools not active (no `tools` in the request, or `tool_choice: "none"`). No call is ever parsed. Tool
  markers are treated like vLLM without a tool parser treats them (they are not "special" tokens, so they
  survive `skip_special_tokens`): their detokenized text, the marker string, goes verbatim into whichever
  field is current (content or reasoning), as any token's text does (so a marker that is the request's stop
  token and whose text is left out of the output adds nothing, as in completions). Nothing is silently lost and
  nothing pretends to be a call.
- Tool call id / name. A call header (the text between `<|tool_call_begin|>` and
  `<|tool_call_argument_begin|>`) is `functions.NAME:IDX`, surrounding whitespace aside; the `functions.` prefix may be
  missing (`search:0`). NAME is 1 or more of `A-Za-z0-9_.:-` (the characters a declared tool name may hold), IDX
  ASCII digits. The returned id is always `functions.NAME:IDX`; the name may hold dots, dashes and colons
  (`functions.my.tool-v2:3` -> `my.tool-v2`, `functions.ns:tool:3` -> `ns:tool`). Any other header (`call_ab12`,
  `get_weather` without `:IDX`, prose after a stray `<|tool_call_begin|>`) is not a call: its text, and the text of
  its arguments, is content (no call is made up from it). A header is known to be invalid as soon as it holds a
  character that no valid header can (a space inside it, say); from then on its text streams as content.
- Arguments are returned without the model's surrounding whitespace (OpenAI `arguments` is a string; a streamed
  call's fragments hold back trailing whitespace until more text follows); invalid JSON is not an error. A call
  that ends with no argument text (none after `<|tool_call_argument_begin|>`, or no argument begin at all) gets "{}".
- Streaming shape (`stream_tool_arguments=True`, the default, like vLLM/SGLang/OpenAI): when
  `<|tool_call_argument_begin|>` arrives the first delta for the call is emitted (index, id, name,
  arguments ""); each later text piece of the arguments is emitted as an `arguments` fragment. The
  concatenation of a call's fragments equals the non-streaming `arguments`. `index` counts the calls of this
  response from 0 (it is not the `:IDX` of the id).
  With `stream_tool_arguments=False` a call is emitted only once complete, as one delta carrying id, name
  and the full arguments; a client then never sees a call that is not complete.
- Cut by max_tokens or a stop string (`finish()` while a call is open). The cut call's text is never turned
  into content (raw markup in `content` breaks clients). In the default live mode the client may already
  have received the head and some argument fragments of the cut call: the parser then reports
  `partial_tool_call_emitted`, and `emitted_tool_calls` (what a non-streaming response returns) holds that
  call with the arguments streamed so far, so a streamed response and a non-streamed one carry the same
  calls. A call cut before its head was emitted (in a header that may still become valid) is in neither; a
  header cut after it can no longer be valid is content, as above.
- finish_reason (`finish_reason(base)`, base being the engine's "stop" or "length"): "tool_calls" only when
  the generation ended by itself ("stop") with at least one complete call and no cut one; otherwise `base`.
  So output cut by max_tokens is always "length", whatever calls it holds (as OpenAI reports truncation;
  vLLM's non-streaming chat gates "tool_calls" on "stop" likewise), and an agent never executes the calls of
  a truncated turn believing it complete.
- Malformed sequences are repaired leniently, and no text is lost: `<|tool_call_begin|>` or
  `<|tool_calls_section_end|>` while a call's arguments are open closes that call as complete; a valid header
  interrupted by a marker other than `<|tool_call_argument_begin|>` / `<|tool_call_end|>` is dropped (it is markup);
  markers that make no sense in the current state (`<|tool_call_end|>` in content, a second section begin inside a
  section, ...) are dropped, and the text around them stays in its field. Text inside a section but outside a call
  is content unless it is only whitespace (which separates calls): held until it is known not to be, it is streamed
  from its first non-whitespace character, and at the end of the output an unclosed section's text is content. Text
  after `<|tool_calls_section_end|>` is content.
- Marker text (tools active). The `text_delta` that comes with a marker token is not trusted: the marker
  string is known from its id. If that text contains the marker string, the text before it is treated as
  ordinary text that precedes the marker and the text after it as ordinary text that follows (an incremental
  detokenizer may release held bytes with the next token); any other non-empty text is treated as text that
  precedes the marker.

Public API: `ParserConfig`, `OutputParser`, `ParserDelta`, `ToolCallDelta`, `ToolCall`,
`ReleasedTextFeeder` (held-back stop-string text to the tokens that produced it), `parse_tool_call_id`,
`parse_output`, and the marker id constants.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from kimi.errors import ProtocolError

# ---- marker token ids (docs/model-format.md, Tokenizer) -------------------------------------------------------------
TOOL_CALLS_SECTION_BEGIN_ID = 163595
TOOL_CALLS_SECTION_END_ID = 163596
TOOL_CALL_BEGIN_ID = 163597
TOOL_CALL_ARGUMENT_BEGIN_ID = 163598
TOOL_CALL_END_ID = 163599
THINK_START_ID = 163606
THINK_END_ID = 163607

MARKER_TEXT: dict[int, str] = {
    TOOL_CALLS_SECTION_BEGIN_ID: "<|tool_calls_section_begin|>",
    TOOL_CALLS_SECTION_END_ID: "<|tool_calls_section_end|>",
    TOOL_CALL_BEGIN_ID: "<|tool_call_begin|>",
    TOOL_CALL_ARGUMENT_BEGIN_ID: "<|tool_call_argument_begin|>",
    TOOL_CALL_END_ID: "<|tool_call_end|>",
    THINK_START_ID: "<think>",
    THINK_END_ID: "</think>",
}
TOOL_MARKER_IDS = frozenset(
    (
        TOOL_CALLS_SECTION_BEGIN_ID,
        TOOL_CALLS_SECTION_END_ID,
        TOOL_CALL_BEGIN_ID,
        TOOL_CALL_ARGUMENT_BEGIN_ID,
        TOOL_CALL_END_ID,
    )
)
THINK_MARKER_IDS = frozenset((THINK_START_ID, THINK_END_ID))

_FUNCTIONS_PREFIX = "functions."

# parser states
_REASONING = "reasoning"
_CONTENT = "content"
_SECTION = "section"  # inside a tool section, between calls
_HEADER = "header"  # after <|tool_call_begin|>, collecting `functions.NAME:IDX`
_ARGS = "args"  # after <|tool_call_argument_begin|> of a valid header, collecting the JSON text
_NOT_A_CALL = "not_a_call"  # after <|tool_call_begin|> whose header is invalid: its text is content
_FINISHED = "finished"


# ---- configuration ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParserConfig:
    """Which parsers are active for one chat request.

    tools: parse tool calls (the request has `tools` and `tool_choice` is not "none"). When False, a tool
        marker's text (the marker string) goes verbatim into the current text field (see the module docstring).
    thinking: the model reasons first (a thinking model with thinking on). The output starts in
        reasoning; a leading `<think>` from the model is consumed.
    prompt_ends_in_think: the prompt's last token is `<think>` (K2.5/K2.6 templates). The output then
        starts in reasoning even if `thinking` is False (the prompt itself opened the block).
    stream_tool_arguments: True streams argument fragments as they arrive (first delta: index, id, name,
        arguments ""); False emits each call once, complete, in one delta.
    marker_text: ((marker id, its detokenized text), ...) of the served vocabulary, where it differs from
        MARKER_TEXT (K2-Instruct's vocabulary names ids 163606 / 163607 `<|reserved_token_...|>`, not `<think>`);
        with skip_special_tokens false that text arrives with the marker token and is left out of the fields.
    """

    tools: bool = False
    thinking: bool = False
    prompt_ends_in_think: bool = False
    stream_tool_arguments: bool = True
    marker_text: tuple[tuple[int, str], ...] | None = None

    @property
    def starts_in_reasoning(self) -> bool:
        """True when the first output token belongs to `reasoning_content`."""
        return self.thinking or self.prompt_ends_in_think

    @classmethod
    def for_prompt(
        cls,
        prompt_token_ids: Sequence[int],
        *,
        tools: bool,
        thinking_model: bool,
        stream_tool_arguments: bool = True,
        marker_text: tuple[tuple[int, str], ...] | None = None,
    ) -> ParserConfig:
        """Derive the reasoning settings from the rendered prompt's last tokens.

        prompt ends in `<think></think>` -> thinking off (template switched it off); ends in `<think>` ->
        reasoning, prompt_ends_in_think; otherwise `thinking = thinking_model` (K2-Thinking emits `<think>`
        itself; K2-Instruct does not reason).
        """
        tail = list(prompt_token_ids[-2:])
        thinking, ends_in_think = thinking_model, False
        if tail == [THINK_START_ID, THINK_END_ID]:
            thinking = False
        elif tail and tail[-1] == THINK_START_ID:
            thinking, ends_in_think = True, True
        return cls(
            thinking=thinking,
            prompt_ends_in_think=ends_in_think,
            tools=tools,
            stream_tool_arguments=stream_tool_arguments,
            marker_text=marker_text,
        )


# ---- output types -------------------------------------------------------------------------------------
@dataclass
class ToolCallDelta:
    """One streamed piece of one tool call (OpenAI `choices[0].delta.tool_calls[i]`).

    The first delta of a call has `id` and `name` set (and `arguments` "" in live mode, the full JSON text
    when `stream_tool_arguments=False`); later deltas have `id` and `name` None and an `arguments` fragment.
    """

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    @property
    def is_head(self) -> bool:
        """True for a call's first delta (carries id and name)."""
        return self.id is not None

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI streaming dict: head `{index, id, type, function: {name, arguments}}`, else
        `{index, function: {arguments}}`."""
        if self.is_head:
            return {
                "index": self.index,
                "id": self.id,
                "type": "function",
                "function": {"name": self.name, "arguments": self.arguments},
            }
        return {"index": self.index, "function": {"arguments": self.arguments}}


@dataclass
class ParserDelta:
    """What one `feed` (or `finish`) produced. Empty strings / an empty list mean "nothing"."""

    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def is_empty(self) -> bool:
        """True when there is nothing to send to the client."""
        return not self.content and not self.reasoning_content and not self.tool_calls

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI `delta` dict with only the non-empty fields (`content`, `reasoning_content`,
        `tool_calls`)."""
        out: dict[str, Any] = {}
        if self.reasoning_content:
            out["reasoning_content"] = self.reasoning_content
        if self.content:
            out["content"] = self.content
        if self.tool_calls:
            out["tool_calls"] = [t.to_openai() for t in self.tool_calls]
        return out

    def _add_fragment(self, index: int, text: str) -> None:
        if not text:
            return
        last = self.tool_calls[-1] if self.tool_calls else None
        if last is not None and last.index == index and not last.is_head:
            last.arguments += text
        else:
            self.tool_calls.append(ToolCallDelta(index=index, arguments=text))


@dataclass(frozen=True)
class ToolCall:
    """A complete tool call (OpenAI `message.tool_calls[i]`). `arguments` is the model's text as-is."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """`{id, type: "function", function: {name, arguments}}`."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


_NAME_RE = re.compile(r"[A-Za-z0-9_.:\-]+")
_PLAUSIBLE_HEADER_RE = re.compile(r"\s*[A-Za-z0-9_.:\-]*\s*")  # every prefix of a valid header matches


def parse_tool_call_id(header: str) -> tuple[str, str] | None:
    """Split a call header `functions.NAME:IDX` into `(id, name)`; None when it is not of that form.

    Surrounding whitespace is ignored and the `functions.` prefix may be missing; NAME is 1 or more of `A-Za-z0-9_.:-`
    and IDX ASCII digits. The id is always `functions.NAME:IDX` (`search:0` -> `functions.search:0`); the name is
    NAME (`functions.my.tool-v2:3` -> `my.tool-v2`, `functions.ns:tool:3` -> `ns:tool`). `call_0af3`, `get_weather`
    (no `:IDX`) and `functions.:0` give None. Source: docs/model-format.md, Chat and tool-call format.
    """
    text = header.strip()
    body = text[len(_FUNCTIONS_PREFIX) :] if text.startswith(_FUNCTIONS_PREFIX) else text
    name, sep, idx = body.rpartition(":")
    if not (sep and idx.isascii() and idx.isdigit() and _NAME_RE.fullmatch(name)):
        return None
    return f"{_FUNCTIONS_PREFIX}{name}:{idx}", name


def _split_marker_text(text: str, marker: str) -> tuple[str, str]:
    """Text that came with a marker token -> (ordinary text before it, ordinary text after it)."""
    if not text or text == marker:
        return "", ""
    i = text.find(marker)
    if i < 0:
        return text, ""
    return text[:i], text[i + len(marker) :]


# ---- the parser ---------------------------------------------------------------------------------------
class OutputParser:
    """Streaming reasoning + kimi_k2 tool-call parser for one request's generated tokens.

    Usage: `delta = parser.feed(token_id, text_delta)` for every generated token (in order), then
    `delta = parser.finish(text_tail)` once (text_tail: what the detokenizer's flush() returned). Each call
    returns a `ParserDelta` (possibly empty). After `finish()`: `tool_calls` (complete calls),
    `has_tool_calls`, `incomplete_tool_call`, `partial_tool_call_emitted`, `finish_reason(base)`.

    Raises RuntimeError on `feed`/`finish` after `finish()`. Never raises on model output, however malformed. See the
    module docstring for every behaviour choice; format source: docs/model-format.md, Chat and tool-call format.
    """

    def __init__(self, config: ParserConfig) -> None:
        self.config = config
        self._marker_text = MARKER_TEXT if config.marker_text is None else {**MARKER_TEXT, **dict(config.marker_text)}
        self._state = _REASONING if config.starts_in_reasoning else _CONTENT
        self._header = ""
        self._held = ""  # _SECTION: whitespace since the last marker, content once non-whitespace follows
        self._section_text = False  # _SECTION: the text since the last marker is content (it is not only whitespace)
        self._args: list[str] = []  # the open call's argument text, surrounding whitespace left out
        self._args_ws = ""  # trailing whitespace of the argument text so far (kept only if more text follows)
        self._call: tuple[int, str, str] | None = None  # (index, id, name) of the open call
        self._next_index = 0
        self._head_sent = False  # live mode: the open call's head delta has been emitted
        self._tool_calls: list[ToolCall] = []
        self._partial: ToolCall | None = None  # the call cut by finish() after its head was emitted
        self.incomplete_tool_call = False
        self.partial_tool_call_emitted = False

    # ---- public -------------------------------------------------------------------------------------
    @property
    def tool_calls(self) -> list[ToolCall]:
        """Complete tool calls so far, in order."""
        return list(self._tool_calls)

    @property
    def emitted_tool_calls(self) -> list[ToolCall]:
        """What the client of a stream has been sent, as whole calls: the complete calls, then (after `finish()`)
        the call cut by the end of the generation if its head was already emitted, with the arguments emitted so
        far. A non-streaming response returns these, so it carries the same calls as the stream."""
        return self._tool_calls + ([self._partial] if self._partial is not None else [])

    @property
    def has_tool_calls(self) -> bool:
        """True when at least one complete tool call was produced."""
        return bool(self._tool_calls)

    @property
    def in_reasoning(self) -> bool:
        """True while output goes to `reasoning_content`."""
        return self._state == _REASONING

    def feed(self, token_id: int, text_delta: str = "") -> ParserDelta:
        """Consume one generated token and its detokenized text; return what to stream now.

        Marker tokens (ids in `MARKER_TEXT`) are recognised by id; their text is handled as described in
        the module docstring. Every other token's text goes to the current field.
        """
        if self._state == _FINISHED:
            raise ProtocolError("OutputParser.feed called after finish()")
        out = ParserDelta()
        marker = self._marker_text.get(token_id)
        if marker is None or (not self.config.tools and token_id not in THINK_MARKER_IDS):
            # without tools a tool marker is ordinary text: its detokenized text (the marker string, which
            # skip_special_tokens keeps; "" when it is a stop token whose text is left out of the output)
            self._text(text_delta, out)
            return out
        before, after = _split_marker_text(text_delta, marker)
        self._text(before, out)
        self._marker(token_id, out)
        self._text(after, out)
        return out

    def is_marker(self, token_id: int) -> bool:
        """Whether `feed` treats token_id as a marker (a state change), not as ordinary text."""
        return token_id in self._marker_text and (self.config.tools or token_id in THINK_MARKER_IDS)

    def finish(self, text_tail: str = "") -> ParserDelta:
        """End of the stream (stop token, stop string, max_tokens or abort).

        `text_tail` is ordinary text still held by the detokenizer. An open call is dropped (see the
        module docstring); `incomplete_tool_call` / `partial_tool_call_emitted` record it. The text of an unclosed
        section, and of a header that can no longer become valid, is returned as content.
        """
        if self._state == _FINISHED:
            raise ProtocolError("OutputParser.finish called twice")
        out = ParserDelta()
        self._text(text_tail, out)
        if self._state == _HEADER:
            self.incomplete_tool_call = True  # a header that may still have become valid (else it is content)
        elif self._state == _ARGS:
            self.incomplete_tool_call = True
            if self._head_sent and self._call is not None:
                self.partial_tool_call_emitted = True
                _, call_id, name = self._call
                self._partial = ToolCall(id=call_id, name=name, arguments="".join(self._args))
        self._state = _FINISHED
        return out

    def finish_reason(self, base: str) -> str:
        """The OpenAI finish_reason given the engine's own ("stop" or "length", or anything else).

        "tool_calls" when the generation ended by itself (`base` "stop") with at least one complete call and no
        call cut after its head was streamed; else `base`. So "length" (cut by max_tokens) is never relabelled:
        the client can tell a truncated turn from a complete one.
        """
        if base == "stop" and self._tool_calls and not self.partial_tool_call_emitted:
            return "tool_calls"
        return base

    # ---- internals ----------------------------------------------------------------------------------
    def _text(self, text: str, out: ParserDelta) -> None:
        if not text:
            return
        st = self._state
        if st in (_CONTENT, _NOT_A_CALL):
            out.content += text
        elif st == _REASONING:
            out.reasoning_content += text
        elif st == _SECTION:
            if self._section_text:
                out.content += text
            elif text.isspace():
                self._held += text
            else:  # not only whitespace: content, from the whitespace held before it on
                out.content += self._held + text
                self._held = ""
                self._section_text = True
        elif st == _HEADER:
            self._header += text
            if not _PLAUSIBLE_HEADER_RE.fullmatch(self._header):  # no valid header starts so: it is text
                out.content += self._header
                self._header = ""
                self._state = _NOT_A_CALL
        elif st == _ARGS:
            if not self._args:
                text = text.lstrip()
            body = text.rstrip()
            if not body:
                if self._args:
                    self._args_ws += text
                return
            piece = self._args_ws + body
            self._args_ws = text[len(body) :]
            self._args.append(piece)
            if self._head_sent and self._call is not None:
                out._add_fragment(self._call[0], piece)

    def _enter(self, state: str) -> None:
        """Change state at a marker: the section's held whitespace is dropped."""
        self._state = state
        self._held = ""
        self._section_text = False

    def _marker(self, tid: int, out: ParserDelta) -> None:
        st = self._state
        if tid == THINK_START_ID:
            return  # consumed wherever it appears
        if tid == THINK_END_ID:
            if st == _REASONING:
                self._enter(_CONTENT)
            return
        # tool markers (with tools; without, `feed` passes their text on as ordinary text)
        if tid == TOOL_CALL_ARGUMENT_BEGIN_ID:
            if st == _HEADER:
                self._open_args(out)
            return  # elsewhere stray: dropped
        in_call = st in (_HEADER, _ARGS, _NOT_A_CALL)
        if tid == TOOL_CALL_END_ID:
            if st == _HEADER:
                self._open_args(out)  # a call without arguments ("{}"), or a header that is not one
            if in_call:
                self._close_call(out)
                self._enter(_SECTION)
            return  # elsewhere stray: dropped
        if st == _HEADER:
            self._end_header(out)
        elif st == _ARGS:
            self._close_call(out)
        if tid == TOOL_CALL_BEGIN_ID:
            self._enter(_HEADER)
        elif tid == TOOL_CALLS_SECTION_BEGIN_ID:
            self._enter(_SECTION)
        elif tid == TOOL_CALLS_SECTION_END_ID and (in_call or st == _SECTION):
            self._enter(_CONTENT)

    def _end_header(self, out: ParserDelta) -> None:
        """A marker ends a header without starting arguments: a valid header is dropped (markup); any other
        header's text is content."""
        if parse_tool_call_id(self._header) is None:
            out.content += self._header
        self._header = ""

    def _open_args(self, out: ParserDelta) -> None:
        parsed = parse_tool_call_id(self._header)
        if parsed is None:  # not a call: the header's text, and what follows, is content
            out.content += self._header
            self._header = ""
            self._enter(_NOT_A_CALL)
            return
        self._header = ""
        self._args = []
        self._args_ws = ""
        self._enter(_ARGS)
        call_id, name = parsed
        if self.config.stream_tool_arguments:
            self._call = (self._next_index, call_id, name)
            self._next_index += 1
            out.tool_calls.append(ToolCallDelta(index=self._call[0], id=call_id, name=name, arguments=""))
            self._head_sent = True
        else:
            self._call = (-1, call_id, name)  # index assigned on completion
            self._head_sent = False

    def _close_call(self, out: ParserDelta) -> None:
        if self._call is not None:
            index, call_id, name = self._call
            if not self._args:
                self._args.append("{}")
                if self._head_sent:
                    out._add_fragment(index, "{}")
            args = "".join(self._args)
            if not self.config.stream_tool_arguments:
                index = self._next_index
                self._next_index += 1
                out.tool_calls.append(ToolCallDelta(index=index, id=call_id, name=name, arguments=args))
            self._tool_calls.append(ToolCall(id=call_id, name=name, arguments=args))
        self._args = []
        self._args_ws = ""
        self._call = None
        self._head_sent = False


# ---- non-streaming helper -----------------------------------------------------------------------------
@runtime_checkable
class _Detokenizer(Protocol):
    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class ReleasedTextFeeder:
    """Feeds an `OutputParser` the text that a stop-string checker released, attributed to the tokens that produced it.

    The controller holds back generated text that may begin a stop string (kimi.controller.stops) and sends it with
    a later token's output, so an output's text can hold characters of earlier tokens. Fed as the later token's
    text, held reasoning text would land in `content` when a `</think>` came in between (and held text could cross
    a tool-call marker likewise). This feeder keeps the tokens whose text is not all out yet, in order, and gives each
    to the parser only after the text produced before it: an ordinary token's text as it is released, a marker
    (with its own text) once all of that text is out.

    feed(token_id, text, held_before, held_after, last): one output of the request (its single token and released
    text); held_before / held_after: the characters the checker held back before / after it
    (`Request.stop_held`); last: the request ends with it (text past a matched stop string was cut: the tokens whose
    text is not out are then fed with what was released of it). Returns what to stream now.

    A stop string's cut ends the output where it falls, markers included: at the end, a marker whose text the cut
    reached (all or part of it), and every marker after the first token the cut reached, is not fed, so the parser
    never sees a `<|tool_call_end|>` or `<|tool_call_argument_begin|>` that the stop string removed (the call stays
    open and is reported as cut, a header as dropped), and no part of a marker's text lands in a field.
    """

    def __init__(self, parser: OutputParser) -> None:
        self.parser = parser
        self._pending: deque[list[Any]] = deque()  # [token id, characters not released yet, released text (markers)]

    def feed(self, token_id: int, text: str, held_before: int, held_after: int, last: bool = False) -> ParserDelta:
        out = ParserDelta()
        pending = self._pending
        pending.append([token_id, max(0, len(text) - held_before + held_after), ""])  # this token's own characters
        parser = self.parser
        cut = False  # (last) the cut of a stop string has been reached: later markers are not in the output
        while pending:
            entry = pending[0]
            tid, rest = entry[0], entry[1]
            piece, text = text[:rest], text[rest:]
            entry[1] = rest - len(piece)
            marker = parser.is_marker(tid)
            if marker:  # fed whole, once all its text is out
                entry[2] += piece
            elif piece:
                _merge(out, parser.feed(tid, piece))
            if entry[1] and not last:
                break
            cut = cut or entry[1] > 0
            if marker and not cut:
                _merge(out, parser.feed(tid, entry[2]))
            pending.popleft()
        if text:  # not expected (the released text never exceeds what was produced): kept, as ordinary text
            _merge(out, parser.feed(-1, text))
        return out


def _merge(out: ParserDelta, d: ParserDelta) -> None:
    """Append delta d to out (a call's argument fragments joined as ParserDelta builds them)."""
    out.content += d.content
    out.reasoning_content += d.reasoning_content
    for t in d.tool_calls:
        if t.is_head:
            out.tool_calls.append(t)
        else:
            out._add_fragment(t.index, t.arguments)


def parse_output(
    token_ids: Sequence[int],
    text_deltas: Sequence[str] | _Detokenizer,
    config: ParserConfig,
    text_tail: str = "",
) -> tuple[str | None, str | None, list[ToolCall]]:
    """Run `OutputParser` over a whole output; return `(content, reasoning_content, tool_calls)`.

    text_deltas: either one text delta per token id (same length as token_ids) or an incremental
    detokenizer (`push(token_id) -> str`, `flush() -> str`, the kimi.tokenizer contract), in which case
    its flush() output is the text tail. content / reasoning_content are None when empty. tool_calls holds
    `emitted_tool_calls`: the calls a stream of the same output carries (the complete ones, then a call cut after
    its head was emitted). Raises ValueError if the text deltas and token ids differ in length.
    """
    parser = OutputParser(config)
    content: list[str] = []
    reasoning: list[str] = []

    def take(d: ParserDelta) -> None:
        content.append(d.content)
        reasoning.append(d.reasoning_content)

    if isinstance(text_deltas, _Detokenizer):
        for tid in token_ids:
            take(parser.feed(tid, text_deltas.push(tid)))
        text_tail = text_deltas.flush() + text_tail
    else:
        deltas = list(text_deltas)
        if len(deltas) != len(token_ids):
            raise ValueError(f"parse_output: {len(token_ids)} token ids but {len(deltas)} text deltas")
        for tid, text in zip(token_ids, deltas):
            take(parser.feed(tid, text))
    take(parser.finish(text_tail))
    c = "".join(content)
    r = "".join(reasoning)
    return (c or None), (r or None), parser.emitted_tool_calls
