"""kimi.controller.params (the one way request fields become SamplingParams / StopParams, for HTTP and ZeroMQ) and
kimi.controller.admission (admission errors as data, the message written by the front-end)."""

from __future__ import annotations

import pytest

from kimi.controller.admission import AdmissionError, AdmissionReason, QueueFull, admission_message, admission_param
from kimi.controller.params import sampling_params
from kimi.controller.validation import BadRequest, Fields

EOS = (163585, 163586)


def params(body: dict, **kw):
    args = dict(vocab_size=1000, eos_token_ids=EOS, logprobs=None, prompt_logprobs=-1, max_tokens_default=16)
    args.update(kw)
    return sampling_params(Fields(body), **args)


def test_defaults_and_values():
    rp = params({})
    assert rp.stop.max_tokens == 16 and rp.max_tokens_field == "max_tokens" and rp.skip_special_tokens
    assert rp.sampling.temperature == 1.0 and rp.sampling.num_logprobs == -1 and rp.sampling.prompt_logprobs == -1
    rp = params(
        {"temperature": 0, "top_k": -1, "stop": "x", "stop_token_ids": [5], "min_tokens": 2, "max_tokens": 9},
        logprobs=3,
        prompt_logprobs=2,
    )
    assert rp.sampling.greedy and rp.sampling.top_k == 0 and rp.sampling.num_logprobs == 3
    assert rp.sampling.prompt_logprobs == 2 and rp.stop.stop == ("x",) and rp.stop.max_tokens == 9
    assert rp.sampling.min_tokens_block_ids == sorted({5, *EOS})  # stop ids and EOS blocked until min_tokens


def test_max_completion_tokens_is_named_when_it_is_the_field_sent():
    rp = params({"max_completion_tokens": 7})
    assert rp.stop.max_tokens == 7 and rp.max_tokens_field == "max_completion_tokens"
    assert params({"max_tokens": 7, "max_completion_tokens": 7}).max_tokens_field == "max_tokens"
    with pytest.raises(BadRequest) as e:
        params({"max_tokens": 7, "max_completion_tokens": 8})
    assert e.value.param == "max_completion_tokens"
    with pytest.raises(BadRequest) as e:
        params({"max_completion_tokens": 3, "min_tokens": 4})
    assert e.value.param == "min_tokens" and "max_completion_tokens (3)" in e.value.message


def test_the_first_bad_field_in_reading_order_is_reported():
    with pytest.raises(BadRequest) as e:
        params({"stop": 5, "temperature": 9})
    assert e.value.param == "temperature"
    with pytest.raises(BadRequest) as e:
        params({"max_tokens": 0, "stop_token_ids": [10**6]})
    assert e.value.param == "stop_token_ids"


def test_admission_errors_carry_data_and_the_front_end_names_its_field():
    e = AdmissionError(AdmissionReason.CONTEXT_OVERFLOW, "max_tokens", limit=512, value=600, prompt_tokens=20)
    assert (e.reason, e.limit, e.value, e.prompt_tokens) == (AdmissionReason.CONTEXT_OVERFLOW, 512, 600, 20)
    assert str(e) == (
        "this model's maximum context length is 512 tokens; the request has 20 prompt tokens and max_tokens asks "
        "for 600 more"
    )
    msg = admission_message(e, "max_completion_tokens")
    assert "max_completion_tokens asks for 600 more" in msg and "max_tokens" not in msg
    assert admission_param(e, "messages", "max_completion_tokens") == "max_completion_tokens"
    p = AdmissionError(AdmissionReason.PROMPT_TOO_LONG, "prompt", limit=512, value=512)
    assert admission_param(p, "messages") == "messages" and "the prompt has 512 tokens" in str(p)
    d = AdmissionError(AdmissionReason.DUPLICATE_ID, "request_id", request_id="zmq-ab-r1")
    assert str(d) == "request id 'zmq-ab-r1' is already in use"
    assert admission_message(d, request_id="r1") == "request id 'r1' is already in use"
    q = QueueFull(AdmissionReason.QUEUE_FULL, None, limit=4)
    assert q.retry_after_s == 1 and "(4 requests)" in str(q)
    kv = AdmissionError(AdmissionReason.KV_OVERFLOW, "max_tokens", limit=304, value=300, prompt_tokens=10)
    assert admission_message(kv, "max_completion_tokens") == (
        "prompt (10 tokens) + max_completion_tokens (300) exceeds the KV cache capacity of 304 tokens"
    )
