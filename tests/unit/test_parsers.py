"""Tests for kimi.controller.parsers: reasoning + kimi_k2 tool-call parsing at the token-id level.

Covers the failure classes of docs/model-format.md, Chat and tool-call format at the parser level: text split across
deltas (one character per delta and odd-sized chunks), two calls in one section, a section cut by max_tokens, names with
dots / dashes, ids without the `functions.` prefix, empty content, markers inside `<think>`, reasoning with / without
`<think>` in the prompt, thinking off.
"""

from __future__ import annotations

import json
import random

import pytest

from kimi.controller.parsers import (
    MARKER_TEXT,
    THINK_END_ID,
    THINK_START_ID,
    TOOL_CALL_ARGUMENT_BEGIN_ID,
    TOOL_CALL_BEGIN_ID,
    TOOL_CALL_END_ID,
    TOOL_CALLS_SECTION_BEGIN_ID,
    TOOL_CALLS_SECTION_END_ID,
    OutputParser,
    ParserConfig,
    ParserDelta,
    ToolCall,
    ToolCallDelta,
    parse_output,
    parse_tool_call_id,
)

TEXT_ID = 1000  # any ordinary (non-marker) token id
SB, SE = TOOL_CALLS_SECTION_BEGIN_ID, TOOL_CALLS_SECTION_END_ID
CB, AB, CE = TOOL_CALL_BEGIN_ID, TOOL_CALL_ARGUMENT_BEGIN_ID, TOOL_CALL_END_ID
TS, TE = THINK_START_ID, THINK_END_ID

TOOLS = ParserConfig(tools=True)
TOOLS_THINK = ParserConfig(tools=True, thinking=True)
TOOLS_WHOLE = ParserConfig(tools=True, stream_tool_arguments=False)


def chunk(text: str, sizes: list[int] | None) -> list[str]:
    """Split text into pieces of the given sizes (cycled); None = one piece."""
    if sizes is None or not text:
        return [text] if text else []
    out, i, k = [], 0, 0
    while i < len(text):
        n = sizes[k % len(sizes)]
        out.append(text[i : i + n])
        i += n
        k += 1
    return out


def toks(*parts: int | str, sizes: list[int] | None = None, marker_text: bool = False) -> list[tuple[int, str]]:
    """Build (token_id, text_delta) pairs: ints are marker ids, strs are ordinary text split by `sizes`."""
    pairs: list[tuple[int, str]] = []
    for p in parts:
        if isinstance(p, int):
            pairs.append((p, MARKER_TEXT[p] if marker_text else ""))
        else:
            pairs.extend((TEXT_ID, piece) for piece in chunk(p, sizes))
    return pairs


def stream(pairs, config: ParserConfig, tail: str = ""):
    """Feed pairs one by one like the controller; rebuild the message like an OpenAI client would.

    Returns (content, reasoning, calls dict index -> [id, name, arguments], parser, deltas). Asserts the
    OpenAI streaming shape: a call's first delta is its head (id + name), later ones are fragments only.
    """
    parser = OutputParser(config)
    deltas = [parser.feed(t, s) for t, s in pairs]
    deltas.append(parser.finish(tail))
    content = "".join(d.content for d in deltas)
    reasoning = "".join(d.reasoning_content for d in deltas)
    calls: dict[int, list] = {}
    for d in deltas:
        for tc in d.tool_calls:
            if tc.index not in calls:
                assert tc.is_head, f"first delta of call {tc.index} must carry id and name: {tc}"
                assert tc.to_openai()["type"] == "function"
                if config.stream_tool_arguments:
                    assert tc.arguments == ""
                calls[tc.index] = [tc.id, tc.name, tc.arguments]
            else:
                assert not tc.is_head and tc.name is None, f"call {tc.index} got a second head"
                assert tc.arguments != "", "empty argument fragments must not be emitted"
                calls[tc.index][2] += tc.arguments
    assert sorted(calls) == list(range(len(calls))), "indices must be 0..n-1"
    if not parser.partial_tool_call_emitted:  # what the client saw == the complete calls
        assert [calls[i] for i in sorted(calls)] == [[t.id, t.name, t.arguments] for t in parser.tool_calls]
    return content, reasoning, calls, parser, deltas


def full(pairs, config: ParserConfig, tail: str = ""):
    ids = [t for t, _ in pairs]
    texts = [s for _, s in pairs]
    return parse_output(ids, texts, config, tail)


CHUNKINGS = [None, [1], [2], [3, 5, 7], [4, 1, 9], [13]]


# ---- reasoning ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("sizes", CHUNKINGS)
@pytest.mark.parametrize("marker_text", [False, True])
def test_reasoning_prompt_ends_in_think(sizes, marker_text):
    cfg = ParserConfig(prompt_ends_in_think=True)
    pairs = toks("Let me think.\nOK", TE, "\n\nThe answer is 4.", sizes=sizes, marker_text=marker_text)
    c, r, calls, _, _ = stream(pairs, cfg)
    assert r == "Let me think.\nOK"
    assert c == "\n\nThe answer is 4."
    assert calls == {}
    assert full(pairs, cfg) == ("\n\nThe answer is 4.", "Let me think.\nOK", [])


@pytest.mark.parametrize("marker_text", [False, True])
def test_reasoning_model_emits_think(marker_text):
    cfg = ParserConfig(thinking=True)
    pairs = toks(TS, "hmm", TE, "done", marker_text=marker_text)
    assert full(pairs, cfg) == ("done", "hmm", [])
    c, r, _, _, _ = stream(pairs, cfg)
    assert (c, r) == ("done", "hmm")


