"""GrammarSpec: what constrains one request's output, as it travels from the controller to the workers.

A msgspec Struct (array_like: field order is the wire format; append fields, never reorder) carried in
`kimi.protocol.SamplingParams.grammar`. Workers compile it with `kimi.structured_output.backend` and cache the result
by the spec itself (it is frozen and hashable).
"""

from __future__ import annotations

import msgspec

KINDS = ("json_schema", "json_object", "regex", "choice", "ebnf", "structural_tag", "union")


class GrammarSpec(msgspec.Struct, array_like=True, frozen=True):
    """One request's constraint.

    kind: one of KINDS. source, by kind: json_schema: the schema as JSON text; json_object: "" (any JSON object);
    regex: the pattern (xgrammar's regex syntax, ECMAScript-like); choice: a JSON array of the allowed strings;
    ebnf: the grammar in xgrammar's EBNF (GBNF-like, root rule `root`); structural_tag: xgrammar's structural tag
    as JSON text (kimi builds these for tool calls: kimi.structured_output.request); union: a JSON array of
    [kind, source, strict] alternatives, any one of which the output satisfies (a tool-call section or a JSON answer).
    strict: json_schema only: True = no properties or array items beyond the schema's (xgrammar strict_mode, as
    OpenAI's `strict: true`); False = the JSON Schema rules (additional properties allowed unless the schema forbids
    them).
    after_think: the constraint starts after the `</think>` token (thinking on): any tokens before it are free.
    """

    kind: str
    source: str
    strict: bool = True
    after_think: bool = False
