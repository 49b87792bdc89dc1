"""Guided decoding (kimi/structured_output): request fields -> GrammarSpec and the 400s naming the field, the
vocabulary xgrammar sees, the bitmask paths of the sampler, the matchers' lifecycle, and the CPU ModelRunner on the
tiny checkpoint producing outputs that validate (one step at a time, pipelined, preempted and recomputed)."""

from __future__ import annotations

import asyncio
import json
import sys

import jsonschema
import pytest
import torch
import xgrammar as xgr

from kimi import protocol
from kimi.config import CacheConfig, ModelConfig
from kimi.controller.parsers import (
    THINK_END_ID,
    TOOL_CALL_ARGUMENT_BEGIN_ID,
    TOOL_CALL_BEGIN_ID,
    TOOL_CALL_END_ID,
    TOOL_CALLS_SECTION_BEGIN_ID,
    TOOL_CALLS_SECTION_END_ID,
)
from kimi.controller.validation import BadRequest
from kimi.model.sampling import apply_token_bitmask, apply_token_bitmask_ref, sample, sample_ref, unpack_bitmask
from kimi.structured_output.backend import GrammarBackend, GrammarError
from kimi.structured_output.bitmask import GuidedRequests
from kimi.structured_output.request import Guided, chat_grammar, completion_grammar, constrain
from kimi.structured_output.spec import GrammarSpec
from kimi.structured_output.vocab import encoded_vocab
from kimi.tiny_checkpoint import make_tiny_checkpoint
from kimi.tokenizer import KimiTokenizer, default_tokenizer_source, write_tokenizer_files

V = 163840
EOS = 163585
IM_END = 163586
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 2},
        "pos": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}},
            "required": ["x"],
            "additionalProperties": False,
        },
    },
    "required": ["color", "ok", "n", "tags", "pos"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
            "strict": True,
        },
    },
    {"type": "function", "function": {"name": "noargs"}},
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> KimiTokenizer:
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(d)  # the built-in byte-level vocabulary (the tiny checkpoints' without the real one)
    return KimiTokenizer.from_dir(d)


@pytest.fixture(scope="module")
def backend(tok) -> GrammarBackend:
    return GrammarBackend(tok, V, [EOS])


def _param(fn, *a, **kw) -> str | None:
    with pytest.raises(BadRequest) as e:
        fn(*a, **kw)
    return e.value.param


# ---- request fields -> GrammarSpec ------------------------------------------------------------------------------
def test_each_field_maps_to_its_spec():
    s = json.dumps(SCHEMA)
    cases = [
        ({"response_format": {"type": "text"}}, None, None),
        ({"response_format": {"type": "json_object"}}, ("json_object", "", True), "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
                }
            },
            ("json_schema", s, True),
            "response_format",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
            ("json_schema", s, False),
            "response_format",
        ),
        ({"structured_outputs": {"json": SCHEMA}}, ("json_schema", s, True), "structured_outputs.json"),
        (
            {"structured_outputs": {"json": s, "backend": "xgrammar"}},
            ("json_schema", s, True),
            "structured_outputs.json",
        ),
        ({"structured_outputs": {"regex": "[a-z]+"}}, ("regex", "[a-z]+", True), "structured_outputs.regex"),
        ({"structured_outputs": {"choice": ["a", "b"]}}, ("choice", '["a", "b"]', True), "structured_outputs.choice"),
        (
            {"structured_outputs": {"grammar": 'root ::= "x"'}},
            ("ebnf", 'root ::= "x"', True),
            "structured_outputs.grammar",
        ),
        ({"structured_outputs": {"json_object": True}}, ("json_object", "", True), "structured_outputs.json_object"),
        ({"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar"}, ("json_schema", s, True), "guided_json"),
        ({"guided_regex": "a+"}, ("regex", "a+", True), "guided_regex"),
        ({"guided_choice": ["x"]}, ("choice", '["x"]', True), "guided_choice"),
        ({"guided_grammar": 'root ::= "x"'}, ("ebnf", 'root ::= "x"', True), "guided_grammar"),
        ({"json_schema": s}, ("json_schema", s, True), "json_schema"),  # SGLang
        ({"regex": "a+"}, ("regex", "a+", True), "regex"),
        ({"ebnf": 'root ::= "x"'}, ("ebnf", 'root ::= "x"', True), "ebnf"),
    ]
    for body, want, param in cases:
        g = completion_grammar(body)
        got = None if g.spec is None else (g.spec.kind, g.spec.source, g.spec.strict)
        assert (got, g.param) == (want, param), body
        assert chat_grammar(body, after_think=False) == g, body