def test_reasoning_without_any_think_start_is_still_reasoning():
    # thinking on, the model skipped `<think>`: text up to `</think>` is reasoning (prefill-robust)
    assert full(toks("abc", TE, "xyz"), ParserConfig(thinking=True)) == ("xyz", "abc", [])


def test_prompt_ends_in_think_forces_reasoning_even_if_thinking_false():
    assert full(toks("abc", TE, "xyz"), ParserConfig(thinking=False, prompt_ends_in_think=True)) == ("xyz", "abc", [])


@pytest.mark.parametrize("marker_text", [False, True])
def test_thinking_off_everything_is_content_and_markers_dropped(marker_text):
    cfg = ParserConfig(thinking=False)
    pairs = toks("a", TS, "b", TE, "c", marker_text=marker_text)
    assert full(pairs, cfg) == ("abc", None, [])


def test_response_cut_before_think_end_is_all_reasoning():
    cfg = ParserConfig(thinking=True)
    pairs = toks(TS, "still thinking about it", sizes=[1], marker_text=True)
    c, r, _, p, _ = stream(pairs, cfg)
    assert (c, r) == ("", "still thinking about it")
    assert full(pairs, cfg) == (None, "still thinking about it", [])
    assert p.finish_reason("length") == "length"


def test_think_markers_never_leak_with_marker_text():
    cfg = ParserConfig(thinking=True, tools=True)
    pairs = toks(TS, "r1", TS, "r2", TE, "c1", TE, TS, "c2", marker_text=True)
    c, r, _, _, _ = stream(pairs, cfg)
    assert r == "r1r2" and c == "c1c2"
    assert "think>" not in c + r


def test_second_think_end_is_dropped():
    assert full(toks("r", TE, "c", TE, "d"), ParserConfig(thinking=True)) == ("cd", "r", [])


def test_marker_text_with_released_bytes_is_split_around_marker():
    # A detokenizer may release held text together with the next token's text.
    p = OutputParser(ParserConfig(thinking=True))
    d1 = p.feed(TEXT_ID, "abc")
    d2 = p.feed(THINK_END_ID, "\ufffd</think>xy")
    d3 = p.feed(THINK_START_ID, "z")  # text without the marker string: treated as preceding text
    assert (d1.reasoning_content, d2.reasoning_content, d2.content, d3.content) == ("abc", "\ufffd", "xy", "z")


def test_for_prompt_derives_reasoning_state():
    ids = [1, 2, 3]
    assert ParserConfig.for_prompt(ids + [TS, TE], tools=True, thinking_model=True) == ParserConfig(tools=True)
    cfg = ParserConfig.for_prompt(ids + [TS], tools=False, thinking_model=False)
    assert cfg.thinking and cfg.prompt_ends_in_think and cfg.starts_in_reasoning
    assert ParserConfig.for_prompt(ids, tools=False, thinking_model=True) == ParserConfig(thinking=True)
    assert ParserConfig.for_prompt(ids, tools=False, thinking_model=False) == ParserConfig()
    assert ParserConfig.for_prompt([], tools=False, thinking_model=False) == ParserConfig()


# ---- tool calls ---------------------------------------------------------------------------------------
WEATHER_ARGS = '{"city": "Tokyo", "unit": "c", "note": "東京 🌧 \\"q\\""}'


@pytest.mark.parametrize("sizes", CHUNKINGS)
@pytest.mark.parametrize("marker_text", [False, True])
def test_single_call_any_chunking_stream_equals_full(sizes, marker_text):
    pairs = toks(
        "Checking.", SB, CB, "functions.get_weather:0", AB, WEATHER_ARGS, CE, SE, sizes=sizes, marker_text=marker_text
    )
    c, r, calls, p, _ = stream(pairs, TOOLS)
    assert c == "Checking." and r == ""
    assert calls == {0: ["functions.get_weather:0", "get_weather", WEATHER_ARGS]}
    content, reasoning, tcs = full(pairs, TOOLS)
    assert (content, reasoning) == ("Checking.", None)
    assert tcs == [ToolCall("functions.get_weather:0", "get_weather", WEATHER_ARGS)]
    assert json.loads(tcs[0].arguments)["note"] == '東京 🌧 "q"'
    assert p.has_tool_calls and p.finish_reason("stop") == "tool_calls"
    assert not p.incomplete_tool_call and not p.partial_tool_call_emitted


