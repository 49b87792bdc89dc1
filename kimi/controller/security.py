"""HTTP hardening around the OpenAI app: Host and Origin checks (DNS rebinding, cross-site requests), CORS for the
origins the operator allows, the JSON Content-Type of POST bodies, and a deadline for a request's headers.

`secure_app(app, config)` wraps the ASGI app (outside the API-key check, so a CORS preflight, which carries no
credentials, is answered); `header_timeout_protocol(seconds)` is the uvicorn HTTP protocol class to serve it with.
Every refusal is an OpenAI-schema error (`{"error": {message, type, param, code}}`). docs/api.md, "Server flags
(security and limits)", documents the rules.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

_WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::", "[::]"})
_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
_JSON_CHARSETS = frozenset({"utf-8", "utf8"})


def split_list(value: str | None) -> tuple[str, ...]:
    """A comma-separated flag value -> its non-empty, stripped items (`"a, b,"` -> `("a", "b")`)."""
    return tuple(x.strip() for x in (value or "").split(",") if x.strip())


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _split_host(value: str) -> tuple[str, int | None] | None:
    """`name[:port]` / `[v6][:port]` -> (lower-case name without brackets or a trailing dot, port or None); None when
    malformed."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        name, rest = value[1:end], value[end + 1 :]
        if rest and not rest.startswith(":"):
            return None
        port_text = rest[1:] if rest else None
    else:
        name, sep, port_text_ = value.rpartition(":")
        if not sep or ":" in name:  # no port, or a bare IPv6 address
            name, port_text = value, None
        else:
            port_text = port_text_
    if port_text is not None and not (port_text.isascii() and port_text.isdigit() and 0 < int(port_text) < 65536):
        return None
    name = name.rstrip(".")
    return (name, int(port_text) if port_text is not None else None) if name else None


@dataclass(frozen=True)
class SecurityConfig:
    """What `secure_app` lets through.

    bind_host, port: the HTTP bind address (`--host`, `--port`). allowed_hosts: `--allowed-hosts` entries (`name`
    matches any port, `name:port` that port only; `*` any Host). allowed_origins: `--allowed-origins` entries (exact
    `scheme://host[:port]` origins; `*` any origin).

    Host rule: bound to a wildcard address (0.0.0.0, ::) with no allowed_hosts, any Host is served; otherwise the Host
    must name the bound address or, bound to loopback or a wildcard, localhost / 127.0.0.1 / [::1] (with the bound port
    or none), or match an allowed_hosts entry. A request without a Host header (HTTP/1.0) is served.
    """

    bind_host: str = "127.0.0.1"
    port: int = 8000
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()

    def any_host(self) -> bool:
        """True when every Host header is served."""
        return "*" in self.allowed_hosts or (self.bind_host in _WILDCARD_BINDS and not self.allowed_hosts)

    def host_allowed(self, host: str | None) -> bool:
        """Whether a request with this Host header value is served (None: the request has none)."""
        if host is None or self.any_host():
            return True
        got = _split_host(host)
        if got is None:
            return False
        name, port = got
        own = {self.bind_host.strip("[]").lower()}
        if self.bind_host in _WILDCARD_BINDS or _is_loopback(self.bind_host):
            own |= _LOOPBACK_NAMES
        if name in own and port in (None, self.port):
            return True
        for entry in self.allowed_hosts:
            want = _split_host(entry)
            if want is not None and want[0] == name and want[1] in (None, port):
                return True
        return False

    def origin_allowed(self, origin: str) -> bool:
        """Whether a request carrying this Origin header is served (scheme and host compared case-insensitively)."""
        if "*" in self.allowed_origins:
            return True
        origin = origin.strip().lower().rstrip("/")
        return any(origin == o.strip().lower().rstrip("/") for o in self.allowed_origins)


def _error(status: int, message: str, code: str, path: str = "") -> JSONResponse:
    """The refusal in the route's error schema: Anthropic's on the /v1/messages routes, else OpenAI's."""
    if path.startswith("/v1/messages"):
        kind = "permission_error" if status == 403 else "invalid_request_error"
        return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status_code=status)
    return JSONResponse(
        {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}},
        status_code=status,
    )


def _header(scope: Any, name: bytes) -> str | None:
    for k, v in scope.get("headers", ()):
        if k == name:
            return str(v.decode("latin-1"))
    return None


