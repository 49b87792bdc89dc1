"""`POST /v1/responses`: the OpenAI Responses API over the chat pipeline.

A Responses request is checked in its own shapes (errors name its fields: `input[2].call_id`, `text.format`,
`max_output_tokens`), translated to the chat route's fields (`to_chat_body`) and run through `ChatAPI._chat_start`:
the same template, tokenizer, engine, parsers, guided decoding, limits and metrics as `/v1/chat/completions`. The
parsed output is rendered as a `response` object (output items `reasoning`, `message`, `function_call`) or as the
Responses event stream (`event: <type>` + `data: {...}` with a `sequence_number`).

Function-call ids: a call's `call_id` is Kimi's `functions.NAME:IDX` as is; any other id in the history is
rewritten by the chat route (kimi.controller.chat, normalize_tool_call_ids).

`previous_response_id`: a stored response (`store`, default true) keeps its input and output as chat messages in a
bounded in-memory LRU (`ResponseStore`); a later request naming it continues from them (its `instructions` are not
carried over, as OpenAI does). An unknown id is a 404 naming `previous_response_id`.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import time
import uuid
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from kimi.controller.http.chat import ChatAPI, _ChatRun
from kimi.controller.http.common import REASONING_EFFORTS, _Choice, error_response, with_parser_tail
from kimi.controller.http.streaming import _SSE
from kimi.controller.parsers import OutputParser, ToolCall, ToolCallDelta
from kimi.controller.validation import BadRequest, Fields
from kimi.protocol import RequestOutput

RESPONSES_FIELDS = frozenset(
    {
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "max_output_tokens",
        "temperature",
        "top_p",
        "text",
        "reasoning",
        "metadata",
        "store",
        "stream",
        "previous_response_id",
        "user",
        "truncation",
        "include",
        "background",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
        "chat_template_kwargs",
    }
)
STORE_SIZE = 1024  # responses kept for previous_response_id (least recently used evicted)
# chat-route field paths a translated body's errors may name -> the Responses field they came from (first match;
# True: the rest of the path is kept)
_PARAM_NAMES: tuple[tuple[str, str, bool], ...] = (
    ("response_format", "text.format", False),
    ("max_tokens", "max_output_tokens", False),
    ("messages", "input", False),
    ("tool_choice", "tool_choice", False),
    ("tools", "tools", True),
    ("chat_template_kwargs", "reasoning", False),
)


@dataclasses.dataclass
class StoredResponse:
    """One stored response: `messages`, its input and output as chat messages (what `previous_response_id`
    continues from); `response`, the final `response` object; `input_items`, its input as Responses items."""

    messages: list[dict[str, Any]]
    response: dict[str, Any]
    input_items: list[dict[str, Any]]


class ResponseStore:
    """Stored responses by id, at most `size`, the least recently used evicted first."""

    def __init__(self, size: int = STORE_SIZE) -> None:
        self.size = size
        self._items: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()

    def get(self, rid: str) -> StoredResponse | None:
        """Response `rid`, or None when it is not stored (never stored, evicted or deleted)."""
        m = self._items.get(rid)
        if m is None:
            return None
        self._items.move_to_end(rid)
        return m

    def put(self, rid: str, stored: StoredResponse) -> None:
        self._items[rid] = stored
        self._items.move_to_end(rid)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def delete(self, rid: str) -> bool:
        """Forget response `rid`; False when it was not stored."""
        return self._items.pop(rid, None) is not None

    def __len__(self) -> int:
        return len(self._items)


def input_items(inp: Any) -> list[dict[str, Any]]:
    """A request's `input` (a string or a list of items, already checked) as the list of input items the
    `input_items` route lists: a string is one user message with an `input_text` part; items without an `id` get
    one."""
    if isinstance(inp, str):
        inp = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": inp}]}]
    out = []
    for item in inp:
        item = dict(item)
        item.setdefault("type", "message")
        if "id" not in item:
            item["id"] = _item_id(
                "msg" if item["type"] == "message" else "fc" if item["type"] == "function_call" else "item"
            )
        out.append(item)
    return out


def _renamed(e: BadRequest) -> BadRequest:
    """A BadRequest about a translated chat field, re-worded to name the Responses field it came from."""
    if e.param is None:
        return e
    for old, new, keep_rest in _PARAM_NAMES:
        if e.param == old or e.param.startswith(old + ".") or e.param.startswith(old + "["):
            rest = e.param[len(old) :].replace(".function.", ".") if keep_rest else ""
            param = new + rest
            return BadRequest(e.message.replace(f"'{e.param}'", f"'{param}'"), param, e.status, e.code)
    return e


def _object(v: Any, path: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise BadRequest(f"'{path}' must be an object", path)
    return v


def _str(v: Any, path: str) -> str:
    if not isinstance(v, str) or not v:
        raise BadRequest(f"'{path}' must be a non-empty string", path)
    return v


def _check_keys(d: dict[str, Any], allowed: tuple[str, ...], path: str) -> None:
    for k in d:
        if k not in allowed:
            raise BadRequest(f"'{path}.{k}' is not supported by this server", f"{path}.{k}")


def _parts_text(v: Any, path: str, kinds: tuple[str, ...]) -> str:
    """A string, or a list of text parts (`{"type": one of kinds, "text"}`) -> its text."""
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise BadRequest(f"'{path}' must be a string or a list of content parts", path)
    out = []
    for j, b in enumerate(v):
        q = f"{path}[{j}]"
        b = _object(b, q)
        kind = b.get("type")
        if kind not in kinds:
            raise BadRequest(
                f"'{q}.type' must be one of {', '.join(kinds)} (this server takes text only), got {kind!r:.40}",
                f"{q}.type",
            )
        key = "refusal" if kind == "refusal" else "text"
        if not isinstance(b.get(key), str):
            raise BadRequest(f"'{q}.{key}' must be a string", f"{q}.{key}")
        _check_keys(b, ("type", key, "annotations", "logprobs"), q)
        out.append(b[key])
    return "".join(out)


def _input_messages(items: Any) -> list[dict[str, Any]]:
    """Responses `input` (a string or a list of items) -> chat messages. Consecutive `reasoning`, assistant
    `message` and `function_call` items form one assistant message (reasoning_content, content, tool_calls);
    `function_call_output` items become `tool` messages. Raises BadRequest naming the input path."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise BadRequest("'input' must be a string or a non-empty list of items", "input")
    out: list[dict[str, Any]] = []

    def assistant(fresh: bool) -> dict[str, Any]:
        last = out[-1] if out else None
        if fresh or last is None or last.get("role") != "assistant":
            last = {"role": "assistant", "content": ""}
            out.append(last)
        return last

    for i, it in enumerate(items):
        p = f"input[{i}]"
        it = _object(it, p)
        kind = it.get("type", "message" if "role" in it else None)
        if kind == "message":
            _check_keys(it, ("type", "role", "content", "id", "status"), p)
            role = it.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise BadRequest(
                    f"'{p}.role' must be user, system, developer or assistant, got {role!r:.40}", f"{p}.role"
                )
            if role == "assistant":
                text = _parts_text(it.get("content"), f"{p}.content", ("output_text", "refusal", "input_text"))
                m = out[-1] if out else None
                if m is not None and m.get("role") == "assistant" and not m["content"] and "tool_calls" not in m:
                    m["content"] = text  # after this turn's reasoning item
                else:
                    out.append({"role": "assistant", "content": text})
                continue
            text = _parts_text(it.get("content"), f"{p}.content", ("input_text",))
            out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            _check_keys(it, ("type", "call_id", "name", "arguments", "id", "status"), p)
            call_id = _str(it.get("call_id"), f"{p}.call_id")
            name = _str(it.get("name"), f"{p}.name")
            if not isinstance(it.get("arguments"), str):
                raise BadRequest(f"'{p}.arguments' must be a string", f"{p}.arguments")
            m = assistant(False)
            m.setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": it["arguments"]}}
            )
        elif kind == "function_call_output":
            _check_keys(it, ("type", "call_id", "output", "id", "status"), p)
            call_id = _str(it.get("call_id"), f"{p}.call_id")
            result = _parts_text(it.get("output"), f"{p}.output", ("input_text",))
            out.append({"role": "tool", "tool_call_id": call_id, "content": result})
        elif kind == "reasoning":
            _check_keys(it, ("type", "id", "summary", "content", "encrypted_content", "status"), p)
            if it.get("encrypted_content") is not None:
                raise BadRequest(f"'{p}.encrypted_content' is not supported by this server", f"{p}.encrypted_content")
            content = it.get("content")
            if content is None:  # only the summary was kept
                content = it.get("summary") or []
                text = _parts_text(content, f"{p}.summary", ("summary_text",))
            else:
                text = _parts_text(content, f"{p}.content", ("reasoning_text",))
            assistant(True)["reasoning_content"] = text
        else:
            raise BadRequest(
                f"'{p}.type' must be message, function_call, function_call_output or reasoning (this server has no "
                f"built-in tools), got {kind!r:.40}",
                f"{p}.type",
            )
    return out


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be a list", "tools")
    out = []
    for i, t in enumerate(tools):
        p = f"tools[{i}]"
        t = _object(t, p)
        if t.get("type") != "function":
            raise BadRequest(
                f"'{p}.type' must be 'function' (built-in tools are not supported), got {t.get('type')!r:.60}",
                f"{p}.type",
            )
        _check_keys(t, ("type", "name", "description", "parameters", "strict"), p)
        fn: dict[str, Any] = {"name": t.get("name")}
        for k in ("description", "parameters", "strict"):
            if t.get(k) is not None:
                fn[k] = t[k]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(tc: Any) -> Any:
    """Responses `tool_choice` -> the chat route's."""
    if isinstance(tc, str):
        if tc not in ("auto", "none", "required"):
            raise BadRequest(f"'tool_choice' must be auto, none, required or an object, got {tc!r:.40}", "tool_choice")
        return tc
    tc = _object(tc, "tool_choice")
    if tc.get("type") != "function":
        raise BadRequest("'tool_choice.type' must be 'function'", "tool_choice.type")
    _check_keys(tc, ("type", "name"), "tool_choice")
    return {"type": "function", "function": {"name": _str(tc.get("name"), "tool_choice.name")}}


