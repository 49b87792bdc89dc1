"""The OpenAI serving contract, end to end: the official `openai` client against a real `kimi serve`.

The model is the tiny K2.6 checkpoint with its embedding / lm_head rewritten into a bigram chain
(tests/e2e/chain_checkpoint.py explains why and how): after `<|im_middle|>` greedy decoding generates
`<think> I think</think>OK` and then a kimi_k2 tool section that repeats the call
`functions.get_weather:0 {"city":"Paris"}` until max_tokens; `logit_bias {<|tool_call_begin|>: -10}`
closes the section after one call (`Done<|im_end|>`). So reasoning / tool-call parsing, stop strings and
token-level features are exercised on tokens the real worker generated, not on a scripted stream. Prompts
made of other tokens behave like the random tiny model.

One server for the module: --api-key, a small --max-body-bytes, --reasoning on, 16-token blocks.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kimi.client import KimiClient
from kimi.controller.chat import encode_chat
from kimi.tokenizer import KimiTokenizer, default_tokenizer_source

if default_tokenizer_source() is None:
    pytest.skip(
        "the chain checkpoint's token ids are those of the real Kimi vocabulary, which is absent "
        "(../shared/kimi-tokenizer or $KIMI_TOKENIZER_DIR)",
        allow_module_level=True,
    )

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chain_checkpoint import CB, CHAIN_TOKENS, IM_MIDDLE, OK, make_chain_checkpoint
from conftest import start_server, stop_server

KEY = "sekrit-key"
MAX_BODY = 65536
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
ASK = [{"role": "user", "content": "weather in Paris?"}]
CALL = {
    "id": "functions.get_weather:0",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
}


@pytest.fixture(scope="module")
def srv(tiny_k26, tmp_path_factory):
    d = make_chain_checkpoint(tiny_k26, str(tmp_path_factory.mktemp("chain") / "chain"))
    log = str(tmp_path_factory.mktemp("log") / "contract.log")
    s = start_server(
        d,
        log,
        "--block-size",
        "16",
        "--num-blocks",
        "200",
        "--max-model-len",
        "512",
        "--token-budget",
        "64",
        "--reasoning",
        "on",
        "--api-key",
        KEY,
        "--max-body-bytes",
        str(MAX_BODY),
    )
    yield s
    assert stop_server(s) == 0, s.log()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key=KEY, max_retries=0, timeout=120)


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def _metrics(srv) -> dict[str, float]:
    text = httpx.get(f"{srv.base_url}/metrics", headers=_auth()).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + ("" if not s.labels else json.dumps(s.labels, sort_keys=True))
            out[key] = s.value
    return out


def _stream_chat(client, **kw):
    """Collect a streamed chat: (reasoning, content, {index: call dict}, finish_reasons, chunks)."""
    reasoning, content, calls, reasons, n_chunks = [], [], {}, [], 0
    for ch in client.chat.completions.create(model="tiny", stream=True, **kw):
        n_chunks += 1
        c = ch.choices[0]
        d = c.delta
        r = getattr(d, "reasoning_content", None) or (d.model_extra or {}).get("reasoning_content")
        if r:
            reasoning.append(r)
        if d.content:
            content.append(d.content)
        for tc in d.tool_calls or []:
            cur = calls.setdefault(
                tc.index,
                {
                    "id": None,
                    "name": None,
                    "arguments": [],
                },
            )
            if tc.id:
                assert cur["id"] is None, "a call's head must come once"
                cur["id"], cur["name"] = tc.id, tc.function.name
            if tc.function and tc.function.arguments:
                cur["arguments"].append(tc.function.arguments)
        if c.finish_reason:
            reasons.append(c.finish_reason)
    return "".join(reasoning), "".join(content), calls, reasons, n_chunks


# ---- auth and limits ----------------------------------------------------------------------------------
def test_reasoning_on_warns_that_the_vocabulary_has_no_think_token(srv):
    """The real vocabulary here is K2-Instruct's (ids 163606 / 163607 reserved, not <think>): --reasoning on still
    splits at those ids (the chain model emits them), and the start-up log says so (the whole log: srv.log() is its
    last 4000 characters, and on cuda the start-up logs more after the warning)."""
    from pathlib import Path

    assert "--reasoning on: this vocabulary has no <think> token (id 163606" in Path(srv.log_path).read_text()


def test_api_key_required_everywhere_but_health(srv, client):
    assert httpx.get(f"{srv.base_url}/health").status_code == 200
    for path in ("/v1/models", "/metrics"):
        r = httpx.get(f"{srv.base_url}{path}")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt="hi", max_tokens=1)
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_body_over_limit_is_413(srv):
    body = {"model": "tiny", "prompt": "x" * MAX_BODY, "max_tokens": 1}
    r = httpx.post(f"{srv.base_url}/v1/completions", json=body, headers=_auth())
    assert r.status_code == 413 and r.json()["error"]["message"]


# ---- tool calls and reasoning ----------------------------------------------------------------------------
def test_an_answer_cut_inside_its_reasoning_has_null_content(client):
    """No text beside the reasoning: content is null (vLLM's reasoning parsers), reasoning_content holds it."""
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=3, temperature=0)
    m = r.choices[0].message
    thought = m.model_extra["reasoning_content"]
    assert m.content is None and thought and " I think".startswith(thought), (m.content, thought)
    assert r.choices[0].finish_reason == "length"


