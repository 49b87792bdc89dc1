"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: the Anthropic Messages API over the chat pipeline.

A Messages request is checked in Anthropic's shapes (errors name its fields: `messages[1].content[0].type`,
`stop_sequences`, `output_config.format`), translated to the chat route's OpenAI fields (`to_chat_body`) and run
through `ChatAPI._chat_start`: the same template, tokenizer, engine, parsers, guided decoding, stops, limits and
metrics as `/v1/chat/completions`. The parsed output is rendered as a `message` (content blocks `thinking`, `text`,
`tool_use`) or as Anthropic's event stream.

Tool-use ids: a call the model makes has Kimi's id `functions.NAME:IDX`, returned as `toolu_` + its URL-safe base64
(no padding), which fits Anthropic's `^[a-zA-Z0-9_-]+$`; such an id in the history is decoded back, so the model sees
its own ids. Any other id (from another model) is rewritten by the chat route (kimi.controller.chat,
normalize_tool_call_ids).
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from kimi.controller.chat import encode_chat
from kimi.controller.http.chat import ChatAPI, _ChatRun, final_message_parts
from kimi.controller.http.common import _Choice, with_parser_tail
from kimi.controller.http.streaming import _SSE
from kimi.controller.offload import run_sized
from kimi.controller.parsers import OutputParser, ToolCall, ToolCallDelta
from kimi.controller.validation import BadRequest, Fields
from kimi.protocol import RequestOutput

# the request fields of /v1/messages (count_tokens: all but the generation ones)
MESSAGES_FIELDS = frozenset(
    {
        "model",
        "max_tokens",
        "messages",
        "system",
        "tools",
        "tool_choice",
        "stop_sequences",
        "temperature",
        "top_p",
        "top_k",
        "stream",
        "metadata",
        "thinking",
        "output_config",
        "cache_control",
        "service_tier",
        "speed",
        "inference_geo",
        "diagnostics",
        "container",
        "user_profile_id",
        "workspace_id",
    }
)
COUNT_TOKENS_FIELDS = frozenset(
    {
        "model",
        "messages",
        "system",
        "tools",
        "tool_choice",
        "thinking",
        "output_config",
        "cache_control",
        "speed",
        "user_profile_id",
        "workspace_id",
    }
)
# fields the anthropic SDK declares that change nothing here at these values -> (the values, why others are refused)
_NOOP_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "speed": ((None, "standard"), "must be 'standard' (one speed is served)"),
    "inference_geo": ((None,), "must be null (the server runs where it runs)"),
    "diagnostics": ((None,), "must be null (no cache-miss diagnostics are made)"),
    "container": ((None,), "must be null (server tools are not supported)"),
}
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    529: "overloaded_error",
}
# Anthropic's status for overloaded_error; kimi's retryable 503s (loading, a full queue, shutting down, a worker
# failure) are sent with it on these routes (the anthropic SDK retries 529 as it retries 5xx)
OVERLOADED = 529
_EFFORTS = ("low", "medium", "high", "xhigh", "max")
_TOOL_KEYS = frozenset(
    {
        "name",
        "description",
        "input_schema",
        "cache_control",
        "type",
        "strict",
        "eager_input_streaming",
        "defer_loading",
        "input_examples",
        "allowed_callers",
    }
)
# tool fields accepted at the values that change nothing here (tool input always streams as it is generated)
_TOOL_NOOPS: dict[str, tuple[tuple[Any, ...], str]] = {
    "eager_input_streaming": ((None, True, False), "must be a boolean"),
    "defer_loading": ((None, False), "must be false (tool search is not supported)"),
    "input_examples": ((None, ()), "must be empty (examples are not rendered into the prompt)"),
    "allowed_callers": ((None, ("direct",)), "must be ['direct'] (code execution is not supported)"),
}
# chat-route field paths a translated body's errors may name -> the Anthropic field they came from (first match;
# None: the whole Anthropic field)
_PARAM_NAMES: tuple[tuple[str, str, bool], ...] = (
    ("response_format.json_schema", "output_config.format", True),
    ("response_format", "output_config.format", True),
    ("stop", "stop_sequences", True),
    ("chat_template_kwargs", "thinking", False),
    ("parallel_tool_calls", "tool_choice.disable_parallel_tool_use", False),
    ("tools", "tools", True),
)


