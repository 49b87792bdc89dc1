"""Request-body validation for the OpenAI-compatible routes and the ZeroMQ submit API: honor or reject, never ignore.

Every field of an OpenAI request is either implemented, accepted only at its no-op value (e.g. `n: 1`,
`presence_penalty: 0`), or rejected with an HTTP 400 whose `param` names it. Errors use the OpenAI error
schema: `{"error": {"message", "type": "invalid_request_error", "param", "code"}}`.
"""

from __future__ import annotations

import builtins
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, overload

from kimi.controller.request import StopParams
from kimi.controller.stops import MAX_STOP_STRINGS
from kimi.protocol import SamplingParams


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

    def reject_unknown(self, elsewhere: tuple[builtins.str, frozenset[builtins.str]] | None = None) -> None:
        """A 400 naming the first field of the body that no check read (None values pass). elsewhere: (path, fields)
        of the other endpoint, whose fields the message then points to (e.g. `tools` sent to /v1/completions)."""
        for k, v in self.body.items():
            if k not in self.seen and v is not None:
                if elsewhere is not None and k in elsewhere[1]:
                    raise BadRequest(f"'{k}' is not supported on this endpoint; it is a field of {elsewhere[0]}", k)
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


# ---- rules shared by the HTTP routes (kimi.controller.http) and the ZeroMQ submit API (kimi.controller.submit)
# Both front-ends read a `Fields` (the ZeroMQ side builds one from a decoded SubmitRequest), so a field has one
# rule, one error message and one way of becoming SamplingParams / StopParams, whichever way it arrives.

MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024
# canonical ASCII decimal: no "+", space, "_" or leading 0 ("-5" is canonical, and outside any vocabulary)
_TOKEN_ID_KEY = re.compile(r"0|-?[1-9][0-9]*")


