"""Every wire type: client <-> controller (ZeroMQ submit API) and controller <-> worker (step plans).

All messages are msgspec Structs encoded with msgpack, `array_like=True` (positional: **field order is the
wire format — append fields, never reorder**) and tagged with a small integer so one socket can carry a
union of types. No pickle anywhere.

Controller -> workers (PUB/SUB, broadcast): `Ping`, `StepPlan`, `Shutdown`.
Workers -> controller (PUSH/PULL): `Ready`, `StepResult`, `WorkerError`, `Pong`.
Client <-> controller (DEALER/ROUTER): `SubmitRequest`, `AbortRequest` / `RequestOutput`.

A step plan is a diff against what the workers already hold (docs/design.md, Step plan and result):
new requests carry their token ids once; continuing requests carry only how many tokens to compute and the
block ids appended since the last step; finished / aborted / preempted rids are dropped. A worker computes
tokens `[num_computed_tokens, num_computed_tokens + num_new_tokens)` of a request and samples the next token
exactly when that reaches the end of the request's known tokens.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kimi.structured_output.spec import GrammarSpec

# temperatures below this sample greedily (argmax: the tempered distribution's limit as T -> 0), vLLM's sampler
# threshold (_SAMPLING_EPS; vLLM's API first raises 0 < T < 0.01 to 0.01); tiny temperatures must not reach the
# division: fp32 logits over 1e-38 overflowed to inf and every token came out as id 0
GREEDY_TEMPERATURE = 1e-5


class SamplingParams(msgspec.Struct, array_like=True, frozen=True, tag=1):
    """What the worker needs to sample one request's tokens.

    temperature: below GREEDY_TEMPERATURE (0 included) = greedy (argmax), see `greedy`. top_p in (0, 1]. top_k:
    0 = off. seed: None = unseeded.
    num_logprobs: -1 = none; 0 = the sampled token's logprob; k > 0 = also the top-k alternatives.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    num_logprobs: int = -1
    # appended (issue #5); semantics and order of application: kimi/model/sampling.py
    min_p: float = 0.0  # keep tokens with prob >= min_p * max prob (after temperature); 0 = off
    presence_penalty: float = 0.0  # subtracted once from the logit of every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # CTRL-style, over prompt + generated tokens; 1 = off
    logit_bias_ids: list[int] = []  # added to the logits: logit[ids[i]] += logit_bias_values[i]
    logit_bias_values: list[float] = []
    min_tokens: int = 0  # until this many tokens are generated, `min_tokens_block_ids` cannot be sampled
    min_tokens_block_ids: list[int] = []  # EOS + stop_token_ids (set by the controller)
    prompt_logprobs: int = -1  # -1 none; k >= 0: logprob of every prompt token (+ top-k) in TokenOutput
    # appended: guided decoding (kimi.structured_output): the output is constrained to this grammar; None = free
    grammar: GrammarSpec | None = None

    @property
    def greedy(self) -> bool:
        """True when the request samples by argmax: temperature < GREEDY_TEMPERATURE."""
        return self.temperature < GREEDY_TEMPERATURE


# ---- controller -> worker ------------------------------------------------------------------------------
class NewRequest(msgspec.Struct, array_like=True, frozen=True, tag=10):
    """A request new to the workers (or re-sent after preemption).

    token_ids: every token known so far (prompt, plus earlier outputs when resumed).
    num_computed_tokens: tokens whose KV is already in `block_ids` (prefix cache hits).
    num_new_tokens: tokens to compute this step, starting at num_computed_tokens.
    block_ids: the request's block table so far.
    """

    rid: int
    dp_rank: int
    token_ids: list[int]
    num_computed_tokens: int
    num_new_tokens: int
    block_ids: list[int]
    sampling: SamplingParams
    num_prompt_tokens: int = -1  # token_ids[:num_prompt_tokens] is the prompt (-1: all of token_ids)