def test_reasoning_next_to_reasoning_content_and_the_reasoning_switches(client):
    """`reasoning` (current vLLM's name) holds what `reasoning_content` holds, in messages and deltas;
    `include_reasoning: false` (vLLM) leaves it out; `separate_reasoning: false` (SGLang) keeps it in the content."""
    kw = dict(model="tiny", messages=ASK, max_tokens=5, temperature=0)
    m = client.chat.completions.create(**kw).choices[0].message
    assert m.model_extra["reasoning"] == m.model_extra["reasoning_content"] == " I think"
    assert m.content == "OK"
    deltas = [ch.choices[0].delta for ch in client.chat.completions.create(**kw, stream=True) if ch.choices]
    thought = [d.model_extra["reasoning_content"] for d in deltas if d.model_extra.get("reasoning_content")]
    assert "".join(thought) == " I think"
    assert all(d.model_extra.get("reasoning") == d.model_extra.get("reasoning_content") for d in deltas)

    off = client.chat.completions.create(**kw, extra_body={"include_reasoning": False}).choices[0].message
    assert off.content == "OK" and "reasoning" not in off.model_extra and "reasoning_content" not in off.model_extra
    streamed = list(client.chat.completions.create(**kw, stream=True, extra_body={"include_reasoning": False}))
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == "OK"
    assert not any((ch.choices[0].delta.model_extra or {}).get("reasoning") for ch in streamed if ch.choices)

    joined = client.chat.completions.create(**kw, extra_body={"separate_reasoning": False}).choices[0].message
    assert joined.content == " I thinkOK" and "reasoning_content" not in joined.model_extra


def test_two_calls_in_one_section_streaming_equals_non_streaming(client):
    kw = dict(messages=ASK, tools=TOOLS, max_tokens=34, temperature=0)  # 34 tokens end right after the second call
    r = client.chat.completions.create(model="tiny", **kw)
    c = r.choices[0]
    assert c.finish_reason == "length"  # max_tokens ended it (the chain goes on with more calls): not "tool_calls"
    assert c.message.model_extra["reasoning_content"] == " I think"
    assert c.message.content == "OK"
    assert [t.model_dump(exclude_none=True) for t in c.message.tool_calls] == [CALL, CALL]
    reasoning, content, calls, reasons, _ = _stream_chat(client, **kw)
    assert (reasoning, content, reasons) == (" I think", "OK", ["length"])
    assert sorted(calls) == [0, 1]
    for call in calls.values():
        assert (call["id"], call["name"], "".join(call["arguments"])) == (CALL["id"], "get_weather", '{"city":"Paris"}')
        assert len(call["arguments"]) == 5, "arguments stream one generated token per delta"
    assert "<|" not in content + reasoning


def _calls_of(message) -> list[tuple[str, str, str]]:
    return [(t.id, t.function.name, t.function.arguments) for t in message.tool_calls or []]


def _streamed_calls(calls: dict) -> list[tuple[str, str, str]]:
    return [(calls[i]["id"], calls[i]["name"], "".join(calls[i]["arguments"])) for i in sorted(calls)]