def test_header_delta_is_emitted_at_argument_begin_then_fragments():
    p = OutputParser(TOOLS)
    assert p.feed(SB).is_empty()
    assert p.feed(CB).is_empty()
    assert p.feed(TEXT_ID, "functions.").is_empty()
    assert p.feed(TEXT_ID, "f:0").is_empty()  # header is buffered until argument-begin
    d = p.feed(AB)
    assert d.tool_calls == [ToolCallDelta(index=0, id="functions.f:0", name="f", arguments="")]
    assert d.to_openai() == {
        "tool_calls": [
            {"index": 0, "id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": ""}}
        ]
    }
    d = p.feed(TEXT_ID, '{"a"')
    assert d.to_openai() == {"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]}
    assert p.feed(TEXT_ID, "").is_empty()
    p.feed(TEXT_ID, ": 1}")
    assert p.feed(CE).is_empty() and p.feed(SE).is_empty()
    p.finish()
    assert p.tool_calls == [ToolCall("functions.f:0", "f", '{"a": 1}')]


@pytest.mark.parametrize("sizes", CHUNKINGS)
def test_two_calls_in_one_section(sizes):
    pairs = toks(
        SB,
        CB,
        "functions.search:0",
        AB,
        '{"q": "a"}',
        CE,
        "\n",
        CB,
        "functions.fetch:1",
        AB,
        '{"url": "http://x/y?z=1"}',
        CE,
        SE,
        sizes=sizes,
    )
    c, _r, calls, _p, _ = stream(pairs, TOOLS)
    want = {
        0: ["functions.search:0", "search", '{"q": "a"}'],
        1: ["functions.fetch:1", "fetch", '{"url": "http://x/y?z=1"}'],
    }
    assert calls == want and c == ""
    content, reasoning, tcs = full(pairs, TOOLS)
    assert content is None and reasoning is None
    assert [[t.id, t.name, t.arguments] for t in tcs] == [want[0], want[1]]


@pytest.mark.parametrize(
    "header,call_id,name",
    [
        ("functions.my.tool-v2:3", "functions.my.tool-v2:3", "my.tool-v2"),
        ("functions.a-b.c-d.e:12", "functions.a-b.c-d.e:12", "a-b.c-d.e"),
        ("search:0", "functions.search:0", "search"),
        ("web.search-v1:7", "functions.web.search-v1:7", "web.search-v1"),
        ("functions.ns:tool:3", "functions.ns:tool:3", "ns:tool"),
        ("  functions.pad:1 \n", "functions.pad:1", "pad"),
    ],
)
def test_tool_names_and_ids(header, call_id, name):
    """The id returned for a call is always `functions.NAME:IDX`, whatever prefix and whitespace the model gave."""
    assert parse_tool_call_id(header) == (call_id, name)
    pairs = toks(SB, CB, header, AB, "{}", CE, SE, sizes=[1])
    _, _, calls, _, _ = stream(pairs, TOOLS)
    assert calls == {0: [call_id, name, "{}"]}
    assert full(pairs, TOOLS)[2] == [ToolCall(call_id, name, "{}")]


@pytest.mark.parametrize(
    "header",
    ["", "   ", "functions.", "functions.:0", ":4", "call_9f3a0c1e", "functions.get_weather", "get_weather:x", "a b:0"],
)
def test_header_that_is_not_name_idx_is_content_not_a_call(header):
    """A header that is not `functions.NAME:IDX` makes no call (no made-up name): its text and its arguments' text
    are content, and the calls after it are parsed as usual."""
    assert parse_tool_call_id(header) is None
    for sizes in CHUNKINGS:
        pairs = toks(SB, CB, header, AB, '{"x": 1}', CE, CB, "functions.ok:1", AB, "{}", CE, SE, "end", sizes=sizes)
        c, _, calls, p, _ = stream(pairs, TOOLS)
        assert calls == {0: ["functions.ok:1", "ok", "{}"]}
        assert c == header + '{"x": 1}end'
        assert full(pairs, TOOLS) == (c, None, [ToolCall("functions.ok:1", "ok", "{}")])
        assert p.finish_reason("stop") == "tool_calls"


def test_header_without_idx_and_without_arguments_is_content():
    """`<|tool_call_begin|>get_weather<|tool_call_end|>` is no call named get_weather (nor `get_weather.0`)."""
    pairs = toks("a", SB, CB, "invalid_get_weather", CE, SE, "b")
    assert full(pairs, TOOLS) == ("ainvalid_get_weatherb", None, [])
    assert stream(pairs, TOOLS)[2] == {}


def test_header_known_invalid_streams_as_content_at_once():
    """Prose after a stray `<|tool_call_begin|>` is content from the character that makes it no header on, not held
    until the end of the output."""
    p = OutputParser(TOOLS)
    assert p.feed(CB).is_empty()
    assert p.feed(TEXT_ID, "Here").is_empty()  # may still be a header
    assert p.feed(TEXT_ID, " is").content == "Here is"
    assert p.feed(TEXT_ID, " more").content == " more"
    assert p.feed(AB).is_empty() and p.feed(TEXT_ID, "{}").content == "{}"
    assert p.finish().is_empty() and p.tool_calls == [] and p.finish_reason("stop") == "stop"


def test_cut_inside_valid_header_prefix_is_dropped_but_other_header_text_is_content():
    c, _, calls, p, _ = stream(toks("x", SB, CB, "functions.get_we"), TOOLS)
    assert (c, calls, p.incomplete_tool_call) == ("x", {}, True)
    c, _, calls, p, _ = stream(toks("x", SB, CB, "not a header"), TOOLS)
    assert (c, calls, p.incomplete_tool_call) == ("xnot a header", {}, False)


def test_invalid_json_arguments_are_passed_through():
    bad = '{"city": "Paris", oops'
    pairs = toks(SB, CB, "functions.f:0", AB, bad, CE, SE, sizes=[2])
    assert full(pairs, TOOLS)[2] == [ToolCall("functions.f:0", "f", bad)]
    assert stream(pairs, TOOLS)[2] == {0: ["functions.f:0", "f", bad]}


def test_call_without_argument_begin_gets_empty_object():
    pairs = toks(SB, CB, "functions.now:0", CE, SE)
    _, _, calls, _, _ = stream(pairs, TOOLS)
    assert calls == {0: ["functions.now:0", "now", "{}"]}
    assert full(pairs, TOOLS)[2] == [ToolCall("functions.now:0", "now", "{}")]
    assert full(pairs, TOOLS_WHOLE)[2] == [ToolCall("functions.now:0", "now", "{}")]


def test_content_after_section_end_is_content():
    pairs = toks("before ", SB, CB, "functions.f:0", AB, "{}", CE, SE, " after", sizes=[1])
    c, _, calls, _, _ = stream(pairs, TOOLS)
    assert c == "before  after" and len(calls) == 1
    assert full(pairs, TOOLS)[0] == "before  after"


def test_whitespace_between_calls_is_dropped_other_text_is_content():
    pairs = toks(SB, " \n", CB, "functions.f:0", AB, "{}", CE, "\n", CB, "functions.g:1", AB, "{}", CE, " \n", SE)
    assert full(pairs, TOOLS) == (
        None,
        None,
        [ToolCall("functions.f:0", "f", "{}"), ToolCall("functions.g:1", "g", "{}")],
    )
    pairs = toks(SB, " \n", CB, "functions.f:0", AB, "{}", CE, " junk ", SE, "!")
    assert full(pairs, TOOLS) == (" junk !", None, [ToolCall("functions.f:0", "f", "{}")])


def test_call_begin_without_section_opens_one():
    pairs = toks("x", CB, "functions.f:0", AB, "{}", CE, SE, "y")
    assert full(pairs, TOOLS) == ("xy", None, [ToolCall("functions.f:0", "f", "{}")])


def test_missing_call_end_is_closed_by_next_call_or_section_end():
    pairs = toks(SB, CB, "functions.a:0", AB, '{"x":1}', CB, "functions.b:1", AB, '{"y":2}', SE, "tail")
    c, _, calls, p, _ = stream(pairs, TOOLS)
    assert calls == {0: ["functions.a:0", "a", '{"x":1}'], 1: ["functions.b:1", "b", '{"y":2}']}
    assert c == "tail" and p.finish_reason("stop") == "tool_calls"


def test_stray_tool_markers_outside_a_call_are_dropped():
    pairs = toks("a", AB, "b", CE, "c", SE, "d")
    assert full(pairs, TOOLS) == ("abcd", None, [])


def test_multiple_sections():
    pairs = toks(SB, CB, "functions.a:0", AB, "{}", CE, SE, "mid", SB, CB, "functions.b:1", AB, "[]", CE, SE)
    c, _, calls, _, _ = stream(pairs, TOOLS)
    assert c == "mid" and calls == {0: ["functions.a:0", "a", "{}"], 1: ["functions.b:1", "b", "[]"]}


# ---- robustness: no text lost, no model whitespace in arguments, every split point -------------------
def every_split(parts: tuple[int | str, ...]):
    """Token lists for `parts` with one text part split in two at every position, then one character per token."""
    yield toks(*parts)
    yield toks(*parts, sizes=[1])
    for k, part in enumerate(parts):
        if isinstance(part, str):
            for j in range(1, len(part)):
                yield toks(*parts[:k], part[:j], part[j:], *parts[k + 1 :])


def assert_every_split(parts, cfg, want):
    """Streamed (rebuilt from deltas) == non-streamed == want, at every split point of every text part."""
    content, reasoning, tool_calls = want
    for pairs in every_split(parts):
        c, r, calls, p, _ = stream(pairs, cfg)
        assert full(pairs, cfg) == want, pairs
        assert (c or None, r or None) == (content, reasoning), pairs
        assert [ToolCall(*calls[i]) for i in sorted(calls)] == tool_calls == p.emitted_tool_calls, pairs


def test_unclosed_tool_section_keeps_the_text_after_it():
    """An unclosed `<|tool_calls_section_begin|>` followed by 10,000 characters of text: the text is content (it used
    to be dropped, leaving an empty content with finish_reason stop)."""
    text = ("The weather in Paris is mild. " * 334)[:10_000]
    for pairs in (toks("Intro. ", SB, text), toks("Intro. ", SB, text, sizes=[7, 3])):
        c, _, calls, p, _ = stream(pairs, TOOLS)
        assert c == "Intro. " + text and calls == {}
        assert full(pairs, TOOLS) == ("Intro. " + text, None, [])
        assert p.finish_reason("stop") == "stop" and not p.incomplete_tool_call
    assert_every_split(("a", SB, " b c"), TOOLS, ("a b c", None, []))
    assert_every_split(("a", SB, "  "), TOOLS, ("a", None, []))  # only whitespace: it separated nothing


def test_stray_markers_never_lose_the_text_after_them():
    assert_every_split(("leaked", SB, CE, "content"), TOOLS, ("leakedcontent", None, []))
    assert_every_split(("a", SB, AB, "b", SB, "c"), TOOLS, ("abc", None, []))
    assert_every_split(
        ("x", SB, CB, "functions.f:0", AB, "{}", CE, "tail"),
        TOOLS,
        ("xtail", None, [ToolCall("functions.f:0", "f", "{}")]),
    )
    # reasoning: an unclosed section that a thinking model opened still gives its text back (as content)
    assert_every_split(("think", SB, "answer"), TOOLS_THINK, ("answer", "think", []))


@pytest.mark.parametrize("cfg", [TOOLS, TOOLS_WHOLE], ids=["live", "whole"])
@pytest.mark.parametrize(
    "raw,args",
    [
        (" {} ", "{}"),
        ('\n  {"a": 1,  "b": " x "}\n\n', '{"a": 1,  "b": " x "}'),
        ("   ", "{}"),
        ("", "{}"),
        ('{"s": "a \n"}', '{"s": "a \n"}'),
    ],
)
def test_arguments_without_surrounding_whitespace(cfg, raw, args):
    """Arguments are returned stripped of the model's surrounding whitespace (the inner text as generated); a call
    whose argument text is empty gets "{}". Streamed fragments never carry the trailing whitespace."""
    parts = (SB, CB, "functions.f:0", AB, raw, CE, SE) if raw else (SB, CB, "functions.f:0", AB, CE, SE)
    assert_every_split(parts, cfg, (None, None, [ToolCall("functions.f:0", "f", args)]))


def test_cut_arguments_leave_out_trailing_whitespace():
    pairs = toks(SB, CB, "functions.f:0", AB, ' {"a": 1, ', sizes=[1])
    _, _, calls, p, _ = stream(pairs, TOOLS)
    assert calls == {0: ["functions.f:0", "f", '{"a": 1,']} and p.partial_tool_call_emitted
    assert full(pairs, TOOLS) == (None, None, [ToolCall("functions.f:0", "f", '{"a": 1,')])


def test_every_split_point_of_a_full_turn():
    parts = (
        TS,
        "plan",
        TE,
        "Sure: ",
        SB,
        " ",
        CB,
        " search:3 ",
        AB,
        ' {"q": "a b"} ',
        CE,
        "\n",
        CB,
        "functions.f.g-h:4",
        AB,
        "{}",
        CE,
        SE,
        " done",
    )
    assert_every_split(
        parts,
        TOOLS_THINK,
        (
            "Sure:  done",
            "plan",
            [ToolCall("functions.search:3", "search", '{"q": "a b"}'), ToolCall("functions.f.g-h:4", "f.g-h", "{}")],
        ),
    )


# ---- cut by max_tokens --------------------------------------------------------------------------------
def test_cut_inside_arguments_live_mode():
    pairs = toks("x", SB, CB, "functions.a:0", AB, '{"k": 1}', CE, CB, "functions.b:1", AB, '{"k": ', sizes=[3])
    _c, _, calls, p, _ = stream(pairs, TOOLS)
    # the client has seen the head and fragments of the second call (index 1) already; it must be told "length"
    assert calls[1][:2] == ["functions.b:1", "b"]
    assert p.tool_calls == [ToolCall("functions.a:0", "a", '{"k": 1}')]
    assert p.incomplete_tool_call and p.partial_tool_call_emitted
    assert p.finish_reason("length") == "length"
    # non-streaming: the calls the stream carried, the cut one with its arguments so far; never content
    assert full(pairs, TOOLS) == (
        "x",
        None,
        [ToolCall("functions.a:0", "a", '{"k": 1}'), ToolCall("functions.b:1", "b", '{"k":')],
    )


@pytest.mark.parametrize("cfg", [TOOLS, TOOLS_WHOLE], ids=["live", "whole"])
def test_streamed_and_non_streamed_calls_agree_at_every_cut(cfg):
    """Cut the same two-call output after every token (max_tokens or a stop): the calls a client rebuilds from
    the stream equal the non-streamed message's calls, and the finish reason is "tool_calls" only for an output
    that ended by itself ("stop") with no call cut mid-stream; a "length" cut is always "length" (a newcomer
    found "tool_calls" for output cut just after a complete call, and streamed calls the response lacked)."""
    pairs = toks(
        "pre", SB, CB, "functions.a:0", AB, '{"k": 1}', CE, CB, "functions.b:1", AB, '{"x": "yz"}', CE, SE, sizes=[2]
    )
    for n in range(len(pairs) + 1):
        _, _, calls, p, _ = stream(pairs[:n], cfg)
        streamed = [ToolCall(*calls[i]) for i in sorted(calls)]
        assert full(pairs[:n], cfg)[2] == streamed == p.emitted_tool_calls, n
        assert p.finish_reason("length") == "length", n
        if p.partial_tool_call_emitted or not p.tool_calls:
            assert p.finish_reason("stop") == "stop", n
        else:
            assert p.finish_reason("stop") == "tool_calls", n
    assert p.finish_reason("stop") == "tool_calls" and len(p.emitted_tool_calls) == 2  # the whole output


def test_stop_inside_arguments_reports_stop_not_length():
    """A stop string or stop token that ends the generation inside a call already streamed gives "stop" (the
    engine's reason), not "length": max_tokens was not reached, and a client reading "length" would retry with a
    larger max_tokens. Still never "tool_calls" while that call is incomplete."""
    pairs = toks("x", SB, CB, "functions.a:0", AB, '{"k": 1}', CE, CB, "functions.b:1", AB, '{"k": ', sizes=[3])
    _, _, calls, p, _ = stream(pairs, TOOLS)
    assert calls[1][:2] == ["functions.b:1", "b"] and p.partial_tool_call_emitted
    assert p.finish_reason("stop") == "stop"
    assert p.finish_reason("length") == "length"


def test_cut_inside_header_emits_nothing_for_that_call():
    pairs = toks(SB, CB, "functions.a:0", AB, "{}", CE, CB, "functions.get_we", sizes=[1])
    c, _, calls, p, _ = stream(pairs, TOOLS)
    assert calls == {0: ["functions.a:0", "a", "{}"]} and c == ""
    assert p.incomplete_tool_call and not p.partial_tool_call_emitted
    # cut by max_tokens: "length" even though a complete call exists (a truncated turn is never "tool_calls");
    # ended by a stop string there: the complete call is all the client got, "tool_calls"
    assert p.finish_reason("length") == "length"
    assert p.finish_reason("stop") == "tool_calls"
    assert full(pairs, TOOLS)[2] == [ToolCall("functions.a:0", "a", "{}")]


def test_cut_right_after_section_begin():
    pairs = toks("hello", SB)
    c, _, calls, p, _ = stream(pairs, TOOLS)
    assert c == "hello" and calls == {} and not p.incomplete_tool_call
    assert p.finish_reason("length") == "length"


@pytest.mark.parametrize("sizes", [[1], None])
def test_cut_inside_arguments_whole_mode_never_emits_broken_call(sizes):
    pairs = toks(SB, CB, "functions.a:0", AB, '{"k": 1}', CE, CB, "functions.b:1", AB, '{"k": ', sizes=sizes)
    _c, _, calls, p, deltas = stream(pairs, TOOLS_WHOLE)
    assert calls == {0: ["functions.a:0", "a", '{"k": 1}']}
    assert p.incomplete_tool_call and not p.partial_tool_call_emitted
    assert p.finish_reason("length") == "length" and p.finish_reason("stop") == "tool_calls"
    assert p.emitted_tool_calls == [ToolCall("functions.a:0", "a", '{"k": 1}')]
    heads = [tc for d in deltas for tc in d.tool_calls]
    assert heads == [ToolCallDelta(0, "functions.a:0", "a", '{"k": 1}')]


def test_whole_mode_equals_live_mode_for_complete_output():
    pairs = toks("pre", SB, CB, "functions.x.y-z:0", AB, WEATHER_ARGS, CE, CB, "search:1", AB, "{}", CE, SE, sizes=[1])
    live = stream(pairs, TOOLS)[:3]
    whole = stream(pairs, TOOLS_WHOLE)[:3]
    assert live == whole
    assert full(pairs, TOOLS) == full(pairs, TOOLS_WHOLE)


# ---- empty content ------------------------------------------------------------------------------------
def test_empty_output():
    assert full([], TOOLS) == (None, None, [])
    assert full([], ParserConfig(thinking=True)) == (None, None, [])
    p = OutputParser(TOOLS)
    assert p.finish().is_empty() and p.finish_reason("stop") == "stop"


def test_only_tool_calls_gives_content_none():
    pairs = toks(SB, CB, "functions.f:0", AB, "{}", CE, SE)
    assert full(pairs, TOOLS)[0] is None
    pairs = toks(TE, SB, CB, "functions.f:0", AB, "{}", CE, SE)
    assert full(pairs, ParserConfig(tools=True, thinking=True))[:2] == (None, None)


def test_empty_text_deltas_produce_empty_deltas():
    p = OutputParser(ParserConfig(thinking=True))
    assert p.feed(TEXT_ID, "").is_empty()
    assert p.feed(THINK_END_ID, "").is_empty()
    assert p.feed(TEXT_ID, "").to_openai() == {}


# ---- markers inside <think> ---------------------------------------------------------------------------
@pytest.mark.parametrize("sizes", [[1], [3, 5], None])
def test_tool_section_inside_think_ends_reasoning_when_tools_active(sizes):
    # Kimi-K2-Thinking / K2.5 sometimes open a tool section without `</think>` (vLLM PR 33646)
    cfg = ParserConfig(tools=True, thinking=True)
    pairs = toks(
        TS,
        "I should look it up.",
        SB,
        CB,
        "functions.lookup:0",
        AB,
        '{"q": "x"}',
        CE,
        SE,
        TE,
        "ok",
        sizes=sizes,
        marker_text=True,
    )
    c, r, calls, _p, _ = stream(pairs, cfg)
    assert r == "I should look it up."
    assert calls == {0: ["functions.lookup:0", "lookup", '{"q": "x"}']}
    assert c == "ok"  # the late `</think>` is dropped
    assert full(pairs, cfg) == ("ok", "I should look it up.", [ToolCall("functions.lookup:0", "lookup", '{"q": "x"}')])


def test_section_begin_inside_think_ends_reasoning_immediately():
    # text between the section begin and the first call (or a cut) must not land in reasoning
    cfg = ParserConfig(tools=True, thinking=True)
    assert full(toks("r", SB, "\n", CB, "functions.f:0", AB, "{}", CE, SE), cfg) == (
        None,
        "r",
        [ToolCall("functions.f:0", "f", "{}")],
    )
    c, r, calls, p, _ = stream(toks("r", SB, " partial"), cfg)
    assert (c, r, calls) == (" partial", "r", {}) and p.finish_reason("length") == "length"


def test_bare_call_begin_inside_think_ends_reasoning():
    cfg = ParserConfig(tools=True, prompt_ends_in_think=True)
    pairs = toks("r", CB, "functions.f:0", AB, "{}", CE)
    assert full(pairs, cfg) == (None, "r", [ToolCall("functions.f:0", "f", "{}")])


def test_tool_markers_inside_think_are_reasoning_text_when_tools_off():
    cfg = ParserConfig(tools=False, thinking=True)
    pairs = toks(TS, "r ", SB, CB, "functions.f:0", AB, "{}", CE, SE, TE, "answer", sizes=[2], marker_text=True)
    c, r, calls, p, _ = stream(pairs, cfg)
    assert r == (
        "r <|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}"
        "<|tool_call_end|><|tool_calls_section_end|>"
    )
    assert c == "answer" and calls == {} and p.finish_reason("stop") == "stop"


@pytest.mark.parametrize("marker_text", [False, True])
def test_tools_off_renders_markers_verbatim_in_content(marker_text):
    """Without tools a marker's detokenized text is ordinary text: the marker string, as the detokenizer gives it
    (skip_special_tokens keeps these); an empty text (a stop token whose text is left out) adds nothing."""
    pairs = toks("x", SB, CB, "functions.f:0", AB, "{}", CE, SE, marker_text=marker_text)
    raw = (
        "x<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}"
        "<|tool_call_end|><|tool_calls_section_end|>"
    )
    assert full(pairs, ParserConfig()) == (raw if marker_text else "xfunctions.f:0{}", None, [])


def test_think_markers_inside_arguments_are_dropped():
    pairs = toks(SB, CB, "functions.f:0", AB, '{"a":', TE, TS, " 1}", CE, SE)
    assert full(pairs, TOOLS)[2] == [ToolCall("functions.f:0", "f", '{"a": 1}')]


# ---- whole-output fuzz: streaming == non-streaming == expected under random chunkings ------------------
def test_random_chunkings_agree():
    rng = random.Random(1234)
    parts = [
        TS,
        "Plan: call two tools. 東京?",
        TE,
        "Sure — ",
        SB,
        CB,
        "functions.weather.get-v2:0",
        AB,
        WEATHER_ARGS,
        CE,
        CB,
        "functions.clock:1",
        AB,
        '{"tz": "Asia/Tokyo"}',
        CE,
        SE,
        "Done ✅",
    ]
    cfg = ParserConfig(tools=True, thinking=True)
    want_calls = [
        ToolCall("functions.weather.get-v2:0", "weather.get-v2", WEATHER_ARGS),
        ToolCall("functions.clock:1", "clock", '{"tz": "Asia/Tokyo"}'),
    ]
    for _ in range(200):
        sizes = [rng.randint(1, 6) for _ in range(rng.randint(1, 4))]
        pairs = toks(*parts, sizes=sizes, marker_text=rng.random() < 0.5)
        content, reasoning, tcs = full(pairs, cfg)
        assert (content, reasoning, tcs) == ("Sure — Done ✅", "Plan: call two tools. 東京?", want_calls)
        c, r, calls, _, _ = stream(pairs, cfg)
        assert (c, r) == (content, reasoning)
        assert [calls[i] for i in sorted(calls)] == [[t.id, t.name, t.arguments] for t in tcs]


# ---- API edges ----------------------------------------------------------------------------------------
def test_feed_after_finish_raises():
    p = OutputParser(TOOLS)
    p.finish()
    with pytest.raises(RuntimeError):
        p.feed(TEXT_ID, "x")
    with pytest.raises(RuntimeError):
        p.finish()


def test_finish_tail_text_goes_to_current_field():
    p = OutputParser(ParserConfig(thinking=True))
    p.feed(TEXT_ID, "a")
    assert p.finish("\ufffd").reasoning_content == "\ufffd"
    pairs = toks("a", TE, "b")
    assert full(pairs, ParserConfig(thinking=True), tail="c") == ("bc", "a", [])


class _FakeDetok:
    """Stands in for kimi.tokenizer.IncrementalDetokenizer: text per id, holds the last piece until flush."""

    def __init__(self, texts: dict[int, str]):
        self.texts = texts
        self.pending = ""

    def push(self, tid: int) -> str:
        out, self.pending = self.pending, self.texts.get(tid, "")
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def test_parse_output_with_detokenizer_and_length_check():
    # a detokenizer that lags one token: the released text arrives with the next (marker) token's id
    texts = {1: "I think", 2: " so", 3: "Yes", 4: "!"}
    ids = [1, 2, THINK_END_ID, 3, 4]
    # Lag moves " so" into the `</think>` delta (treated as preceding text) and "!" into the flush tail.
    assert parse_output(ids, _FakeDetok(texts), ParserConfig(thinking=True)) == ("Yes!", "I think so", [])
    with pytest.raises(ValueError):
        parse_output([1, 2], ["a"], ParserConfig())


def test_parser_delta_to_openai_omits_empty_fields():
    d = ParserDelta(content="c", reasoning_content="")
    assert d.to_openai() == {"content": "c"}
    d = ParserDelta(reasoning_content="r", tool_calls=[ToolCallDelta(2, arguments="{")])
    assert d.to_openai() == {"reasoning_content": "r", "tool_calls": [{"index": 2, "function": {"arguments": "{"}}]}
    assert ToolCall("i", "n", "{}").to_openai() == {
        "id": "i",
        "type": "function",
        "function": {"name": "n", "arguments": "{}"},
    }


def test_marker_text_of_another_vocabulary_stays_out_of_the_fields():
    """K2-Instruct's vocabulary names ids 163606 / 163607 `<|reserved_token_...|>`. With skip_special_tokens false
    that text comes with the marker tokens; given the vocabulary's marker text (ParserConfig.marker_text, which
    the HTTP server derives from its tokenizer) it is split off like `<think>` / `</think>`, not streamed."""
    from kimi.controller.parsers import THINK_END_ID, THINK_START_ID, OutputParser, ParserConfig

    names = ((THINK_START_ID, "<|reserved_token_163606|>"), (THINK_END_ID, "<|reserved_token_163607|>"))
    feed = [(THINK_START_ID, names[0][1]), (5, " I think"), (THINK_END_ID, names[1][1]), (6, "Answer")]
    p = OutputParser(ParserConfig(thinking=True, marker_text=names))
    deltas = [p.feed(t, x) for t, x in feed] + [p.finish()]
    assert "".join(d.reasoning_content for d in deltas) == " I think"
    assert "".join(d.content for d in deltas) == "Answer"
    p = OutputParser(ParserConfig(thinking=True))  # without it, the names are ordinary text (the old behaviour)
    deltas = [p.feed(t, x) for t, x in feed] + [p.finish()]
    assert "".join(d.reasoning_content for d in deltas) == names[0][1] + " I think" + names[1][1]


# ---- text held back for stop strings, released with later tokens (ReleasedTextFeeder) -----------------
def _controller_outputs(tokens, stops, include):
    """What kimi.controller.output sends for `tokens` ([(id, own text)]) with stop strings: per output
    (id, released text, held before, held after, last), and the produced text's released length."""
    from kimi.controller.stops import StopChecker

    checker = StopChecker(stops, include)
    outs, held, released = [], 0, 0
    for i, (tid, text) in enumerate(tokens):
        produced = len(checker.held) + len(text)
        emit, stopped, _ = checker.feed(text)
        last = stopped or i == len(tokens) - 1
        if last and not stopped:
            emit += checker.flush()
        after = produced - len(emit) if stopped else len(checker.held)  # as Request.stop_held records it
        outs.append((tid, emit, held, after, last))
        held = after
        released += len(emit)
        if last:
            break
    return outs, released


def _feed_released(outs, cfg):
    """The controller outputs through a ReleasedTextFeeder -> (content, reasoning, tool calls as a non-streamed
    response returns them: `emitted_tool_calls`)."""
    from kimi.controller.parsers import ReleasedTextFeeder

    feeder = ReleasedTextFeeder(OutputParser(cfg))
    r = c = ""
    for tid, text, hb, ha, last in outs:
        d = feeder.feed(tid, text, hb, ha, last)
        r, c = r + d.reasoning_content, c + d.content
    d = feeder.parser.finish()
    return c + d.content, r + d.reasoning_content, feeder.parser.emitted_tool_calls


def test_released_text_goes_with_the_token_that_produced_it():
    """A stop string's possible prefix held back at the end of the reasoning and released after `</think>` stays
    reasoning; a stop string spanning `</think>` (include_stop_str_in_output) splits at it (the adversarial case:
    " I" " think" </think> "OK" with stop " thinkOK")."""
    tokens = [(TEXT_ID, " I"), (TEXT_ID, " think"), (TE, ""), (TEXT_ID, "OK"), (TEXT_ID, " more")]
    cfg = ParserConfig(thinking=True)
    for stops, include, want in (
        ([" thinkOK"], True, (" I think", "OK")),
        ([" thinkOK"], False, (" I", "")),
        (["thinkX"], False, (" I think", "OK more")),
    ):
        outs, _ = _controller_outputs(tokens, stops, include)
        c, r, _ = _feed_released(outs, cfg)
        assert (r, c) == want, (stops, include)


def test_released_text_attribution_matches_per_token_parsing_fuzz():
    """Random outputs (reasoning, tool calls, markers with and without their text), random stop strings drawn from
    the output's own text (so they match, often across tokens and markers), with and without
    include_stop_str_in_output: what the feeder gives the parser equals parsing each token with its own text cut at
    the released length (the text a stop string cut is gone; every ordinary token up to the end is still fed, a marker
    only when its whole text was released and no token before it was cut)."""
    rng = random.Random(7)
    words = [" I", " think", "OK", "th", "ink", "a", "b", "functions.f:0", '{"x":', " 1}", "é", "—"]
    for _ in range(3000):
        tools = rng.random() < 0.5
        marker_text = rng.random() < 0.5
        seq = []
        for _ in range(rng.randint(1, 14)):
            if rng.random() < 0.3:
                tid = rng.choice([TS, TE, SB, SE, CB, AB, CE])
                seq.append((tid, MARKER_TEXT[tid] if marker_text else ""))
            else:
                seq.append((TEXT_ID + rng.randint(0, 3), rng.choice(words)))
        stream = "".join(t for _, t in seq)
        stops = []
        for _ in range(rng.randint(1, 3)):
            if stream and rng.random() < 0.8:
                i = rng.randrange(len(stream))
                stops.append(stream[i : i + rng.randint(1, 9)])
            else:
                stops.append(rng.choice(["zz", "thinkX", "OKa"]))
        include = rng.random() < 0.5
        cfg = ParserConfig(tools=tools, thinking=rng.random() < 0.7)
        outs, released = _controller_outputs(seq, stops, include)
        fed = seq[: len(outs)]
        # reference: every fed token with its own text cut at the released length; a marker (as the parser treats
        # it) only when the cut did not reach it
        probe = OutputParser(cfg)
        ids, cut, pos = [], [], 0
        for tid, t in fed:
            if not (probe.is_marker(tid) and pos + len(t) > released):
                ids.append(tid)
                cut.append(t[: max(0, released - pos)])
            pos += len(t)
        want = parse_output(ids, cut, cfg)
        c, r, calls = _feed_released(outs, cfg)
        assert (c or None, r or None, calls) == want, (seq, stops, include, cfg)
