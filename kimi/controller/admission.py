"""Why the engine refuses a request, as data: the front-ends (HTTP, ZeroMQ) write the message in their own terms.

`AdmissionError` carries the reason, the request field it concerns, the limit and the value compared;
`admission_message(e, max_tokens_field, request_id)` writes the sentence with the field the client sent
(`max_completion_tokens` for `max_tokens`) and the request id the client knows; `admission_param` names the field
(`messages` for a chat prompt, `prompt[i]` for prompt i of a batch). The first three live in kimi.errors and are
re-exported here.
"""

from __future__ import annotations

from kimi.errors import AdmissionError, AdmissionReason, QueueFullError, admission_message

QueueFull = QueueFullError  # the name before kimi.errors

__all__ = ["AdmissionError", "AdmissionReason", "QueueFull", "QueueFullError", "admission_message", "admission_param"]


def admission_param(
    e: AdmissionError, prompt_field: str = "prompt", max_tokens_field: str = "max_tokens"
) -> str | None:
    """The request field an AdmissionError names, in the front-end's terms (`messages` for a chat prompt)."""
    if e.param == "prompt":
        return prompt_field
    if e.param == "max_tokens":
        return max_tokens_field
    return e.param
