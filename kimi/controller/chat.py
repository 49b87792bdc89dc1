"""Chat messages -> prompt token ids through the checkpoint's template, without letting user text become
control tokens.

Rendering the template and encoding the result with special tokens allowed would turn a user's literal
`<|im_end|>` into the control token (a prompt-injection hole; docs/model-format.md, Tokenizer). Instead every piece of
message text is replaced by a private-use marker (U+F0000, refused anywhere in a chat request's rendered text)
before rendering; the rendered prompt is then split at control tokens found in the template's own text only, and
each run of text between two control tokens (template text and message text together) is encoded whole with special
tokens disallowed: the ids HF's `tokenize()` and vLLM give the rendered prompt when the messages hold no
control-token strings, and message text never becomes a control token.
"""

from __future__ import annotations

import json
import re
import weakref
from collections.abc import Collection
from typing import Any

from kimi.controller.validation import BadRequest, check_prompt_text_fits, first_path, json_path
from kimi.tokenizer import KimiTokenizer

_ROLES = ("system", "developer", "user", "assistant", "tool")  # developer: OpenAI's newer name, rendered as system
_REASONING_KEYS = ("reasoning_content", "reasoning")  # reasoning: vLLM's current name
_MARK = "\U000f0000"  # plane-15 private use: never in real text we accept (rejected below)
_MARK_RE = re.compile(_MARK + r"(\d+)" + _MARK)


def _check_text(s: str, param: str) -> None:
    if _MARK in s:
        raise BadRequest(f"'{param}' contains the reserved character U+F0000", param)


def _check_tree(value: Any, param: str) -> None:
    """_check_text over a JSON value (one scan of its dump), naming the first string or key holding U+F0000 by its
    path under `param` (`tools[0].function.description`, `chat_template_kwargs.x`)."""
    if _MARK not in json.dumps(value, ensure_ascii=False):
        return
    parts = first_path(value, lambda v: isinstance(v, str) and _MARK in v, lambda k: _MARK in k) or []
    sub = json_path(parts)
    _check_text(_MARK, param + ("" if not sub else sub if sub.startswith("[") else "." + sub))