def anthropic_error(message: str, status: int) -> JSONResponse:
    """Anthropic's error body `{"type": "error", "error": {"type", "message"}}` with HTTP status `status`; kimi's
    503 (retry later) is sent as Anthropic's 529 overloaded_error, with Retry-After."""
    if status == 503:
        status = OVERLOADED
    kind = _ERROR_TYPES.get(status, "api_error")
    headers = {"Retry-After": "1"} if status == OVERLOADED else None
    return JSONResponse(
        {"type": "error", "error": {"type": kind, "message": message}}, status_code=status, headers=headers
    )


def _renamed(e: BadRequest) -> BadRequest:
    """A BadRequest about a translated chat field, re-worded to name the Anthropic field it came from."""
    if e.param is None:
        return e
    for old, new, keep_rest in _PARAM_NAMES:
        if e.param == old or e.param.startswith(old + ".") or e.param.startswith(old + "["):
            rest = e.param[len(old) :] if keep_rest else ""
            if old == "tools":  # the chat route's tools[i].function.parameters... -> tools[i].input_schema...
                rest = rest.replace(".function.parameters", ".input_schema").replace(".function.", ".")
            param = new + rest
            return BadRequest(e.message.replace(f"'{e.param}'", f"'{param}'"), param, e.status, e.code)
    return e


def tool_use_id(call_id: str) -> str:
    """Kimi's call id `functions.NAME:IDX` -> `toolu_<URL-safe base64 of it, unpadded>`."""
    return "toolu_" + base64.urlsafe_b64encode(call_id.encode()).decode().rstrip("=")


def kimi_call_id(tool_id: str) -> str:
    """The inverse of `tool_use_id`; an id not made by it is returned as sent."""
    if tool_id.startswith("toolu_"):
        b = tool_id[len("toolu_") :]
        try:
            raw = base64.urlsafe_b64decode(b + "=" * (-len(b) % 4)).decode()
        except (binascii.Error, UnicodeDecodeError, ValueError):
            return tool_id
        if raw.startswith("functions.") and ":" in raw:
            return raw
    return tool_id


def _text_block(b: Any, q: str) -> str:
    """One `{"type": "text", "text"}` block (cache_control / citations allowed) at path q -> its text."""
    if not isinstance(b, dict) or b.get("type") != "text":
        kind = b.get("type") if isinstance(b, dict) else None
        raise BadRequest(
            f"'{q}.type' must be 'text' (this server takes text only), got {kind!r:.40}",
            f"{q}.type" if isinstance(b, dict) else q,
        )
    if not isinstance(b.get("text"), str):
        raise BadRequest(f"'{q}.text' must be a string", f"{q}.text")
    for k in b:
        if k not in ("type", "text", "cache_control", "citations"):
            raise BadRequest(f"'{q}.{k}' is not supported by this server", f"{q}.{k}")
    text: str = b["text"]
    return text


def _text_blocks(v: Any, path: str) -> str:
    """A string, or a list of text blocks -> its text."""
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise BadRequest(f"'{path}' must be a string or a list of text blocks", path)
    return "".join(_text_block(b, f"{path}[{j}]") for j, b in enumerate(v))