def json_content_type_error(content_type: str | None) -> str | None:
    """Why a POST body with this Content-Type is refused (415), or None when it is read as JSON.

    Accepted: no Content-Type or an empty one (what Python's `requests` / `httpx` send for raw bytes; FastAPI, and so
    vLLM, read such bodies as JSON), `application/json` and `application/*+json`, with no charset or UTF-8. Refused:
    anything else, such as `application/x-www-form-urlencoded` (what `curl -d` sends without `-H`) or `text/plain`
    (which a browser form may send cross-site without a preflight).
    """
    if content_type is None or not content_type.strip():
        return None
    media, *params = (p.strip() for p in content_type.split(";"))
    kind, _, sub = media.lower().partition("/")
    if kind != "application" or not (sub == "json" or sub.endswith("+json")):
        return (
            f"Content-Type {media!r} is not supported: send the body as JSON with 'Content-Type: application/json' "
            "(curl -d without -H sends application/x-www-form-urlencoded)"
        )
    for p in params:
        key, _, value = p.partition("=")
        if key.strip().lower() == "charset" and value.strip().strip('"').lower() not in _JSON_CHARSETS:
            return f"charset {value.strip()!r} is not supported: the body must be UTF-8 JSON"
    return None


class _Guard:
    """Host check, Origin check and POST Content-Type check, in that order, around `app`."""

    def __init__(self, app: Any, config: SecurityConfig) -> None:
        self.app = app
        self.config = config

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cfg = self.config
        if scope["path"] != "/health" and not cfg.host_allowed(_header(scope, b"host")):
            host = _header(scope, b"host")
            msg = f"Host {host!r} is not served here (start the server with --allowed-hosts to allow it)"
            await _error(400, msg, "invalid_host", scope.get("path", ""))(scope, receive, send)
            return
        origin = _header(scope, b"origin")
        if origin is not None and not cfg.origin_allowed(origin):
            msg = f"cross-origin requests from {origin!r} are not allowed (start the server with --allowed-origins)"
            await _error(403, msg, "origin_not_allowed", scope.get("path", ""))(scope, receive, send)
            return
        if scope["method"] == "POST":
            why = json_content_type_error(_header(scope, b"content-type"))
            if why is not None:
                await _error(415, why, "unsupported_media_type", scope.get("path", ""))(scope, receive, send)
                return
        await self.app(scope, receive, send)


def secure_app(app: Any, config: SecurityConfig) -> Any:
    """`app` behind the checks of `SecurityConfig`: a Host not served is a 400 (`code: "invalid_host"`; /health is
    exempt, for probes that address the server by IP), an Origin header not allowed a 403
    (`code: "origin_not_allowed"`; preflights too), a POST whose Content-Type is not JSON a 415
    (`json_content_type_error`). Allowed origins get CORS headers and their preflight `OPTIONS` answered (Starlette's
    CORSMiddleware: methods GET / POST, any request header, no credentials)."""
    inner = app
    if config.allowed_origins:
        inner = CORSMiddleware(
            app,
            allow_origins=list(config.allowed_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["*"],
            expose_headers=["Retry-After"],
        )
    return _Guard(inner, config)


def header_timeout_protocol(timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's h11 HTTP protocol with a deadline for request headers: a connection whose request line and headers
    are not all received within `timeout_s` seconds of its opening (or, kept alive, of the previous response's end)
    is closed. The deadline is not moved by partial data, so headers sent a byte at a time (slowloris) hold a
    connection no longer than a silent client does. Bodies have their own deadline (`--request-body-timeout`)."""

    class HeaderTimeoutH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _header_cycle: Any = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._header_timer is not None and self.cycle is not self._header_cycle:  # headers complete
                self._cancel_header_timer()

        def on_response_complete(self) -> None:
            cycle = self.cycle
            super().on_response_complete()
            if self.cycle is cycle and not self.transport.is_closing():  # no pipelined request began
                self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            self._header_cycle = self.cycle
            self._header_timer = self.loop.call_later(timeout_s, self._on_header_timeout)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _on_header_timeout(self) -> None:
            self._header_timer = None
            if self.cycle is self._header_cycle and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutH11Protocol


def origins_and_hosts_summary(config: SecurityConfig) -> Iterable[str]:
    """Log lines describing the Host / Origin policy (for start-up)."""
    if config.any_host():
        yield "HTTP: any Host header is served (bound to a wildcard address without --allowed-hosts)"
    if config.allowed_origins:
        yield f"HTTP: CORS allowed for {', '.join(config.allowed_origins)}"
