"""Request fields -> GrammarSpec: one pure function per endpoint of the decoded body, used by HTTP and ZeroMQ alike.

Fields (docs/api.md, "Guided decoding"), at most one constraint per request:
- OpenAI: `response_format` `{"type": "text"}` (no constraint), `{"type": "json_object"}`, `{"type": "json_schema",
  "json_schema": {"name", "schema", "strict", "description"}}` (`strict: true`: nothing beyond the schema);
  chat `tools` with `tool_choice` `"required"` or a named function, and `"strict": true` tools under `"auto"`: the
  output is Kimi's tool-call markup (below);
- vLLM: `structured_outputs` `{json | regex | choice | grammar | json_object}` (the other keys at their defaults),
  and the older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (with `guided_decoding_backend`
  "xgrammar" or "auto", `guided_whitespace_pattern` null);
- SGLang: `json_schema` (a JSON string), `regex`, `ebnf`.

Tool calls are forced as `<|tool_calls_section_begin|>` (`<|tool_call_begin|>functions.NAME:IDX
<|tool_call_argument_begin|>` + JSON matching NAME's `parameters` + `<|tool_call_end|>`)+ `<|tool_calls_section_end|>`,
the markers as their tokens (the output parser reads them by id), IDX 1-6 digits; `parallel_tool_calls: false` =
one call; a named function = one call of it. Under `auto` with strict tools: free text, and a call the model opens
(`<|tool_calls_section_begin|>`) must name a declared tool with arguments matching a strict tool's schema (any JSON
object for a non-strict one). JSON constraints allow up to 16 consecutive whitespace characters between tokens of
the JSON (a model cannot pad forever).

Thinking (the chat prompt leaves the model reasoning: kimi.controller.parsers.ParserConfig.starts_in_reasoning): the
constraint starts after the `</think>` token (GrammarSpec.after_think).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from kimi.controller.parsers import (
    THINK_END_ID,
    THINK_START_ID,
    TOOL_CALL_ARGUMENT_BEGIN_ID,
    TOOL_CALL_BEGIN_ID,
    TOOL_CALL_END_ID,
    TOOL_CALLS_SECTION_BEGIN_ID,
    TOOL_CALLS_SECTION_END_ID,
)
from kimi.controller.validation import BadRequest
from kimi.errors import BackendUnavailableError
from kimi.protocol import SamplingParams
from kimi.structured_output.backend import MAX_WHITESPACE, GrammarBackend, GrammarError
from kimi.structured_output.spec import GrammarSpec

# every field this module reads, per endpoint (the rest of the body is the caller's)
COMMON_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
    "json_schema",
    "regex",
    "ebnf",
)
# vLLM StructuredOutputsParams keys kimi accepts at these (no-op) values
_SO_NOOP: dict[str, tuple[Any, ...]] = {
    "disable_fallback": (False,),
    "disable_any_whitespace": (False,),
    "disable_additional_properties": (False,),
    "whitespace_pattern": (None,),
    "structural_tag": (None,),
    "backend": (None, "auto", "xgrammar"),
}
_SO_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_MARKER_EXCLUDES = [
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
]


@dataclass(frozen=True)
class Guided:
    """A request's constraint: spec (None = unconstrained) and param, the field it came from (a grammar xgrammar
    refuses is a 400 naming it)."""

    spec: GrammarSpec | None = None
    param: str | None = None


def _schema_text(v: Any, param: str) -> str:
    """A JSON schema given as an object or as JSON text -> canonical JSON text (BadRequest naming `param`)."""
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError as e:
            raise BadRequest(f"'{param}' is not valid JSON: {e}", param) from None
    if not isinstance(v, (dict, bool)):
        raise BadRequest(f"'{param}' must be a JSON Schema (an object)", param)
    ref = _remote_ref(v)
    if ref is not None:  # xgrammar would leave it unconstrained: the schema would not be enforced
        raise BadRequest(
            f"'{param}' refers to {ref!r}: only references inside the schema ('#...') are supported", param
        )
    return json.dumps(v, ensure_ascii=False)


def _remote_ref(v: Any) -> str | None:
    """The first `$ref` of a schema that does not point inside it (not `#...`), or None."""
    stack = [v]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            r = x.get("$ref")
            if isinstance(r, str) and not r.startswith("#"):
                return r
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return None


def _string(v: Any, param: str) -> str:
    if not isinstance(v, str) or not v:
        raise BadRequest(f"'{param}' must be a non-empty string", param)
    return v


def _choice(v: Any, param: str) -> str:
    if not isinstance(v, list) or not v or not all(isinstance(c, str) for c in v):
        raise BadRequest(f"'{param}' must be a non-empty list of strings", param)
    return json.dumps(v, ensure_ascii=False)


def _response_format(rf: Any) -> GrammarSpec | None:
    p = "response_format"
    if not isinstance(rf, dict):
        raise BadRequest(f"'{p}' must be an object", p)
    kind = rf.get("type")
    extra = sorted(set(rf) - {"type", "json_schema"})
    if extra:
        raise BadRequest(f"'{p}.{extra[0]}' is not supported", f"{p}.{extra[0]}")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", "")
    if kind != "json_schema":
        raise BadRequest(f"'{p}.type' must be 'text', 'json_object' or 'json_schema'", f"{p}.type")
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise BadRequest(f"'{p}.json_schema' must be an object", f"{p}.json_schema")
    for k in js:
        if k not in ("name", "schema", "strict", "description"):
            raise BadRequest(f"'{p}.json_schema.{k}' is not supported", f"{p}.json_schema.{k}")
    name = js.get("name")
    if name is not None and not isinstance(name, str):
        raise BadRequest(f"'{p}.json_schema.name' must be a string", f"{p}.json_schema.name")
    strict = js.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise BadRequest(f"'{p}.json_schema.strict' must be a boolean", f"{p}.json_schema.strict")
    schema = js.get("schema")
    if schema is None:  # OpenAI: no schema = any JSON object
        return GrammarSpec("json_object", "")
    return GrammarSpec("json_schema", _schema_text(schema, f"{p}.json_schema.schema"), strict=bool(strict))


def _structured_outputs(so: Any) -> tuple[GrammarSpec, str]:
    p = "structured_outputs"
    if not isinstance(so, dict):
        raise BadRequest(f"'{p}' must be an object", p)
    given = [k for k in _SO_KINDS if so.get(k) not in (None, False)]
    for k, v in so.items():
        if k in _SO_KINDS:
            continue
        allowed = _SO_NOOP.get(k)
        if allowed is None:
            raise BadRequest(f"'{p}.{k}' is not supported", f"{p}.{k}")
        if not any(v == a and type(v) is type(a) for a in allowed):
            raise BadRequest(
                f"'{p}.{k}'={v!r} is not supported; only {', '.join(repr(a) for a in allowed)} is accepted", f"{p}.{k}"
            )
    if len(given) != 1:
        raise BadRequest(f"'{p}' must set exactly one of {', '.join(_SO_KINDS)}", p)
    k = given[0]
    q = f"{p}.{k}"
    v = so[k]
    if k == "json":
        return GrammarSpec("json_schema", _schema_text(v, q)), q
    if k == "regex":
        return GrammarSpec("regex", _string(v, q)), q
    if k == "choice":
        return GrammarSpec("choice", _choice(v, q)), q
    if k == "grammar":
        return GrammarSpec("ebnf", _string(v, q)), q
    if v is not True:
        raise BadRequest(f"'{q}' must be a boolean", q)
    return GrammarSpec("json_object", ""), q


def _fields_spec(body: Mapping[str, Any]) -> Guided:
    """The constraint of the fields every generation endpoint takes; BadRequest when several are given."""
    found: list[Guided] = []
    rf = body.get("response_format")
    if rf is not None:
        spec = _response_format(rf)
        if spec is not None:
            found.append(Guided(spec, "response_format"))
    so = body.get("structured_outputs")
    if so is not None:
        spec, param = _structured_outputs(so)
        found.append(Guided(spec, param))
    backend = body.get("guided_decoding_backend")
    if backend is not None and backend not in ("auto", "xgrammar"):
        raise BadRequest(
            f"'guided_decoding_backend'={backend!r} is not supported; only 'xgrammar' (or 'auto') is",
            "guided_decoding_backend",
        )
    if body.get("guided_whitespace_pattern") is not None:
        raise BadRequest("'guided_whitespace_pattern' is not supported", "guided_whitespace_pattern")
    for name, kind in (
        ("guided_json", "json_schema"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "ebnf"),
        ("json_schema", "json_schema"),  # SGLang: a JSON string
        ("regex", "regex"),
        ("ebnf", "ebnf"),
    ):
        v = body.get(name)
        if v is None:
            continue
        if kind == "json_schema":
            src = _schema_text(v, name)
        elif kind == "choice":
            src = _choice(v, name)
        else:
            src = _string(v, name)
        found.append(Guided(GrammarSpec(kind, src), name))
    if len(found) > 1:
        raise BadRequest(
            f"'{found[1].param}' cannot be combined with '{found[0].param}': give one output constraint",
            found[1].param,
        )
    return found[0] if found else Guided()


def completion_grammar(body: Mapping[str, Any]) -> Guided:
    """The constraint of a /v1/completions body (or a ZeroMQ submission). Raises BadRequest naming the field."""
    return _fields_spec(body)


def chat_grammar(body: Mapping[str, Any], *, after_think: bool) -> Guided:
    """The constraint of a /v1/chat/completions body whose `tools` / `tool_choice` are already validated
    (kimi.controller.chat.validate_tools). after_think: the rendered prompt leaves the model reasoning
    (ParserConfig.starts_in_reasoning). Raises BadRequest naming the field."""
    g = _fields_spec(body)
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls") is not False
    tool_spec: GrammarSpec | None = None
    if tools and choice not in ("none",):
        if choice == "required":
            tool_spec = _tool_tag(tools, "required", parallel)
        elif isinstance(choice, dict):
            name = choice["function"]["name"]
            tool_spec = _tool_tag([t for t in tools if t["function"]["name"] == name], "required", False)
        elif g.spec is not None and g.spec.kind in ("json_schema", "json_object"):
            # auto with a JSON answer format (the OpenAI Agents SDK's tools + output_type): the reply is either a
            # tool-call section (strict tools' arguments constrained) or the answer in that format
            section = _tool_tag(tools, "required", parallel, strict_only=True)
            tool_spec = union_spec([section, _json_answer_tag(g.spec)])
            g = Guided()
        elif any(t["function"].get("strict") is True for t in tools):
            tool_spec = _tool_tag(tools, "auto", parallel)
    if tool_spec is not None:
        if g.spec is not None and (choice == "required" or isinstance(choice, dict)):
            g = Guided()  # a forced call this turn: the answer format applies to a later turn's answer
        if g.spec is not None:
            raise BadRequest(
                f"'{g.param}' other than a JSON format cannot be combined with strict tool calls (tools[].function"
                ".strict): give one output constraint",
                g.param,
            )
        g = Guided(tool_spec, "tools")
    if g.spec is not None and after_think:
        g = Guided(GrammarSpec(g.spec.kind, g.spec.source, g.spec.strict, after_think=True), g.param)
    return g


async def constrain(backend: GrammarBackend, guided: Guided, sampling: SamplingParams) -> SamplingParams:
    """`sampling` with the request's constraint (unchanged when there is none), after compiling it off the event
    loop: BadRequest naming `guided.param` when xgrammar refuses it, naming `min_tokens` when that is set too (a
    grammar may end before it: the two cannot both be honoured)."""
    if guided.spec is None:
        return sampling
    if sampling.min_tokens > 0:
        raise BadRequest(
            f"'min_tokens' cannot be combined with an output constraint ('{guided.param}'): the grammar may end first",
            "min_tokens",
        )
    try:
        await backend.compile_async(guided.spec)
    except GrammarError as e:
        raise BadRequest(f"'{guided.param}' cannot be compiled: {e}", guided.param) from None
    except BackendUnavailableError as e:
        raise BadRequest(
            f"'{guided.param}' needs guided decoding, which this server cannot run: {e}", guided.param
        ) from None
    return msgspec.structs.replace(sampling, grammar=guided.spec)


def union_spec(parts: list[GrammarSpec]) -> GrammarSpec:
    """A constraint any one of `parts` satisfies (xgrammar Grammar.union); parts of one alternative each."""
    return GrammarSpec("union", json.dumps([[p.kind, p.source, p.strict] for p in parts], ensure_ascii=False))


def _json_answer_tag(spec: GrammarSpec) -> GrammarSpec:
    """A JSON answer (json_schema / json_object spec) as a structural tag whose strings hold no tool-call marker."""
    schema: Any = json.loads(spec.source) if spec.kind == "json_schema" else {"type": "object"}
    fmt = {
        "type": "json_schema",
        "json_schema": schema,
        "max_whitespace_cnt": MAX_WHITESPACE,
        "excludes": _MARKER_EXCLUDES,
    }
    return GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False))


def _token(tid: int) -> dict[str, Any]:
    return {"type": "token", "token": tid}


def _call_tag(fn: Mapping[str, Any], constrained: bool) -> dict[str, Any]:
    params = fn.get("parameters")
    schema: Any = params if (constrained and params is not None) else {"type": "object"}
    if constrained and params is None:  # no parameters: the empty argument object
        schema = {"type": "object", "properties": {}, "additionalProperties": False}
    return {
        "type": "tag",
        "begin": _token(TOOL_CALL_BEGIN_ID),
        "content": {
            "type": "sequence",
            "elements": [
                {"type": "const_string", "value": f"functions.{fn['name']}:"},
                {"type": "regex", "pattern": "[0-9]{1,6}"},
                _token(TOOL_CALL_ARGUMENT_BEGIN_ID),
                {
                    "type": "json_schema",
                    "json_schema": schema,
                    "max_whitespace_cnt": MAX_WHITESPACE,
                    "excludes": _MARKER_EXCLUDES,
                },
            ],
        },
        "end": _token(TOOL_CALL_END_ID),
    }


def _tool_tag(tools: list[dict[str, Any]], mode: str, parallel: bool, strict_only: bool | None = None) -> GrammarSpec:
    """The structural tag of Kimi's tool-call section (module docstring). mode: "required" (the output is the
    section) or "auto" (free text; a section the model opens is constrained). strict_only: only strict tools'
    arguments follow their schema (default: under "auto")."""
    if strict_only is None:
        strict_only = mode == "auto"
    calls = {
        "type": "tags_with_separator",
        "tags": [_call_tag(t["function"], not strict_only or t["function"].get("strict") is True) for t in tools],
        "separator": "",
        "at_least_one": True,
        "stop_after_first": not parallel,
    }
    fmt: dict[str, Any]
    if mode == "required":
        fmt = {
            "type": "sequence",
            "elements": [_token(TOOL_CALLS_SECTION_BEGIN_ID), calls, _token(TOOL_CALLS_SECTION_END_ID)],
        }
    else:
        fmt = {
            "type": "token_triggered_tags",
            "trigger_tokens": [TOOL_CALLS_SECTION_BEGIN_ID],
            "tags": [
                {
                    "type": "tag",
                    "begin": _token(TOOL_CALLS_SECTION_BEGIN_ID),
                    "content": calls,
                    "end": _token(TOOL_CALLS_SECTION_END_ID),
                }
            ],
            # outside a section no other marker (a stray one would confuse the parser), nor a second reasoning block
            "exclude_tokens": [
                TOOL_CALL_BEGIN_ID,
                TOOL_CALL_ARGUMENT_BEGIN_ID,
                TOOL_CALL_END_ID,
                TOOL_CALLS_SECTION_END_ID,
                THINK_START_ID,
                THINK_END_ID,
            ],
            "stop_after_first": not parallel,
        }
    return GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False))
