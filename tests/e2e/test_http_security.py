"""HTTP hardening of a real `kimi serve --fake-workers` server (kimi/controller/security.py): JSON Content-Type (415),
CORS for --allowed-origins and 403 for other origins, the Host check (DNS rebinding), the request-header deadline
(raw sockets), named errors for over-nested and non-UTF-8 bodies; the ZeroMQ API is unaffected."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlparse

import httpx
import openai
import pytest
from conftest import start_server, stop_server

from kimi.client import KimiClient

ORIGIN = "https://app.example"
BODY = b'{"model": "tiny", "prompt": "hi", "max_tokens": 1}'


@pytest.fixture(scope="module")
def srv(tiny_k26, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("log") / "security.log")
    s = start_server(
        tiny_k26,
        log,
        "--fake-workers",
        "--request-header-timeout",
        "1",
        "--allowed-origins",
        f"{ORIGIN}, https://other.example:8443",
        "--allowed-hosts",
        "api.example,pinned.example:9999",
    )
    yield s
    assert stop_server(s) == 0, s.log()


def _addr(srv) -> tuple[str, int]:
    u = urlparse(srv.base_url)
    assert u.hostname is not None and u.port is not None
    return u.hostname, u.port


def _post(srv, body: bytes = BODY, path: str = "/v1/completions", **headers: str) -> httpx.Response:
    return httpx.post(srv.base_url + path, content=body, headers=headers, timeout=30)


def _prompt_tokens(srv) -> float:
    text = httpx.get(srv.base_url + "/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("kimi:prompt_tokens_total"))


def _is_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    if code is not None:
        assert err["code"] == code
    return err


# ---- Content-Type ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "ctype",
    [
        "application/x-www-form-urlencoded",
        "text/plain",
        "text/plain;charset=UTF-8",
        "multipart/form-data; boundary=x",
        "application/json; charset=latin-1",
        "application/jsonx",
        "json",
    ],
)
def test_post_body_that_is_not_json_is_415(srv, ctype):
    before = _prompt_tokens(srv)
    err = _is_error(_post(srv, **{"Content-Type": ctype}), 415, "unsupported_media_type")
    assert "application/json" in err["message"] or "UTF-8" in err["message"]
    _is_error(_post(srv, path="/v1/chat/completions", **{"Content-Type": ctype}), 415, "unsupported_media_type")
    assert _prompt_tokens(srv) == before  # nothing ran


@pytest.mark.parametrize(
    "ctype",
    [
        None,
        "",
        "application/json",
        "application/json; charset=utf-8",
        'Application/JSON;charset="UTF8"',
        "application/vnd.kimi+json",
    ],
)
def test_json_content_types_and_none_are_accepted(srv, ctype):
    headers = {} if ctype is None else {"Content-Type": ctype}
    r = _post(srv, **headers)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1


def test_curl_form_default_is_refused_but_the_openai_client_works(srv):
    """`curl -d` without `-H 'Content-Type: application/json'` sends a form type: refused, where the openai client
    (which sends application/json) is served."""
    r = httpx.post(srv.base_url + "/v1/completions", data={"model": "tiny", "prompt": "hi"}, timeout=30)
    _is_error(r, 415)
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert out.choices[0].finish_reason in ("stop", "length")


# ---- Origin / CORS ------------------------------------------------------------------------------------------
def test_cors_preflight_for_an_allowed_origin(srv):
    r = httpx.options(
        srv.base_url + "/v1/chat/completions",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
        timeout=10,
    )
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"]
    allowed = r.headers["access-control-allow-headers"].lower()
    assert "authorization" in allowed and "content-type" in allowed


def test_allowed_origin_gets_cors_headers_streamed_and_not(srv):
    h = {"Origin": "https://other.example:8443", "Content-Type": "application/json"}
    r = _post(srv, **h)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://other.example:8443"
    body = b'{"model": "tiny", "prompt": "hi", "max_tokens": 3, "stream": true}'
    with httpx.stream("POST", srv.base_url + "/v1/completions", content=body, headers=h, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "https://other.example:8443"
        assert "data: [DONE]" in r.read().decode()


@pytest.mark.parametrize("origin", ["https://evil.example", "null", "http://app.example", "https://app.example:444"])
def test_other_origins_are_403_preflight_and_request(srv, origin):
    before = _prompt_tokens(srv)
    _is_error(_post(srv, Origin=origin, **{"Content-Type": "application/json"}), 403, "origin_not_allowed")
    _is_error(httpx.get(srv.base_url + "/v1/models", headers={"Origin": origin}, timeout=10), 403)
    r = httpx.options(
        srv.base_url + "/v1/completions",
        headers={"Origin": origin, "Access-Control-Request-Method": "POST"},
        timeout=10,
    )
    _is_error(r, 403, "origin_not_allowed")
    assert "access-control-allow-origin" not in r.headers
    assert _prompt_tokens(srv) == before


# ---- Host ---------------------------------------------------------------------------------------------------
def test_forged_host_is_refused_bound_names_and_allowed_hosts_served(srv):
    port = _addr(srv)[1]
    before = _prompt_tokens(srv)
    for host in (
        "evil.example",
        f"evil.example:{port}",
        "127.0.0.1:1",
        "api.example.evil",
        "pinned.example:9998",
        "[::2]",
        "bad host",
    ):
        _is_error(_post(srv, Host=host), 400, "invalid_host")
        _is_error(httpx.get(srv.base_url + "/v1/models", headers={"Host": host}, timeout=10), 400, "invalid_host")
    assert _prompt_tokens(srv) == before
    for host in (
        f"127.0.0.1:{port}",
        "127.0.0.1",
        f"localhost:{port}",
        f"LOCALHOST.:{port}",
        f"[::1]:{port}",
        "api.example",
        "api.example:80",
        "pinned.example:9999",
    ):
        r = _post(srv, Host=host)
        assert r.status_code == 200, (host, r.text)
    r = httpx.get(srv.base_url + "/health", headers={"Host": "evil.example"}, timeout=10)  # probes by IP
    assert r.status_code == 200


# ---- header deadline ----------------------------------------------------------------------------------------
def _closed_within(s: socket.socket, seconds: float) -> bool:
    """True when the server closes s (EOF or reset) within `seconds`."""
    s.settimeout(seconds)
    try:
        return s.recv(4096) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_half_sent_headers_are_closed_after_the_deadline(srv):
    """200 connections holding half a header, one trickling a byte at a time (slowloris) and one kept alive after a
    response with half of its next header: all are closed after --request-header-timeout (1 s), while a complete
    request on a fresh connection is served meanwhile."""
    addr = _addr(srv)
    socks = []
    try:
        for _ in range(200):
            s = socket.create_connection(addr, timeout=10)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-")
            socks.append(s)
        keep = socket.create_connection(addr, timeout=10)
        socks.append(keep)
        keep.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(BODY) + BODY
        )
        reply = b""
        while b'"usage"' not in reply:
            chunk = keep.recv(65536)
            assert chunk, reply
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 200")
        keep.sendall(b"GET /v1/models HTTP/1.1\r\nHo")
        slow = socket.create_connection(addr, timeout=10)
        socks.append(slow)
        t0 = time.monotonic()
        closed = False
        for b in b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * 200:
            try:
                slow.sendall(bytes([b]))
            except OSError:
                closed = True
                break
            if _closed_within(slow, 0.25):
                closed = True
                break
        assert closed and time.monotonic() - t0 < 30
        assert _post(srv).status_code == 200  # a client that sends its request at once is served
        assert all(_closed_within(s, 30) for s in socks[:200])
        assert _closed_within(keep, 30)
    finally:
        for s in socks:
            s.close()
    assert _post(srv).status_code == 200


# ---- body errors name the field -----------------------------------------------------------------------------
def test_over_nested_and_non_utf8_bodies_name_the_field(srv):
    deep = b'{"model": "tiny", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b', "max_tokens": 1}'
    err = _is_error(_post(srv, deep, "/v1/chat/completions"), 400)
    assert err["param"] == "messages" and "nested too deeply" in err["message"]
    err = _is_error(_post(srv, b"[" * 100_000 + b"]" * 100_000), 400)
    assert err["param"] is None and "nested too deeply" in err["message"]
    bad = b'{"model": "tiny", "messages": [{"role": "user", "content": "caf\xe9"}], "max_tokens": 1}'
    err = _is_error(_post(srv, bad, "/v1/chat/completions"), 400)
    assert err["param"] == "messages[0].content" and "not valid UTF-8" in err["message"]
    err = _is_error(_post(srv, b'{"model": "tiny", "prompt": "hi", "\xff": 1}'), 400)
    assert err["param"] is None  # a key that is not UTF-8 cannot be named (its object is the body)
    assert _post(srv).status_code == 200


def test_zmq_api_is_unaffected(srv):
    with KimiClient(srv.zmq_addr, timeout_s=30) as c:
        outs = list(c.generate("Hello world", max_tokens=3, temperature=0.0))
    assert outs[-1].finished and outs[-1].finish_reason == "length"