def _text_format(text: Any) -> dict[str, Any] | None:
    """Responses `text` -> the chat route's response_format (None: plain text)."""
    text = _object(text, "text")
    _check_keys(text, ("format", "verbosity"), "text")
    if text.get("verbosity") not in (None, "medium"):
        raise BadRequest("'text.verbosity' is not supported by this server (only 'medium')", "text.verbosity")
    fmt = text.get("format")
    if fmt is None:
        return None
    fmt = _object(fmt, "text.format")
    kind = fmt.get("type")
    if kind == "text":
        _check_keys(fmt, ("type",), "text.format")
        return None
    if kind == "json_object":
        _check_keys(fmt, ("type",), "text.format")
        return {"type": "json_object"}
    if kind == "json_schema":
        _check_keys(fmt, ("type", "name", "schema", "strict", "description"), "text.format")
        js: dict[str, Any] = {"name": _str(fmt.get("name"), "text.format.name")}
        js["schema"] = _object(fmt.get("schema"), "text.format.schema")
        for k in ("strict", "description"):
            if fmt.get(k) is not None:
                js[k] = fmt[k]
        return {"type": "json_schema", "json_schema": js}
    raise BadRequest(f"'text.format.type' must be text, json_object or json_schema, got {kind!r:.40}", "text.format")