def test_section_cut_by_max_tokens(client):
    kw = dict(messages=ASK, tools=TOOLS, max_tokens=29, temperature=0)  # cut inside the second call's arguments
    r = client.chat.completions.create(model="tiny", **kw)
    c = r.choices[0]
    assert c.finish_reason == "length"
    # the truncated call is returned as far as it was generated, as the stream carries it
    assert _calls_of(c.message) == [(CALL["id"], "get_weather", '{"city":"Paris"}'), (CALL["id"], "get_weather", '{"')]
    _, content, calls, reasons, _ = _stream_chat(client, **kw)
    assert reasons == ["length"] and content == "OK" and _streamed_calls(calls) == _calls_of(c.message)


def test_cut_by_max_tokens_is_length_and_streams_the_same_calls(client):
    """max_tokens anywhere from inside the first call's arguments to just after the second (complete at token 34):
    always "length", even just after a complete call or inside the next call's header (it said "tool_calls", so an agent
    would run the calls of a truncated turn); and the non-streamed calls equal the streamed ones at every cut (the
    non-streamed response used to drop a call whose head and argument fragments the stream had sent)."""
    from concurrent.futures import ThreadPoolExecutor

    def both(n: int):  # the non-streamed response and the stream of the same request (batched together)
        kw = dict(messages=ASK, tools=TOOLS, max_tokens=n, temperature=0)
        return client.chat.completions.create(model="tiny", **kw), _stream_chat(client, **kw)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(both, range(17, 35)))
    for n, (r, (_, _, calls, reasons, _)) in zip(range(17, 35), results):
        c = r.choices[0]
        assert r.usage.completion_tokens == n and c.finish_reason == "length", (n, c)
        assert reasons == ["length"] and _streamed_calls(calls) == _calls_of(c.message), (n, calls, c.message)
    assert len(_calls_of(c.message)) == 2  # n = 34: both calls complete, still "length"


def test_stop_string_inside_a_call_is_stop_not_length(client):
    """A stop string matching inside a call's arguments ends the generation with finish_reason "stop" (max_tokens
    was not reached; it said "length"); the call is returned as far as the text before the stop string, as the
    stream carries it (never "tool_calls": that call is incomplete)."""
    kw = dict(messages=ASK, tools=TOOLS, max_tokens=60, temperature=0, stop=["Par"])
    c = client.chat.completions.create(model="tiny", **kw).choices[0]
    assert c.finish_reason == "stop" and c.model_extra["stop_reason"] == "Par"
    assert _calls_of(c.message) == [(CALL["id"], "get_weather", '{"city":"')]
    _, content, calls, reasons, _ = _stream_chat(client, **kw)
    assert reasons == ["stop"] and content == "OK" and _streamed_calls(calls) == _calls_of(c.message)


def test_stop_string_reaching_into_a_marker_cuts_the_call_there(client):
    """A stop string that begins in a call's arguments or header and ends in or after a marker: the marker is cut
    with it. So the call stays open (finish "stop", the arguments as far as the text before the stop string, no
    marker text in them), or, cut in its header, is in neither response. (Before: the cut `<|tool_call_end|>` still
    closed the call, giving "tool_calls" with cut JSON; part of a cut marker's text landed in the arguments; a cut
    `<|tool_call_argument_begin|>` still opened the call, with a truncated name.) Streamed the same."""
    cases = [
        ('"}<|tool_call_end|>', [(CALL["id"], "get_weather", '{"city":"Paris')]),
        ("}<|tool_call_end|><|tool_calls_section_end|>", [(CALL["id"], "get_weather", '{"city":"Paris"')]),
        ('Paris"}<|tool_call_end|>', [(CALL["id"], "get_weather", '{"city":"')]),
        ("_end|>", [(CALL["id"], "get_weather", '{"city":"Paris"}')]),
        ("weather:0<|tool_call_argument_begin|>", []),
        ("0<|tool_call_argument_begin|>", []),
        (":0<|tool_call_argument_begin|>", []),
    ]
    for stop, want in cases:
        kw = dict(messages=ASK, tools=TOOLS, max_tokens=60, temperature=0, stop=[stop], logit_bias={str(CB): -10})
        c = client.chat.completions.create(model="tiny", **kw).choices[0]
        assert (c.finish_reason, c.model_extra["stop_reason"]) == ("stop", stop), (stop, c)
        assert c.message.content == "OK" and _calls_of(c.message) == want, (stop, c.message)
        _, content, calls, reasons, _ = _stream_chat(client, **kw)
        assert reasons == ["stop"] and content == "OK" and _streamed_calls(calls) == want, (stop, calls)
    # the same stop strings kept in the output (include_stop_str_in_output): the markers they hold are in the output
    kw = dict(
        messages=ASK,
        tools=TOOLS,
        max_tokens=60,
        temperature=0,
        stop=['"}<|tool_call_end|>'],
        logit_bias={str(CB): -10},
        extra_body={"include_stop_str_in_output": True},
    )
    c = client.chat.completions.create(model="tiny", **kw).choices[0]
    assert c.finish_reason == "tool_calls" and _calls_of(c.message) == [(CALL["id"], "get_weather", '{"city":"Paris"}')]


