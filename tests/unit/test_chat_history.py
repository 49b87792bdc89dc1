"""Chat history rendering (kimi/controller/chat.py): tool-call ids rewritten to `functions.NAME:IDX` consistently in the
assistant message and its tool results, and prior reasoning (`reasoning_content`, or vLLM's `reasoning`) rendered back
by the template (docs/model-format.md, Chat and tool-call format)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from kimi import tokenizer as tk_mod
from kimi.controller.chat import encode_chat, normalize_tool_call_ids, validate_messages
from kimi.controller.validation import BadRequest
from kimi.tokenizer import KimiTokenizer, default_tokenizer_source, write_tokenizer_files

SYS = "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
GEN = "<|im_assistant|>assistant<|im_middle|>"


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> KimiTokenizer:
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(d)
    return KimiTokenizer.from_dir(d)


def call(call_id: str, name: str, args: str = "{}") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def prompt(tok: KimiTokenizer, msgs: list[dict]) -> str:
    return tok.decode(encode_chat(tok, msgs, None, {}))


def ids_of(msgs: list[dict]) -> list[str]:
    """The tool-call ids and tool_call_ids of messages, in order."""
    out = []
    for m in msgs:
        out += [c["id"] for c in m.get("tool_calls") or ()]
        if m["role"] == "tool":
            out.append(m["tool_call_id"])
    return out


AGENT = [
    {"role": "user", "content": "Weather and time in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [call("call_ab12", "get_weather"), call("search:0", "clock")]},
    {"role": "tool", "tool_call_id": "call_ab12", "content": "Sunny"},
    {"role": "tool", "tool_call_id": "search:0", "content": "12:00"},
    {"role": "assistant", "content": "Sunny, noon."},
    {"role": "user", "content": "And Rome?"},
    # the client reuses `call_ab12` in the next turn (as some do per turn): its result follows the newer call
    {"role": "assistant", "content": "", "tool_calls": [call("call_ab12", "get_weather")]},
    {"role": "tool", "tool_call_id": "call_ab12", "content": "Rain"},
]


def test_foreign_ids_become_functions_name_idx_in_calls_and_results():
    sent = copy.deepcopy(AGENT)
    out = validate_messages(sent)
    assert ids_of(out) == [
        "functions.get_weather:0",
        "functions.clock:1",
        "functions.get_weather:0",
        "functions.clock:1",
        "functions.get_weather:2",
        "functions.get_weather:2",
    ]
    assert sent == AGENT  # the caller's messages are untouched


def test_kimi_ids_are_kept_and_new_ones_avoid_them():
    msgs = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [call("x1", "f"), call("functions.f:1", "f")]},
        {"role": "tool", "tool_call_id": "x1", "content": "a"},
        {"role": "tool", "tool_call_id": "functions.f:1", "content": "b"},
        # an id of the Kimi form that names another function is rewritten too
        {"role": "assistant", "content": None, "tool_calls": [call("functions.f:0", "g"), call("f:7", "f")]},
        {"role": "tool", "tool_call_id": "functions.f:0", "content": "c"},
        {"role": "tool", "tool_call_id": "unknown", "content": "d"},  # names no call: kept
    ]
    out = validate_messages(msgs)
    assert ids_of(out) == [
        "functions.f:0",
        "functions.f:1",
        "functions.f:0",
        "functions.f:1",
        "functions.g:2",
        "functions.f:3",
        "functions.g:2",
        "unknown",
    ]
    assert normalize_tool_call_ids(out) == out  # rewritten ids are kept as they are


def test_rewritten_ids_reach_the_prompt(tok):
    text = prompt(tok, copy.deepcopy(AGENT))
    assert "call_ab12" not in text and "search:0" not in text
    assert text.count("<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>") == 1
    assert "## Return of functions.get_weather:0\nSunny" in text
    assert "## Return of functions.clock:1\n12:00" in text
    assert "<|tool_call_begin|>functions.get_weather:2<|tool_call_argument_begin|>" in text
    assert "## Return of functions.get_weather:2\nRain" in text


def test_reasoning_content_is_rendered_back(tok):
    msgs = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "reasoning_content": "They greet me.", "content": "Hello!"},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "reasoning_content": "Need a tool.", "content": None, "tool_calls": [call("c", "w")]},
        {"role": "tool", "tool_call_id": "c", "content": "Sunny"},
    ]
    assert prompt(tok, msgs) == (
        SYS
        + "<|im_user|>user<|im_middle|>Hi<|im_end|>"
        + "<|im_assistant|>assistant<|im_middle|><think>They greet me.</think>Hello!<|im_end|>"
        + "<|im_user|>user<|im_middle|>Weather?<|im_end|>"
        + "<|im_assistant|>assistant<|im_middle|><think>Need a tool.</think><|tool_calls_section_begin|>"
        + "<|tool_call_begin|>functions.w:0<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>"
        + "<|im_end|><|im_system|>tool<|im_middle|>## Return of functions.w:0\nSunny<|im_end|>"
        + GEN
    )


def test_reasoning_is_an_alias_of_reasoning_content(tok):
    base = [{"role": "user", "content": "Hi"}]
    want = prompt(tok, [*base, {"role": "assistant", "reasoning_content": "R", "content": "A"}])
    assert "<think>R</think>A" in want
    assert prompt(tok, [*base, {"role": "assistant", "reasoning": "R", "content": "A"}]) == want
    both = {"role": "assistant", "reasoning_content": "R", "reasoning": "other", "content": "A"}
    assert prompt(tok, [*base, both]) == want  # reasoning_content wins
    nulls = {"role": "assistant", "reasoning_content": None, "reasoning": "R", "content": "A"}
    assert prompt(tok, [*base, nulls]) == want
    plain = prompt(tok, [*base, {"role": "assistant", "reasoning": None, "content": "A"}])
    assert "<think>" not in plain and plain == prompt(tok, [*base, {"role": "assistant", "content": "A"}])


@pytest.mark.parametrize("key", ["reasoning_content", "reasoning"])
@pytest.mark.parametrize("value", [5, ["x"], {"a": 1}, True])
def test_reasoning_of_another_type_is_a_400_naming_it(tok, key, value):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", key: value, "content": "A"}]
    with pytest.raises(BadRequest) as e:
        encode_chat(tok, msgs, None, {})
    assert e.value.param == f"messages[1].{key}"


@pytest.mark.parametrize("key", ["reasoning_content", "reasoning"])
def test_reasoning_text_never_becomes_control_tokens(tok, key):
    """Reasoning text is message text: a control-token string in it stays characters, and U+F0000 is refused."""
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", key: "x<|im_end|>y", "content": "A"}]
    ids = encode_chat(tok, msgs, None, {})
    im_end = tok.encode("<|im_end|>", allow_special=True)
    assert len(im_end) == 1
    assert ids.count(im_end[0]) == 3  # default system, user, assistant: none from the reasoning
    assert "x<|im_end|>y" in tok.decode(ids)
    msgs[1][key] = "a\U000f0000b"
    with pytest.raises(BadRequest) as e:
        encode_chat(tok, msgs, None, {})
    assert e.value.param == f"messages[1].{key}"


def test_real_vocabulary_reasoning_encodes_as_the_rendered_prompt():
    """With the real vocabulary, a history with reasoning and rewritten ids encodes as encode(rendered prompt,
    allow_special=True), what HF and vLLM feed the model, and a control-token string in the reasoning stays text."""
    src = default_tokenizer_source()
    if src is None:
        pytest.skip("real Kimi vocabulary not available (set KIMI_TOKENIZER_DIR)")
    real = KimiTokenizer.from_dir(src)
    real.chat_template = (Path(tk_mod.__file__).parent / "chat_template.jinja").read_text()
    msgs = [*copy.deepcopy(AGENT[:4]), {"role": "assistant", "reasoning": "Both known.", "content": "Sunny, noon."}]
    rendered = real.apply_chat_template(validate_messages(copy.deepcopy(msgs)), add_generation_prompt=True)
    assert "<think>Both known.</think>Sunny, noon." in rendered and "call_ab12" not in rendered
    assert encode_chat(real, msgs, None, {}) == real.encode(rendered, allow_special=True)
    msgs[-1]["reasoning"] = "a<|im_end|>b"
    im_end = real.encode("<|im_end|>", allow_special=True)[0]
    assert encode_chat(real, msgs, None, {}).count(im_end) == 6  # system, user, assistant, 2 tools, assistant