def _object(v: Any, path: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise BadRequest(f"'{path}' must be an object", path)
    return v


def _messages(system: Any, messages: Any) -> list[dict[str, Any]]:
    """Anthropic `system` + `messages` -> OpenAI chat messages. A user turn's `tool_result` blocks become `tool`
    messages (before the turn's text); an assistant turn's `thinking` becomes its `reasoning_content` and its
    `tool_use` blocks its `tool_calls`. Raises BadRequest naming the Anthropic path."""
    out: list[dict[str, Any]] = []
    if system is not None:
        out.append({"role": "system", "content": _text_blocks(system, "system")})
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        p = f"messages[{i}]"
        m = _object(m, p)
        for k in m:
            if k not in ("role", "content"):
                raise BadRequest(f"'{p}.{k}' is not supported by this server", f"{p}.{k}")
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise BadRequest(f"'{p}.role' must be 'user' or 'assistant', got {role!r:.40}", f"{p}.role")
        c = m.get("content")
        if isinstance(c, str):
            out.append({"role": role, "content": c})
            continue
        if not isinstance(c, list):
            raise BadRequest(f"'{p}.content' must be a string or a list of content blocks", f"{p}.content")
        text: list[str] = []
        thinking: list[str] = []
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        allowed = ("text", "tool_result") if role == "user" else ("text", "thinking", "redacted_thinking", "tool_use")
        for j, b in enumerate(c):
            q = f"{p}.content[{j}]"
            b = _object(b, q)
            kind = b.get("type")
            if kind not in allowed:
                raise BadRequest(
                    f"'{q}.type' must be one of {', '.join(allowed)} in a {role} message (this server takes text "
                    f"only), got {kind!r:.40}",
                    f"{q}.type",
                )
            if kind == "text":
                text.append(_text_block(b, q))
            elif kind == "thinking":
                if not isinstance(b.get("thinking"), str):
                    raise BadRequest(f"'{q}.thinking' must be a string", f"{q}.thinking")
                thinking.append(b["thinking"])
            elif kind == "tool_use":
                calls.append(_tool_use_call(b, q))
            elif kind == "tool_result":
                results.append(_tool_result_message(b, q))
        out.extend(results)
        if role == "user":
            if text or not results:
                out.append({"role": "user", "content": "".join(text)})
            continue
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
        if thinking:
            msg["reasoning_content"] = "".join(thinking)
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def _tool_use_call(b: dict[str, Any], q: str) -> dict[str, Any]:
    """A `tool_use` block (at path q) -> an OpenAI tool call. Raises BadRequest naming the Anthropic path."""
    if not isinstance(b.get("id"), str) or not b["id"]:
        raise BadRequest(f"'{q}.id' must be a non-empty string", f"{q}.id")
    if not isinstance(b.get("name"), str) or not b["name"]:
        raise BadRequest(f"'{q}.name' must be a non-empty string", f"{q}.name")
    args = _object(b.get("input"), f"{q}.input")
    return {
        "id": kimi_call_id(b["id"]),
        "type": "function",
        "function": {"name": b["name"], "arguments": args},
    }


def _tool_result_message(b: dict[str, Any], q: str) -> dict[str, Any]:
    """A `tool_result` block (at path q) -> an OpenAI `tool` message. Raises BadRequest naming the Anthropic
    path."""
    if not isinstance(b.get("tool_use_id"), str) or not b["tool_use_id"]:
        raise BadRequest(f"'{q}.tool_use_id' must be a non-empty string", f"{q}.tool_use_id")
    for k in b:
        if k not in ("type", "tool_use_id", "content", "is_error", "cache_control"):
            raise BadRequest(f"'{q}.{k}' is not supported by this server", f"{q}.{k}")
    body = b.get("content")
    result = "" if body is None else _text_blocks(body, f"{q}.content")
    is_error = b.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise BadRequest(f"'{q}.is_error' must be a boolean", f"{q}.is_error")
    if is_error:  # Kimi's format has no error flag: the result says so in words
        result = f"Error: {result}"
    return {"role": "tool", "tool_call_id": kimi_call_id(b["tool_use_id"]), "content": result}


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list) or not tools:
        raise BadRequest("'tools' must be a non-empty list", "tools")
    out = []
    for i, t in enumerate(tools):
        p = f"tools[{i}]"
        t = _object(t, p)
        if t.get("type") not in (None, "custom"):
            raise BadRequest(
                f"'{p}.type' must be 'custom' (server tools are not supported), got {t['type']!r:.60}", f"{p}.type"
            )
        for k in t:
            if k not in _TOOL_KEYS:
                raise BadRequest(f"'{p}.{k}' is not supported by this server", f"{p}.{k}")
        for k, (ok, why) in _TOOL_NOOPS.items():
            v = t.get(k)
            if (tuple(v) if isinstance(v, list) else v) not in ok:
                raise BadRequest(f"'{p}.{k}' {why}", f"{p}.{k}")
        if not isinstance(t.get("name"), str):
            raise BadRequest(f"'{p}.name' must be a string", f"{p}.name")
        fn: dict[str, Any] = {"name": t["name"], "parameters": _object(t.get("input_schema"), f"{p}.input_schema")}
        if t.get("description") is not None:
            if not isinstance(t["description"], str):
                raise BadRequest(f"'{p}.description' must be a string", f"{p}.description")
            fn["description"] = t["description"]
        if t.get("strict") is not None:
            if not isinstance(t["strict"], bool):
                raise BadRequest(f"'{p}.strict' must be a boolean", f"{p}.strict")
            fn["strict"] = t["strict"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(tc: Any, names: list[str]) -> tuple[Any, bool]:
    """Anthropic `tool_choice` -> (OpenAI tool_choice, parallel_tool_calls)."""
    tc = _object(tc, "tool_choice")
    kind = tc.get("type")
    allowed: tuple[str, ...] = (
        ("type", "name", "disable_parallel_tool_use") if kind == "tool" else ("type", "disable_parallel_tool_use")
    )
    if kind == "none":
        allowed = ("type",)
    for k in tc:
        if k not in allowed:
            raise BadRequest(f"'tool_choice.{k}' is not allowed with type {kind!r:.20}", f"tool_choice.{k}")
    dp = tc.get("disable_parallel_tool_use", False)
    if not isinstance(dp, bool):
        raise BadRequest(
            "'tool_choice.disable_parallel_tool_use' must be a boolean", "tool_choice.disable_parallel_tool_use"
        )
    if kind == "auto":
        return "auto", not dp
    if kind == "any":
        return "required", not dp
    if kind == "none":
        return "none", True
    if kind == "tool":
        name = tc.get("name")
        if name is None:
            raise BadRequest("'tool_choice.name' is required with type 'tool'", "tool_choice.name")
        if not isinstance(name, str) or name not in names:
            raise BadRequest(f"'tool_choice.name' must name a tool in 'tools', got {name!r:.60}", "tool_choice.name")
        return {"type": "function", "function": {"name": name}}, not dp
    raise BadRequest(f"'tool_choice.type' must be auto, any, tool or none, got {kind!r:.40}", "tool_choice.type")


def _thinking(th: Any, max_tokens: int | None) -> tuple[bool, bool]:
    """Anthropic `thinking` -> (Kimi thinking on, thinking shown in the reply)."""
    th = _object(th, "thinking")
    kind = th.get("type")
    if kind == "disabled":
        keys: tuple[str, ...] = ("type",)
    elif kind == "enabled":
        keys = ("type", "budget_tokens", "display")
        b = th.get("budget_tokens")
        if not isinstance(b, int) or isinstance(b, bool) or b < 1024:
            raise BadRequest("'thinking.budget_tokens' must be an integer >= 1024", "thinking.budget_tokens")
        if max_tokens is not None and b >= max_tokens:
            raise BadRequest("'thinking.budget_tokens' must be less than 'max_tokens'", "thinking.budget_tokens")
    elif kind == "adaptive":
        keys = ("type", "display")
    else:
        raise BadRequest(f"'thinking.type' must be enabled, adaptive or disabled, got {kind!r:.40}", "thinking.type")
    for k in th:
        if k not in keys:
            raise BadRequest(f"'thinking.{k}' is not allowed with type {kind!r}", f"thinking.{k}")
    display = th.get("display")
    if display not in (None, "summarized", "omitted"):
        raise BadRequest("'thinking.display' must be 'summarized' or 'omitted'", "thinking.display")
    return kind != "disabled", display != "omitted"


def to_chat_body(body: dict[str, Any], count_only: bool = False) -> tuple[dict[str, Any], bool]:
    """An Anthropic Messages body -> (the equivalent /v1/chat/completions body, thinking shown in the reply).

    count_only: a count_tokens body (no max_tokens, no sampling fields). Fields outside MESSAGES_FIELDS (or
    COUNT_TOKENS_FIELDS) are a 400 naming them; `model` is the caller's (ServerBase._body checks it). Raises
    BadRequest naming the Anthropic field."""
    fields = COUNT_TOKENS_FIELDS if count_only else MESSAGES_FIELDS
    for k in body:
        if k not in fields:
            if count_only and k in MESSAGES_FIELDS:
                raise BadRequest(f"'{k}' is not a field of /v1/messages/count_tokens", k)
            raise BadRequest(f"'{k}' is not supported by this server", k)
    for k, (ok, why) in _NOOP_FIELDS.items():
        if body.get(k) not in ok:
            raise BadRequest(f"'{k}' {why}", k)
    for k in ("user_profile_id", "workspace_id"):
        if body.get(k) is not None and not isinstance(body[k], str):
            raise BadRequest(f"'{k}' must be a string", k)
    max_tokens = body.get("max_tokens")
    if not count_only:
        if max_tokens is None:
            raise BadRequest("'max_tokens' is required", "max_tokens")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise BadRequest("'max_tokens' must be an integer >= 1", "max_tokens")
    out: dict[str, Any] = {"messages": _messages(body.get("system"), body.get("messages"))}
    if not count_only:
        out["max_tokens"] = max_tokens
        for k in ("temperature", "top_p", "top_k", "stream"):
            if body.get(k) is not None:
                out[k] = body[k]
        if body.get("stop_sequences") is not None:
            if not isinstance(body["stop_sequences"], list):
                raise BadRequest("'stop_sequences' must be a list of strings", "stop_sequences")
            out["stop"] = body["stop_sequences"]
        md = body.get("metadata")
        if md is not None:
            md = _object(md, "metadata")
            if md.get("user_id") is not None and not isinstance(md["user_id"], str):
                raise BadRequest("'metadata.user_id' must be a string", "metadata.user_id")
        if body.get("cache_control") is not None:  # the prefix cache is automatic
            _object(body["cache_control"], "cache_control")
        if body.get("service_tier") not in (None, "auto", "standard_only"):
            raise BadRequest("'service_tier' must be 'auto' or 'standard_only'", "service_tier")
    if body.get("tools") is not None:
        out["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        names = [t["function"]["name"] for t in out.get("tools", [])]
        if "tools" not in out:
            kind = _object(body["tool_choice"], "tool_choice").get("type")
            if kind in ("auto", "any", "tool"):
                raise BadRequest(f"'tool_choice' of type {kind!r} needs 'tools'", "tool_choice")
            _tool_choice(body["tool_choice"], names)  # `none`, or a 400 naming what is wrong
        else:
            out["tool_choice"], parallel = _tool_choice(body["tool_choice"], names)
            if not parallel:
                out["parallel_tool_calls"] = False
    show_thinking = True
    if body.get("thinking") is not None:
        on, show_thinking = _thinking(body["thinking"], max_tokens)
        out["chat_template_kwargs"] = {"thinking": on}
    if body.get("output_config") is not None:
        _output_config(body["output_config"], out)
    return out, show_thinking


def _output_config(oc: Any, out: dict[str, Any]) -> None:
    """Anthropic `output_config` (effort, format) into the chat body `out`: chat_template_kwargs'
    reasoning_effort and response_format. Raises BadRequest naming the field."""
    oc = _object(oc, "output_config")
    for k in oc:
        if k not in ("format", "effort"):
            raise BadRequest(f"'output_config.{k}' is not supported by this server", f"output_config.{k}")
    effort = oc.get("effort")
    if effort is not None:  # passed to the template (Kimi's templates do not read it)
        if effort not in _EFFORTS:
            raise BadRequest(f"'output_config.effort' must be one of {', '.join(_EFFORTS)}", "output_config.effort")
        out.setdefault("chat_template_kwargs", {})["reasoning_effort"] = effort
    fmt = oc.get("format")
    if fmt is not None:
        fmt = _object(fmt, "output_config.format")
        if fmt.get("type") != "json_schema":
            raise BadRequest("'output_config.format.type' must be 'json_schema'", "output_config.format.type")
        for k in fmt:
            if k not in ("type", "schema"):
                raise BadRequest(f"'output_config.format.{k}' is not supported", f"output_config.format.{k}")
        schema = _object(fmt.get("schema"), "output_config.format.schema")
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}


def _tool_input(arguments: str) -> dict[str, Any]:
    """A call's argument text -> `tool_use.input`; text that is not a JSON object is kept under `"arguments"`."""
    try:
        v = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {"arguments": arguments}
    return v if isinstance(v, dict) else {"arguments": arguments}


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: ".encode() + json.dumps({"type": kind, **data}, ensure_ascii=False).encode() + b"\n\n"


class AnthropicAPI(ChatAPI):
    """The /v1/messages routes (a mixin of OpenAIServer)."""

    def _stop_reason(self, c: _Choice) -> tuple[str | None, str | None]:
        """(Anthropic stop_reason, stop_sequence) of a finished choice."""
        o = c.final
        assert c.parser is not None
        base = o.finish_reason
        if base == "length":
            return "max_tokens", None
        if base == "stop":
            if c.parser.finish_reason("stop") == "tool_calls":
                return "tool_use", None
            if isinstance(o.stop_reason, str):
                return "stop_sequence", o.stop_reason
            return "end_turn", None
        return base, None

    def _message_usage(self, run: _ChatRun, c: _Choice) -> dict[str, Any]:
        n_prompt = len(run.ids)
        cached = c.last.num_cached_tokens if c.last else 0
        return {
            "input_tokens": n_prompt - cached,
            "output_tokens": c.last.num_output_tokens if c.last else 0,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
        }

    async def messages(self, request: HTTPRequest) -> Response | _SSE:
        """`POST /v1/messages`."""
        try:
            f = await self._body(request)
            chat, show_thinking = to_chat_body(f.body)
            cf = Fields(chat)
            cf.body_bytes = f.body_bytes
            try:
                run = await self._chat_start(cf, endpoint="/v1/messages")
            except BadRequest as e:
                raise _renamed(e) from None
        except BadRequest as e:
            return anthropic_error(e.message, e.status)
        c = _Choice(
            0, run.sib.ids[0], parser=OutputParser(run.pcfg), request=run.sib.requests[0] if run.sib.requests else None
        )
        msg_id = "msg_" + run.rid.removeprefix("chatcmpl-")
        reasons = run.pcfg.starts_in_reasoning
        if not run.g.stream:
            err = await self._collect(request, run.sib, [c])
            if err is not None:
                return anthropic_error(err, 503 if err == self.engine.closing else 500)
            text, thought, calls = final_message_parts(c, run.parallel)
            assert c.parser is not None
            calls = calls[: len(c.parser.tool_calls)]  # a call cut by the end of the output has no tool_use block
            content: list[dict[str, Any]] = []
            if reasons and thought:  # display "omitted": the block with its text left out, as Anthropic does
                content.append({"type": "thinking", "thinking": thought if show_thinking else "", "signature": ""})
            if text or not (calls or content):
                content.append({"type": "text", "text": text})
            content.extend(self._tool_use(t) for t in calls)
            stop_reason, stop_sequence = self._stop_reason(c)
            return JSONResponse(
                {
                    "id": msg_id,
                    "type": "message",
                    "role": "assistant",
                    "model": self.model_name,
                    "content": content,
                    "stop_reason": stop_reason,
                    "stop_sequence": stop_sequence,
                    "usage": self._message_usage(run, c),
                }
            )
        eager = frozenset(t["name"] for t in f.body.get("tools") or () if t.get("eager_input_streaming") is True)
        return self._message_stream(run, c, msg_id, reasons, show_thinking, eager)

    @staticmethod
    def _tool_use(t: ToolCall) -> dict[str, Any]:
        return {"type": "tool_use", "id": tool_use_id(t.id), "name": t.name, "input": _tool_input(t.arguments)}

    def _message_stream(
        self, run: _ChatRun, c: _Choice, msg_id: str, reasons: bool, show_thinking: bool, eager: frozenset[str]
    ) -> _SSE:
        """The event stream: message_start (with the first output, when the prefix-cache hit that splits the prompt
        into input_tokens and cache_read_input_tokens is known: the same split message_delta reports), ping, content
        blocks (thinking / text / tool_use, each started,
        delta'd and stopped in turn; a thinking block under display "omitted" has no deltas), message_delta (stop
        reason, usage), message_stop; an error is an `error` event that ends the stream. A tool_use block is sent
        once its call is complete (a call cut by the end of the output is in no block, as in the non-streamed
        message), except for the tools named in `eager` (`eager_input_streaming`), whose input streams as it is
        generated."""
        stream = _MessageStream(self, run, c, reasons, show_thinking, eager, msg_id)
        return _SSE(run.sib, stream.render, done=b"")

    async def count_tokens(self, request: HTTPRequest) -> Response:
        """`POST /v1/messages/count_tokens`: `{"input_tokens": N}`, the prompt tokens /v1/messages would give the
        same messages, system, tools and thinking."""
        try:
            f = await self._body(request)
            chat, _ = to_chat_body(f.body, count_only=True)
            try:
                cf = Fields(chat)
                tools, _, _ = self._tool_args(cf)
                kwargs = self._template_kwargs(cf)
                ids = await run_sized(
                    f.body_bytes,
                    encode_chat,
                    self.tokenizer,
                    chat["messages"],
                    tools,
                    kwargs,
                    self.engine.max_model_len,
                )
            except BadRequest as e:
                raise _renamed(e) from None
        except BadRequest as e:
            return anthropic_error(e.message, e.status)
        return JSONResponse({"input_tokens": len(ids)})


class _MessageStream:
    """The state of one streamed /v1/messages reply (`AnthropicAPI._message_stream`): the open content block's
    index, kind and tool-call index."""

    def __init__(
        self,
        api: AnthropicAPI,
        run: _ChatRun,
        c: _Choice,
        reasons: bool,
        show_thinking: bool,
        eager: frozenset[str] = frozenset(),
        msg_id: str = "",
    ) -> None:
        assert c.parser is not None
        self.api, self.run, self.c, self.p = api, run, c, c.parser
        self.msg_id = msg_id
        self.started = False  # message_start sent
        self.reasons, self.show_thinking, self.eager = reasons, show_thinking, eager
        self.state: dict[str, Any] = {"index": -1, "kind": None, "call": None}
        self.live: set[int] = set()  # the calls (response index) whose tool_use block streams as generated
        self.complete = 0  # the complete calls (the parser's tool_calls) looked at so far

    def open_block(self, kind: str, block: dict[str, Any], call: int | None = None) -> bytes:
        """Stop the open block, start `block` (of `kind`; a tool_use block: of call `call`); its events."""
        state = self.state
        data = self.close_block()
        state["index"] += 1
        state["kind"], state["call"] = kind, call
        return data + _event("content_block_start", {"index": state["index"], "content_block": block})

    def close_block(self) -> bytes:
        """The open block's content_block_stop (none open: b"")."""
        if self.state["kind"] is None:
            return b""
        self.state["kind"] = None
        return _event("content_block_stop", {"index": self.state["index"]})

    def delta(self, d: dict[str, Any]) -> bytes:
        """A content_block_delta of the open block."""
        return _event("content_block_delta", {"index": self.state["index"], "delta": d})

    def message_start(self) -> bytes:
        """message_start (usage: the prompt split by the prefix-cache hit of the outputs seen, no output tokens)
        and a ping."""
        usage = self.api._message_usage(self.run, self.c) | {"output_tokens": 0}
        msg: dict[str, Any] = {
            "id": self.msg_id,
            "type": "message",
            "role": "assistant",
            "model": self.api.model_name,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage,
        }
        return _event("message_start", {"message": msg}) + _event("ping", {})

    def render(self, i: int, o: RequestOutput) -> tuple[bytes, bool]:
        """SSE events for output o, and whether the stream ends with it (see _SSE)."""
        c, state = self.c, self.state
        c.note(o)
        out = []
        if not self.started:
            self.started = True
            out.append(self.message_start())
        if o.error is not None:
            out.append(_event("error", {"error": {"type": "api_error", "message": o.error}}))
            return b"".join(out), True
        d = c.parse(o) if o.token_ids else None
        d = with_parser_tail(self.p, o, d)
        if d is not None:
            if d.reasoning_content and self.reasons:
                if state["kind"] != "thinking":
                    out.append(self.open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""}))
                if self.show_thinking:
                    out.append(self.delta({"type": "thinking_delta", "thinking": d.reasoning_content}))
            if d.content:
                if state["kind"] != "text":
                    out.append(self.open_block("text", {"type": "text", "text": ""}))
                out.append(self.delta({"type": "text_delta", "text": d.content}))
            out.extend(self._call_events(d.tool_calls))
        if o.finished:
            if state["index"] < 0:  # an empty reply: one empty text block, as Anthropic sends
                out.append(self.open_block("text", {"type": "text", "text": ""}))
            out.append(self.close_block())
            stop_reason, stop_sequence = self.api._stop_reason(c)
            out.append(
                _event(
                    "message_delta",
                    {
                        "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                        "usage": self.api._message_usage(self.run, c),
                    },
                )
            )
            out.append(_event("message_stop", {}))
        return b"".join(out), False

    def _call_events(self, tool_calls: list[ToolCallDelta]) -> list[bytes]:
        """Events of the tool calls of one output (not parallel: only the first call's): the fragments of a call
        of an `eager` tool as they come; any other call whole (its block started, its arguments in one
        input_json_delta) once complete."""
        out = []
        for t in tool_calls:
            if not self.run.parallel and t.index > 0:
                continue
            if t.is_head:
                if t.name not in self.eager:
                    continue
                assert t.id is not None
                self.live.add(t.index)
                out.append(self.open_block("tool_use", self._block(t.id, t.name), t.index))
            elif t.index not in self.live or self.state["kind"] != "tool_use" or self.state["call"] != t.index:
                continue  # a buffered call, or a fragment of a call whose block is closed
            if t.arguments:
                out.append(self.delta({"type": "input_json_delta", "partial_json": t.arguments}))
        complete = self.p.tool_calls
        for k in range(self.complete, len(complete)):
            if k in self.live or (k > 0 and not self.run.parallel):
                continue
            call = complete[k]
            out.append(self.open_block("tool_use", self._block(call.id, call.name), k))
            if call.arguments:
                out.append(self.delta({"type": "input_json_delta", "partial_json": call.arguments}))
        self.complete = len(complete)
        return out

    @staticmethod
    def _block(call_id: str, name: str | None) -> dict[str, Any]:
        return {"type": "tool_use", "id": tool_use_id(call_id), "name": name, "input": {}}