def _noop(body: dict[str, Any], name: str, allowed: tuple[Any, ...], why: str) -> None:
    v = body.get(name)
    if v is not None and v not in allowed:
        raise BadRequest(f"'{name}' {why}", name)


def to_chat_body(body: dict[str, Any], history: list[dict[str, Any]]) -> tuple[dict[str, Any], int]:
    """A Responses body -> (the equivalent /v1/chat/completions body, the index in its `messages` where this
    request's own input starts). history: the chat messages of `previous_response_id` ([] for none). Fields
    outside RESPONSES_FIELDS are a 400 naming them; `model` is the caller's (ServerBase._body checks it). Raises
    BadRequest naming the Responses field."""
    for k in body:
        if k not in RESPONSES_FIELDS:
            raise BadRequest(f"'{k}' is not supported by this server", k)
    if body.get("input") is None:
        raise BadRequest("'input' is required", "input")
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        messages.append({"role": "system", "content": _parts_text(instructions, "instructions", ("input_text",))})
    messages.extend(history)
    start = len(messages)
    messages.extend(_input_messages(body["input"]))
    out: dict[str, Any] = {"messages": messages}
    for k in ("temperature", "top_p", "stream", "parallel_tool_calls", "chat_template_kwargs"):
        if body.get(k) is not None:
            out[k] = body[k]
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    if body.get("tools"):
        out["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        tc = _tool_choice(body["tool_choice"])
        if "tools" in out:
            out["tool_choice"] = tc
        elif tc != "none" and tc != "auto":
            raise BadRequest("'tool_choice' needs 'tools'", "tool_choice")
    if body.get("text") is not None:
        fmt = _text_format(body["text"])
        if fmt is not None:
            out["response_format"] = fmt
    if body.get("reasoning") is not None:
        r = _object(body["reasoning"], "reasoning")
        _check_keys(r, ("effort", "summary", "generate_summary"), "reasoning")
        effort = r.get("effort")
        if effort is not None:
            if effort not in REASONING_EFFORTS:
                raise BadRequest(
                    f"'reasoning.effort' must be one of {', '.join(REASONING_EFFORTS)}", "reasoning.effort"
                )
            kw = dict(_object(out.get("chat_template_kwargs", {}), "chat_template_kwargs"))
            kw.setdefault("thinking", effort != "none")
            if effort != "none":  # passed to the template (Kimi's templates do not read it)
                kw.setdefault("reasoning_effort", effort)
            out["chat_template_kwargs"] = kw
        for k in ("summary", "generate_summary"):  # summaries are not made: the reasoning text is returned whole
            if r.get(k) not in (None, "auto", "concise", "detailed"):
                raise BadRequest(f"'reasoning.{k}' must be auto, concise or detailed", f"reasoning.{k}")
    md = body.get("metadata")
    if md is not None:
        md = _object(md, "metadata")
        if len(md) > 16 or not all(isinstance(k, str) and isinstance(v, str) for k, v in md.items()):
            raise BadRequest("'metadata' must map at most 16 strings to strings", "metadata")
    for k in ("store", "background"):
        if body.get(k) is not None and not isinstance(body[k], bool):
            raise BadRequest(f"'{k}' must be a boolean", k)
    _noop(body, "background", (False,), "is not supported (responses run in the foreground)")
    _noop(body, "truncation", ("disabled",), "must be 'disabled' (this server does not truncate the input)")
    _noop(body, "service_tier", ("auto", "default"), "must be 'auto' or 'default'")
    inc = body.get("include")
    if inc is not None and inc != []:
        raise BadRequest("'include' is not supported by this server (send [] or leave it out)", "include")
    for k in ("user", "prompt_cache_key", "safety_identifier", "previous_response_id"):
        if body.get(k) is not None and not isinstance(body[k], str):
            raise BadRequest(f"'{k}' must be a string", k)
    return out, start


def _sse(kind: str, data: dict[str, Any], seq: list[int]) -> bytes:
    seq[0] += 1
    payload = {"type": kind, "sequence_number": seq[0] - 1, **data}
    return f"event: {kind}\ndata: ".encode() + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "role": "assistant",
        "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "encrypted_content": None,
        "status": status,
    }


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _output_message(text: str, thought: str, calls: list[ToolCall]) -> dict[str, Any]:
    """The chat assistant message of a response's output (what a later previous_response_id continues from)."""
    m: dict[str, Any] = {"role": "assistant", "content": text}
    if thought:
        m["reasoning_content"] = thought
    if calls:
        m["tool_calls"] = [t.to_openai() for t in calls]
    return m


