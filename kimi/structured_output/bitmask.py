"""The worker's matchers: one xgrammar GrammarMatcher per constrained request, fed every sampled token, filling the
next step's token bitmask.

Why in the worker: with async scheduling the controller plans step N+1 before it has step N's tokens, but the worker
has them (ModelRunner.finish) before it launches step N+1's sampling, so the mask for N+1 is filled there without a
round trip; with CUDA the fill overlaps step N+1's forward on the device.

Lifecycle (per rank, for the requests of its DP rank): `add` on a NewRequest with a grammar (also a request re-sent
after preemption: its already generated tokens are replayed into a fresh matcher); `GuidedRow.accept` on each
sampled token; `fill` before each sampling; `drop` when the plan lists the rid as finished (finished, aborted or
preempted). `num_held` is what is left: 0 whenever no constrained request is live.

Compiling runs in a background thread from `add` on, so it overlaps the request's prefill; the first `fill` of the
row waits for it. A matcher that has accepted a stop token (terminated) masks nothing (a step the controller planned
before it saw the stop token samples a token it will discard; with ignore_eos the rest of the output is free).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from kimi.controller.parsers import (
    TOOL_CALL_ARGUMENT_BEGIN_ID,
    TOOL_CALL_BEGIN_ID,
    TOOL_CALL_END_ID,
    TOOL_CALLS_SECTION_BEGIN_ID,
    TOOL_CALLS_SECTION_END_ID,
)
from kimi.structured_output.backend import GrammarBackend
from kimi.structured_output.spec import GrammarSpec

if TYPE_CHECKING:
    import xgrammar

log = logging.getLogger(__name__)

BATCH_FILL_MIN_ROWS = 4  # from this many constrained rows on, xgrammar fills the masks on several threads
# The tool-call markers have their text in xgrammar's vocabulary (a structural tag names them), so a grammar that
# allows arbitrary text (a JSON string, a broad regex) would allow them too, and the output parser would read one as
# a tool call. Every grammar but a structural tag has them cleared from its mask.
TOOL_MARKER_IDS = (
    TOOL_CALLS_SECTION_BEGIN_ID,
    TOOL_CALLS_SECTION_END_ID,
    TOOL_CALL_BEGIN_ID,
    TOOL_CALL_ARGUMENT_BEGIN_ID,
    TOOL_CALL_END_ID,
)


def _clear_masks(token_ids: Sequence[int]) -> list[tuple[int, int]]:
    """(word, int32 AND-mask) pairs that clear the bits of token_ids in an xgrammar bitmask row."""
    words: dict[int, int] = {}
    for t in token_ids:
        words[t // 32] = words.get(t // 32, 0) | (1 << (t % 32))
    out = []
    for w, bits in sorted(words.items()):
        keep = ~bits & 0xFFFFFFFF
        out.append((w, keep - (1 << 32) if keep >= 1 << 31 else keep))
    return out


class GuidedRow:
    """One constrained request's matcher (built when its grammar has compiled).

    error: set when the grammar failed to compile on this worker or a sampled token was outside it; the request
    must then end with this error (`accept` returns it).
    """

    def __init__(
        self, compiled: Future[xgrammar.CompiledGrammar], generated: Sequence[int], markers_allowed: bool = False
    ) -> None:
        self._compiled = compiled
        self.markers_allowed = markers_allowed  # a structural tag (tool calls): the grammar itself places the markers
        self._matcher: xgrammar.GrammarMatcher | None = None
        self._backlog = list(generated)  # tokens to accept once the matcher exists
        self.error: str | None = None

    def matcher(self) -> xgrammar.GrammarMatcher | None:
        """The matcher, waiting for the compile if needed (None after an error)."""
        if self._matcher is None and self.error is None:
            import xgrammar as xgr

            try:
                compiled = self._compiled.result()
            except Exception as e:  # GrammarError, or no vocabulary (a tokenizer that does not load)
                self.error = f"guided decoding failed on the worker: {type(e).__name__}: {e}"
                return None
            m = xgr.GrammarMatcher(compiled)
            for tok in self._backlog:
                if m.is_terminated():
                    break
                if not m.accept_token(tok):
                    self.error = f"guided decoding: generated token {tok} is outside the grammar"
                    return None
            self._backlog = []
            self._matcher = m
        return self._matcher

    @property
    def terminated(self) -> bool:
        """Whether the matcher has accepted a stop token (it masks nothing from then on)."""
        return self._matcher is not None and self._matcher.is_terminated()

    def accept(self, token_id: int) -> str | None:
        """Advance the matcher by one sampled token. Returns None, or the error that must end the request."""
        m = self.matcher()
        if m is None:
            return self.error
        if m.is_terminated():
            return None
        if not m.accept_token(token_id):
            self.error = f"guided decoding: sampled token {token_id} is outside the grammar"
            return self.error
        return None


class GuidedRequests:
    """The constrained requests of one worker rank and the bitmask buffer of its steps.

    backend: a callable returning the GrammarBackend (called once, in the compile thread, at the first `add`: it
    loads the tokenizer and builds xgrammar's vocabulary). vocab_size: the model's logits per row.
    Counters (the worker logs them at exit; tests read them): num_requests (rows added), num_held (rows live now).
    """

    def __init__(self, backend: Callable[[], GrammarBackend], vocab_size: int) -> None:
        self._make_backend = backend
        self._backend: GrammarBackend | None = None
        self.vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kimi-grammar")
        self.rows: dict[int, GuidedRow] = {}
        self.num_requests = 0
        self._bitmask: torch.Tensor | None = None  # [rows, ceil(vocab_size / 32)] int32
        self._batch: xgrammar.BatchGrammarMatcher | None = None
        self._marker_clears = [(w, m) for w, m in _clear_masks(TOOL_MARKER_IDS) if w * 32 < vocab_size]

    @property
    def num_held(self) -> int:
        """Matchers of live requests on this rank."""
        return len(self.rows)

    def backend(self) -> GrammarBackend:
        """The GrammarBackend (made on first use)."""
        if self._backend is None:
            self._backend = self._make_backend()
        return self._backend

    def _compile(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
        return self.backend().compile(spec)

    def add(self, rid: int, spec: GrammarSpec, generated: Sequence[int] = ()) -> GuidedRow:
        """Start guiding request `rid` (replacing an older row of the same rid). generated: the tokens it already
        produced (a request re-sent after preemption), replayed into the matcher."""
        row = GuidedRow(self._pool.submit(self._compile, spec), generated, spec.kind in ("structural_tag", "union"))
        self.rows[rid] = row
        self.num_requests += 1
        return row

    def drop(self, rid: int) -> None:
        """Forget request `rid` (finished, aborted or preempted); a no-op for an unconstrained one."""
        self.rows.pop(rid, None)

    def fill(self, rows: Sequence[tuple[int, GuidedRow]], batch_size: int) -> tuple[list[int], torch.Tensor] | None:
        """The bitmask of one sampling step: rows are (row of the sampled batch, its GuidedRow).

        Returns (the batch rows that are masked, bitmask int32 [batch_size, ceil(vocab_size / 32)] on the CPU whose
        listed rows hold their allowed tokens: bit t % 32 of word t // 32 set = token t allowed; other rows are
        stale), or None when no row needs a mask (terminated or failed ones need none). Waits for grammars that are
        still compiling.
        """
        import xgrammar as xgr

        live = [(j, m) for j, g in rows if (m := g.matcher()) is not None and not m.is_terminated()]
        plain = [j for j, g in rows if not g.markers_allowed and g.matcher() is not None and not g.terminated]
        if not live:
            return None
        bm = self._bitmask
        if bm is None or bm.shape[0] < batch_size:
            bm = self._bitmask = xgr.allocate_token_bitmask(max(batch_size, 8), self.vocab_size)
        if len(live) >= BATCH_FILL_MIN_ROWS:
            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher(max_threads=max(1, min(8, (os.cpu_count() or 2) // 2)))
            self._batch.batch_fill_next_token_bitmask([m for _, m in live], bm, [j for j, _ in live])
        else:
            for j, m in live:
                m.fill_next_token_bitmask(bm, j)
        if plain and self._marker_clears:
            idx = torch.tensor(plain)
            for w, keep in self._marker_clears:
                bm[idx, w] &= keep
        return [j for j, _ in live], bm[:batch_size]

    def close(self) -> None:
        """Stop the compile thread (pending compiles are dropped)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
