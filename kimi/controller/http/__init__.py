"""OpenAI-compatible HTTP routes (Starlette), served by uvicorn inside the controller's event loop.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (both non-streaming and SSE streaming ending
with `data: [DONE]`), `GET /v1/models`, `POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`, `GET /version`,
`GET /metrics` (Prometheus), `GET /health` ("loading" with 503 until the workers are ready). Every accepted field, its
range and what is rejected: docs/api.md.

- Honor or reject: a field kimi implements is honoured; one that vLLM / SGLang clients send at its no-op value is
  accepted; any other value is a 400 in the OpenAI error schema whose `param` names it (kimi.controller.validation,
  kimi.controller.params); an accepted request always ends with a finish_reason or an error.
- `n > 1` runs n sibling requests with the same prompt (ids `<id>-0` .. `<id>-{n-1}`); the prefix cache
  shares the prompt's KV between them. With a seed, sibling i uses seed + i.
- A client that disconnects (streaming or not) has all its requests aborted at once (their KV blocks are
  freed before the next step is planned).
- `api_key`: every route but /health needs `Authorization: Bearer <key>` (401 otherwise).
- Request bodies larger than `max_body_bytes` get a 413 (read no further).

Modules: server (the app, routes, authentication), completions, chat, tokenize, models (one per endpoint), common
(what they share), streaming (SSE), body (JSON bodies), protocol (the request Structs: every accepted field), openapi
(`/openapi.json` from them).
"""

from kimi.controller.http.server import OpenAIServer

__all__ = ["OpenAIServer"]
