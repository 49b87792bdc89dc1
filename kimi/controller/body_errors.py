"""Naming the field of a request body that cannot be decoded: bytes that are not UTF-8, or nesting deeper than the
JSON parser goes. Both run only on a body already refused, to fill the 400's `param`."""

from __future__ import annotations

import json
import re

from kimi.controller.validation import first_path, json_path

_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")  # what surrogateescape makes of a byte that is not UTF-8
_SURROGATE = re.compile("[\ud800-\udfff]")
# a JSON string or a structural character (numbers and literals are skipped: they never change the depth)
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{},]')


def invalid_utf8_path(raw: bytes) -> str | None:
    """The JSON path (`messages[0].content`) of the first string holding bytes that are not UTF-8 (for a key: the
    object holding it); None when it cannot be named (the bytes are outside any string, the body is not JSON
    otherwise, or the body itself is that string)."""
    try:
        body = json.loads(raw.decode("utf-8", "surrogateescape"))
    except (ValueError, RecursionError):
        return None
    parts = first_path(body, lambda v: isinstance(v, str) and _ESCAPED_BYTE.search(v) is not None, _ESCAPED_BYTE.search)
    path = json_path(parts) if parts else ""
    return path if path and not _SURROGATE.search(path) else None


def deepest_field(text: str) -> str | None:
    """The top-level key of a JSON object body whose value is nested deepest (for a body the parser refused as
    nested too deeply); None when the body is not an object or no key can be named. One regex pass over the text."""
    depth = 0
    top_object = expect_key = False
    key: str | None = None
    best: tuple[int, str | None] = (0, None)
    for m in _TOKEN.finditer(text):
        t = m.group()
        if t == "[" or t == "{":
            depth += 1
            if depth == 1:
                top_object = expect_key = t == "{"
            elif depth > best[0] and top_object:
                best = (depth, key)
        elif t == "]" or t == "}":
            depth -= 1
        elif t == ",":
            expect_key = expect_key or (depth == 1 and top_object)
        elif expect_key and depth == 1:
            expect_key = False
            try:
                key = json.loads(t)
            except ValueError:
                key = None
    name = best[1]
    return name if name and not _SURROGATE.search(name) else None