class ContinueRequest(msgspec.Struct, array_like=True, frozen=True, tag=11):
    """A request the workers already hold: compute `num_new_tokens` more; `new_block_ids` appended to its table."""

    rid: int
    num_new_tokens: int
    new_block_ids: list[int]
    # appended: speculative decoding (docs/speculative.md): the last num_draft_tokens of the num_new_tokens are the
    # first num_draft_tokens of the worker's own draft proposal for this request (the target verifies them)
    num_draft_tokens: int = 0


class StepPlan(msgspec.Struct, array_like=True, frozen=True, tag=12):
    """One engine step. `step` increases by one per plan; a worker that sees a gap fails loudly.

    `finished` rids are dropped by their owners before the step runs.
    """

    step: int
    new: list[NewRequest]
    cont: list[ContinueRequest]
    finished: list[int]


class Ping(msgspec.Struct, array_like=True, frozen=True, tag=13):
    """Heartbeat / start-up probe; workers answer the first one with `Ready` and exit when pings stop."""

    seq: int


class Shutdown(msgspec.Struct, array_like=True, frozen=True, tag=14):
    """Workers exit cleanly."""

    reason: str = ""


# ---- worker -> controller ------------------------------------------------------------------------------
class Ready(msgspec.Struct, array_like=True, frozen=True, tag=20):
    """A rank has loaded its weights and KV cache. num_blocks includes the null block 0."""

    rank: int
    world_size: int
    num_blocks: int
    block_size: int
    device: str


class TokenOutput(msgspec.Struct, array_like=True, frozen=True, tag=21):
    """One sampled token of one request. logprob is None unless asked; top_ids/top_logprobs likewise."""

    rid: int
    token_id: int
    logprob: float | None = None
    top_ids: list[int] | None = None
    top_logprobs: list[float] | None = None
    # appended: set on a request's first sampled token when SamplingParams.prompt_logprobs >= 0.
    # Entry i is about prompt token i given tokens < i; entry 0, and positions served from the prefix
    # cache (not computed by this worker), are None.
    prompt_logprobs: list[float | None] | None = None
    prompt_top_ids: list[list[int] | None] | None = None
    prompt_top_logprobs: list[list[float] | None] | None = None
    # appended: the worker cannot go on with this request (guided decoding: its grammar failed on the worker, or the
    # token is outside it); the controller ends the request with this error
    error: str | None = None
    # appended: speculative decoding: the tokens emitted after token_id in the same verify step (accepted drafts, then
    # the correction or bonus token), with their logprob / top alternatives when asked; None: token_id alone
    next_token_ids: list[int] | None = None
    next_logprobs: list[float | None] | None = None
    next_top_ids: list[list[int] | None] | None = None
    next_top_logprobs: list[list[float] | None] | None = None


class StepResult(msgspec.Struct, array_like=True, frozen=True, tag=22):
    """Every rank answers every step (possibly with no outputs) so the controller knows the step is done."""

    step: int
    rank: int
    outputs: list[TokenOutput]


class WorkerError(msgspec.Struct, array_like=True, frozen=True, tag=23):
    """A rank failed; the controller fails all in-flight requests and exits non-zero."""

    rank: int
    message: str


class Pong(msgspec.Struct, array_like=True, frozen=True, tag=24):
    """A rank's answer to a `Ping` (sent by its heartbeat thread, also while a step runs): `step` is the last
    step the rank finished. A rank whose pongs stop (dead, SIGSTOPped, wedged) is failed by the controller."""

    rank: int
    seq: int
    step: int


ToWorker = StepPlan | Ping | Shutdown
FromWorker = Ready | StepResult | WorkerError | Pong


