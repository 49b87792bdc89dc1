"""Request-body validation for the OpenAI-compatible routes and the ZeroMQ submit API: honor or reject, never ignore.

Every field of an OpenAI request is either implemented, accepted only at its no-op value (e.g. `n: 1`,
`presence_penalty: 0`), or rejected with an HTTP 400 whose `param` names it. Errors use the OpenAI error
schema: `{"error": {"message", "type": "invalid_request_error", "param", "code"}}`.
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Callable
from typing import Any, overload

from kimi.errors import KimiError


class BadRequest(KimiError):
    """An invalid request; `status` (400 unless said otherwise), `param` names the field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class Fields:
    """Typed access to a JSON object's fields; records which were read so the rest can be rejected.

    body: the decoded object; where: what it is, for the message when it is not an object; param: the field that
    holds it (None for the request body itself), named by that error."""

    def __init__(self, body: Any, where: str = "body", param: str | None = None) -> None:
        if not isinstance(body, dict):
            raise BadRequest(f"the request {where} must be a JSON object", param)
        self.body = body
        self.seen: set[str] = set()
        self.body_bytes = 0  # the HTTP body's size, when the server sets it (kimi.controller.offload)

    def _get(self, name: str) -> Any:
        self.seen.add(name)
        return self.body.get(name)

    def has(self, name: str) -> bool:
        return self.body.get(name) is not None

    def str(self, name: str, default: str | None = None, required: bool = False) -> str | None:
        v = self._get(name)
        if v is None:
            if required:
                raise BadRequest(f"'{name}' is required", name)
            return default
        if not isinstance(v, str):
            raise BadRequest(f"'{name}' must be a string", name)
        return v

    def bool(self, name: builtins.str, default: builtins.bool) -> builtins.bool:
        v = self._get(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise BadRequest(f"'{name}' must be a boolean", name)
        return v

    @overload
    def int(
        self, name: builtins.str, default: builtins.int, lo: builtins.int | None = None, hi: builtins.int | None = None
    ) -> builtins.int: ...

    @overload
    def int(
        self, name: builtins.str, default: None, lo: builtins.int | None = None, hi: builtins.int | None = None
    ) -> builtins.int | None: ...

    def int(
        self,
        name: builtins.str,
        default: builtins.int | None,
        lo: builtins.int | None = None,
        hi: builtins.int | None = None,
    ) -> builtins.int | None:
        """The field as an integer in [lo, hi] (a JSON integer, not a float or a boolean); `default` if absent."""
        v = self._get(name)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int):  # 1.0, "1" and true are not integers
            raise BadRequest(f"'{name}' must be an integer, got {_json_type(v)}", name)
        lo = -(2**63) if lo is None else lo  # every integer travels to the workers as a 64-bit value
        hi = 2**63 - 1 if hi is None else hi
        if v < lo:
            raise BadRequest(f"'{name}' must be >= {lo}, got {v}", name)
        if v > hi:
            raise BadRequest(f"'{name}' must be <= {hi}, got {v}", name)
        return v

    def float(
        self,
        name: builtins.str,
        default: builtins.float,
        check: Callable[[builtins.float], builtins.bool] | None = None,
        what: builtins.str = "",
    ) -> builtins.float:
        v = self._get(name)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise BadRequest(f"'{name}' must be a number", name)
        try:
            v = float(v)
        except OverflowError:  # an integer beyond the float range (JSON allows any number of digits)
            raise BadRequest(
                f"'{name}' must be {what or 'a finite number'}, got an integer too large for a float "
                f"({v.bit_length()} bits)",
                name,
            ) from None
        if not math.isfinite(v) or (check is not None and not check(v)):
            raise BadRequest(f"'{name}' must be {what}, got {v}", name)
        return v

    def int_list(self, name: builtins.str, lo: builtins.int, hi: builtins.int) -> list[builtins.int]:
        v = self._get(name)
        if v is None:
            return []
        if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise BadRequest(f"'{name}' must be a list of integers", name)
        for x in v:
            if not lo <= x < hi:
                raise BadRequest(f"'{name}' holds {x}, outside [{lo}, {hi})", name)
        return v

    def noop(self, name: builtins.str, allowed: tuple[Any, ...], why: builtins.str = "is not supported") -> None:
        """Accept the field only at one of its no-op values (None always allowed), of the same JSON type: 1.0 and
        true are not the integer 1, 0 is not false. A value of another JSON type is refused as such."""
        v = self._get(name)
        if v is None:
            return
        types = {_json_type(a) for a in allowed}
        if _json_type(v) not in types:
            raise BadRequest(f"'{name}' must be {' or '.join(sorted(types))}, got {_json_type(v)}", name)
        if not any(v == a and _json_type(v) == _json_type(a) for a in allowed):  # False == 0 in Python
            raise BadRequest(f"'{name}'={v!r} {why}; only {', '.join(repr(a) for a in allowed)} is accepted", name)

    def accept(self, *names: builtins.str) -> None:
        """Fields that change nothing about generation (e.g. `user`), accepted as given."""
        self.seen.update(names)

    def reject_unknown(
        self,
        elsewhere: tuple[builtins.str, frozenset[builtins.str]] | None = None,
        declared: frozenset[builtins.str] | None = None,
    ) -> None:
        """A 400 naming the first field of the body that no check read (None values pass). elsewhere: (path, fields)
        of the other endpoint, whose fields the message then points to (e.g. `tools` sent to /v1/completions).
        declared: the route's declared fields (kimi.controller.http.protocol); a field outside them is unknown, one
        declared but not read does not apply to this request (e.g. `tools` beside a /tokenize `prompt`)."""
        for k, v in self.body.items():
            if k not in self.seen and v is not None:
                if elsewhere is not None and k in elsewhere[1]:
                    raise BadRequest(f"'{k}' is not supported on this endpoint; it is a field of {elsewhere[0]}", k)
                if declared is not None and k in declared:
                    raise BadRequest(f"'{k}' does not apply to this request", k)
                raise BadRequest(f"'{k}' is not supported by this server", k)


