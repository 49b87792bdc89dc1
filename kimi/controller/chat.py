"""Chat messages -> prompt token ids through the checkpoint's template, without letting user text become
control tokens.

Rendering the template and encoding the result with special tokens allowed would turn a user's literal
`<|im_end|>` into the control token (a prompt-injection hole; KIMI.md section 4). Instead every piece of
message text is replaced by a private-use marker before rendering; the rendered prompt is split at the
markers; template text is encoded with special tokens allowed and message text with them disallowed.
Message text sits between special tokens in the Kimi format, so the split does not change how ordinary
text tokenizes.
"""

from __future__ import annotations

import re
from typing import Any

from kimi.controller.validation import BadRequest
from kimi.tokenizer import KimiTokenizer

_ROLES = ("system", "user", "assistant", "tool")
_MARK = "\U000f0000"  # plane-15 private use: never in real text we accept (rejected below)
_MARK_RE = re.compile(_MARK + r"(\d+)" + _MARK)


def _check_text(s: str, param: str) -> None:
    if _MARK in s:
        raise BadRequest(f"'{param}' contains the reserved character U+F0000", param)


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check the OpenAI `messages` shape; raises BadRequest naming e.g. `messages[2].content`."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
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
                    raise BadRequest(f"'{p}.content[{j}]' must be {{'type': 'text', 'text': str}} (only text is supported)", f"{p}.content")
        elif not isinstance(c, str):
            raise BadRequest(f"'{p}.content' must be a string or a list of text parts", f"{p}.content")
        if "name" in m and m["name"] is not None and not isinstance(m["name"], str):
            raise BadRequest(f"'{p}.name' must be a string", f"{p}.name")
    return messages


def encode_chat(
    tokenizer: KimiTokenizer, messages: Any, tools: list[dict[str, Any]] | None, template_kwargs: dict[str, Any]
) -> list[int]:
    """Prompt token ids for a chat request (generation prompt appended).

    Raises BadRequest for malformed messages or a template that fails on them.
    """
    messages = validate_messages(messages)
    pieces: list[str] = []

    def mark(s: str, param: str) -> str:
        _check_text(s, param)
        pieces.append(s)
        return f"{_MARK}{len(pieces) - 1}{_MARK}"

    marked = []
    for i, m in enumerate(messages):
        m2 = dict(m)
        c = m.get("content")
        if isinstance(c, str):
            m2["content"] = mark(c, f"messages[{i}].content") if c else c
        elif isinstance(c, list):
            m2["content"] = [{**part, "text": mark(part["text"], f"messages[{i}].content")} for part in c]
        marked.append(m2)
    try:
        rendered = tokenizer.apply_chat_template(marked, tools=tools, add_generation_prompt=True, **template_kwargs)
    except ValueError as e:
        raise BadRequest(str(e), "messages") from None
    ids: list[int] = []
    pos = 0
    for mt in _MARK_RE.finditer(rendered):
        ids.extend(tokenizer.encode(rendered[pos : mt.start()], allow_special=True))
        ids.extend(tokenizer.encode(pieces[int(mt.group(1))], allow_special=False))
        pos = mt.end()
    ids.extend(tokenizer.encode(rendered[pos:], allow_special=True))
    return ids
