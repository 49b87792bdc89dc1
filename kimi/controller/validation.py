"""Request-body validation for the OpenAI-compatible routes: honor or reject, never ignore.

Every field of an OpenAI request is either implemented, accepted only at its no-op value (e.g. `n: 1`,
`presence_penalty: 0`), or rejected with an HTTP 400 whose `param` names it. Errors use the OpenAI error
schema: `{"error": {"message", "type": "invalid_request_error", "param", "code"}}`.
"""

from __future__ import annotations

import math
from typing import Any, Callable


class BadRequest(Exception):
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
    """Typed access to a JSON object's fields; records which were read so the rest can be rejected."""

    def __init__(self, body: Any, where: str = "body") -> None:
        if not isinstance(body, dict):
            raise BadRequest(f"the request {where} must be a JSON object", None)
        self.body = body
        self.seen: set[str] = set()

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

    def bool(self, name: str, default: bool) -> bool:
        v = self._get(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise BadRequest(f"'{name}' must be a boolean", name)
        return v

    def int(self, name: str, default: int | None, lo: int | None = None, hi: int | None = None) -> int | None:
        v = self._get(name)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int):
            if isinstance(v, float) and v.is_integer():
                v = int(v)
            else:
                raise BadRequest(f"'{name}' must be an integer", name)
        lo = -(2**63) if lo is None else lo  # every integer travels to the workers as a 64-bit value
        hi = 2**63 - 1 if hi is None else hi
        if v < lo:
            raise BadRequest(f"'{name}' must be >= {lo}, got {v}", name)
        if v > hi:
            raise BadRequest(f"'{name}' must be <= {hi}, got {v}", name)
        return v

    def float(
        self, name: str, default: float, check: Callable[[float], bool] | None = None, what: str = ""
    ) -> float:
        v = self._get(name)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise BadRequest(f"'{name}' must be a number", name)
        v = float(v)
        if not math.isfinite(v) or (check is not None and not check(v)):
            raise BadRequest(f"'{name}' must be {what}, got {v}", name)
        return v

    def int_list(self, name: str, lo: int, hi: int) -> list[int]:
        v = self._get(name)
        if v is None:
            return []
        if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise BadRequest(f"'{name}' must be a list of integers", name)
        for x in v:
            if not lo <= x < hi:
                raise BadRequest(f"'{name}' holds {x}, outside [{lo}, {hi})", name)
        return v

    def noop(self, name: str, allowed: tuple[Any, ...], why: str = "is not supported") -> None:
        """Accept the field only at one of its no-op values (None always allowed)."""
        v = self._get(name)
        if v is None:
            return
        if isinstance(v, bool) and not any(isinstance(a, bool) for a in allowed):
            raise BadRequest(f"'{name}' {why}", name)
        if v not in allowed:
            raise BadRequest(f"'{name}'={v!r} {why}; only {', '.join(repr(a) for a in allowed)} is accepted", name)

    def accept(self, *names: str) -> None:
        """Fields that change nothing about generation (e.g. `user`), accepted as given."""
        self.seen.update(names)

    def reject_unknown(self) -> None:
        for k, v in self.body.items():
            if k not in self.seen and v is not None:
                raise BadRequest(f"'{k}' is not supported by this server", k)