def test_bad_fields_are_400s_naming_the_field():
    cases = [
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}},
            "response_format.json_schema.strict",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"foo": 1}}}, "response_format.json_schema.foo"),
        ({"response_format": {"type": "text", "x": 1}}, "response_format.x"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {}}, "structured_outputs"),
        (
            {"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
            "structured_outputs.disable_any_whitespace",
        ),
        ({"structured_outputs": {"regex": "a", "frob": 1}}, "structured_outputs.frob"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
        ({"guided_regex": 5}, "guided_regex"),
        ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
        ({"guided_regex": "a", "guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
        ({"guided_regex": "a", "regex": "b"}, "regex"),  # two constraints: the second is named
        ({"response_format": {"type": "json_object"}, "guided_json": {}}, "guided_json"),
    ]
    for body, param in cases:
        assert _param(completion_grammar, body) == param, body
    regex_and_strict = {"tools": TOOLS, "guided_regex": "a+"}  # a strict tool under auto and a non-JSON format
    assert _param(chat_grammar, regex_and_strict, after_think=False) == "guided_regex"
    remote = {"guided_json": {"properties": {"a": {"$ref": "https://example.com/a.json"}}}}
    assert _param(completion_grammar, remote) == "guided_json"  # xgrammar would not enforce it


def test_tools_with_a_json_answer_format(backend, tok):
    """tools + response_format under auto (the OpenAI Agents SDK's tools + output_type): a tool-call section or the
    JSON answer; with a forced call the format waits for a later turn."""
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}
    g = chat_grammar({"tools": TOOLS, "response_format": fmt}, after_think=False)
    assert g.param == "tools" and g.spec is not None and g.spec.kind == "union"
    args = tok.encode('{"city": "Oslo"}')
    call = [TOOL_CALLS_SECTION_BEGIN_ID, TOOL_CALL_BEGIN_ID] + tok.encode("functions.get_weather:0")
    call += [TOOL_CALL_ARGUMENT_BEGIN_ID] + args + [TOOL_CALL_END_ID, TOOL_CALLS_SECTION_END_ID, EOS]
    assert _accepts(backend, g.spec, call)
    answer = json.dumps({"color": "red", "ok": True, "n": 1, "tags": ["a"], "pos": {"x": 2}})
    assert _valid(answer) and _accepts(backend, g.spec, tok.encode(answer) + [EOS])
    wrong = json.dumps({"color": "red", "ok": True, "n": 1})  # misses required properties
    assert not _valid(wrong) and not _accepts(backend, g.spec, tok.encode(wrong) + [EOS])
    assert not _accepts(backend, g.spec, tok.encode("plain text") + [EOS])
    m = xgr.GrammarMatcher(backend.compile(g.spec))
    assert all(m.accept_token(t) for t in tok.encode('{"color": "'))
    assert not m.accept_token(TOOL_CALL_BEGIN_ID)  # no marker inside the answer's strings
    forced = chat_grammar({"tools": TOOLS, "tool_choice": "required", "response_format": fmt}, after_think=False)
    assert forced.spec is not None and forced.spec.kind == "structural_tag" and _accepts(backend, forced.spec, call)


def _valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except jsonschema.ValidationError:
        return False
    return True


def test_compile_errors_and_min_tokens_are_400s_naming_the_field(backend):
    sp = protocol.SamplingParams()
    for body, param in [
        ({"guided_regex": "[a-"}, "guided_regex"),
        ({"structured_outputs": {"grammar": "root ::= nothere"}}, "structured_outputs.grammar"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}},
            "response_format",
        ),
    ]:
        with pytest.raises(BadRequest) as e:
            asyncio.run(constrain(backend, completion_grammar(body), sp))
        assert e.value.param == param and "cannot be compiled" in e.value.message, e.value.message
    with pytest.raises(BadRequest) as e:
        asyncio.run(
            constrain(backend, completion_grammar({"guided_regex": "a+"}), protocol.SamplingParams(min_tokens=2))
        )
    assert e.value.param == "min_tokens"
    ok = asyncio.run(constrain(backend, completion_grammar({"guided_regex": "a+"}), sp))
    assert ok.grammar == GrammarSpec("regex", "a+")
    assert asyncio.run(constrain(backend, Guided(), sp)) is sp
    with pytest.raises(GrammarError):
        backend.compile(GrammarSpec("regex", "(("))


