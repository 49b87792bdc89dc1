"""`GET /v1/models`, `GET /v1/models/{id}`, `GET /version`."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

import kimi
from kimi.controller.http.common import ServerBase, error_response
from kimi.controller.validation import BadRequest


class ModelsAPI(ServerBase):
    """The model and version routes (a mixin of OpenAIServer)."""

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "kimi",
            "root": self.model_root,
            "parent": None,
            "max_model_len": self.engine.max_model_len,
        }

    async def models(self, request: HTTPRequest) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: HTTPRequest) -> Response:
        """`GET /v1/models/{id}` (the openai client's `models.retrieve`): the served model, else a 404."""
        model_id = request.path_params["model_id"]
        if model_id != self.model_name:
            return error_response(
                BadRequest(
                    f"the model '{model_id}' does not exist; this server serves '{self.model_name}'",
                    None,
                    status=404,
                    code="model_not_found",
                )
            )
        return JSONResponse(self._model_card())

    async def version(self, request: HTTPRequest) -> Response:
        """`GET /version`: `{"version": kimi's package version}` (vLLM's shape)."""
        return JSONResponse({"version": kimi.__version__})
