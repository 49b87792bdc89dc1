"""The request-body walks of kimi.controller.http that name a bad value's field: over-long integer literals (past
Python's int-conversion digit limit) and lone UTF-16 surrogates. Paths come back as `a[1].b` strings; the walks
collect them on the way out, so bodies of many elements under long keys are walked once (a 1 MB key over 100k
elements here)."""

import json
import sys

import pytest

from kimi.controller import http as h

LONG = "9" * (sys.get_int_max_str_digits() + 1)


def _parse(text: str):
    """As the server does: a plain parse, and on the digit-limit error a second one with the stand-in."""
    try:
        return json.loads(text), False
    except json.JSONDecodeError:
        raise
    except ValueError:
        return json.loads(text, parse_int=h._parse_int), True


@pytest.mark.parametrize("text,path", [
    ('{"a": %s}' % LONG, "a"),
    ('{"a": [1, {"b": [2, -%s]}]}' % LONG, "a[1].b[1]"),
    ('{"x.y": {"[0]": %s}}' % LONG, "x.y.[0]"),
    ('{"": %s}' % LONG, ""),
    ('[[[%s]]]' % LONG, "[0][0][0]"),
])
def test_long_integer_paths(text, path):
    body, reparsed = _parse(text)
    assert reparsed
    parts = h._long_int(body)
    assert parts is not None and h._json_path(parts) == path


def test_long_integer_replaced_by_a_later_duplicate_key_is_gone():
    body, reparsed = _parse('{"max_tokens": %s, "max_tokens": 3}' % LONG)
    assert reparsed and body == {"max_tokens": 3} and h._long_int(body) is None


def test_one_digit_fewer_parses_as_an_integer():
    body, reparsed = _parse('{"a": %s}' % LONG[1:])
    assert not reparsed and body["a"] == int(LONG[1:])


def test_surrogate_paths_and_keys():
    assert h._json_path(h._lone_surrogate(json.loads('{"m": [{"c": "ok"}, {"c": "x\\ud800"}]}'))) == "m[1].c"
    assert h._json_path(h._lone_surrogate(json.loads('{"lb": {"\\udc00": 1}}'))) == "lb"  # a key: its object
    assert h._lone_surrogate(json.loads('{"m": ["ok", 1, {"c": "\\ud83d\\ude00"}]}')) is None  # a pair is fine


def test_walks_of_long_keys_over_many_elements():
    key = "k" * 1_000_000
    body = json.loads('{"model": "x", "%s": [%s"\\ud800"]}' % (key, "1," * 100_000))
    assert h._json_path(h._lone_surrogate(body)) == key + "[100000]"
    body, _ = _parse('{"model": "x", "%s": [%s%s]}' % (key, "1," * 100_000, LONG))
    assert h._json_path(h._long_int(body)) == key + "[100000]"
