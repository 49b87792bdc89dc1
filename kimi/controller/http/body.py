"""A request body's bytes -> its JSON value, with the bad values named by their JSON path."""

from __future__ import annotations

import json
import re
import sys
from typing import Any

from kimi.controller.body_errors import deepest_field
from kimi.controller.validation import BadRequest, first_path, json_path


def _decode_body(text: str) -> Any:
    """A request body's JSON -> its value (Python's json module: a duplicate key keeps its last value).

    Raises BadRequest: malformed JSON; nesting too deep; a string holding a lone UTF-16 surrogate (a key holding one
    at the path of its object: the key itself cannot be echoed back); an integer literal longer than Python's
    int-conversion limit (sys.get_int_max_str_digits(), 4300 digits by default), which json.loads refuses for the
    whole body: the body is then parsed again, with a stand-in for such literals, to name the field. The plain parse
    runs first, so only that rare body pays a Python callback per integer; each walk runs only for a body that can
    hold what it looks for."""
    long_int = False
    try:
        try:
            body = json.loads(text)
        except json.JSONDecodeError:
            raise
        except ValueError:  # the digit limit
            long_int = True
            body = json.loads(text, parse_int=_parse_int)
        if _SURROGATE_ESCAPE.search(text):  # valid UTF-8 cannot hold surrogates: only a \uD8xx-style escape can
            parts = first_path(body, _holds_surrogate, _SURROGATE_RE.search)
            if parts is not None:  # not UTF-8 encodable: it would fail the response (echo, reasoning), the template
                path = json_path(parts)
                raise BadRequest(f"'{path or 'body'}' contains a lone UTF-16 surrogate (U+D800..U+DFFF)", path or None)
        parts = first_path(body, _is_long_int) if long_int else None
    except ValueError as e:  # JSONDecodeError, here or after a long literal
        raise BadRequest(f"the request body is not valid JSON: {e}", None) from e
    except RecursionError:
        field = deepest_field(text)
        raise BadRequest(f"{f'{field!r} in ' if field else ''}the request body is nested too deeply", field) from None
    if (
        parts
    ):  # (None when a later duplicate key replaced it; [] when the body is one: Fields says it must be an object)
        path = json_path(parts)
        raise BadRequest(f"'{path}' is an integer of more than {sys.get_int_max_str_digits()} digits", path)
    return body


class _LongInt:
    """_decode_body's stand-in for an integer literal over Python's int-conversion limit."""

    __slots__ = ()


_LONG_INT = _LongInt()


def _parse_int(literal: str) -> Any:
    """json.loads's parse_int for a body holding an over-long integer: the literal's int, or _LONG_INT."""
    limit = sys.get_int_max_str_digits()
    if limit and len(literal) - literal.startswith("-") > limit:
        return _LONG_INT
    return int(literal)


def _is_long_int(v: Any) -> bool:
    return v is _LONG_INT


def _holds_surrogate(v: Any) -> bool:
    return isinstance(v, str) and _SURROGATE_RE.search(v) is not None


_SURROGATE_RE = re.compile("[\ud800-\udfff]")
# a JSON escape of a UTF-16 surrogate (\uD800-\uDFFF): the walk above runs only for bodies holding one, so long
# token-id prompts are not walked element by element
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE_ESCAPE_BYTES = re.compile(rb"\\u[dD][89a-fA-F]")  # the same in a raw body (bodies the Structs skip)