def test_tool_choice_maps_to_a_structural_tag_and_thinking_to_after_think():
    assert chat_grammar({"tools": TOOLS, "tool_choice": "none"}, after_think=False).spec is None
    loose = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": False}}, TOOLS[1]]
    assert chat_grammar({"tools": loose}, after_think=False).spec is None  # auto without strict tools: free
    assert chat_grammar({"tools": loose, "tool_choice": "auto"}, after_think=False).spec is None
    for body in (
        {"tools": TOOLS, "tool_choice": "required"},
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "noargs"}}},
        {"tools": TOOLS},  # a strict tool under auto
    ):
        g = chat_grammar(body, after_think=False)
        assert g.param == "tools" and g.spec is not None and g.spec.kind == "structural_tag"
        assert not g.spec.after_think
        assert chat_grammar(body, after_think=True).spec.after_think
    g = chat_grammar({"response_format": {"type": "json_object"}}, after_think=True)
    assert g.spec == GrammarSpec("json_object", "", after_think=True)


# ---- vocabulary ---------------------------------------------------------------------------------------------------
def test_encoded_vocab_bytes_markers_specials_and_padding(tok):
    enc = encoded_vocab(tok, V)
    assert len(enc) == V
    assert enc[ord("a")] == b"a" and enc[300] == tok.id_to_bytes(300)
    assert enc[TOOL_CALL_BEGIN_ID] == b"<|tool_call_begin|>" and enc[THINK_END_ID] == b"</think>"
    assert enc[EOS] == b"" and enc[IM_END] == b"" and enc[163700] == b""  # special / reserved: never text
    padded = encoded_vocab(tok, V + 64)  # a model with more rows than the tokenizer: the extra ids are empty
    assert len(padded) == V + 64 and padded[V:] == [b""] * 64 and padded[:V] == enc
    info = xgr.TokenizerInfo(padded, xgr.VocabType.RAW, vocab_size=V + 64, stop_token_ids=[EOS])
    assert set(range(V, V + 64)) <= set(info.special_token_ids)


def test_the_real_vocabulary_builds_when_present():
    src = default_tokenizer_source() or "/work/shared/kimi-tokenizer"
    try:
        real = KimiTokenizer.from_dir(src)
    except FileNotFoundError:
        pytest.skip(f"no real Kimi vocabulary at {src}")
    assert encoded_vocab(real, V)[THINK_END_ID] == b"</think>"  # a reserved id there; the parser's marker by id
    b = GrammarBackend(real, V, [EOS])
    m = xgr.GrammarMatcher(b.compile(GrammarSpec("json_schema", json.dumps(SCHEMA))))
    text = '{"color": "blue", "ok": true, "n": 7, "tags": ["a"], "pos": {"x": -3}}'
    for t in real.encode(text) + [IM_END]:
        assert m.accept_token(t), real.decode([t])
    assert m.is_terminated()


