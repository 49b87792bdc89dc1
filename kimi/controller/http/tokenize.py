"""`POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info` (vLLM's request and response shapes)."""

from __future__ import annotations

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from kimi.controller.chat import encode_chat
from kimi.controller.http.common import ServerBase, error_response
from kimi.controller.http.protocol import DETOKENIZE_FIELDS, TOKENIZE_FIELDS
from kimi.controller.offload import run_sized
from kimi.controller.validation import BadRequest


class TokenizeAPI(ServerBase):
    """The tokenizer routes (a mixin of OpenAIServer)."""

    async def tokenizer_info(self, request: HTTPRequest) -> Response:
        """`GET /tokenizer_info`: the tokenizer's configuration as vLLM serves it (lm-eval's `remote` tokenizer
        reads `eos_token`, `bos_token`, `pad_token` and `chat_template` from it)."""
        t = self.tokenizer
        return JSONResponse(
            {
                "tokenizer_class": "TikTokenTokenizer",
                "bos_token": t.bos_token,
                "eos_token": t.eos_token,
                "pad_token": t.pad_token,
                "chat_template": t.chat_template,
                "model_max_length": self.engine.max_model_len,
                "vocab_size": t.vocab_size,
            }
        )

    async def tokenize(self, request: HTTPRequest) -> Response:
        """`POST /tokenize` (vLLM's request and response): `prompt` (a string, encoded with control-token strings
        recognised, as vLLM's HF tokenizers do) or chat `messages` (rendered and encoded exactly as
        /v1/chat/completions does) -> `{count, max_model_len, tokens, token_strs}`."""
        try:
            f = await self._body(request)
            has_prompt, has_messages = f.has("prompt"), f.has("messages")
            if has_prompt == has_messages:
                raise BadRequest("give exactly one of 'prompt' and 'messages'", "prompt" if has_prompt else "messages")
            f.bool("add_special_tokens", not has_messages)  # Kimi's tokenizer adds no BOS / EOS either way
            strs = f.bool("return_token_strs", False)
            if has_prompt:
                prompt = f.str("prompt")
                assert prompt is not None
                ids = await run_sized(len(prompt), self.tokenizer.encode, prompt, True)
            else:
                tools, _, _ = self._tool_args(f)
                kwargs = self._template_kwargs(f)
                add_gen, cont = self._generation_prompt_args(f)
                for name, why in (
                    ("chat_template", "the checkpoint's template is used"),
                    ("mm_processor_kwargs", "this server takes text only"),
                ):
                    if f._get(name) is not None:
                        raise BadRequest(f"'{name}' is not supported ({why}); send null or leave it out", name)
                ids = await run_sized(
                    f.body_bytes,
                    encode_chat,
                    self.tokenizer,
                    f._get("messages"),
                    tools,
                    kwargs,
                    None,
                    add_gen,
                    cont,
                )
            f.reject_unknown(None, TOKENIZE_FIELDS)
        except BadRequest as e:
            return error_response(e)
        return JSONResponse(
            {
                "count": len(ids),
                "max_model_len": self.engine.max_model_len,
                "tokens": ids,
                "token_strs": [self._token_str(t) for t in ids] if strs else None,
            }
        )

    async def detokenize(self, request: HTTPRequest) -> Response:
        """`POST /detokenize` (vLLM's request and response): `tokens` (ids in the vocabulary) -> `{prompt}`,
        special tokens included."""
        try:
            f = await self._body(request)
            tokens = f._get("tokens")
            if tokens is None:
                raise BadRequest("'tokens' is required", "tokens")
            ids = f.int_list("tokens", 0, self.vocab_size)
            f.reject_unknown(None, DETOKENIZE_FIELDS)
        except BadRequest as e:
            return error_response(e)
        return JSONResponse({"prompt": self.tokenizer.decode(ids)})