_NAME_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check the OpenAI `messages` shape; raises BadRequest naming e.g. `messages[2].content`.

    Assistant messages may carry `tool_calls` (`[{id, type: "function", function: {name, arguments}}]`,
    arguments a JSON string or an object) and their reasoning as `reasoning_content` or `reasoning` (vLLM's name), a
    string or null. Tool messages need a non-empty string `tool_call_id`. Returns the messages to render: a
    `developer` message (OpenAI's newer name for system instructions) becomes a copy with role `system`, as Kimi's
    template knows no developer role; an assistant message's `reasoning` becomes `reasoning_content` (which wins when
    both are given); tool-call ids are rewritten by `normalize_tool_call_ids`.
    """
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"'{p}' must be an object", p)
        role = m.get("role")
        if role not in _ROLES:
            raise BadRequest(f"'{p}.role' must be one of {', '.join(_ROLES)}", f"{p}.role")
        c = m.get("content")
        if c is None:
            if role != "assistant":
                raise BadRequest(f"'{p}.content' is required for role {role}", f"{p}.content")
        elif isinstance(c, list):
            for j, part in enumerate(c):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise BadRequest(
                        f"'{p}.content[{j}]' must be {{'type': 'text', 'text': str}} (only text is supported)",
                        f"{p}.content[{j}]",
                    )
        elif not isinstance(c, str):
            raise BadRequest(f"'{p}.content' must be a string or a list of text parts", f"{p}.content")
        if "name" in m and m["name"] is not None and not isinstance(m["name"], str):
            raise BadRequest(f"'{p}.name' must be a string", f"{p}.name")
        calls = m.get("tool_calls")
        if calls is not None:
            if role != "assistant":
                raise BadRequest(f"'{p}.tool_calls' is only allowed on assistant messages", f"{p}.tool_calls")
            if not isinstance(calls, list):
                raise BadRequest(f"'{p}.tool_calls' must be a list", f"{p}.tool_calls")
            for j, call in enumerate(calls):
                q = f"{p}.tool_calls[{j}]"
                if not isinstance(call, dict):
                    raise BadRequest(f"'{q}' must be an object", q)
                if not isinstance(call.get("id"), str) or not call["id"]:
                    raise BadRequest(f"'{q}.id' must be a non-empty string", f"{q}.id")
                if call.get("type") is not None and call["type"] != "function":  # absent: taken as "function"
                    raise BadRequest(f"'{q}.type' must be 'function', got {call['type']!r}", f"{q}.type")
                fn = call.get("function")
                if not isinstance(fn, dict):
                    raise BadRequest(f"'{q}.function' must be an object", f"{q}.function")
                if not isinstance(fn.get("name"), str) or not fn["name"]:
                    raise BadRequest(f"'{q}.function.name' must be a non-empty string", f"{q}.function.name")
                args = fn.get("arguments")
                if args is not None and not isinstance(args, (str, dict)):
                    raise BadRequest(
                        f"'{q}.function.arguments' must be a JSON string or an object", f"{q}.function.arguments"
                    )
        for key in _REASONING_KEYS if role == "assistant" else ():
            if m.get(key) is not None and not isinstance(m[key], str):
                raise BadRequest(f"'{p}.{key}' must be a string or null", f"{p}.{key}")
        if role == "tool" and (not isinstance(m.get("tool_call_id"), str) or not m["tool_call_id"]):
            raise BadRequest(f"'{p}.tool_call_id' must be a non-empty string for role tool", f"{p}.tool_call_id")
        if role == "developer":
            m = {**m, "role": "system"}
        elif role == "assistant" and "reasoning" in m:
            m = {k: v for k, v in m.items() if k != "reasoning"}
            if m.get("reasoning_content") is None and messages[i]["reasoning"] is not None:
                m["reasoning_content"] = messages[i]["reasoning"]
        out.append(m)
    return normalize_tool_call_ids(out)


def _is_kimi_call_id(call_id: str, name: str) -> bool:
    """Whether call_id is `functions.{name}:IDX` (IDX ASCII digits)."""
    prefix = f"functions.{name}:"
    idx = call_id[len(prefix) :]
    return call_id.startswith(prefix) and idx.isascii() and idx.isdigit()


def normalize_tool_call_ids(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rewrite history tool-call ids that are not Kimi's `functions.NAME:IDX` to that form (docs/model-format.md,
    Chat and tool-call format), in the assistant message and in the tool messages that answer it.

    The model was trained on `functions.NAME:IDX` ids, IDX counting the calls of the conversation; an id of another
    form (`call_ab12`, `search:0`, or one naming another function) becomes `functions.NAME:K`, NAME the call's
    function name and K its position among the conversation's calls (raised past any IDX that a kept id of that name
    uses). A tool message's `tool_call_id` takes the new id of the latest call that had its old id (clients reuse
    ids such as `call_0` turn after turn); an id that names no call is kept. Messages are validated
    (`validate_messages`); the ones changed are returned as copies, the caller's objects are untouched.
    """
    taken = {
        c["id"]
        for m in messages
        if m.get("role") == "assistant"
        for c in m.get("tool_calls") or ()
        if _is_kimi_call_id(c["id"], c["function"]["name"])
    }
    renamed: dict[str, str] = {}
    position = 0
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                name = call["function"]["name"]
                new_id = call["id"]
                if not _is_kimi_call_id(new_id, name):
                    k = position
                    while f"functions.{name}:{k}" in taken:
                        k += 1
                    new_id = f"functions.{name}:{k}"
                    taken.add(new_id)
                    renamed[call["id"]] = new_id
                calls.append(call if new_id == call["id"] else {**call, "id": new_id})
                position += 1
            m = {**m, "tool_calls": calls}
        elif role == "tool" and m["tool_call_id"] in renamed:
            m = {**m, "tool_call_id": renamed[m["tool_call_id"]]}
        out.append(m)
    return out


_TOOL_KEYS = frozenset({"type", "function"})
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})


