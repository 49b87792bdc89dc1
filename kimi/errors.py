"""kimi's exceptions: one base class, `KimiError`, and a subclass per kind of failure.

Each subclass also derives from the builtin exception it replaced (ValueError for bad input or configuration,
RuntimeError for a failure while running), so `except ValueError` / `except RuntimeError` clauses keep working.

    KimiError
    ├── ConfigError(ValueError)          a configuration kimi cannot run with (config.json, flags, environment)
    ├── CheckpointError(ValueError)      a checkpoint that does not match its config
    ├── KVCacheSizeError(ValueError)     a KV cache that does not fit in the device's memory
    ├── AdmissionError(ValueError)       a request the engine refuses (reason, param, limit, value)
    │   └── QueueFullError               the waiting queue is full (retry later)
    ├── EngineDeadError(RuntimeError)    the engine stopped after a failure; new requests are refused
    ├── WorkerFailedError(RuntimeError)  a worker rank failed, exited or went silent (ranks, step)
    ├── PeerFailure(RuntimeError)        a collective with the other ranks failed (seen by a healthy rank)
    └── ProtocolError(RuntimeError)      a party broke the step protocol or a call order (a bug, not bad input)

Elsewhere, for their module's callers: kimi.controller.validation.BadRequest (an invalid HTTP / ZeroMQ request),
kimi.structured_output.backend.GrammarError, kimi.controller.block_pool.NoFreeBlocks, kimi.client.ClientError.
"""

from __future__ import annotations

import enum


class KimiError(Exception):
    """Base class of every exception kimi raises on purpose."""


class ConfigError(KimiError, ValueError):
    """A configuration kimi cannot run with: a checkpoint's config.json that is missing, malformed or describes an
    unsupported model; options that contradict each other or the workers; a malformed environment variable."""


class CheckpointError(KimiError, ValueError):
    """A checkpoint does not match its config: names the offending tensor and, where known, its file."""


class KVCacheSizeError(KimiError, ValueError):
    """The KV cache asked for (--num-blocks / --kv-cache-memory-gib) does not fit in the device's memory; the
    message names the flag, the bytes needed and the bytes available. The worker prints it without a traceback."""


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


class AdmissionError(KimiError, ValueError):
    """A request that can never run (too long for max_model_len or for the whole KV cache, ...), or (QueueFullError)
    one that cannot be queued now.

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


class QueueFullError(AdmissionError):
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


class EngineDeadError(KimiError, RuntimeError):
    """The engine stopped after a worker failure (or is closing, or still loading); new requests are refused."""


class WorkerFailedError(KimiError, RuntimeError):
    """A worker failed: a rank reported an error, exited, stopped answering, or missed a step's deadline.

    `ranks`: the ranks concerned (ascending; () when the failure names none, e.g. a liveness check's report);
    `rank`: the one rank when exactly one is concerned, else None; `step`: the step it happened in, None when at
    start-up or unknown.
    """

    def __init__(self, message: str, *, ranks: tuple[int, ...] = (), step: int | None = None) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.step = step

    @property
    def rank(self) -> int | None:
        return self.ranks[0] if len(self.ranks) == 1 else None


class PeerFailure(KimiError, RuntimeError):
    """A collective with the other ranks failed (a peer died, was stopped past the timeout, or the network
    broke): this rank is healthy, a peer probably is not.

    Named PeerFailure, not PeerFailureError: a rank reports its error as `<class name>: <message>`, so this is the
    name users read in a failed request's error (docs/multinode.md quotes it)."""


PeerFailureError = PeerFailure


class ProtocolError(KimiError, RuntimeError):
    """A party broke a protocol kimi's own code keeps: a step plan or result out of order or inconsistent with what
    was sent before, a KV slot overwritten, a method called out of order. Always a bug, never bad input."""


class BackendUnavailableError(KimiError, RuntimeError):
    """A kernel or backend this install or GPU cannot run: Triton not installed, a kernel built for another GPU
    architecture."""