class ResponsesAPI(ChatAPI):
    """The /v1/responses route (a mixin of OpenAIServer); `response_store` holds the stored responses."""

    response_store: ResponseStore

    def _response_object(
        self, rid: str, body: dict[str, Any], created: int, status: str, output: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """The `response` object's fields other than usage (set by the caller) for request body `body`."""
        text = body.get("text") or {}
        return {
            "id": rid,
            "object": "response",
            "created_at": created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "model": self.model_name,
            "output": output,
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"),
            "reasoning": {"effort": (body.get("reasoning") or {}).get("effort"), "summary": None},
            "store": body.get("store", True),
            "temperature": body.get("temperature", 1.0),
            "text": {"format": text.get("format") or {"type": "text"}, "verbosity": "medium"},
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [],
            "top_p": body.get("top_p", 1.0),
            "truncation": "disabled",
            "usage": None,
            "user": body.get("user"),
            "metadata": body.get("metadata") or {},
        }

    def _response_usage(self, run: _ChatRun, c: _Choice, reasoning_tokens: int) -> dict[str, Any]:
        n_out = c.last.num_output_tokens if c.last else 0
        return {
            "input_tokens": len(run.ids),
            "input_tokens_details": {"cached_tokens": c.last.num_cached_tokens if c.last else 0},
            "output_tokens": n_out,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": len(run.ids) + n_out,
        }

    async def responses(self, request: HTTPRequest) -> Response | _SSE:
        """`POST /v1/responses`."""
        try:
            f = await self._body(request)
            body = f.body
            history: list[dict[str, Any]] = []
            prev = body.get("previous_response_id")
            if prev is not None:
                got = self.response_store.get(prev) if isinstance(prev, str) else None
                if got is None:
                    raise BadRequest(
                        f"no stored response with id {prev!r:.80}", "previous_response_id", status=404, code="not_found"
                    )
                history = list(got.messages)
            chat, start = to_chat_body(body, history)
            cf = Fields(chat)
            cf.body_bytes = f.body_bytes
            try:
                run = await self._chat_start(cf, endpoint="/v1/responses")
            except BadRequest as e:
                raise _renamed(e) from None
        except BadRequest as e:
            return error_response(e, {"Retry-After": "1"} if e.status == 503 else None)
        c = _Choice(
            0, run.sib.ids[0], parser=OutputParser(run.pcfg), request=run.sib.requests[0] if run.sib.requests else None
        )
        rid = "resp_" + run.rid.removeprefix("chatcmpl-")
        created = int(time.time())
        reasons = run.pcfg.starts_in_reasoning and run.include_reasoning
        own_input = chat["messages"][start:]
        store = body.get("store", True) is not False

        def remember(text: str, thought: str, calls: list[ToolCall], resp: dict[str, Any]) -> None:
            if store:
                messages = history + own_input + [_output_message(text, thought, calls)]
                self.response_store.put(rid, StoredResponse(messages, resp, input_items(body["input"])))

        if not run.g.stream:
            err = await self._collect(request, run.sib, [c])
            if err is not None:
                return error_response(BadRequest(err, None, status=503 if err == self.engine.closing else 500))
            text, thought, calls, n_reasoning = self._final_parts(c, run.parallel)
            status = "incomplete" if c.final.finish_reason == "length" else "completed"
            output: list[dict[str, Any]] = []
            if reasons and thought:
                output.append(_reasoning_item(_item_id("rs"), thought, "completed"))
            if text or not (calls or output):
                output.append(_message_item(_item_id("msg"), text, status))
            output.extend(_call_item(_item_id("fc"), t.id, t.name, t.arguments, "completed") for t in calls)
            resp = self._response_object(rid, body, created, status, output)
            resp["usage"] = self._response_usage(run, c, n_reasoning if reasons else 0)
            remember(text, thought, calls, resp)
            return JSONResponse(resp)
        return self._response_stream(run, c, body, rid, created, reasons, remember)

    def _stored(self, request: HTTPRequest) -> StoredResponse:
        rid = request.path_params["response_id"]
        got = self.response_store.get(rid)
        if got is None:
            raise BadRequest(f"no stored response with id {rid!r:.80}", "response_id", status=404, code="not_found")
        return got

    async def get_response(self, request: HTTPRequest) -> Response:
        """`GET /v1/responses/{response_id}`: a stored response object; 404 when it is not stored."""
        try:
            return JSONResponse(self._stored(request).response)
        except BadRequest as e:
            return error_response(e)

    async def delete_response(self, request: HTTPRequest) -> Response:
        """`DELETE /v1/responses/{response_id}`: forget a stored response (later requests naming it get a 404)."""
        rid = request.path_params["response_id"]
        if not self.response_store.delete(rid):
            return error_response(
                BadRequest(f"no stored response with id {rid!r:.80}", "response_id", status=404, code="not_found")
            )
        return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})

    async def response_input_items(self, request: HTTPRequest) -> Response:
        """`GET /v1/responses/{response_id}/input_items`: the stored response's input items, a list object;
        `order` (`desc`, the default, or `asc`), `limit` (1-100, default 20), `after` (an item id)."""
        try:
            items = list(self._stored(request).input_items)
            q = request.query_params
            order = q.get("order", "desc")
            if order not in ("asc", "desc"):
                raise BadRequest("'order' must be asc or desc", "order")
            try:
                limit = int(q.get("limit", "20"))
            except ValueError:
                limit = 0
            if not 1 <= limit <= 100:
                raise BadRequest("'limit' must be an integer from 1 to 100", "limit")
            if order == "desc":
                items.reverse()
            after = q.get("after")
            if after is not None:
                ids = [it["id"] for it in items]
                if after not in ids:
                    raise BadRequest(f"no input item with id {after!r:.80}", "after")
                items = items[ids.index(after) + 1 :]
        except BadRequest as e:
            return error_response(e)
        page = items[:limit]
        return JSONResponse(
            {
                "object": "list",
                "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(items) > limit,
            }
        )

    @staticmethod
    def _final_parts(c: _Choice, parallel: bool) -> tuple[str, str, list[ToolCall], int]:
        """A finished non-streamed choice's (content text, reasoning text, tool calls, output tokens that went to
        the reasoning), parsed from its collected outputs as a stream of the same output carries them; not
        parallel: at most the first call."""
        p = c.parser
        assert p is not None
        content, reasoning = [], []
        tail = ""
        n_reasoning = 0
        for o in c.outputs:
            if not o.token_ids:
                tail += o.text
                continue
            d = c.parse(o)
            content.append(d.content)
            reasoning.append(d.reasoning_content)
            if d.reasoning_content:
                n_reasoning += len(o.token_ids)
        d = p.finish(tail)
        content.append(d.content)
        reasoning.append(d.reasoning_content)
        calls = list(p.emitted_tool_calls)
        return "".join(content), "".join(reasoning), calls if parallel else calls[:1], n_reasoning

    def _response_stream(
        self,
        run: _ChatRun,
        c: _Choice,
        body: dict[str, Any],
        rid: str,
        created: int,
        reasons: bool,
        remember: Any,
    ) -> _SSE:
        """The event stream: response.created, response.in_progress, then each output item in turn (added, its
        content part added, text / reasoning / argument deltas, done events), then response.completed (or
        response.incomplete at max_output_tokens); an engine error is response.failed, which ends the stream."""
        stream = _ResponseStream(self, run, c, body, rid, created, reasons, remember)
        start = self._response_object(rid, body, created, "in_progress", [])
        first = _sse("response.created", {"response": start}, stream.seq) + _sse(
            "response.in_progress", {"response": start}, stream.seq
        )
        return _SSE(run.sib, stream.render, first, done=b"")


