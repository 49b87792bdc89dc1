"""Turning sampled tokens into client-visible outputs: stop conditions, incremental detokenization, deltas."""

from __future__ import annotations

from kimi.controller.request import Request
from kimi.protocol import RequestOutput, TokenOutput
from kimi.tokenizer import IncrementalDetokenizer, KimiTokenizer


class OutputProcessor:
    """Applies one sampled token to a request and says whether it finished.

    eos_token_ids: the model's EOS ids (config.json, generation_config.json and `<|im_end|>`); they end a
    request unless it asked for ignore_eos. max_model_len caps prompt + output tokens (finish "length").
    """

    def __init__(self, tokenizer: KimiTokenizer, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def start(self, req: Request) -> None:
        req.detokenizer = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=req.skip_special_tokens)

    def append(self, req: Request, out: TokenOutput) -> RequestOutput:
        """Append `out.token_id` to `req`, check stops, and return the delta for the client.

        Sets req.finish_reason ("stop" or "length") when the request ends with this token.
        """
        tok = out.token_id
        req.token_ids.append(tok)
        text = req.detokenizer.push(tok)
        reason = None
        if tok in req.stop.stop_token_ids or (not req.stop.ignore_eos and tok in self.eos_token_ids):
            reason = "stop"
        elif req.num_output_tokens >= req.stop.max_tokens or len(req.token_ids) >= self.max_model_len:
            reason = "length"
        if reason is not None:
            text += req.detokenizer.flush()
            req.finish_reason = reason
        return RequestOutput(
            request_id=req.request_id,
            token_ids=[tok],
            text=text,
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            logprobs=None if out.logprob is None else [out.logprob],
        )

    @staticmethod
    def final(req: Request, finish_reason: str | None, error: str | None = None) -> RequestOutput:
        """A terminal output carrying no token (abort, error)."""
        return RequestOutput(
            request_id=req.request_id,
            token_ids=[],
            text="",
            finished=True,
            finish_reason=finish_reason,
            error=error,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
        )