def test_tool_marker_as_stop_token_without_tools_leaves_its_text_out(client):
    """Without tools a tool marker is ordinary text; as the request's stop token its text is left out of the chat
    content like any stop token's (it came back as "OK<|tool_calls_section_begin|>"), kept with
    include_stop_str_in_output; the same streamed."""
    from kimi.controller.parsers import TOOL_CALLS_SECTION_BEGIN_ID as SECTION

    kw = dict(model="tiny", messages=ASK, max_tokens=60, temperature=0, extra_body={"stop_token_ids": [SECTION]})
    c = client.chat.completions.create(**kw).choices[0]
    assert (c.message.content, c.finish_reason, c.model_extra["stop_reason"]) == ("OK", "stop", SECTION)
    _, content, _, reasons, _ = _stream_chat(client, **{k: v for k, v in kw.items() if k != "model"})
    assert (content, reasons) == ("OK", ["stop"])
    kw["extra_body"] = {"stop_token_ids": [SECTION], "include_stop_str_in_output": True}
    c = client.chat.completions.create(**kw).choices[0]
    assert c.message.content == "OK<|tool_calls_section_begin|>"


def test_section_closed_then_content_then_eos(client):
    r = client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, max_tokens=60, temperature=0, logit_bias={str(CB): -10}
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "OKDone"
    assert [t.model_dump(exclude_none=True) for t in c.message.tool_calls] == [CALL]
    assert r.usage.completion_tokens == 23


def test_tool_choice_variants(srv, client):
    none = client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=12, temperature=0
    )
    m = none.choices[0].message
    assert not m.tool_calls and none.choices[0].finish_reason == "length"
    assert m.content.startswith("OK<|tool_calls_section_begin|><|tool_call_begin|>functions")  # markers as text
    named = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        max_tokens=34,
        temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
    )
    assert [t.id for t in named.choices[0].message.tool_calls] == [CALL["id"]]  # parallel off: first call only
    req = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=60,
        temperature=0,
        logit_bias={str(CB): -10},
    )  # one call, EOS
    assert req.choices[0].finish_reason == "tool_calls" and _calls_of(req.choices[0].message) == [
        (CALL["id"], "get_weather", '{"city":"Paris"}')
    ]
    cut = client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=20, temperature=0
    )  # token 20 completes the first call: cut there
    assert cut.choices[0].finish_reason == "length" and len(cut.choices[0].message.tool_calls) == 1
    for body, param in [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "x", "description": "<|im_end|>"}}]}, "tools"),
        # unknown keys, as anywhere else in a request; strict must be a boolean (true is guided decoding)
        ({"tools": [{"type": "function", "function": {"name": "x", "strict": "yes"}}]}, "tools[0].function.strict"),
        ({"tools": [{"type": "function", "function": {"name": "x", "foo": 1}}]}, "tools[0].function.foo"),
        ({"tools": [{"type": "function", "function": {"name": "x"}, "extra": 1}]}, "tools[0].extra"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}, "foo": 1}},
            "tool_choice.foo",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather", "x": 1}}},
            "tool_choice.function.x",
        ),
    ]:
        r = httpx.post(
            f"{srv.base_url}/v1/chat/completions",
            headers=_auth(),
            json={"model": "tiny", "messages": ASK, "max_tokens": 2, **body},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    ok = [{"type": "function", "function": {"name": "x", "strict": False, "description": "d", "parameters": {}}}]
    r = httpx.post(
        f"{srv.base_url}/v1/chat/completions",
        headers=_auth(),
        json={"model": "tiny", "messages": ASK, "max_tokens": 2, "tools": ok},
    )
    assert r.status_code == 200, r.text


def test_thinking_off_via_chat_template_kwargs(client):
    r = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        max_tokens=20,
        temperature=0,
        extra_body={"chat_template_kwargs": {"thinking": False}},
    )
    m = r.choices[0].message
    assert m.content == "OK" and m.model_extra.get("reasoning_content") is None
    assert [t.id for t in m.tool_calls] == [CALL["id"]]


