"""kimi.controller.security's rules (Host, Origin, Content-Type) and kimi.controller.body_errors' field naming, without
a server (tests/e2e/test_http_security.py serves them)."""

from __future__ import annotations

import pytest

from kimi.controller.body_errors import deepest_field, invalid_utf8_path
from kimi.controller.security import SecurityConfig, json_content_type_error, split_list


def test_loopback_bind_serves_loopback_names_with_its_port_only():
    c = SecurityConfig("127.0.0.1", 8000)
    for host in ("127.0.0.1", "127.0.0.1:8000", "localhost:8000", "LocalHost", "[::1]:8000", "localhost.:8000"):
        assert c.host_allowed(host), host
    for host in ("evil.example", "evil.example:8000", "127.0.0.1:8001", "127.0.0.2", "[::1", "a:b:c", "x:0", ""):
        assert not c.host_allowed(host), host
    assert c.host_allowed(None)  # HTTP/1.0 without Host


def test_wildcard_bind_serves_any_host_unless_allowed_hosts_are_given():
    assert SecurityConfig("0.0.0.0", 80).host_allowed("anything.example:1234")
    assert SecurityConfig("::", 80).host_allowed("10.1.2.3")
    c = SecurityConfig("0.0.0.0", 80, allowed_hosts=("api.example", "pinned.example:9999"))
    assert c.host_allowed("api.example:443") and c.host_allowed("pinned.example:9999") and c.host_allowed("localhost")
    assert not c.host_allowed("pinned.example") and not c.host_allowed("10.1.2.3:80")
    assert SecurityConfig("127.0.0.1", 80, allowed_hosts=("*",)).host_allowed("evil.example")


def test_specific_address_bind():
    c = SecurityConfig("10.0.0.5", 8000)
    assert c.host_allowed("10.0.0.5:8000") and not c.host_allowed("localhost:8000")
    assert SecurityConfig("::1", 8000).host_allowed("[::1]:8000")


def test_origins_exact_case_insensitive_or_any():
    c = SecurityConfig(allowed_origins=("https://App.example",))
    assert c.origin_allowed("https://app.example") and c.origin_allowed("HTTPS://APP.EXAMPLE/")
    assert not c.origin_allowed("http://app.example") and not c.origin_allowed("null")
    assert SecurityConfig(allowed_origins=("*",)).origin_allowed("null")
    assert not SecurityConfig().origin_allowed("http://127.0.0.1:8000")
    assert split_list(" a, b ,,") == ("a", "b") and split_list(None) == ()


@pytest.mark.parametrize(
    "ctype,ok",
    [
        (None, True),
        ("  ", True),
        ("application/json", True),
        ("application/json;charset=utf-8", True),
        ("application/problem+json; charset=UTF8", True),
        ("application/json; charset=iso-8859-1", False),
        ("application/x-www-form-urlencoded", False),
        ("text/plain", False),
        ("text/json", False),
    ],
)
def test_json_content_types(ctype, ok):
    assert (json_content_type_error(ctype) is None) == ok


@pytest.mark.parametrize(
    "raw,path",
    [
        (b'{"prompt": "caf\xe9"}', "prompt"),
        (b'{"a": 1, "messages": [{"role": "user"}, {"content": ["x", "\xff"]}]}', "messages[1].content[1]"),
        (b'{"a": {"k\xff": 1}}', "a"),
        (b'{"a": 1}\xff', None),
        (b'"\xff"', None),
    ],
)
def test_invalid_utf8_path(raw, path):
    assert invalid_utf8_path(raw) == path


def test_deepest_field():
    assert deepest_field('{"a": [[1]], "b": {"c": [[[["]]]]"]]]], "d": 1}') == "b"
    assert deepest_field('{"a": 1, "b": "[[[["}') is None
    assert deepest_field("[[[[]]]]") is None
    assert deepest_field('{"x": {"y": [' * 3 + "]}" * 3 + "}") == "x"
