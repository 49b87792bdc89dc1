"""Turning sampled tokens into client-visible outputs: stop conditions, incremental detokenization, deltas."""

from __future__ import annotations

from kimi.controller.request import Request
from kimi.controller.stops import StopChecker
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
        """Attach the request's incremental detokenizer and (when it has stop strings) its StopChecker."""
        req.detokenizer = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=req.skip_special_tokens)
        if req.stop.stop:
            req.stop_checker = StopChecker(req.stop.stop, req.stop.include_stop_str_in_output)

    def append(self, req: Request, out: TokenOutput) -> RequestOutput:
        """Append `out.token_id` to `req`, check stops, and return the delta for the client.

        Stops, first match wins: a `stop_token_ids` id (finish "stop", stop_reason = the id); an EOS id
        unless ignore_eos (finish "stop", stop_reason None, as vLLM); a stop string completing in the text
        (finish "stop", stop_reason = the string; the text is cut before it, or after it with
        include_stop_str_in_output; text that may still begin a stop string is held back, never streamed);
        max_tokens or max_model_len (finish "length"). Stop strings are looked for only once the request
        has `min_tokens` output tokens (vLLM's rule); earlier text is streamed as it comes.
        Sets req.finish_reason when the request ends with this token.
        """
        tok = out.token_id
        req.token_ids.append(tok)
        text = req.detokenizer.push(tok)
        reason = None
        stop_reason: str | int | None = None
        if tok in req.stop.stop_token_ids:
            reason, stop_reason = "stop", tok
        elif not req.stop.ignore_eos and tok in self.eos_token_ids:
            reason = "stop"
        elif req.num_output_tokens >= req.stop.max_tokens or len(req.token_ids) >= self.max_model_len:
            reason = "length"
        if reason is not None:
            text += req.detokenizer.flush()
        checker: StopChecker | None = req.stop_checker  # type: ignore[assignment]
        if checker is not None and req.num_output_tokens >= req.stop.min_tokens:
            text, stopped, matched = checker.feed(text)
            if stopped:
                reason, stop_reason = "stop", matched
            elif reason is not None:
                text += checker.flush()
        if reason is not None:
            req.finish_reason = reason
        plp = ptid = ptlp = None
        if out.prompt_logprobs is not None and not req.prompt_logprobs_sent:
            plp, ptid, ptlp = out.prompt_logprobs, out.prompt_top_ids, out.prompt_top_logprobs
            req.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=req.request_id,
            token_ids=[tok],
            text=text,
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            logprobs=None if out.logprob is None else [out.logprob],
            top_ids=None if out.top_ids is None else [out.top_ids],
            top_logprobs=None if out.top_logprobs is None else [out.top_logprobs],
            stop_reason=stop_reason,
            num_cached_tokens=getattr(req, "num_cached_tokens", 0),
            prompt_logprobs=plp,
            prompt_top_ids=ptid,
            prompt_top_logprobs=ptlp,
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
            num_cached_tokens=getattr(req, "num_cached_tokens", 0),
        )