def test_history_with_non_canonical_tool_call_ids(srv, client):
    """History ids of another form are rewritten to functions.NAME:IDX before the template renders them."""
    msgs = [
        {"role": "user", "content": "find it"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "search:0", "type": "function", "function": {"name": "search", "arguments": '{"q":"a"}'}},
                {"id": "call_0af3", "type": "function", "function": {"name": "my.tool-v2", "arguments": {"x": 1}}},
            ],
        },
        {"role": "tool", "tool_call_id": "search:0", "content": "found"},
        {"role": "tool", "tool_call_id": "call_0af3", "content": "done"},
    ]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, temperature=0)
    tok = KimiTokenizer.from_dir(srv.model_dir)
    ids = encode_chat(tok, msgs, None, {})
    assert r.usage.prompt_tokens == len(ids)
    text = tok.decode(ids)
    # ids rendered as the model was trained on them, functions.NAME:IDX, in the calls and in their results
    assert '<|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>{"q":"a"}<|tool_call_end|>' in text
    assert '<|tool_call_begin|>functions.my.tool-v2:1<|tool_call_argument_begin|>{"x":1}<|tool_call_end|>' in text
    assert "## Return of functions.search:0\nfound" in text and "## Return of functions.my.tool-v2:1\ndone" in text
    assert "call_0af3" not in text and "search:0<" not in text.replace("functions.search:0", "")


# ---- stops ------------------------------------------------------------------------------------------------
def test_stop_strings_tokens_and_hold_back(client):
    kw = dict(model="tiny", prompt=[IM_MIDDLE], max_tokens=40, temperature=0)
    r = client.completions.create(**kw, stop=["Paris", "zzz"])
    c = r.choices[0]
    assert c.text.endswith('{"city":"') and "Paris" not in c.text
    assert c.finish_reason == "stop" and c.model_extra["stop_reason"] == "Paris"
    r = client.completions.create(**kw, stop="Paris", extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].text.endswith('{"city":"Paris')
    r = client.completions.create(**kw, extra_body={"stop_token_ids": [OK]})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == OK
    assert r.choices[0].text == " I think" and r.usage.completion_tokens == 5  # the stop token's text left out
    r = client.completions.create(**kw, extra_body={"stop_token_ids": [OK], "include_stop_str_in_output": True})
    assert r.choices[0].text == " I thinkOK" and r.usage.completion_tokens == 5
    # "thinkOK" spans two generated tokens: " think" must be held back, never streamed.
    chunks = [ch.choices[0] for ch in client.completions.create(**kw, stop=["thinkOK"], stream=True)]
    texts = [ch.text for ch in chunks]
    assert "".join(texts) == " I " and not any("think" in t for t in texts)
    assert chunks[-1].finish_reason == "stop" and chunks[-1].model_extra["stop_reason"] == "thinkOK"


def test_text_held_for_a_stop_string_stays_in_the_reasoning_it_came_from(client):
    """ " think" (end of the reasoning) may begin the stop string "thinkX", so it is held back until "OK" (after
    </think>) shows no match: it must come out as reasoning, not content. A stop string spanning </think> with
    include_stop_str_in_output splits at it. Streamed and not (found by an adversarial tester)."""
    kw = dict(messages=ASK, temperature=0, max_tokens=5)
    for stop, include, want in (
        (["thinkX"], False, (" I think", "OK", "length")),
        ([" thinkOK"], True, (" I think", "OK", "stop")),
        ([" thinkOK"], False, (" I", None, "stop")),
    ):
        extra = {"extra_body": {"include_stop_str_in_output": include}}
        m = client.chat.completions.create(model="tiny", **kw, stop=stop, **extra)
        got = (
            m.choices[0].message.model_extra["reasoning_content"],
            m.choices[0].message.content,
            m.choices[0].finish_reason,
        )
        assert got == want, (stop, include, got)
        reasoning, content, _, reasons, _ = _stream_chat(client, **kw, stop=stop, **extra)
        assert (reasoning, content or None, reasons) == (want[0], want[1], [want[2]]), (stop, include)


