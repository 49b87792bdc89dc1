"""Compiling a GrammarSpec with xgrammar, with a bounded cache keyed by the spec.

The controller compiles every new constraint once, in a worker thread (`compile_async`), to refuse one xgrammar
rejects with a 400 before the request is admitted; each worker compiles again from the spec for its matchers (its
own cache). Compiling a small JSON schema against the Kimi vocabulary takes tens of milliseconds; the cache makes a
repeated schema free.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kimi.errors import BackendUnavailableError, KimiError
from kimi.structured_output.spec import GrammarSpec

if TYPE_CHECKING:
    import xgrammar

    from kimi.tokenizer import KimiTokenizer

THINK_END_ID = 163607  # `</think>` (kimi.controller.parsers.THINK_END_ID)
MAX_WHITESPACE = 16  # consecutive whitespace characters a JSON constraint allows between tokens of the JSON
CACHE_SIZE = 256  # compiled grammars kept (least recently used out first)


class GrammarError(KimiError, ValueError):
    """xgrammar refused the spec (a schema, regex or grammar it cannot compile); the message says why."""


def build_grammar(spec: GrammarSpec) -> xgrammar.Grammar:
    """The xgrammar Grammar of a spec (before compiling against a vocabulary). Raises GrammarError."""
    import xgrammar as xgr

    try:
        if spec.kind == "json_schema":
            g = xgr.Grammar.from_json_schema(spec.source, strict_mode=spec.strict, max_whitespace_cnt=MAX_WHITESPACE)
        elif spec.kind == "json_object":
            g = xgr.Grammar.from_json_schema('{"type": "object"}', strict_mode=False, max_whitespace_cnt=MAX_WHITESPACE)
        elif spec.kind == "regex":
            g = xgr.Grammar.from_regex(spec.source)
        elif spec.kind == "choice":
            g = xgr.Grammar.from_ebnf(choice_ebnf(json.loads(spec.source)))
        elif spec.kind == "ebnf":
            g = xgr.Grammar.from_ebnf(spec.source)
        elif spec.kind == "structural_tag":
            g = xgr.Grammar.from_structural_tag(spec.source)
        elif spec.kind == "union":  # kimi.structured_output.request.union_spec
            g = xgr.Grammar.union(
                *[build_grammar(GrammarSpec(k, src, strict)) for k, src, strict in json.loads(spec.source)]
            )
        else:
            raise GrammarError(f"unknown grammar kind {spec.kind!r}")
        if spec.after_think:
            think = {
                "type": "structural_tag",
                "format": {
                    "type": "tag",
                    "begin": "",
                    "content": {"type": "any_tokens", "exclude_tokens": [THINK_END_ID]},
                    "end": {"type": "token", "token": THINK_END_ID},
                },
            }
            g = xgr.Grammar.concat(xgr.Grammar.from_structural_tag(json.dumps(think)), g)
    except GrammarError:
        raise
    except Exception as e:  # xgrammar raises RuntimeError, ValueError, InvalidJSONError, ... with its reason
        raise GrammarError(_first_line(e)) from None
    return g


def choice_ebnf(choices: Iterable[str]) -> str:
    """EBNF whose language is exactly the given strings: `root ::= "a" | "b"` (each a JSON-escaped literal, which
    xgrammar's EBNF string syntax reads alike)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


_CPP_PREFIX = re.compile(r"^(\[[^\]]*\]\s*)?(\S+\.(cc|h|cpp):\d+:\s*)?")


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    lines = [ln for ln in text.splitlines() if ln.strip()]
    line = lines[-1] if lines else text
    # xgrammar's C++ errors start with "[time] " and "file.cc:line: "; the reason follows
    line = _CPP_PREFIX.sub("", line)
    return line[:500]


class GrammarBackend:
    """Compiles GrammarSpecs for one vocabulary, cached (CACHE_SIZE entries, least recently used out first).

    tokenizer: the served vocabulary; vocab_size: the model's logits per row; eos_token_ids: the checkpoint's EOS
    ids (with `<|im_end|>` the stop tokens a complete grammar allows: `stop_ids`). xgrammar's vocabulary is built at
    the first compile (a few hundred milliseconds). Thread-safe.
    """

    def __init__(
        self, tokenizer: KimiTokenizer, vocab_size: int, eos_token_ids: Iterable[int], max_threads: int = 2
    ) -> None:
        from kimi.structured_output.vocab import stop_token_ids

        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = [i for i in stop_token_ids(eos_token_ids, tokenizer) if 0 <= i < vocab_size]
        self._max_threads = max_threads
        self._vocab: list[bytes] | None = None
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._cache: OrderedDict[GrammarSpec, xgrammar.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._init_lock = threading.Lock()
        self.num_compiled = 0  # specs compiled (cache misses)

    def encoded_vocab(self) -> list[bytes]:
        """Per token id in [0, vocab_size): its bytes as xgrammar reads them (kimi.structured_output.vocab)."""
        from kimi.structured_output.vocab import encoded_vocab

        with self._init_lock:
            if self._vocab is None:
                self._vocab = encoded_vocab(self.tokenizer, self.vocab_size)
            return self._vocab

    def compiler(self) -> xgrammar.GrammarCompiler:
        """The xgrammar.GrammarCompiler (built on first use). Raises BackendUnavailableError without xgrammar."""
        vocab = self.encoded_vocab()
        with self._init_lock:
            if self._compiler is None:
                try:
                    import xgrammar as xgr
                except ImportError as e:
                    raise BackendUnavailableError(f"xgrammar is not installed on this server ({e})") from None

                info = xgr.TokenizerInfo(
                    vocab, xgr.VocabType.RAW, vocab_size=self.vocab_size, stop_token_ids=self.stop_ids
                )
                # xgrammar's own cache is off: this class's cache is keyed by the spec, bounded by entries
                self._compiler = xgr.GrammarCompiler(info, max_threads=self._max_threads, cache_enabled=False)
            return self._compiler

    def compile(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
        """The compiled grammar of `spec` (cached). Raises GrammarError when xgrammar refuses it,
        BackendUnavailableError when xgrammar is not installed."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        compiler = self.compiler()
        grammar = build_grammar(spec)
        try:
            compiled = compiler.compile_grammar(grammar)
        except Exception as e:
            raise GrammarError(_first_line(e)) from None
        with self._lock:
            self.num_compiled += 1
            self._cache[spec] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    async def compile_async(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
        """`compile` in the default executor (off the event loop). Raises GrammarError."""
        return await asyncio.get_running_loop().run_in_executor(None, self.compile, spec)