def no_other_keys(obj: dict[str, Any], allowed: Collection[str], path: str) -> None:
    """BadRequest naming the first key of obj outside `allowed` (in the order sent)."""
    for k in obj:
        if k not in allowed:
            raise BadRequest(f"'{path}.{k}' is not supported by this server", f"{path}.{k}")


def validate_tools(tools: Any) -> list[str]:
    """Check the OpenAI `tools` list (`[{type: "function", function: {name, description?, parameters?,
    strict?}}]`); return the function names. Names: 1-128 of `A-Za-z0-9_.:-` (Kimi ids are
    `functions.NAME:IDX`, so dots, dashes and colons are allowed). Any other key is a 400 (the API's rule for
    unknown fields); `strict: true` is enforced by guided decoding (kimi.structured_output.request). Raises
    BadRequest naming `tools[i]...`.
    """
    if not isinstance(tools, list) or not tools:
        raise BadRequest("'tools' must be a non-empty list", "tools")
    names: list[str] = []
    seen: set[str] = set()  # a list lookup made 20000 tools take ~2 s on the event loop
    for i, t in enumerate(tools):
        p = f"tools[{i}]"
        if not isinstance(t, dict):
            raise BadRequest(f"'{p}' must be an object", p)
        if t.get("type") != "function":
            raise BadRequest(f"'{p}.type' must be 'function'", f"{p}.type")
        no_other_keys(t, _TOOL_KEYS, p)
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise BadRequest(f"'{p}.function' must be an object", f"{p}.function")
        no_other_keys(fn, _FUNCTION_KEYS, f"{p}.function")
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise BadRequest(f"'{p}.function.strict' must be a boolean", f"{p}.function.strict")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise BadRequest(f"'{p}.function.name' must be 1-128 characters of A-Za-z0-9_.:-", f"{p}.function.name")
        if name in seen:
            raise BadRequest(f"'{p}.function.name' {name!r} is declared twice", f"{p}.function.name")
        seen.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise BadRequest(f"'{p}.function.description' must be a string", f"{p}.function.description")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise BadRequest(f"'{p}.function.parameters' must be a JSON Schema object", f"{p}.function.parameters")
        names.append(name)
    return names


_SPECIAL_IDS: weakref.WeakKeyDictionary[KimiTokenizer, tuple[re.Pattern[str], dict[str, int]]] = (
    weakref.WeakKeyDictionary()
)


def _special_ids(tokenizer: KimiTokenizer) -> tuple[re.Pattern[str], dict[str, int]]:
    """(a regex matching any control-token string, longest first; string -> id) for the ids from 163584 up,
    built once per tokenizer."""
    cached = _SPECIAL_IDS.get(tokenizer)
    if cached is None:
        ids: dict[str, int] = {}
        for s in {tokenizer.decode([i]) for i in range(163584, tokenizer.vocab_size)} - {""}:
            got = tokenizer.encode(s, allow_special=True)
            if len(got) == 1:
                ids[s] = got[0]
        alts = "|".join(re.escape(s) for s in sorted(ids, key=len, reverse=True))
        cached = (re.compile(alts or r"(?!)"), ids)  # (?!) never matches: a vocabulary without control tokens
        _SPECIAL_IDS[tokenizer] = cached
    return cached


