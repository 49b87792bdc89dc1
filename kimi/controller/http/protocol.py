"""The request bodies of the OpenAI server's routes, declared as msgspec Structs (names, JSON types, ranges, defaults).

The declarations are the list of what each route accepts: a top-level field not declared here is a 400 naming it
(`Fields.reject_unknown(declared=...)`), and `/openapi.json` is generated from them (kimi.controller.http.openapi).
The generation routes decode their body with them (`decode_struct`: msgspec checks JSON types and ranges in C); a
body they refuse, and any body holding a `\\uD800`-style escape, is decoded again by Python's json module so that the
route's readers (kimi.controller.params, kimi.controller.validation) name the first bad field in kimi's words. The
readers check every value either way, so what is accepted and every error message are the readers'.
tests/e2e/test_vllm_fields.py sends every declared field at its default and every no-op extension at another value;
tests/unit/test_http_protocol.py checks the declarations themselves.

Fields of three kinds: the OpenAI ones kimi implements; vLLM's and SGLang's extensions kimi implements (e.g.
`return_token_ids`, `separate_reasoning`); and extensions accepted only at their no-op value (`NOOP_VALUES`: e.g.
`use_beam_search: false`) or only as null (`NULL_ONLY`: e.g. `logits_processors`), so that a
client of vLLM or SGLang sending its defaults is served and any other value is a 400 naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

MAX_N = 16
MAX_LOGPROBS = 20
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

Int64 = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]
TopK = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS, description="top-k alternatives per position, 0..20")]
PositiveInt = Annotated[int, Meta(ge=1)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """`stream_options` (only with `stream: true`)."""

    include_usage: Annotated[bool | None, Meta(description="a final chunk with usage, `usage: null` before")] = None
    continuous_usage_stats: Annotated[
        bool | None, Meta(description="with include_usage: usage on every chunk (vLLM)")
    ] = None


class GenerationRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The fields both generation routes take (docs/api.md, "Fields common to both generation routes")."""

    model: Annotated[str | None, Meta(description="the served model; absent, null or empty: the served model")] = None
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0, description="below 1e-5: greedy")] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=-1, le=INT64_MAX, description="0 or -1: off")] = 0
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] = 1.0
    seed: Int64 | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    best_of: Annotated[int | None, Meta(description="must equal n")] = None
    logit_bias: Annotated[
        dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]] | None,
        Meta(description="token id (decimal string) -> bias; at most 1024 entries"),
    ] = None
    stop: Annotated[str | list[str] | None, Meta(description="up to 4 non-empty strings")] = None
    stop_token_ids: Annotated[list[Annotated[int, Meta(ge=0)]], Meta(max_length=256)] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: Annotated[int, Meta(ge=0, description="at most max_tokens")] = 0
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    store: Annotated[bool | None, Meta(description="false only")] = None
    service_tier: Literal["auto", "default"] | None = None
    metadata: dict[str, Any] | None = None
    prompt_logprobs: Annotated[TopK | None, Meta(description="vLLM; not with stream")] = None
    return_token_ids: Annotated[bool, Meta(description="vLLM: prompt_token_ids and token_ids in the response")] = False
    priority: Annotated[Int64, Meta(description="with --scheduling-policy priority: lower starts first (vLLM)")] = 0
    cache_salt: Annotated[str, Meta(min_length=1, description="prefix-cache isolation (vLLM)")] | None = None
    # guided decoding (kimi.structured_output.request reads and checks them; at most one per request)
    response_format: Annotated[
        dict[str, Any] | None, Meta(description="text, json_object, or json_schema {name, schema, strict}")
    ] = None
    structured_outputs: Annotated[
        dict[str, Any] | None, Meta(description="vLLM: one of json, regex, choice, grammar, json_object")
    ] = None
    guided_json: Annotated[str | dict[str, Any] | None, Meta(description="vLLM (older name)")] = None
    guided_regex: Annotated[str | None, Meta(description="vLLM (older name)")] = None
    guided_choice: Annotated[list[str] | None, Meta(description="vLLM (older name)")] = None
    guided_grammar: Annotated[str | None, Meta(description="vLLM (older name): EBNF")] = None
    guided_decoding_backend: Annotated[str | None, Meta(description='"xgrammar" or "auto" only')] = None
    guided_whitespace_pattern: Annotated[str | None, Meta(description="null only")] = None
    json_schema: Annotated[str | dict[str, Any] | None, Meta(description="SGLang")] = None
    regex: Annotated[str | None, Meta(description="SGLang")] = None
    ebnf: Annotated[str | None, Meta(description="SGLang")] = None
    # vLLM / SGLang extensions accepted at their no-op values only (NOOP_VALUES)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool = False
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    spaces_between_special_tokens: bool = True
    return_tokens_as_token_ids: bool = False
    add_special_tokens: Annotated[bool | None, Meta(description="Kimi's tokenizer adds no BOS / EOS either way")] = None
    no_stop_trim: bool = False
    return_hidden_states: bool = False
    # accepted only as null (NULL_ONLY)
    logits_processors: list[Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    lora_path: str | list[str] | None = None
    session_params: dict[str, Any] | None = None
    custom_logit_processor: str | None = None


class CompletionRequest(GenerationRequest, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """`POST /v1/completions`."""

    prompt: Annotated[
        str | list[int | str | list[int]],
        Meta(description="a string, a list of token ids, or a batch (a list of either): one choice per prompt and n"),
    ]
    echo: bool = False
    logprobs: TopK | None = None
    suffix: Annotated[str | None, Meta(description='"" only')] = None
    prompt_embeds: str | list[str] | None = None


class ChatCompletionRequest(GenerationRequest, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """`POST /v1/chat/completions`."""

    messages: Annotated[
        list[dict[str, Any]],
        Meta(min_length=1, description="roles system, developer, user, assistant, tool; text content"),
    ]
    max_completion_tokens: PositiveInt | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    logprobs: bool = False
    top_logprobs: TopK | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    modalities: Annotated[list[str] | None, Meta(description='["text"] only')] = None
    add_generation_prompt: bool = True
    continue_final_message: Annotated[bool, Meta(description="assistant prefill (vLLM)")] = False
    echo: Annotated[bool, Meta(description="prepend the final assistant message's text (vLLM)")] = False
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    include_reasoning: Annotated[bool, Meta(description="false: no reasoning in the response (vLLM)")] = True
    separate_reasoning: Annotated[bool, Meta(description="false: reasoning stays in content (SGLang)")] = True
    chat_template: Annotated[str | None, Meta(description="null only: the checkpoint's template is used")] = None
    documents: list[dict[str, Any]] | None = None
    media_io_kwargs: dict[str, Any] | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """`POST /tokenize` (vLLM): exactly one of `prompt` and `messages`."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    mm_processor_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """`POST /detokenize` (vLLM)."""

    model: str | None = None
    tokens: list[Annotated[int, Meta(ge=0)]]


# extension fields accepted only at these values (None, absent, always); compared with their JSON type (1 is not 1.0)
NOOP_VALUES: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (False,),
    "length_penalty": (1.0, 1),
    "early_stopping": (False,),
    "allowed_token_ids": ([],),
    "bad_words": ([],),
    "spaces_between_special_tokens": (True,),
    "return_tokens_as_token_ids": (False,),
    "add_special_tokens": (True, False),
    "no_stop_trim": (False,),
    "return_hidden_states": (False,),
}
# extension fields accepted only as null or absent, and why a value is refused
NULL_ONLY: dict[str, str] = {
    "truncate_prompt_tokens": "this server does not truncate prompts",
    "logits_processors": "this server runs no custom logits processors",
    "kv_transfer_params": "this server does no disaggregated prefill",
    "vllm_xargs": "this server takes no extra sampling arguments",
    "mm_processor_kwargs": "this server takes text only",
    "lora_path": "this server serves no LoRA adapters",
    "session_params": "this server keeps no sessions",
    "custom_logit_processor": "this server runs no custom logits processors",
    "prompt_embeds": "this server takes token ids or text only",
    "documents": "the checkpoint's template renders no documents",
    "media_io_kwargs": "this server takes text only",
    "chat_template": "the checkpoint's template is used",
}


_DECODERS: dict[type[msgspec.Struct], msgspec.json.Decoder[Any]] = {}


def decode_struct(raw: bytes, struct: type[msgspec.Struct]) -> dict[str, Any] | None:
    """A body's bytes -> {field: value} for every declared field (defaults filled in; `stream_options` as a dict),
    or None when msgspec refuses the body (malformed JSON or UTF-8, an undeclared field, a wrong JSON type, a value
    outside its declared range): the caller then decodes it with Python's json module to name the problem."""
    dec = _DECODERS.get(struct)
    if dec is None:
        dec = _DECODERS[struct] = msgspec.json.Decoder(struct)
    try:
        obj = dec.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    body = msgspec.structs.asdict(obj)
    so = body.get("stream_options")
    if so is not None:
        body["stream_options"] = {k: v for k, v in msgspec.structs.asdict(so).items() if v is not None}
    return body


def declared(struct: type[msgspec.Struct]) -> frozenset[str]:
    """The top-level field names a route's Struct declares."""
    return frozenset(struct.__struct_fields__)


COMPLETION_FIELDS = declared(CompletionRequest)
CHAT_FIELDS = declared(ChatCompletionRequest)
TOKENIZE_FIELDS = declared(TokenizeRequest)
DETOKENIZE_FIELDS = declared(DetokenizeRequest)