_JSON_TYPES = (  # first match wins: bool before int (a bool is an int in Python)
    (type(None), "null"),
    (bool, "a boolean"),
    (int, "an integer"),
    (float, "a number with a fraction or exponent"),
    (str, "a string"),
    (list, "an array"),
    (dict, "an object"),
)


def first_path(v: Any, leaf: Callable[[Any], bool], key: Callable[[str], Any] | None = None) -> list[str | int] | None:
    """The path (keys / indices, innermost first; [] for v itself) of the first value in v for which leaf(value) is
    true, or of the object holding the first key for which key(k) is; None if there is none. The path is collected
    on the way back out, so a body of many elements under long keys costs one visit per element."""
    if leaf(v):
        return []
    if isinstance(v, dict):
        for k, x in v.items():
            if key is not None and key(k):
                return []
            found = first_path(x, leaf, key)
            if found is not None:
                found.append(k)
                return found
    elif isinstance(v, list):
        for i, x in enumerate(v):
            found = first_path(x, leaf, key)
            if found is not None:
                found.append(i)
                return found
    return None


def json_path(parts: list[str | int]) -> str:
    """Innermost-first path parts -> `messages[1].content` ("" for the body itself)."""
    out = ""
    for p in reversed(parts):
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out


def _json_type(v: Any) -> str:
    """The JSON type name of a decoded value (for error messages and exact-type comparisons)."""
    return next((name for t, name in _JSON_TYPES if isinstance(v, t)), type(v).__name__)


def check_prompt_text_fits(
    tokenizer: Any, text: str, max_model_len: int, param: str = "prompt", subject: str = "the prompt has"
) -> None:
    """BadRequest (naming `param`) when `text` surely has max_model_len tokens or more (kimi.tokenizer
    .KimiTokenizer.min_num_tokens, no encoding): a huge prompt is refused before seconds of tokenizing. The
    message is the engine's for a prompt that leaves no room, with the bound instead of the count. A chat request
    passes its messages' text (param `messages`, subject "the messages' text has"): its prompt holds that text and
    more."""
    lb = tokenizer.min_num_tokens(text)
    if lb >= max_model_len:
        raise BadRequest(
            f"this model's maximum context length is {max_model_len} tokens; {subject} at least "
            f"{lb} tokens ({len(text)} characters), which leaves no room for a generated token",
            param,
        )
