"""kimi.controller.http.body._decode_body: a request body's JSON, with the bad values named by their JSON path
(`a[1].b`): over-long integer literals (past Python's int-conversion digit limit) and lone UTF-16 surrogates. The path
is collected on the way out of the walk, so bodies of many elements under long keys are walked once (a 1 MB key over
100k elements here)."""

import sys

import pytest

from kimi.controller.http import body as h
from kimi.controller.validation import BadRequest

LONG = "9" * (sys.get_int_max_str_digits() + 1)


def _param(text: str) -> str | None:
    with pytest.raises(BadRequest) as e:
        h._decode_body(text)
    return e.value.param


@pytest.mark.parametrize(
    "text,path",
    [
        ('{"a": ' + LONG + "}", "a"),
        ('{"a": [1, {"b": [2, -' + LONG + "]}]}", "a[1].b[1]"),
        ('{"x.y": {"[0]": ' + LONG + "}}", "x.y.[0]"),
        ('{"": ' + LONG + "}", ""),
        ("[[[" + LONG + "]]]", "[0][0][0]"),
    ],
)
def test_long_integer_paths(text, path):
    assert _param(text) == path


def test_long_integer_replaced_by_a_later_duplicate_key_is_gone():
    assert h._decode_body('{"max_tokens": ' + LONG + ', "max_tokens": 3}') == {"max_tokens": 3}


def test_one_digit_fewer_parses_as_an_integer():
    assert h._decode_body('{"a": ' + LONG[1:] + "}")["a"] == int(LONG[1:])


def test_malformed_after_a_long_integer_is_malformed_json():
    with pytest.raises(BadRequest, match="not valid JSON"):
        h._decode_body('{"a": ' + LONG + ", }")


def test_surrogate_paths_and_keys():
    assert _param('{"m": [{"c": "ok"}, {"c": "x\\ud800"}]}') == "m[1].c"
    assert _param('{"lb": {"\\udc00": 1}}') == "lb"  # a key: its object
    assert _param('{"lb": {"\\udc00": ' + LONG + "}}") == "lb"  # the surrogate first, never the key in a message
    assert h._decode_body('{"m": ["ok", 1, {"c": "\\ud83d\\ude00"}]}')["m"][2]["c"] == "\U0001f600"  # a pair is fine


def test_walks_of_long_keys_over_many_elements():
    key = "k" * 1_000_000
    assert _param('{"model": "x", "' + key + '": [' + "1," * 100_000 + '"\\ud800"]}') == key + "[100000]"
    assert _param('{"model": "x", "' + key + '": [' + "1," * 100_000 + LONG + "]}") == key + "[100000]"