def encode_chat(
    tokenizer: KimiTokenizer,
    messages: Any,
    tools: list[dict[str, Any]] | None,
    template_kwargs: dict[str, Any],
    max_model_len: int | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> list[int]:
    """Prompt token ids for a chat request (with add_generation_prompt, the template's generation prompt appended;
    with continue_final_message, the prompt ends right after the final message's content, which the model then
    continues: assistant prefill, as vLLM; the template must render that content, else a 400 naming `messages`).

    Every user-controlled string that the template copies (content, names, tool-call ids and arguments,
    tool_call_id) is encoded with special tokens disallowed. The prompt is split at the template's control tokens
    and each text run between two of them is encoded whole, so a message's text merges with the template text
    next to it, as HF's `tokenize()` / vLLM encode the rendered prompt (equal to `tokenizer.encode(rendered,
    allow_special=True)` below `_split_for_encode`'s 400k-character / 25k-run limits, which that call applies
    to the whole prompt rather than per run). U+F0000 (the placeholder marker) anywhere in the messages, tools
    or chat_template_kwargs is a 400. Tool declarations are rendered by the template
    as JSON; since they cannot be split out, a declaration that contains a control-token string (e.g.
    `<|im_end|>`) is rejected. With max_model_len, messages whose text surely has that many tokens or more are
    refused (param `messages`) before the template renders or anything is tokenized. Raises BadRequest for
    malformed messages or a template that fails on them.
    """
    sent = messages
    messages = validate_messages(messages)
    if tools:
        blob = json.dumps(tools, ensure_ascii=False)
        found = _special_ids(tokenizer)[0].search(blob)  # one scan of the declarations
        if found:
            raise BadRequest(f"'tools' contains the control-token string {found.group(0)!r}", "tools")
        _check_tree(tools, "tools")
    if template_kwargs:
        _check_tree(template_kwargs, "chat_template_kwargs")
    marked, pieces, final_piece = _mark_messages(messages, sent, continue_final_message)
    if max_model_len is not None:  # the prompt holds every piece: refuse one surely too long before tokenizing it
        check_prompt_text_fits(tokenizer, "".join(pieces), max_model_len, "messages", "the messages' text has")
    rendered = _render_template(tokenizer, marked, tools, template_kwargs, add_generation_prompt)
    if continue_final_message:  # cut after the final message's last piece of content
        end = f"{_MARK}{final_piece}{_MARK}"
        at = rendered.rfind(end)
        if final_piece < 0 or at < 0:
            raise BadRequest(
                "'continue_final_message': the chat template does not render the final message's content",
                "messages",
            )
        rendered = rendered[: at + len(end)]
    return _encode_rendered(tokenizer, rendered, pieces)


class _Pieces:
    """The user-controlled strings of a chat request, each replaced in the messages by a numbered marker
    (`_MARK` index `_MARK`) so the rendered prompt shows where each one goes."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def mark(self, s: str, param: str) -> str:
        """Check s (BadRequest naming `param`), store it; return its marker."""
        _check_text(s, param)
        self.texts.append(s)
        return f"{_MARK}{len(self.texts) - 1}{_MARK}"


def _mark_messages(
    messages: list[dict[str, Any]], sent: Any, continue_final_message: bool
) -> tuple[list[dict[str, Any]], list[str], int]:
    """(the messages with every user-controlled string replaced by its marker, the strings in marker order, the
    index of the final message's last content piece with continue_final_message, else -1). `sent` is the
    messages as the client sent them (for the name of the reasoning field). Raises BadRequest naming the field."""
    pieces = _Pieces()
    marked = []
    final_piece = -1
    for i, m in enumerate(messages):
        final = continue_final_message and i == len(messages) - 1
        m2, c = _mark_content(m, i, final, pieces)
        if final:
            final_piece = len(pieces.texts) - 1
        _mark_other_fields(m, m2, i, sent, pieces)
        # any other field the template may copy; the strings marked above were checked there (not dumped again)
        rest = {k: v for k, v in m.items() if k not in ("content", "name", "tool_call_id", "reasoning_content")}
        if isinstance(c, list):  # the parts' other keys
            rest["content"] = [{**part, "text": ""} for part in c]
        _check_tree(rest, f"messages[{i}]")
        marked.append(m2)
    return marked, pieces.texts, final_piece


def _mark_content(m: dict[str, Any], i: int, final: bool, pieces: _Pieces) -> tuple[dict[str, Any], Any]:
    """(a copy of message i with its content marked, the content as it was; "" for an empty final message)."""
    m2 = dict(m)
    c = m.get("content")
    if final and not c:  # an empty prefill: its marker still shows where the content goes
        c = ""
        m2["content"] = pieces.mark("", f"messages[{i}].content")
    elif isinstance(c, str):
        m2["content"] = pieces.mark(c, f"messages[{i}].content") if c else c
    elif isinstance(c, list):
        m2["content"] = [
            {**part, "text": pieces.mark(part["text"], f"messages[{i}].content[{j}].text")} for j, part in enumerate(c)
        ]
    return m2, c


def _mark_other_fields(m: dict[str, Any], m2: dict[str, Any], i: int, sent: Any, pieces: _Pieces) -> None:
    """Mark message i's name, reasoning, tool_call_id and tool calls into m2."""
    if isinstance(m.get("name"), str) and m["name"]:
        m2["name"] = pieces.mark(m["name"], f"messages[{i}].name")
    if isinstance(m.get("reasoning_content"), str) and m["reasoning_content"]:
        # the field the client sent the reasoning in
        key = "reasoning_content" if sent[i].get("reasoning_content") is not None else "reasoning"
        m2["reasoning_content"] = pieces.mark(m["reasoning_content"], f"messages[{i}].{key}")
    if isinstance(m.get("tool_call_id"), str) and m["tool_call_id"]:
        m2["tool_call_id"] = pieces.mark(m["tool_call_id"], f"messages[{i}].tool_call_id")
    if m.get("tool_calls"):
        calls = []
        for j, call in enumerate(m["tool_calls"]):
            fn = dict(call["function"])
            args = fn.get("arguments")
            if isinstance(args, dict):  # the template's compact JSON, marked so it stays text
                args = json.dumps(args, separators=(",", ":"), ensure_ascii=False)
            p = f"messages[{i}].tool_calls[{j}]"
            fn["arguments"] = pieces.mark(args, f"{p}.function.arguments") if args else "{}"
            fn["name"] = pieces.mark(fn["name"], f"{p}.function.name")
            calls.append({**call, "id": pieces.mark(call["id"], f"{p}.id"), "function": fn})
        m2["tool_calls"] = calls


def _render_template(
    tokenizer: KimiTokenizer,
    marked: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    template_kwargs: dict[str, Any],
    add_generation_prompt: bool,
) -> str:
    """The chat template rendered on the marked messages. A template ValueError is a BadRequest naming
    `chat_template_kwargs` when the messages render without the kwargs, else naming `messages`."""
    try:
        return tokenizer.apply_chat_template(
            marked, tools=tools, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
    except ValueError as e:
        if template_kwargs:  # blame the kwargs when the template renders these messages without them
            try:
                tokenizer.apply_chat_template(marked, tools=tools, add_generation_prompt=add_generation_prompt)
            except ValueError:
                pass
            else:
                raise BadRequest(
                    f"the chat template failed with these 'chat_template_kwargs' (it renders these "
                    f"messages without them): {e}",
                    "chat_template_kwargs",
                ) from None
        raise BadRequest(str(e), "messages") from None


def _encode_rendered(tokenizer: KimiTokenizer, rendered: str, pieces: list[str]) -> list[int]:
    """Token ids of the rendered prompt, its markers replaced by `pieces`.

    Tokenizes as encode(rendered prompt, allow_special=True) would (HF / vLLM): the text between two control
    tokens is ONE ordinary run, whether it comes from the template or from the request, so a message's text
    merges with the template text around it as it does there (" functions" after "## Return of", "foo" + "bar"
    of two text parts). Control tokens are recognised only in the template's own text.
    """
    special = _special_ids(tokenizer)
    ids: list[int] = []
    run: list[str] = []

    def flush() -> None:
        if run:
            ids.extend(tokenizer.encode("".join(run), allow_special=False))
            run.clear()

    def template_text(s: str) -> None:
        at = 0
        for sm in special[0].finditer(s):
            run.append(s[at : sm.start()])
            flush()
            ids.append(special[1][sm.group(0)])
            at = sm.end()
        run.append(s[at:])

    pos = 0
    for mt in _MARK_RE.finditer(rendered):
        template_text(rendered[pos : mt.start()])
        run.append(pieces[int(mt.group(1))])
        pos = mt.end()
    template_text(rendered[pos:])
    flush()
    return ids
