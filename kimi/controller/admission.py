"""Why the engine refuses a request, as data: the front-ends (HTTP, ZeroMQ) write the message in their own terms.

`AdmissionError` carries the reason, the request field it concerns, the limit and the value compared;
`admission_message(e, max_tokens_field, request_id)` writes the sentence with the field the client sent
(`max_completion_tokens` for `max_tokens`) and the request id the client knows; `admission_param` names the field
(`messages` for a chat prompt, `prompt[i]` for prompt i of a batch).
"""

from __future__ import annotations

import enum


class AdmissionReason(enum.Enum):
    """Why `Engine.add_request` refused a request (AdmissionError.reason)."""

    DUPLICATE_ID = "duplicate_id"  # the request id is in use
    EMPTY_PROMPT = "empty_prompt"
    PROMPT_TOO_LONG = "prompt_too_long"  # value: prompt tokens >= limit: max_model_len
    TOKEN_OUT_OF_VOCAB = "token_out_of_vocab"  # value: the id; limit: the vocabulary size
    MAX_TOKENS_TOO_SMALL = "max_tokens_too_small"  # value: max_tokens < 1
    CONTEXT_OVERFLOW = "context_overflow"  # prompt_tokens + value (max_tokens) > limit: max_model_len
    PROMPT_FILLS_KV = "prompt_fills_kv"  # value: prompt tokens >= limit: the KV cache capacity in tokens
    KV_OVERFLOW = "kv_overflow"  # prompt_tokens + value (max_tokens) > limit: the KV cache capacity in tokens
    UNENCODABLE = "unencodable"  # the sampling parameters do not encode for the workers (detail: why)
    PRIORITY_POLICY = "priority_policy"  # value: a non-zero priority under the fcfs policy
    QUEUE_FULL = "queue_full"  # limit: max_waiting


class AdmissionError(ValueError):
    """A request that can never run (too long for max_model_len or for the whole KV cache, ...), or (QueueFull) one
    that cannot be queued now.

    The data, not a sentence: `reason` (AdmissionReason), `param` (the offending request field: `prompt`,
    `max_tokens`, `priority`, `request_id` or None), `limit` and `value` (the numbers compared; see AdmissionReason),
    `prompt_tokens`, `request_id` and `detail`. The front-end writes the message in its own terms
    (`admission_message`); str(e) is that message in the engine's terms.
    """

    def __init__(
        self,
        reason: AdmissionReason,
        param: str | None = None,
        *,
        limit: int | None = None,
        value: int | None = None,
        prompt_tokens: int | None = None,
        request_id: str | None = None,
        detail: str = "",
    ) -> None:
        self.reason = reason
        self.param = param
        self.limit = limit
        self.value = value
        self.prompt_tokens = prompt_tokens
        self.request_id = request_id
        self.detail = detail
        super().__init__(admission_message(self))


class QueueFull(AdmissionError):
    """The waiting queue holds `max_waiting` requests already; retry later (HTTP 503 + Retry-After)."""

    retry_after_s = 1


def admission_message(e: AdmissionError, max_tokens_field: str = "max_tokens", request_id: str | None = None) -> str:
    """The message of an AdmissionError for the client: `max_tokens_field` is the field the client sent for
    max_tokens, `request_id` the id the client knows the request by (the engine's id is internal)."""
    r, lim, val, n = e.reason, e.limit, e.value, e.prompt_tokens
    mt = max_tokens_field
    if r is AdmissionReason.DUPLICATE_ID:
        return f"request id {request_id if request_id is not None else e.request_id!r} is already in use"
    if r is AdmissionReason.EMPTY_PROMPT:
        return "the prompt is empty"
    if r is AdmissionReason.PROMPT_TOO_LONG:
        return (
            f"this model's maximum context length is {lim} tokens; the prompt has {val} tokens, which leaves no room "
            "for a generated token"
        )
    if r is AdmissionReason.TOKEN_OUT_OF_VOCAB:
        return f"prompt token id {val} is outside the vocabulary [0, {lim})"
    if r is AdmissionReason.MAX_TOKENS_TOO_SMALL:
        return f"{mt} must be at least 1, got {val}"
    if r is AdmissionReason.CONTEXT_OVERFLOW:
        return (
            f"this model's maximum context length is {lim} tokens; the request has {n} prompt tokens and {mt} asks "
            f"for {val} more"
        )
    if r is AdmissionReason.PROMPT_FILLS_KV:
        return (
            f"the prompt ({val} tokens) fills the KV cache capacity of {lim} tokens, which leaves no room for a "
            "generated token"
        )
    if r is AdmissionReason.KV_OVERFLOW:
        return f"prompt ({n} tokens) + {mt} ({val}) exceeds the KV cache capacity of {lim} tokens"
    if r is AdmissionReason.PRIORITY_POLICY:
        return (
            f"'priority' {val} needs the priority scheduling policy (kimi serve --scheduling-policy priority); this "
            "server schedules first come, first served"
        )
    if r is AdmissionReason.QUEUE_FULL:
        return f"the server's waiting queue is full ({lim} requests); retry later"
    return f"sampling parameters cannot be sent to the workers: {e.detail}"


def admission_param(
    e: AdmissionError, prompt_field: str = "prompt", max_tokens_field: str = "max_tokens"
) -> str | None:
    """The request field an AdmissionError names, in the front-end's terms (`messages` for a chat prompt)."""
    if e.param == "prompt":
        return prompt_field
    if e.param == "max_tokens":
        return max_tokens_field
    return e.param