@dataclass
class SamplingFields:
    """The per-token sampling controls of one request, validated (`read_sampling`)."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    seed: int | None


def read_sampling(f: Fields) -> SamplingFields:
    """temperature [0, 2], top_p (0, 1], top_k >= -1 (-1 and 0 = off), min_p [0, 1], presence / frequency
    penalties [-2, 2], repetition_penalty (0, 10], seed a signed 64-bit integer (None = unseeded); read in
    this order (the first bad field is the one reported)."""
    temperature = f.float("temperature", 1.0, lambda v: 0.0 <= v <= 2.0, "in [0, 2]")
    top_p = f.float("top_p", 1.0, lambda v: 0.0 < v <= 1.0, "in (0, 1]")
    top_k = f.int("top_k", 0, lo=-1)
    if top_k == -1:
        top_k = 0
    min_p = f.float("min_p", 0.0, lambda v: 0.0 <= v <= 1.0, "in [0, 1]")
    presence = f.float("presence_penalty", 0.0, lambda v: -2.0 <= v <= 2.0, "in [-2, 2]")
    frequency = f.float("frequency_penalty", 0.0, lambda v: -2.0 <= v <= 2.0, "in [-2, 2]")
    repetition = f.float("repetition_penalty", 1.0, lambda v: 0.0 < v <= 10.0, "in (0, 10]")
    seed = f.int("seed", None, lo=-(2**63), hi=2**63 - 1)
    return SamplingFields(temperature, top_p, top_k, min_p, presence, frequency, repetition, seed)


def read_logit_bias(f: Fields, vocab_size: int) -> tuple[list[int], list[float]]:
    """`logit_bias`: {token id: bias in [-100, 100]}, at most MAX_LOGIT_BIAS entries, ids in [0, vocab_size)
    -> (ids, biases) in the mapping's order. A key is an int (ZeroMQ) or, as JSON keys are strings, the id's
    canonical decimal string ("0", "5", "163839"; "-1" is out of range like the int -1); " 5", "+5", "05",
    "1_0", "5.0" and non-ASCII digits are rejected (Python's int() would take most of them)."""
    lb = f._get("logit_bias")
    if lb is None:
        return [], []
    if not isinstance(lb, dict):
        raise BadRequest("'logit_bias' must be an object mapping token ids to biases", "logit_bias")
    if len(lb) > MAX_LOGIT_BIAS:
        raise BadRequest(f"'logit_bias' holds more than {MAX_LOGIT_BIAS} entries", "logit_bias")
    ids, vals = [], []
    for k, v in lb.items():
        if isinstance(k, int) and not isinstance(k, bool):
            tid = k
        elif isinstance(k, str) and _TOKEN_ID_KEY.fullmatch(k):
            if len(k) > 18:  # further from 0 than than any vocabulary (and int() of a huge string is slow or refused)
                raise BadRequest(
                    f"'logit_bias' token id {k[:24]}... is outside the vocabulary [0, {vocab_size})", "logit_bias"
                )
            tid = int(k)
        else:
            raise BadRequest(
                f"'logit_bias' key {k!r:.40} is not a token id (a non-negative decimal integer without "
                "sign, spaces or leading zeros)",
                "logit_bias",
            )
        if not 0 <= tid < vocab_size:
            raise BadRequest(f"'logit_bias' token id {tid} is outside the vocabulary [0, {vocab_size})", "logit_bias")
        # the range test also refuses NaN and the infinities, and compares integers of any size without a float
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise BadRequest(f"'logit_bias' value for {tid} must be a number in [-100, 100]", "logit_bias")
        ids.append(tid)
        vals.append(float(v))
    return ids, vals


def read_stop_strings(f: Fields) -> tuple[str, ...]:
    """`stop`: a string or a list of up to MAX_STOP_STRINGS non-empty strings -> the distinct strings, in order."""
    stop = f._get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadRequest("'stop' must be a string or a list of strings", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise BadRequest(f"'stop' holds {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed", "stop")
    if any(s == "" for s in stop):
        raise BadRequest("'stop' strings must not be empty", "stop")
    return tuple(dict.fromkeys(stop))


def read_stop_token_ids(f: Fields, vocab_size: int) -> list[int]:
    """`stop_token_ids`: at most MAX_STOP_TOKEN_IDS ids in [0, vocab_size)."""
    stop_ids = f.int_list("stop_token_ids", 0, vocab_size)
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise BadRequest(f"'stop_token_ids' holds more than {MAX_STOP_TOKEN_IDS} ids", "stop_token_ids")
    return stop_ids


def read_min_tokens(f: Fields, max_tokens: int, max_field: str = "max_tokens") -> int:
    """`min_tokens`: 0 .. max_tokens (max_field: the request field max_tokens came from, named in the error)."""
    min_tokens = f.int("min_tokens", 0, lo=0)
    if min_tokens > max_tokens:
        raise BadRequest(f"'min_tokens' ({min_tokens}) must not exceed {max_field} ({max_tokens})", "min_tokens")
    return min_tokens


def generation_params(
    s: SamplingFields,
    *,
    logprobs: int | None,
    prompt_logprobs: int,
    logit_bias_ids: list[int],
    logit_bias_values: list[float],
    stop: tuple[str, ...],
    include_stop_str_in_output: bool,
    stop_token_ids: list[int],
    ignore_eos: bool,
    max_tokens: int,
    min_tokens: int,
    eos_token_ids: Iterable[int],
) -> tuple[SamplingParams, StopParams]:
    """The validated fields as the worker's SamplingParams and the controller's StopParams.

    With min_tokens > 0 the ids the worker keeps from being sampled until then (`min_tokens_block_ids`) are
    the stop_token_ids plus, unless ignore_eos, the model's EOS ids (`eos_token_ids`), sorted.
    """
    block = sorted(set(stop_token_ids) | (set() if ignore_eos else set(eos_token_ids))) if min_tokens else []
    sampling = SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        seed=s.seed,
        num_logprobs=-1 if logprobs is None else logprobs,
        min_p=s.min_p,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty,
        logit_bias_ids=logit_bias_ids,
        logit_bias_values=logit_bias_values,
        min_tokens=min_tokens,
        min_tokens_block_ids=block,
        prompt_logprobs=prompt_logprobs,
    )
    stop_params = StopParams(
        max_tokens=max_tokens,
        stop_token_ids=frozenset(stop_token_ids),
        ignore_eos=ignore_eos,
        stop=stop,
        include_stop_str_in_output=include_stop_str_in_output,
        min_tokens=min_tokens,
    )
    return sampling, stop_params


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