class _ResponseStream:
    """The state of one streamed /v1/responses reply (`ResponsesAPI._response_stream`): the event sequence
    number, the output items done so far, the open item and the reply accumulated for the store."""

    def __init__(
        self,
        api: ResponsesAPI,
        run: _ChatRun,
        c: _Choice,
        body: dict[str, Any],
        rid: str,
        created: int,
        reasons: bool,
        remember: Any,
    ) -> None:
        assert c.parser is not None
        self.api, self.run, self.c, self.p = api, run, c, c.parser
        self.body, self.rid, self.created, self.reasons, self.remember = body, rid, created, reasons, remember
        self.seq = [0]
        self.output: list[dict[str, Any]] = []
        # the open item: kind ("reasoning" / "message" / "function_call" / None), id, text so far, call index
        self.st: dict[str, Any] = {"kind": None, "id": "", "text": "", "call": None, "name": "", "call_id": ""}
        self.acc: dict[str, Any] = {"text": "", "thought": "", "calls": [], "n_reasoning": 0}

    def close(self, status: str = "completed") -> bytes:
        """The done events of the open item (none open: b""), which joins `output`."""
        st, seq, output = self.st, self.seq, self.output
        kind = st["kind"]
        if kind is None:
            return b""
        st["kind"] = None
        idx = len(output)
        iid, text = st["id"], st["text"]
        ev = []
        if kind == "function_call":
            item = _call_item(iid, st["call_id"], st["name"], text, "completed")
            self.acc["calls"].append(ToolCall(st["call_id"], st["name"], text))
            ev.append(
                _sse(
                    "response.function_call_arguments.done",
                    {"item_id": iid, "output_index": idx, "arguments": text, "name": st["name"]},
                    seq,
                )
            )
        else:
            if kind == "message":
                item = _message_item(iid, text, status)
                part = item["content"][0]
                ev.append(
                    _sse(
                        "response.output_text.done",
                        {"item_id": iid, "output_index": idx, "content_index": 0, "text": text, "logprobs": []},
                        seq,
                    )
                )
            else:
                item = _reasoning_item(iid, text, "completed")
                part = item["content"][0]
                ev.append(
                    _sse(
                        "response.reasoning_text.done",
                        {"item_id": iid, "output_index": idx, "content_index": 0, "text": text},
                        seq,
                    )
                )
            ev.append(
                _sse(
                    "response.content_part.done",
                    {"item_id": iid, "output_index": idx, "content_index": 0, "part": part},
                    seq,
                )
            )
        ev.append(_sse("response.output_item.done", {"output_index": idx, "item": item}, seq))
        output.append(item)
        return b"".join(ev)

    def open_item(self, kind: str, call: Any = None) -> bytes:
        """Close the open item, open one of `kind` (a function_call: for tool-call head `call`); its events."""
        st, seq = self.st, self.seq
        data = self.close()
        idx = len(self.output)
        st.update(kind=kind, text="", call=None)
        if kind == "function_call":
            st.update(id=_item_id("fc"), call=call.index, name=call.name, call_id=call.id)
            item = _call_item(st["id"], call.id, call.name, "", "in_progress")
            return data + _sse("response.output_item.added", {"output_index": idx, "item": item}, seq)
        if kind == "message":
            st["id"] = _item_id("msg")
            item = {**_message_item(st["id"], "", "in_progress"), "content": []}
            part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            st["id"] = _item_id("rs")
            item = {**_reasoning_item(st["id"], "", "in_progress"), "content": []}
            part = {"type": "reasoning_text", "text": ""}
        return (
            data
            + _sse("response.output_item.added", {"output_index": idx, "item": item}, seq)
            + _sse(
                "response.content_part.added",
                {"item_id": st["id"], "output_index": idx, "content_index": 0, "part": part},
                seq,
            )
        )

    def text_delta(self, kind: str, delta: str) -> bytes:
        """A text / reasoning delta event of the open item."""
        self.st["text"] += delta
        ev = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        data: dict[str, Any] = {"item_id": self.st["id"], "output_index": len(self.output), "content_index": 0}
        data["delta"] = delta
        if kind == "message":
            data["logprobs"] = []
        return _sse(ev, data, self.seq)

    def render(self, i: int, o: RequestOutput) -> tuple[bytes, bool]:
        """SSE events for output o, and whether the stream ends with it (see _SSE)."""
        c, st, acc = self.c, self.st, self.acc
        c.note(o)
        if o.error is not None:
            resp = self.api._response_object(self.rid, self.body, self.created, "failed", self.output)
            resp["error"] = {"code": "server_error", "message": o.error}
            return _sse("response.failed", {"response": resp}, self.seq), True
        d = c.parse(o) if o.token_ids else None
        if d is not None and d.reasoning_content:
            acc["n_reasoning"] += len(o.token_ids)
        d = with_parser_tail(self.p, o, d)
        out = []
        if d is not None:
            if d.reasoning_content and self.reasons:
                if st["kind"] != "reasoning":
                    out.append(self.open_item("reasoning"))
                out.append(self.text_delta("reasoning", d.reasoning_content))
                acc["thought"] += d.reasoning_content
            if d.content:
                if st["kind"] != "message":
                    out.append(self.open_item("message"))
                out.append(self.text_delta("message", d.content))
                acc["text"] += d.content
            out.extend(self._call_events(d.tool_calls))
        if o.finished:
            out.extend(self._finish(o))
        return b"".join(out), False

    def _call_events(self, tool_calls: list[ToolCallDelta]) -> list[bytes]:
        """Events of the tool-call fragments of one output (not parallel: only the first call's)."""
        st, out = self.st, []
        for t in tool_calls:
            if not self.run.parallel and t.index > 0:
                continue
            if t.is_head:
                out.append(self.open_item("function_call", t))
            elif st["kind"] != "function_call" or st["call"] != t.index:
                continue  # a fragment of a call whose item is closed (calls arrive one after another)
            if t.arguments:
                st["text"] += t.arguments
                out.append(
                    _sse(
                        "response.function_call_arguments.delta",
                        {"item_id": st["id"], "output_index": len(self.output), "delta": t.arguments},
                        self.seq,
                    )
                )
        return out

    def _finish(self, o: RequestOutput) -> list[bytes]:
        """The events ending the stream after the final output o: the open item's done events, then
        response.completed (response.incomplete at the length limit); the reply is remembered."""
        out = []
        status = "incomplete" if o.finish_reason == "length" else "completed"
        if not self.output and self.st["kind"] is None:  # an empty reply: one empty message, as non-streamed
            out.append(self.open_item("message"))
        out.append(self.close(status))
        resp = self.api._response_object(self.rid, self.body, self.created, status, self.output)
        resp["usage"] = self.api._response_usage(self.run, self.c, self.acc["n_reasoning"] if self.reasons else 0)
        self.remember(self.acc["text"], self.acc["thought"], self.acc["calls"], resp)
        out.append(_sse(f"response.{status}", {"response": resp}, self.seq))
        return out