def test_min_tokens_and_ignore_eos(client):
    kw = dict(model="tiny", prompt=[IM_MIDDLE], max_tokens=40, temperature=0, logit_bias={str(CB): -10})
    assert client.completions.create(**kw).usage.completion_tokens == 23  # ... Done <|im_end|>
    r = client.completions.create(**kw, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 40
    r = client.completions.create(**kw, extra_body={"min_tokens": 30})
    assert r.usage.completion_tokens >= 30
    r = client.completions.create(**kw, stop=["Done"], extra_body={"min_tokens": 30})
    assert r.usage.completion_tokens >= 30  # stop strings count only after min_tokens
    # EOS's text, kept by skip_special_tokens: false, is left out as vLLM does, unless include_stop_str_in_output
    r = client.completions.create(**kw, extra_body={"skip_special_tokens": False})
    assert r.choices[0].text.endswith("Done") and r.choices[0].finish_reason == "stop"
    r = client.completions.create(**kw, extra_body={"skip_special_tokens": False, "include_stop_str_in_output": True})
    assert r.choices[0].text.endswith("Done<|im_end|>") and r.usage.completion_tokens == 23


# ---- logprobs -------------------------------------------------------------------------------------------
def test_completion_logprobs_and_echo_match_the_sampler(srv, client):
    with KimiClient(srv.zmq_addr, timeout_s=60) as zc:
        outs = list(zc.generate([1000], max_tokens=1, temperature=0.0, logprobs=5))
    g, lp_g = outs[0].token_ids[0], outs[0].logprobs[0]
    r = client.completions.create(model="tiny", prompt=[1000], max_tokens=3, temperature=0, logprobs=5)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs[0] == pytest.approx(lp_g, abs=1e-5)
    for j in range(3):
        assert len(lp.top_logprobs[j]) == 5
        assert lp.token_logprobs[j] == pytest.approx(max(lp.top_logprobs[j].values()), abs=1e-6)  # greedy
        assert all(math.isfinite(v) and v <= 0 for v in lp.top_logprobs[j].values())
    # echo: the prompt's own logprobs, computed on the prompt path, equal what the sampler reported.
    e = client.completions.create(model="tiny", prompt=[1000, g], max_tokens=1, temperature=0, logprobs=1, echo=True)
    el = e.choices[0].logprobs
    assert el.token_logprobs[0] is None and el.token_logprobs[1] == pytest.approx(lp_g, abs=1e-4)
    assert len(el.tokens) == 3 and el.text_offset[:2] == [0, len(el.tokens[0])]
    assert e.choices[0].text.startswith(el.tokens[0] + el.tokens[1])


def test_chat_logprobs(client):
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for t in content:
        assert len(t.top_logprobs) == 2 and math.isfinite(t.logprob) and isinstance(t.bytes, list)
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-6)


# ---- sampling, n, usage -------------------------------------------------------------------------------------
def test_seed_reproducible_and_n_siblings(client):
    # banning the chain's tokens keeps random sampling out of the deterministic chain
    ban = {str(t): -100 for t in CHAIN_TOKENS}
    kw = dict(
        model="tiny",
        prompt=[5, 6, 7],
        max_tokens=8,
        temperature=1.0,
        seed=7,
        n=2,
        logit_bias=ban,
        extra_body={"ignore_eos": True},
    )
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text  # siblings use seed + index
    assert a.usage.completion_tokens == 16 and a.usage.prompt_tokens == 3
    chunks = list(client.completions.create(**{**kw, "n": 3}, stream=True, stream_options={"include_usage": True}))
    finals = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finals == [0, 1, 2]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    greedy = client.completions.create(
        model="tiny",
        prompt=[5, 6, 7],
        max_tokens=6,
        temperature=0,
        presence_penalty=1.5,
        frequency_penalty=1.0,
        extra_body={"repetition_penalty": 1.3, "min_p": 0.1, "top_k": 5},
    )
    assert greedy.usage.completion_tokens >= 1


def test_tiny_temperature_and_top_p_sample_the_greedy_tokens(client):
    """temperature 1e-38 (below 1e-5: greedy) and top_p 1e-300 (rounds to 0 in fp32; the most likely token
    is always kept) give the greedy output; both used to give token id 0 at every step."""
    ban = {str(t): -100 for t in CHAIN_TOKENS}
    kw = dict(
        model="tiny", prompt=[11, 12, 13], max_tokens=6, logit_bias=ban, logprobs=0, extra_body={"ignore_eos": True}
    )
    want = client.completions.create(**kw, temperature=0)
    for extra in (
        dict(temperature=1e-38),
        dict(temperature=1e-300, seed=3),
        dict(temperature=1.0, top_p=1e-300),
        dict(temperature=0.7, top_p=1e-46, seed=9),
    ):
        got = client.completions.create(**kw, **extra)
        assert got.choices[0].logprobs.tokens == want.choices[0].logprobs.tokens, extra
        assert got.choices[0].text == want.choices[0].text, extra


