"""Turning sampled tokens into client-visible outputs: stop conditions, incremental detokenization, deltas."""

from __future__ import annotations

import codecs

from kimi.controller.request import Request
from kimi.controller.stops import StopChecker
from kimi.protocol import RequestOutput, TokenOutput
from kimi.tokenizer import KimiTokenizer


class FastDetokenizer:
    """`kimi.tokenizer.IncrementalDetokenizer` with a per-token shortcut; the same text, token for token.

    `texts[i]` is token i's text when its bytes are complete, valid UTF-8 on their own ("" for a skipped
    special token, an empty or unknown entry), else None. While the UTF-8 decoder holds no partial
    character, such a token's text is exactly what the incremental decoder would return, so `push` returns
    it without running the decoder (most tokens of most text); otherwise (a token ending mid-character, or
    one that completes a held character) it runs the same incremental UTF-8 decoder (errors="replace") as
    IncrementalDetokenizer. tests/unit/test_controller_fast_paths.py checks the equality on random streams.
    """

    __slots__ = ("_decoder", "_skip", "_table", "_texts")

    def __init__(self, tokenizer: KimiTokenizer, texts: list[str | None], skip_special_tokens: bool = True) -> None:
        self._texts = texts
        self._table = tokenizer._table
        self._skip = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    @staticmethod
    def texts(tokenizer: KimiTokenizer, skip_special_tokens: bool) -> list[str | None]:
        """The per-token text table for `tokenizer` (build once, share between requests)."""
        skip = tokenizer.special_ids if skip_special_tokens else frozenset()
        out: list[str | None] = []
        for i, b in enumerate(tokenizer._table):
            if not b or i in skip:
                out.append("")
                continue
            try:
                out.append(b.decode("utf-8"))
            except UnicodeDecodeError:
                out.append(None)
        return out

    def push(self, token_id: int) -> str:
        """Add one token; return the text completed by it (possibly "")."""
        dec = self._decoder
        if not dec.buffer:  # no partial character held
            if 0 <= token_id < len(self._texts):
                text = self._texts[token_id]
                if text is not None:
                    return text
            else:
                return ""
        if token_id in self._skip or not (0 <= token_id < len(self._table)):
            return ""
        b = self._table[token_id]
        return dec.decode(b, final=False) if b else ""

    def flush(self) -> str:
        """End of stream: return what is left (an incomplete trailing character becomes U+FFFD)."""
        return self._decoder.decode(b"", final=True)


class OutputProcessor:
    """Applies one sampled token to a request and says whether it finished.

    eos_token_ids: the model's EOS ids (config.json, generation_config.json and `<|im_end|>`); they end a
    request unless it asked for ignore_eos. max_model_len caps prompt + output tokens (finish "length").
    """

    def __init__(self, tokenizer: KimiTokenizer, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        # skip_special_tokens -> FastDetokenizer.texts (the default's built now, not on the first request)
        self._texts: dict[bool, list[str | None]] = {True: FastDetokenizer.texts(tokenizer, True)}

    def start(self, req: Request) -> None:
        """Attach the request's incremental detokenizer and (when it has stop strings) its StopChecker."""
        skip = bool(req.skip_special_tokens)
        texts = self._texts.get(skip)
        if texts is None:
            texts = self._texts[skip] = FastDetokenizer.texts(self.tokenizer, skip)
        req.detokenizer = FastDetokenizer(self.tokenizer, texts, skip_special_tokens=skip)
        if req.stop.stop:
            req.stop_checker = StopChecker(req.stop.stop, req.stop.include_stop_str_in_output)
            req.stop_held = []

    def process(self, req: Request, out: TokenOutput, num_tokens: int | None = None) -> RequestOutput:
        """Check stops and detokenize for `out.token_id`, which the scheduler has appended to `req.token_ids`
        (Scheduler.update_from_output), and return the delta for the client. num_tokens: the request's token count
        up to and including this token (None: len(req.token_ids); a verify step's tokens are appended together and
        processed one at a time).

        Stops, first match wins: a `stop_token_ids` id (finish "stop", stop_reason = the id); an EOS id
        unless ignore_eos (finish "stop", stop_reason None, as vLLM) - either token's text is left out of the
        output unless include_stop_str_in_output (vLLM's rule); a stop string completing in the text
        (finish "stop", stop_reason = the string; the text is cut before it, or after it with
        include_stop_str_in_output; text that may still begin a stop string is held back, never streamed);
        max_tokens or max_model_len (finish "length"). With min_tokens, a stop string must end in the text of
        a later token than the first min_tokens (vLLM's rule); it may begin earlier, so text of those tokens
        that could begin one is held back too.
        Sets req.finish_reason when the request ends with this token.
        """
        tok = out.token_id
        n_tokens = len(req.token_ids) if num_tokens is None else num_tokens
        n_out = n_tokens - req.num_prompt_tokens
        stop = req.stop
        reason = None
        stop_reason: str | int | None = None
        if tok in stop.stop_token_ids:
            reason, stop_reason = "stop", tok
        elif not stop.ignore_eos and tok in self.eos_token_ids:
            reason = "stop"
        elif n_out >= stop.max_tokens or n_tokens >= self.max_model_len:
            reason = "length"
        # a stop token's (stop_token_ids, EOS) text is not output unless include_stop_str_in_output, as vLLM's
        # detokenizer leaves it out; its id still counts (token_ids, usage, logprobs)
        detok = req.detokenizer
        assert detok is not None, "OutputProcessor.start attaches the detokenizer"
        text = "" if reason == "stop" and not stop.include_stop_str_in_output else detok.push(tok)
        if reason is not None:
            text += detok.flush()
        checker = req.stop_checker
        if checker is not None:
            produced = len(checker.held) + len(text)  # characters not emitted yet, this token's included
            text, stopped, matched = checker.feed(text, match=n_out > stop.min_tokens)
            if stopped:
                reason, stop_reason = "stop", matched
            elif reason is not None:
                text += checker.flush()
            # characters produced and not emitted after this token: held back, or (a stop string matched) cut for
            # good; chat's ReleasedTextFeeder attributes the emitted text to tokens by these counts
            assert req.stop_held is not None, "start() sets stop_held with the stop checker"
            req.stop_held.append(produced - len(text) if stopped else len(checker.held))
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
            num_output_tokens=n_out,
            logprobs=None if out.logprob is None else [out.logprob],
            top_ids=None if out.top_ids is None else [out.top_ids],
            top_logprobs=None if out.top_logprobs is None else [out.top_logprobs],
            stop_reason=stop_reason,
            num_cached_tokens=req.num_cached_tokens,
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
