"""The HTTP side of the serving benchmarks (tools/bench_serving.py): the server's base URL, its API key and the
model to ask for, and the one-line summary of a run.

A base URL may be given as the OpenAI client takes it (`http://host:port/v1`) or without the `/v1`; requests go to
`<root>/v1/...` either way. Without `--model`, the benchmark asks the server for its models (`GET /v1/models`) and
takes the only one; several are an error that names them. httpx is imported only where a request is made.
"""

from __future__ import annotations

from typing import Any

from kimi import envs


def normalize_base_url(url: str) -> str:
    """The server's root URL, without a trailing `/v1` or slash: "http://h:8000/v1/" -> "http://h:8000". Raises
    ValueError for a URL without an http(s) scheme."""
    u = url.strip().rstrip("/")
    if u.endswith("/v1"):
        u = u[: -len("/v1")].rstrip("/")
    if not u.startswith(("http://", "https://")):
        raise ValueError(f"base URL {url!r}: expected http://HOST:PORT or https://HOST:PORT, with or without /v1")
    return u


def default_api_key() -> str | None:
    """$OPENAI_API_KEY, as the OpenAI client reads it; None when unset or empty."""
    return envs.OPENAI_API_KEY.get()


def auth_headers(api_key: str | None) -> dict[str, str]:
    """{"Authorization": "Bearer KEY"}, or nothing without a key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def pick_model(models: Any, root: str) -> str:
    """The one model of a `GET /v1/models` body ({"data": [{"id": ...}, ...]}). Raises ValueError for no model,
    several (naming them: pass one with --model), or a body that is not a model list."""
    try:
        ids = [str(m["id"]) for m in models["data"]]
    except (KeyError, TypeError) as e:
        raise ValueError(f"{root}/v1/models: not an OpenAI model list ({e!r})") from e
    if not ids:
        raise ValueError(f"{root}/v1/models lists no model")
    if len(ids) > 1:
        raise ValueError(f"{root}/v1/models lists {len(ids)} models ({', '.join(ids)}): choose one with --model")
    return ids[0]


def served_model(root: str, api_key: str | None, timeout: float = 30.0) -> str:
    """The server's only model (pick_model of its GET /v1/models). Raises ValueError when the request fails, is
    refused (e.g. 401 without the right --api-key) or lists no single model."""
    import httpx

    try:
        r = httpx.get(f"{root}/v1/models", headers=auth_headers(api_key), timeout=timeout)
    except httpx.HTTPError as e:
        raise ValueError(f"GET {root}/v1/models: {type(e).__name__}: {e}") from e
    if r.status_code != 200:
        raise ValueError(f"GET {root}/v1/models: HTTP {r.status_code}: {r.text[:200]}")
    try:
        body = r.json()
    except ValueError as e:
        raise ValueError(f"GET {root}/v1/models: not JSON ({e})") from e
    return pick_model(body, root)


def summary_line(report: dict) -> str:
    """One line of a bench_serving report: requests, errors, throughput, TTFT p50 and TPOT p50."""

    def ms(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.1f} ms"

    return (
        f"{report['num_requests']} requests, {report['errors']} errors: "
        f"{report['output_token_throughput_per_s']:.0f} output tok/s, {report['request_throughput_per_s']:.2f} req/s, "
        f"TTFT p50 {ms(report['ttft']['p50_ms'])}, TPOT p50 {ms(report['tpot']['p50_ms'])}"
    )