def test_n_siblings_share_the_prompt_kv(srv, client):
    """n = 4: the prompt is computed once; the 3 other choices reuse its 6 full 16-token blocks."""
    prompt = list(range(3000, 3100))  # 100 tokens: 6 full blocks
    before = _metrics(srv)["kimi:prefix_cache_hits_total"]
    r = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=3,
        temperature=0,
        n=4,
        logit_bias={str(t): -100 for t in CHAIN_TOKENS},
        extra_body={"ignore_eos": True},
    )
    hits = _metrics(srv)["kimi:prefix_cache_hits_total"] - before
    assert hits == 3 * 96, hits
    alone = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=3,
        temperature=0,
        logit_bias={str(t): -100 for t in CHAIN_TOKENS},
        extra_body={"ignore_eos": True},
    )
    assert {c.text for c in r.choices} == {alone.choices[0].text}  # greedy: sharing changes no token


def test_cached_tokens_reported(client):
    prompt = list(range(2000, 2040))  # 40 tokens: two full 16-token blocks can be shared
    client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens == 32


BAD = [
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"min_p": 2}, "min_p"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"logprobs": 21}, "logprobs"),
    ({"n": 17}, "n"),
    ({"best_of": 3}, "best_of"),
    ({"echo": "yes"}, "echo"),
    ({"seed": "x"}, "seed"),
    ({"stop_token_ids": [163840]}, "stop_token_ids"),
    ({"suffix": "x"}, "suffix"),
]


@pytest.mark.parametrize("extra,param", BAD, ids=[p for _, p in BAD])
def test_bad_sampling_fields_are_400(srv, extra, param):
    r = httpx.post(
        f"{srv.base_url}/v1/completions",
        headers=_auth(),
        json={"model": "tiny", "prompt": "hi", "max_tokens": 4, **extra},
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"


def test_nan_and_chat_only_fields_are_400(srv):
    r = httpx.post(
        f"{srv.base_url}/v1/completions",
        headers={**_auth(), "content-type": "application/json"},
        content=b'{"model": "tiny", "prompt": "hi", "temperature": NaN}',
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = httpx.post(
        f"{srv.base_url}/v1/chat/completions",
        headers=_auth(),
        json={"model": "tiny", "messages": ASK, "top_logprobs": 2},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


# ---- aborts and metrics ----------------------------------------------------------------------------------
def _wait_idle(srv, timeout_s: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = _metrics(srv)
        if m["kimi:num_requests_running"] == 0 and m["kimi:kv_cache_used_blocks"] == 0:
            return m
        assert time.monotonic() < deadline, f"not idle: {m}"
        time.sleep(0.05)


def test_client_disconnect_aborts_and_frees_kv(srv):
    aborted = '{"finished_reason": "abort"}'
    before = _metrics(srv).get(f"kimi:request_success_total{aborted}", 0)
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 500, "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", f"{srv.base_url}/v1/completions", json={**body, "stream": True}, headers=_auth()) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(x.startswith("data: {") for x in got)
        m = _metrics(srv)
        assert m["kimi:num_requests_running"] == 1 and m["kimi:kv_cache_used_blocks"] >= 1
    _wait_idle(srv)
    with pytest.raises(httpx.ReadTimeout):  # the non-streaming client gives up mid-generation
        httpx.post(f"{srv.base_url}/v1/completions", json=body, headers=_auth(), timeout=1.0)
    m = _wait_idle(srv)
    assert m[f"kimi:request_success_total{aborted}"] == before + 2


def test_metrics_exposition(srv, client):
    client.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0)
    m = _metrics(srv)
    assert m["kimi:prompt_tokens_total"] > 0 and m["kimi:generation_tokens_total"] >= 3
    assert m["kimi:time_to_first_token_seconds_count"] >= 1
    assert m["kimi:inter_token_latency_seconds_count"] >= 2
    assert m["kimi:e2e_request_latency_seconds_count"] >= 1
    assert m["kimi:kv_cache_total_blocks"] == 199
    assert m["kimi:prefix_cache_hits_total"] >= 32  # test_cached_tokens_reported's hit (module order)
    assert m["kimi:num_requests_waiting"] == 0