# ---- client <-> controller -----------------------------------------------------------------------------
class SubmitRequest(msgspec.Struct, array_like=True, frozen=True, tag=30, kw_only=True):
    """Submit one generation. Exactly one of `prompt` (text) and `prompt_token_ids` must be given.

    The fields mean what the HTTP API's fields of the same name mean (docs/api.md) and are validated by the
    same rules (kimi.controller.validation; a bad value ends the request with an error naming the field):
    max_tokens >= 1; temperature in [0, 2] (below 1e-5 = greedy); top_p in (0, 1]; top_k >= -1 (-1 and 0 = off);
    seed: a signed 64-bit integer (None = unseeded); stop_token_ids: up to 256 token ids that end generation
    (stop_reason = the id); ignore_eos: keep going past EOS ids; logprobs: None, or 0..20 top alternatives;
    min_p in [0, 1] (0 = off); presence_penalty / frequency_penalty in [-2, 2]; repetition_penalty in (0, 10]
    (1 = off); logit_bias: {token id: bias in [-100, 100]}, up to 1024 entries; min_tokens in [0, max_tokens]:
    EOS (unless ignore_eos) and stop_token_ids cannot be sampled, and stop strings are not looked for, before
    that many tokens; stop: a string or up to 4 non-empty strings that end generation (stop_reason = the
    string; text that could still begin one is held back, never sent); include_stop_str_in_output: keep the
    matched stop string in the text. response_format / structured_outputs: an output constraint (guided decoding), as
    the HTTP API's fields of these names; priority: with `kimi serve --scheduling-policy priority` waiting requests
    start by (priority, arrival), lower first (non-zero under fcfs is an error); cache_salt: a non-empty string,
    requests share prefix-cache blocks only with requests of the same salt.

    Wire format: the fields from `min_p` on were appended later; a message that ends before them (an older
    client) decodes with their defaults.
    """

    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    # appended: the HTTP API's other per-request sampling / stop controls
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    # appended: guided decoding, as the HTTP fields of the same names (docs/api.md, "Guided decoding")
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    # appended: scheduling order and prefix-cache isolation (the HTTP API's fields of the same names)
    priority: int = 0
    cache_salt: str | None = None


class AbortRequest(msgspec.Struct, array_like=True, frozen=True, tag=31):
    """Stop a submitted request; its KV blocks are freed within one step."""

    request_id: str


class RequestOutput(msgspec.Struct, array_like=True, frozen=True, tag=32, kw_only=True):
    """A delta of one request's output. The last one has `finished=True` and a finish_reason or an error.

    finish_reason: "stop" (EOS or stop token), "length" (max_tokens or max_model_len), "abort".
    """

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    logprobs: list[float] | None = None
    # appended (issue #5)
    top_ids: list[list[int]] | None = None  # per token in token_ids: top-k alternative ids, highest first
    top_logprobs: list[list[float]] | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended the request
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_logprobs: list[float | None] | None = None  # on the first delta, when asked (see TokenOutput)
    prompt_top_ids: list[list[int] | None] | None = None
    prompt_top_logprobs: list[list[float] | None] | None = None


ToController = SubmitRequest | AbortRequest

_worker_decoder = msgspec.msgpack.Decoder(ToWorker)
_controller_decoder = msgspec.msgpack.Decoder(FromWorker)
_submit_decoder = msgspec.msgpack.Decoder(ToController)
_output_decoder = msgspec.msgpack.Decoder(RequestOutput)
_encoder = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    """msgpack bytes of any wire Struct."""
    return _encoder.encode(msg)


def decode_to_worker(data: bytes) -> StepPlan | Ping | Shutdown:
    """Decode a controller -> worker message; raises msgspec.DecodeError on malformed input."""
    return _worker_decoder.decode(data)


def decode_from_worker(data: bytes) -> Ready | StepResult | WorkerError | Pong:
    """Decode a worker -> controller message; raises msgspec.DecodeError on malformed input."""
    return _controller_decoder.decode(data)


def decode_to_controller(data: bytes) -> SubmitRequest | AbortRequest:
    """Decode a client -> controller message; raises msgspec.ValidationError / DecodeError on bad input."""
    return _submit_decoder.decode(data)


def decode_output(data: bytes) -> RequestOutput:
    """Decode a controller -> client output message."""
    return _output_decoder.decode(data)
