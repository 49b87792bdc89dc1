"""Request fields -> the engine's settings, one way for the HTTP routes and the ZeroMQ submit API.

Both front-ends read a `kimi.controller.validation.Fields` (the ZeroMQ side builds one from a decoded
`protocol.SubmitRequest`), so a field has one rule, one error message and one way of becoming `SamplingParams` /
`StopParams`, whichever way it arrives: `sampling_params` reads the sampling and stop fields in a fixed order (the
first bad field is the one reported) and is the one place where per-request generation constraints are attached.
The engine's admission errors carry data (kimi.controller.admission); each front-end writes their message with
`admission_message` in its own terms.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from kimi.controller.request import StopParams
from kimi.controller.stops import MAX_STOP_STRINGS
from kimi.controller.validation import BadRequest, Fields
from kimi.protocol import SamplingParams

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


@dataclass(frozen=True)
class RequestParams:
    """A request's validated generation settings (`sampling_params`).

    max_tokens_field: the request field max_tokens came from (`max_tokens`, or `max_completion_tokens` when only
    that was sent), named in errors about it.
    """

    sampling: SamplingParams
    stop: StopParams
    skip_special_tokens: bool
    max_tokens_field: str = "max_tokens"
    priority: int = 0  # the scheduler's order under the priority policy (lower first)
    cache_salt: str | None = None  # prefix-cache isolation: blocks are shared only under the same salt


def sampling_params(
    f: Fields,
    *,
    vocab_size: int,
    eos_token_ids: Iterable[int],
    logprobs: int | None,
    prompt_logprobs: int,
    max_tokens_default: int,
) -> RequestParams:
    """The sampling and stop fields of a request -> RequestParams; raises BadRequest naming the first bad field.

    Reads, in this order: temperature, top_p, top_k, min_p, presence / frequency / repetition penalties, seed
    (`read_sampling`), logit_bias, stop, include_stop_str_in_output, stop_token_ids, ignore_eos,
    skip_special_tokens, max_tokens / max_completion_tokens (equal when both are sent; `max_tokens_default` when
    neither is), min_tokens, priority (a signed 64-bit integer), cache_salt (a non-empty string). logprobs: the
    per-token top-k count (None = off); prompt_logprobs: -1 = off, else the prompt positions' top-k. vocab_size bounds
    token ids; eos_token_ids are blocked until min_tokens.
    Output constraints (a grammar for `response_format` or the guided-decoding fields) belong here, between reading
    the fields and building SamplingParams, so that both front-ends attach them alike; this server has none yet.
    """
    sampling = read_sampling(f)
    lb_ids, lb_vals = read_logit_bias(f, vocab_size)
    stop_strings = read_stop_strings(f)
    include_stop = f.bool("include_stop_str_in_output", False)
    stop_ids = read_stop_token_ids(f, vocab_size)
    ignore_eos = f.bool("ignore_eos", False)
    skip_special = f.bool("skip_special_tokens", True)
    max_tokens = f.int("max_tokens", None, lo=1)
    max_field = "max_tokens"
    if f.has("max_completion_tokens"):
        mct = f.int("max_completion_tokens", None, lo=1)
        if max_tokens is not None and mct != max_tokens:
            raise BadRequest(
                "'max_tokens' and 'max_completion_tokens' disagree; send one of them", "max_completion_tokens"
            )
        if max_tokens is None and mct is not None:  # errors about it name the field the client sent
            max_field = "max_completion_tokens"
        max_tokens = mct
    else:
        f.accept("max_completion_tokens")
    if max_tokens is None:
        max_tokens = max_tokens_default
    min_tokens = read_min_tokens(f, max_tokens, max_field)
    priority = f.int("priority", 0)
    cache_salt = f.str("cache_salt")
    if cache_salt == "":
        raise BadRequest("'cache_salt' must be a non-empty string", "cache_salt")
    sp, st = generation_params(
        sampling,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        logit_bias_ids=lb_ids,
        logit_bias_values=lb_vals,
        stop=stop_strings,
        include_stop_str_in_output=include_stop,
        stop_token_ids=stop_ids,
        ignore_eos=ignore_eos,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        eos_token_ids=eos_token_ids,
    )
    return RequestParams(sp, st, skip_special, max_field, priority, cache_salt)
