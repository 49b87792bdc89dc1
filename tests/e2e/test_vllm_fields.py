"""End to end: the request fields and routes that vLLM / SGLang clients send, with the `openai` client against a real
`kimi serve` on the tiny K2.6 checkpoint (the CPU model, so logprobs and prompt logprobs are the model's).

Covered: `stream_options.continuous_usage_stats`, batched `/v1/completions` prompts (strings and token-id lists, with
`n`, `echo`, `logprobs`, streaming), `/tokenize`, `/detokenize`, `/version`, `/tokenizer_info`, the `/v1/models`
card, and the 400s for values kimi cannot honour.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from conftest import start_server, stop_server

import kimi

KEY = "fields-key"
MSGS = [{"role": "user", "content": "What is 1+1?"}]


@pytest.fixture(scope="module")
def srv(tiny_k26, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("log") / "fields.log")
    s = start_server(
        tiny_k26, log, "--max-model-len", "512", "--num-blocks", "200", "--block-size", "16", "--api-key", KEY
    )
    yield s
    assert stop_server(s) == 0, s.log()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key=KEY, max_retries=0, timeout=120)


def _post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{srv.base_url}{path}", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def _get(srv, path: str) -> httpx.Response:
    return httpx.get(f"{srv.base_url}{path}", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)


def _bad(r: httpx.Response, param: str) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"
    return err["message"]


# ---- continuous usage stats ----------------------------------------------------------------------------
def test_continuous_usage_stats_on_completions(client):
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt="Hello there",
            max_tokens=6,
            temperature=0,
            extra_body={"ignore_eos": True},
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 6
    prompt_tokens = chunks[-1].usage.prompt_tokens
    with_choices = [c for c in chunks if c.choices]
    assert with_choices, "no content chunk"
    seen = []
    for c in with_choices:
        assert c.usage is not None, c
        assert c.usage.prompt_tokens == prompt_tokens
        assert c.usage.total_tokens == prompt_tokens + c.usage.completion_tokens
        seen.append(c.usage.completion_tokens)
    assert seen == sorted(seen) and seen[-1] == 6 and seen[0] >= 1


def test_continuous_usage_stats_on_chat_and_without_include_usage(client):
    kw = dict(model="tiny", messages=MSGS, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}, stream=True)
    chunks = list(
        client.chat.completions.create(**kw, stream_options={"include_usage": True, "continuous_usage_stats": True})
    )
    head, body, last = chunks[0], [c for c in chunks[1:] if c.choices], chunks[-1]
    assert head.choices[0].delta.role == "assistant" and head.usage.completion_tokens == 0
    assert all(c.usage is not None for c in body)
    assert body[-1].usage.completion_tokens == 5 == last.usage.completion_tokens
    assert body[-1].choices[0].finish_reason == "length"
    # as vLLM: continuous_usage_stats only adds to include_usage; alone it changes nothing
    plain = list(client.chat.completions.create(**kw, stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is None for c in plain)
    assert "".join(c.choices[0].delta.content or "" for c in plain) == "".join(
        c.choices[0].delta.content or "" for c in body
    )


# ---- batched completions -------------------------------------------------------------------------------
def test_batched_string_prompts_with_n_match_single_requests(client):
    prompts = ["The sky is", "One two three", "Kimi"]
    single = [
        client.completions.create(model="tiny", prompt=p, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
        for p in prompts
    ]
    r = client.completions.create(
        model="tiny", prompt=prompts, n=2, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in r.choices] == list(range(6))
    for c in r.choices:  # index = prompt_i * n + j (OpenAI's order)
        assert c.text == single[c.index // 2].choices[0].text
        assert c.finish_reason == "length"
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in single)
    assert r.usage.completion_tokens == 6 * 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 30


def test_batched_token_id_prompts_echo_and_logprobs(client):
    prompts = [[100, 200, 300], [400, 500, 600, 700, 800]]
    r = client.completions.create(
        model="tiny",
        prompt=prompts,
        max_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
        echo=True,
        logprobs=2,
    )
    assert len(r.choices) == 2
    for c, p in zip(r.choices, prompts):
        one = client.completions.create(
            model="tiny", prompt=p, max_tokens=3, temperature=0, extra_body={"ignore_eos": True}, echo=True, logprobs=2
        ).choices[0]
        assert c.text == one.text
        lp = c.logprobs
        assert len(lp.tokens) == len(p) + 3  # the echoed prompt's tokens, then the generated ones
        assert lp.token_logprobs[0] is None and all(x is not None for x in lp.token_logprobs[1:])
        # float32 on the CPU: the two prompts' rows run in one step here and alone there, and the GEMMs' blocking
        # depends on the row count, so logprobs agree to float32 rounding (a few ulps of the logits), not bit for bit
        want = one.logprobs.token_logprobs
        assert [x is None for x in lp.token_logprobs] == [x is None for x in want]
        got_vals = [x for x in lp.token_logprobs if x is not None]
        assert got_vals == pytest.approx([x for x in want if x is not None], rel=1e-5, abs=1e-5)
        assert lp.text_offset == one.logprobs.text_offset
    assert r.usage.prompt_tokens == 8


def test_batched_stream_equals_non_stream(client):
    prompts = ["alpha beta", "gamma"]
    kw = dict(model="tiny", prompt=prompts, n=2, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    for ch in client.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in full.choices}
    assert reasons == dict.fromkeys(range(4), "length")
    assert usage.prompt_tokens == full.usage.prompt_tokens and usage.completion_tokens == 16


def test_batched_prompt_errors_name_the_prompt(srv):
    base = {"model": "tiny", "max_tokens": 2}
    _bad(_post(srv, "/v1/completions", {**base, "prompt": ["ok", ""]}), "prompt[1]")
    _bad(_post(srv, "/v1/completions", {**base, "prompt": [[1, 2], [3, "x"]]}), "prompt[1]")
    _bad(_post(srv, "/v1/completions", {**base, "prompt": ["ok", 5]}), "prompt[1]")
    _bad(_post(srv, "/v1/completions", {**base, "prompt": [[1], [10**7]]}), "prompt[1]")
    too_long = list(range(1, 600))
    _bad(_post(srv, "/v1/completions", {**base, "prompt": [[1, 2], too_long]}), "prompt[1]")


# ---- tokenizer routes ----------------------------------------------------------------------------------
def test_tokenize_prompt_matches_completions_usage_and_detokenize_round_trips(srv, client):
    text = "Hello world, tokenize me"
    r = _post(srv, "/tokenize", {"model": "tiny", "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["max_model_len"] == 512
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"])
    assert "".join(body["token_strs"]) == text
    done = client.completions.create(model="tiny", prompt=text, max_tokens=1)
    assert done.usage.prompt_tokens == body["count"]
    d = _post(srv, "/detokenize", {"model": "tiny", "tokens": body["tokens"]})
    assert d.status_code == 200 and d.json() == {"prompt": text}
    assert _post(srv, "/tokenize", {"prompt": text}).json()["token_strs"] is None


def test_tokenize_messages_match_chat_usage(srv, client):
    r = _post(srv, "/tokenize", {"model": "tiny", "messages": MSGS})
    assert r.status_code == 200, r.text
    chat = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=1)
    assert chat.usage.prompt_tokens == r.json()["count"]
    no_gen = _post(srv, "/tokenize", {"messages": MSGS, "add_generation_prompt": False}).json()
    assert no_gen["count"] < r.json()["count"]
    assert r.json()["tokens"][: no_gen["count"]] == no_gen["tokens"]


def test_tokenize_control_token_strings_and_eos_for_lm_eval(srv):
    """lm-eval's remote tokenizer takes `eos_token` from /tokenizer_info and its id as /tokenize's first token."""
    info = _get(srv, "/tokenizer_info")
    assert info.status_code == 200
    eos = info.json()["eos_token"]
    assert {"bos_token", "pad_token", "chat_template", "model_max_length"} <= set(info.json())
    assert "im_end" in info.json()["chat_template"]
    ids = _post(srv, "/tokenize", {"prompt": eos, "add_special_tokens": False}).json()["tokens"]
    assert len(ids) == 1, ids
    assert _post(srv, "/detokenize", {"tokens": ids}).json()["prompt"] == eos


def test_tokenizer_route_errors(srv):
    _bad(_post(srv, "/tokenize", {"prompt": "a", "messages": MSGS}), "prompt")
    _bad(_post(srv, "/tokenize", {}), "messages")
    _bad(_post(srv, "/tokenize", {"prompt": 5}), "prompt")
    _bad(_post(srv, "/tokenize", {"prompt": "a", "bogus": 1}), "bogus")
    _bad(_post(srv, "/tokenize", {"messages": MSGS, "chat_template": "{{x}}"}), "chat_template")
    _bad(_post(srv, "/detokenize", {"tokens": [1, 10**7]}), "tokens")
    _bad(_post(srv, "/detokenize", {"tokens": "abc"}), "tokens")
    _bad(_post(srv, "/detokenize", {}), "tokens")
    r = _post(srv, "/tokenize", {"model": "other", "prompt": "a"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert httpx.post(f"{srv.base_url}/tokenize", json={"prompt": "a"}).status_code == 401


def test_version_and_models_card(srv, client):
    assert _get(srv, "/version").json() == {"version": kimi.__version__}
    assert httpx.get(f"{srv.base_url}/version").status_code == 401
    (card,) = client.models.list().data
    extra = card.model_extra or {}
    assert card.id == "tiny"
    assert extra["root"] == srv.model_dir and extra["parent"] is None and extra["max_model_len"] == 512
    assert client.models.retrieve("tiny").model_extra["root"] == srv.model_dir


# ---- prompt_logprobs, return_token_ids -----------------------------------------------------------------
def test_prompt_logprobs_on_completions_match_echo_logprobs(srv, client):
    prompt = [100, 200, 300, 400]
    r = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=2,
        temperature=0,
        echo=True,
        logprobs=1,
        extra_body={"prompt_logprobs": 3},
    )
    c = r.choices[0]
    plp = c.model_extra["prompt_logprobs"]
    assert len(plp) == len(prompt) and plp[0] is None
    for j, entry in enumerate(plp[1:], 1):
        assert len(entry) in (3, 4)  # the prompt token, then the top 3 (the prompt token may be one of them)
        first_key = next(iter(entry))
        assert first_key == str(prompt[j])
        assert entry[first_key]["logprob"] == pytest.approx(c.logprobs.token_logprobs[j], abs=1e-5)
        assert {v["rank"] for v in entry.values()} - {None} == {1, 2, 3}  # the top 3 are ranked 1..3
        assert all(isinstance(v["decoded_token"], str) for v in entry.values())
        # echo's own top_logprobs keep logprobs=1 alternatives although the worker sent prompt_logprobs' top 3
        assert len(c.logprobs.top_logprobs[j]) <= 2
    msg = _bad(
        _post(srv, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "stream": True, "prompt_logprobs": 1}),
        "prompt_logprobs",
    )
    assert "stream" in msg
    _bad(_post(srv, "/v1/completions", {"prompt": prompt, "prompt_logprobs": 21}), "prompt_logprobs")
    _bad(_post(srv, "/v1/completions", {"prompt": prompt, "prompt_logprobs": -1}), "prompt_logprobs")


def test_prompt_logprobs_on_chat(srv, client):
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=1, extra_body={"prompt_logprobs": 0})
    plp = r.model_extra["prompt_logprobs"]
    assert len(plp) == r.usage.prompt_tokens and plp[0] is None
    assert all(len(e) == 1 for e in plp[1:])


def test_return_token_ids_completions_stream_and_not(srv, client):
    kw = dict(model="tiny", prompt="Count: one two", max_tokens=5, temperature=0)
    r = client.completions.create(**kw, extra_body={"return_token_ids": True, "ignore_eos": True})
    c = r.choices[0].model_extra
    assert c["prompt_token_ids"] == _post(srv, "/tokenize", {"prompt": "Count: one two"}).json()["tokens"]
    assert len(c["token_ids"]) == r.usage.completion_tokens == 5
    ids, prompt_ids = [], None
    for ch in client.completions.create(**kw, stream=True, extra_body={"return_token_ids": True, "ignore_eos": True}):
        for x in ch.choices:
            extra = x.model_extra
            if "prompt_token_ids" in extra:
                assert prompt_ids is None, "the prompt's ids come once"
                prompt_ids = extra["prompt_token_ids"]
            ids += extra["token_ids"]
    assert prompt_ids == c["prompt_token_ids"] and ids == c["token_ids"]
    plain = client.completions.create(**kw).choices[0].model_extra
    assert "token_ids" not in plain and "prompt_token_ids" not in plain


def test_return_token_ids_chat(srv, client):
    r = client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=4, temperature=0, extra_body={"return_token_ids": True}
    )
    assert r.model_extra["prompt_token_ids"] == _post(srv, "/tokenize", {"messages": MSGS}).json()["tokens"]
    assert len(r.choices[0].model_extra["token_ids"]) == r.usage.completion_tokens
    heads, ids = [], {0: [], 1: []}
    for ch in client.chat.completions.create(
        model="tiny",
        messages=MSGS,
        max_tokens=4,
        temperature=0,
        n=2,
        stream=True,
        extra_body={"return_token_ids": True},
    ):
        if "prompt_token_ids" in (ch.model_extra or {}):
            heads.append(ch.model_extra["prompt_token_ids"])
        for c in ch.choices:
            ids[c.index] += (c.model_extra or {}).get("token_ids", [])
    assert heads == [r.model_extra["prompt_token_ids"]]  # once per stream
    assert ids[0] == ids[1] == r.choices[0].model_extra["token_ids"]  # greedy: both choices, as not streamed


# ---- chat: prefill, echo, reasoning_effort ---------------------------------------------------------------
PREFILL = [*MSGS, {"role": "assistant", "content": "The answer is"}]


def test_continue_final_message_and_echo(srv, client):
    cont = _post(
        srv, "/tokenize", {"messages": PREFILL, "continue_final_message": True, "add_generation_prompt": False}
    )
    closed = _post(srv, "/tokenize", {"messages": PREFILL, "add_generation_prompt": False})
    assert cont.status_code == 200 and closed.status_code == 200, (cont.text, closed.text)
    c, k = cont.json()["tokens"], closed.json()["tokens"]
    assert len(c) < len(k) and k[: len(c)] == c  # the turn left open: the closing token(s) are missing
    kw = dict(model="tiny", messages=PREFILL, max_tokens=3, temperature=0)
    r = client.chat.completions.create(
        **kw, extra_body={"continue_final_message": True, "add_generation_prompt": False}
    )
    assert r.usage.prompt_tokens == len(c)
    echoed = client.chat.completions.create(
        **kw, extra_body={"continue_final_message": True, "add_generation_prompt": False, "echo": True}
    )
    assert echoed.choices[0].message.content == "The answer is" + (r.choices[0].message.content or "")
    streamed = "".join(
        ch.choices[0].delta.content or ""
        for ch in client.chat.completions.create(
            **kw, stream=True, extra_body={"continue_final_message": True, "add_generation_prompt": False, "echo": True}
        )
        if ch.choices
    )
    assert streamed == echoed.choices[0].message.content
    # echo of a conversation that ends with a user turn adds nothing (vLLM: only the assistant's own text)
    plain = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=3, temperature=0)
    user_echo = client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=3, temperature=0, extra_body={"echo": True}
    )
    assert user_echo.choices[0].message.content == plain.choices[0].message.content
    body = {"messages": PREFILL, "continue_final_message": True, "add_generation_prompt": True, "max_tokens": 1}
    _bad(_post(srv, "/v1/chat/completions", body), "continue_final_message")


def test_reasoning_effort_is_passed_to_the_template(srv, client):
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=1, reasoning_effort="low")
    assert r.choices[0].finish_reason in ("length", "stop")
    _bad(_post(srv, "/v1/chat/completions", {"messages": MSGS, "reasoning_effort": "extreme"}), "reasoning_effort")


# ---- priority, cache_salt ------------------------------------------------------------------------------
def test_priority_needs_the_priority_policy(srv, client):
    client.completions.create(model="tiny", prompt="hi", max_tokens=1, extra_body={"priority": 0})
    msg = _bad(_post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "priority": 1}), "priority")
    assert "--scheduling-policy priority" in msg
    _bad(_post(srv, "/v1/completions", {"prompt": "hi", "priority": 1.5}), "priority")


def test_cache_salt_separates_prefix_cache_entries(srv, client):
    prompt = list(range(1000, 1040))  # 40 tokens: two full 16-token blocks

    def cached(**extra) -> int:
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-a") == 32
    assert cached(cache_salt="tenant-b") == 0
    assert cached() == 0  # the unsalted cache holds none of the salted blocks
    assert cached() == 32
    _bad(_post(srv, "/v1/completions", {"prompt": "hi", "cache_salt": ""}), "cache_salt")
    _bad(_post(srv, "/v1/completions", {"prompt": "hi", "cache_salt": 5}), "cache_salt")


@pytest.fixture(scope="module")
def prio_srv(tiny_k26, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("log") / "priority.log")
    s = start_server(tiny_k26, log, "--max-model-len", "512", "--max-num-seqs", "1", "--scheduling-policy", "priority")
    yield s
    assert stop_server(s) == 0, s.log()


def test_priority_policy_runs_lower_priority_values_first(prio_srv):
    """One running slot: while a long request runs, a request of priority 5 and then one of priority -1 queue;
    the second starts (and ends) first."""
    c = openai.OpenAI(base_url=f"{prio_srv.base_url}/v1", api_key="x", max_retries=0, timeout=120)
    done: list[str] = []

    def run(name: str, prio: int, n: int) -> None:
        c.completions.create(
            model="tiny", prompt=f"{name} go", max_tokens=n, extra_body={"priority": prio, "ignore_eos": True}
        )
        done.append(name)

    long = c.completions.create(
        model="tiny", prompt="long go", max_tokens=60, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(long))  # the long request is running: the slot is taken
    late = threading.Thread(target=run, args=("late", 5, 4))
    late.start()
    deadline = time.monotonic() + 60
    while "kimi:num_requests_waiting 1.0" not in httpx.get(f"{prio_srv.base_url}/metrics").text:
        assert time.monotonic() < deadline, "the priority-5 request never queued"
        time.sleep(0.05)
    urgent = threading.Thread(target=run, args=("urgent", -1, 4))
    urgent.start()
    while "kimi:num_requests_waiting 2.0" not in httpx.get(f"{prio_srv.base_url}/metrics").text:
        assert time.monotonic() < deadline, "the priority -1 request never queued"
        time.sleep(0.05)
    for _ in long:  # the long request ends; then the queued two run one at a time
        pass
    late.join(120)
    urgent.join(120)
    assert done == ["urgent", "late"]


# ---- the declared request Structs ----------------------------------------------------------------------
def _defaults(struct) -> dict:
    """Every field of a request Struct that has a non-null default, at that default."""
    names = struct.__struct_fields__
    defaults = dict(zip(names[len(names) - len(struct.__struct_defaults__) :], struct.__struct_defaults__))
    return {k: v for k, v in defaults.items() if v is not None and not callable(v)}


def test_every_declared_field_at_its_default_is_accepted(srv):
    from kimi.controller.http.protocol import ChatCompletionRequest, CompletionRequest

    body = {**_defaults(CompletionRequest), "prompt": "hi", "max_tokens": 2}
    r = _post(srv, "/v1/completions", body)
    assert r.status_code == 200, (r.text, body)
    body = {**_defaults(ChatCompletionRequest), "messages": MSGS, "max_tokens": 2}
    r = _post(srv, "/v1/chat/completions", body)
    assert r.status_code == 200, (r.text, body)


def test_extensions_other_than_their_noop_value_are_400(srv):
    from kimi.controller.http.protocol import CHAT_FIELDS, COMPLETION_FIELDS, NOOP_VALUES, NULL_ONLY

    other = {bool: lambda v: not v, float: lambda v: v + 0.5, list: lambda v: [1]}
    for name, allowed in NOOP_VALUES.items():
        if len(allowed) > 1 and all(isinstance(a, bool) for a in allowed):
            continue  # add_special_tokens: either value is accepted
        bad = other[type(allowed[0])](allowed[0])
        if name in COMPLETION_FIELDS:
            _bad(_post(srv, "/v1/completions", {"prompt": "hi", name: bad}), name)
        if name in CHAT_FIELDS:
            _bad(_post(srv, "/v1/chat/completions", {"messages": MSGS, name: bad}), name)
    for name in NULL_ONLY:
        value = {"truncate_prompt_tokens": 5}.get(name, "x")
        if name in COMPLETION_FIELDS:
            _bad(_post(srv, "/v1/completions", {"prompt": "hi", name: value}), name)
        if name in CHAT_FIELDS:
            _bad(_post(srv, "/v1/chat/completions", {"messages": MSGS, name: value}), name)
    _bad(_post(srv, "/tokenize", {"prompt": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]}), "tools")


def test_openapi_json_is_generated_from_the_structs(srv):
    from kimi.controller.http.openapi import openapi_document

    r = _get(srv, "/openapi.json")
    assert r.status_code == 200
    assert r.json() == openapi_document("tiny")
    assert "continuous_usage_stats" in r.json()["components"]["schemas"]["StreamOptions"]["properties"]
    assert httpx.get(f"{srv.base_url}/openapi.json").status_code == 401


def test_zmq_priority_and_cache_salt_follow_the_http_rules(srv, prio_srv):
    """The ZeroMQ API reads priority and cache_salt through the same params module: the same refusal under fcfs,
    the same salted prefix cache, and priority accepted under the priority policy."""
    from kimi.client import KimiClient, KimiError

    prompt = list(range(2000, 2040))
    with KimiClient(srv.zmq_addr, timeout_s=60) as c:
        with pytest.raises(KimiError, match="--scheduling-policy priority"):
            list(c.generate(prompt, max_tokens=1, priority=2))
        first = list(c.generate(prompt, max_tokens=1, cache_salt="zmq-salt"))
        again = list(c.generate(prompt, max_tokens=1, cache_salt="zmq-salt"))
        other = list(c.generate(prompt, max_tokens=1, cache_salt="zmq-other"))
    assert (first[-1].num_cached_tokens, again[-1].num_cached_tokens, other[-1].num_cached_tokens) == (0, 32, 0)
    with KimiClient(prio_srv.zmq_addr, timeout_s=60) as c:
        outs = list(c.generate(prompt, max_tokens=2, priority=-5, ignore_eos=True))
    assert outs[-1].finished and outs[-1].error is None and outs[-1].num_output_tokens == 2


def test_large_bodies_decode_through_the_structs_with_the_same_outcomes(srv):
    """Bodies of 1 KiB or more are decoded by the route's Struct (msgspec), smaller ones by json.loads: the answers,
    and every error's param and message, are the same either way."""
    from kimi.controller.http.common import STRUCT_DECODE_MIN_BYTES

    pad = "x" * STRUCT_DECODE_MIN_BYTES  # `user` is accepted and unused: it only makes the body large

    def both(path: str, body: dict) -> tuple[httpx.Response, httpx.Response]:
        small = _post(srv, path, body)
        large = _post(srv, path, {**body, "user": pad})
        assert len(json.dumps({**body, "user": pad})) >= STRUCT_DECODE_MIN_BYTES
        return small, large

    ok = {"prompt": [100, 200, 300], "max_tokens": 4, "temperature": 0, "logprobs": 1, "n": 2, "seed": 3}
    small, large = both("/v1/completions", ok)
    assert small.status_code == large.status_code == 200
    assert [c["text"] for c in small.json()["choices"]] == [c["text"] for c in large.json()["choices"]]
    chat = {"messages": MSGS, "max_tokens": 3, "temperature": 0, "stream_options": {"include_usage": True}}
    small, large = both("/v1/chat/completions", {**chat, "stream": True})
    assert small.status_code == large.status_code == 200 and small.text.count("data:") == large.text.count("data:")
    bad = [
        ("/v1/completions", {"prompt": "a", "frobnicate": 1}),
        ("/v1/completions", {"prompt": "a", "tools": []}),
        ("/v1/completions", {"prompt": "a", "temperature": 3}),
        ("/v1/completions", {"prompt": "a", "max_tokens": True}),
        ("/v1/completions", {"prompt": "a", "top_k": 1.0}),
        ("/v1/completions", {"prompt": "a", "stop_token_ids": [-1]}),
        ("/v1/completions", {"prompt": "a", "seed": 2**64}),
        ("/v1/completions", {"prompt": [1, "b"]}),
        ("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": True}}),
        ("/v1/completions", {"prompt": "a", "stream": True, "stream_options": {"bogus": True}}),
        ("/v1/completions", {"prompt": "a", "use_beam_search": True}),
        ("/v1/completions", {"prompt": "a", "min_tokens": 20, "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": []}),
        ("/v1/chat/completions", {"messages": MSGS, "suffix": "x"}),
        ("/v1/chat/completions", {"messages": MSGS, "reasoning_effort": "max"}),
        ("/v1/chat/completions", {"messages": MSGS, "guided_json": {"type": "nope"}}),
    ]
    for path, body in bad:
        small, large = both(path, body)
        assert small.status_code == large.status_code == 400, (body, small.text, large.text)
        assert small.json() == large.json(), body
    raw = '{"prompt": "a", "max_tokens": 2, "temperature": NaN, "user": "' + pad + '"}'  # json's literal: not finite
    r = httpx.post(
        f"{srv.base_url}/v1/completions",
        content=raw,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