# ---- bitmask application ------------------------------------------------------------------------------------------
def _random_bitmask(B: int, g: torch.Generator) -> torch.Tensor:
    bm = torch.randint(-(2**31), 2**31 - 1, (B, V // 32), dtype=torch.int32, generator=g)
    bm[:, 0] |= 1  # token 0 always allowed, so no row is all -inf
    return bm


def test_bitmask_paths_agree_and_sampling_keeps_to_the_mask():
    g = torch.Generator().manual_seed(0)
    B = 5
    logits = torch.randn(B, V, generator=g)
    bm = _random_bitmask(B, g)
    rows = [0, 2, 3]
    a, b = logits.clone(), logits.clone()
    apply_token_bitmask(a, (rows, bm))  # xgrammar's CPU kernel
    apply_token_bitmask_ref(b, (rows, bm))
    assert torch.equal(a, b)
    allowed = unpack_bitmask(bm, V)
    for r in range(B):
        if r in rows:
            assert torch.equal(torch.isfinite(a[r]), allowed[r])
        else:
            assert torch.equal(a[r], logits[r])
    # bit order: token t <-> bit t % 32 of word t // 32
    one = torch.zeros(1, V // 32, dtype=torch.int32)
    one[0, 3] = 1 << 5
    assert torch.nonzero(unpack_bitmask(one, V)[0]).flatten().tolist() == [3 * 32 + 5]
    params = [
        protocol.SamplingParams(temperature=0.0, num_logprobs=2),
        protocol.SamplingParams(temperature=1.0, seed=1),
        protocol.SamplingParams(temperature=0.8, top_p=0.9, seed=2, num_logprobs=0),
        protocol.SamplingParams(temperature=0.0),
        protocol.SamplingParams(temperature=1.0, seed=3, top_k=50),
    ]

    def gens():
        return [None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params]

    got = sample(logits.clone(), params, gens(), bitmask=(rows, bm))
    ref = sample_ref(logits.clone(), params, gens(), bitmask=(rows, bm))
    assert got.token_ids == ref.token_ids and got.top_ids == ref.top_ids
    for r in rows:
        assert allowed[r, got.token_ids[r]]
    assert sample(logits.clone(), params, gens()).token_ids == sample_ref(logits.clone(), params, gens()).token_ids


# ---- matchers -----------------------------------------------------------------------------------------------------
def _allowed(got: tuple[list[int], torch.Tensor], row: int) -> set[int]:
    return set(torch.nonzero(unpack_bitmask(got[1][row : row + 1], V)[0]).flatten().tolist())


def _accepts(backend: GrammarBackend, spec: GrammarSpec, ids: list[int]) -> bool:
    m = xgr.GrammarMatcher(backend.compile(spec))
    return all(m.accept_token(t) for t in ids) and m.is_terminated()


def test_matcher_lifecycle_replay_terminate_and_counters(backend, tok):
    gr = GuidedRequests(lambda: backend, V)
    spec = GrammarSpec("choice", json.dumps(["yes", "no"]))
    a = gr.add(1, spec)
    gr.add(2, GrammarSpec("regex", "[0-9]+"))
    assert (gr.num_requests, gr.num_held) == (2, 2)
    got = gr.fill([(0, a)], 3)
    assert got is not None and got[0] == [0] and got[1].shape == (3, V // 32)
    assert _allowed(got, 0) == {ord("y"), ord("n")}
    assert a.accept(ord("n")) is None and a.accept(ord("o")) is None
    got = gr.fill([(1, a)], 2)
    assert got is not None and _allowed(got, 1) == set(backend.stop_ids)
    assert a.accept(IM_END) is None and a.terminated
    assert gr.fill([(0, a)], 1) is None  # terminated: masks nothing (a token sampled after the stop is free)
    assert a.accept(ord("z")) is None
    # a fresh row given the generated tokens (a preempted request re-sent) is where the old one was
    b = gr.add(1, spec, generated=[ord("y"), ord("e")])
    assert gr.num_held == 2
    got = gr.fill([(0, b)], 1)
    assert got is not None and _allowed(got, 0) == {ord("s")}
    assert b.accept(ord("x")) is not None  # outside the grammar: the request must end with this error
    gr.drop(1)
    gr.drop(2)
    gr.drop(3)  # not constrained: a no-op
    assert gr.num_held == 0 and gr.num_requests == 3
    bad = gr.add(4, GrammarSpec("regex", "[a-"))
    assert gr.fill([(0, bad)], 1) is None and "guided decoding" in (bad.accept(1) or "")
    gr.drop(4)
    gr.close()


def test_many_rows_fill_like_one_at_a_time(backend):
    gr = GuidedRequests(lambda: backend, V)
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    rows = [gr.add(i, spec) for i in range(6)]
    prefix = b'{"color": "red", "ok": tr'
    for i, r in enumerate(rows):
        for ch in prefix[: 3 + 4 * i]:
            assert r.accept(ch) is None
    batch = gr.fill(list(enumerate(rows)), 6)  # several rows: xgrammar's batch matcher, on threads
    assert batch is not None
    batch_bits = [_allowed(batch, i) for i in range(6)]
    for i, r in enumerate(rows):
        one = gr.fill([(0, r)], 1)
        assert one is not None and _allowed(one, 0) == batch_bits[i]


def test_tool_markers_are_masked_off_except_where_a_tool_tag_places_them(backend, tok):
    """Inside a JSON string every text token is allowed, and the markers have their text in xgrammar's vocabulary:
    the mask of every grammar but a tool structural tag clears them (the output parser would read one as a call)."""
    gr = GuidedRequests(lambda: backend, V)
    plain = gr.add(1, GrammarSpec("json_object", ""))
    for ch in b'{"k": "':
        assert plain.accept(ch) is None
    tag = gr.add(2, chat_grammar({"tools": TOOLS}, after_think=False).spec)  # auto with a strict tool
    got = gr.fill([(0, plain), (1, tag)], 2)
    assert got is not None
    inside_string, free_text = _allowed(got, 0), _allowed(got, 1)
    assert ord("<") in inside_string and ord("a") in inside_string  # a string takes any text ...
    assert not inside_string & {TOOL_CALLS_SECTION_BEGIN_ID, TOOL_CALL_BEGIN_ID, TOOL_CALL_END_ID}  # ... no marker
    assert TOOL_CALLS_SECTION_BEGIN_ID in free_text  # the tag's trigger: a call may open
    assert TOOL_CALL_BEGIN_ID not in free_text  # but no other marker outside a section
    gr.drop(1)
    gr.drop(2)
    gr.close()


def test_after_think_tool_tags_and_parallel_calls(backend, tok):
    json_after = GrammarSpec("json_object", "", after_think=True)
    assert _accepts(backend, json_after, tok.encode("free {text") + [THINK_END_ID] + tok.encode('{"a": 1}') + [EOS])
    assert not _accepts(backend, json_after, tok.encode('{"a": 1}') + [EOS])  # the JSON comes after </think>

    def call(name: str, idx: int, args: str) -> list[int]:
        return (
            [TOOL_CALL_BEGIN_ID]
            + tok.encode(f"functions.{name}:{idx}")
            + [TOOL_CALL_ARGUMENT_BEGIN_ID]
            + tok.encode(args)
            + [TOOL_CALL_END_ID]
        )

    two = (
        [TOOL_CALLS_SECTION_BEGIN_ID]
        + call("get_weather", 0, '{"city": "Oslo"}')
        + call("noargs", 1, "{}")
        + [TOOL_CALLS_SECTION_END_ID, IM_END]
    )
    one = [TOOL_CALLS_SECTION_BEGIN_ID] + call("noargs", 0, "{}") + [TOOL_CALLS_SECTION_END_ID, IM_END]
    req = chat_grammar({"tools": TOOLS, "tool_choice": "required"}, after_think=False).spec
    assert _accepts(backend, req, two) and _accepts(backend, req, one)
    assert not _accepts(backend, req, tok.encode("hi") + one)  # the call comes first
    bad_args = [TOOL_CALLS_SECTION_BEGIN_ID] + call("get_weather", 0, '{"city": "Rome"}')
    assert not _accepts(backend, req, bad_args)
    single = chat_grammar({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}, after_think=False)
    assert _accepts(backend, single.spec, one) and not _accepts(backend, single.spec, two)
    named = chat_grammar(
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, after_think=False
    ).spec
    assert not _accepts(backend, named, one)
    assert _accepts(
        backend,
        named,
        [TOOL_CALLS_SECTION_BEGIN_ID] + call("get_weather", 3, '{"city":"Paris"}') + [TOOL_CALLS_SECTION_END_ID, EOS],
    )
    auto = chat_grammar({"tools": TOOLS}, after_think=True).spec  # a strict tool under auto, thinking on
    assert _accepts(backend, auto, tok.encode("hmm") + [THINK_END_ID] + tok.encode("Plain text.") + [EOS])
    assert _accepts(backend, auto, [THINK_END_ID] + tok.encode("Sure: ") + two)
    assert not _accepts(backend, auto, [THINK_END_ID] + bad_args)  # an opened call is constrained
    nameless = [TOOL_CALLS_SECTION_BEGIN_ID] + call("other", 0, "{}")
    assert not _accepts(backend, auto, [THINK_END_ID] + nameless)  # to a declared name


# ---- the CPU ModelRunner on the tiny checkpoint -------------------------------------------------------------------
BS = 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "k2.6", "k2.6", seed=0, tokenizer_source=None)


def _runner(ckpt):
    from kimi.worker.runner import ModelRunner

    cfg = ModelConfig.from_dir(ckpt)
    return ModelRunner(
        ckpt, cfg, CacheConfig(block_size=BS, num_blocks=400), device="cpu", dtype=torch.float32, progress=False
    )


def _drive(runner, reqs: dict[int, dict], overlap: bool, preempt_at: int | None = None) -> dict[int, list[int]]:
    """Run requests to their end the way async scheduling plans them (each plan made before the previous step's
    tokens are known when `overlap`): one decode token per step, a request dropped in the plan after the step that
    ended it (a stop token, an error or max_tokens). preempt_at: at that step request 0 is dropped and re-sent as new
    with its prompt and outputs so far (recompute)."""
    stops = {EOS, IM_END}
    out: dict[int, list[int]] = {rid: [] for rid in reqs}
    done: set[int] = set()
    sent: set[int] = set()
    drops: list[int] = []
    blocks = {rid: list(range(1 + 20 * rid, 21 + 20 * rid)) for rid in reqs}

    def on_prev(h):
        for t in runner.finish(h):
            if t.rid in done:
                continue  # a step planned before the end was known: ignored, as the controller does
            assert t.error is None, t.error
            out[t.rid].append(t.token_id)
            if t.token_id in stops or len(out[t.rid]) >= reqs[t.rid]["max_tokens"]:
                done.add(t.rid)
                drops.append(t.rid)

    pending = None
    step = 0
    while len(done) < len(reqs) or drops:
        step += 1
        new, cont = [], []
        fin = list(drops)
        drops.clear()
        for rid, r in reqs.items():
            if rid in done:
                continue
            if rid == 0 and step == preempt_at and rid in sent:
                if pending is not None:
                    on_prev(pending)  # the recompute starts from the tokens known
                    pending = None
                fin.append(rid)
                sent.discard(rid)
            if rid not in sent:
                ids = r["prompt"] + out[rid]
                new.append(protocol.NewRequest(rid, 0, ids, 0, len(ids), blocks[rid], r["sampling"], len(r["prompt"])))
                sent.add(rid)
            else:
                cont.append(protocol.ContinueRequest(rid, 1, []))
        plan = protocol.StepPlan(step, new, cont, fin)
        if overlap:
            pending = runner.launch(plan, pending, on_prev=on_prev)
        else:
            on_prev(runner.launch(plan))
        assert step < 400
    if pending is not None:
        on_prev(pending)
    if drops:
        runner.execute(protocol.StepPlan(step + 1, [], [], drops))
    return out


def _text(tok, ids: list[int]) -> str:
    return tok.decode([t for t in ids if t not in (EOS, IM_END)])


def test_model_runner_outputs_validate_pipelined_and_after_preemption(ckpt):
    tok = KimiTokenizer.from_dir(ckpt)
    pos = SCHEMA["properties"]["pos"]
    first = {"type": "object", "properties": {"c": SCHEMA["properties"]["color"], "pos": pos}, "required": ["c", "pos"]}
    schema = json.dumps(first)
    small = {
        "type": "object",
        "properties": {"b": {"type": "boolean"}},
        "required": ["b"],
        "additionalProperties": False,
    }
    reqs = {
        0: dict(
            prompt=[5, 6, 7, 8],
            max_tokens=120,
            sampling=protocol.SamplingParams(temperature=0.0, grammar=GrammarSpec("json_schema", schema)),
        ),
        1: dict(prompt=[9, 10], max_tokens=6, sampling=protocol.SamplingParams(temperature=0.0)),  # unconstrained
        2: dict(
            prompt=[11, 12, 13],
            max_tokens=100,
            sampling=protocol.SamplingParams(
                temperature=1.0, seed=5, grammar=GrammarSpec("json_schema", json.dumps(small))
            ),
        ),
        3: dict(
            prompt=[14],
            max_tokens=40,
            sampling=protocol.SamplingParams(
                temperature=0.7, seed=9, grammar=GrammarSpec("choice", '["alpha", "beta"]')
            ),
        ),
    }
    results = []
    for overlap, preempt in ((False, None), (True, None), (True, 7)):
        runner = _runner(ckpt)
        runner.overlap_cpu = overlap
        out = _drive(runner, reqs, overlap, preempt)
        jsonschema.validate(json.loads(_text(tok, out[0])), first)
        jsonschema.validate(json.loads(_text(tok, out[2])), small)
        assert _text(tok, out[3]) in ("alpha", "beta")
        assert out[0][-1] in (EOS, IM_END) and len(out[1]) == 6
        assert runner.guided.num_held == 0, "every constrained request was dropped"
        assert runner.guided.num_requests == 3 + (preempt is not None)
        results.append(out)
        runner.close()
    assert results[0] == results[1] == results[2], "pipelined and preempted runs sample the same tokens"


def test_a_server_without_xgrammar_refuses_the_constraint_naming_the_field(tok, monkeypatch):
    """An install whose xgrammar is missing: a constrained request is a 400 naming its field, not a server error."""
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` raises ImportError
    fresh = GrammarBackend(tok, V, [EOS])
    body = {"response_format": {"type": "json_object"}}
    with pytest.raises(BadRequest) as e:
        asyncio.run(constrain(fresh, completion_grammar(body), protocol.SamplingParams()))
    assert e.value.param == "response_format" and e.value.status == 400
    assert "xgrammar is not installed" in e.value.message
