"""FakeRunner: a worker that loads no model and returns deterministic pseudo-random tokens.

`kimi serve --fake-workers` starts the normal torchrun workers with `--fake`; each rank then uses this
runner instead of `ModelRunner`. Everything else is real: the ZeroMQ step plans and results, the step
numbering, DP rank ownership, the controller, HTTP. It exists to measure the controller + HTTP cost per
step without a model (tools/bench_controller.py) and to check the controller's KV bookkeeping at scale.

Tokens. Greedy (SamplingParams.greedy) and seeded requests get a token that is a pure function of the request's
context: a 64-bit mix (splitmix64 finaliser) of (previous token, position, seed), reduced modulo
`FAKE_VOCAB` (100000, ordinary BPE ids well below Kimi's special tokens, so EOS never comes out). So a
request yields the same tokens alone, batched, or after preemption and recompute. Unseeded sampling
(not greedy, no seed) draws from Python's `random`.

Guided decoding. A request with a grammar (SamplingParams.grammar) is guided by the same matchers as the real
runner's (kimi.structured_output.bitmask.GuidedRequests, with the checkpoint's tokenizer: `model`); its token is
chosen among the allowed ones: a stop token when the grammar allows one (the fake ends as soon as it may), else,
among the allowed tokens of the fewest bytes (a marker token counting as one), the one the token rule above picks
(its value modulo their number). So
a constrained output is valid, stays deterministic, and (spelling strings one character at a time, closing them with
probability about 1 in 95 per token) ends.

KV bookkeeping check. The runner keeps a token-id "cache" with one int64 per KV slot. Every computed token
is written at its slot (block_table[p // block_size] * block_size + p % block_size). A new request's
first `num_computed_tokens` positions (its prefix-cache hit) must already hold exactly its tokens, and a
continuing request's last computed position must still hold its token; otherwise the controller handed out
a block with the wrong content (or let someone overwrite a shared one) and the step fails loudly
(ProtocolError -> WorkerError -> every request fails). Cost: one array store per token.

Speculative decoding. A continuing request with `num_draft_tokens` k verifies the fake draft's k proposals
(`fake_draft_token`: right about 70% of the time): accepted while they equal the fake model's tokens, then its
token; so a greedy or seeded request yields the same tokens with and without speculation, 1 .. k + 1 per step.

Simulated model time: with `$KIMI_FAKE_STEP_MS` (and `$KIMI_FAKE_TOKEN_US`) set, each step that computes tokens
lasts at least STEP_MS + TOKEN_US * its tokens / 1000 milliseconds (the runner sleeps the rest, leaving the CPU
to the controller as a GPU step would), so a benchmark can show how much of the controller's per-step work
overlaps the model's (async scheduling), prefill steps being longer than decode steps.

Timing. `step_times` records (t_start, t_end, num_requests, num_tokens) per executed step (time.perf_counter
seconds); with `$KIMI_FAKE_STATS` set, they are written there as JSON at exit (rank 0 only), so a benchmark
can compute the controller's share of each step (the gap between one step's end and the next's start).
"""

from __future__ import annotations

import atexit
import json
import random
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kimi import envs, protocol
from kimi.config import CacheConfig, ModelConfig
from kimi.errors import ConfigError, ProtocolError
from kimi.structured_output.bitmask import GuidedRequests, GuidedRow
from kimi.tokenizer import SPECIAL_ID_START
from kimi.worker.kv_cache import kv_cache_bytes_per_block
from kimi.worker.runner_base import StepHandle

if TYPE_CHECKING:
    import torch

FAKE_VOCAB = 100_000
_MASK = (1 << 64) - 1


def fake_token(prev_token: int, position: int, seed: int = 0) -> int:
    """The fake model's next token after `prev_token` at `position` (0-based index of the new token).

    Pure function; returns an int in [0, FAKE_VOCAB). splitmix64 finaliser (Steele et al. 2014).
    """
    x = (prev_token * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9 + seed * 0x94D049BB133111EB) & _MASK
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK
    x ^= x >> 31
    return x % FAKE_VOCAB


def fake_draft_token(prev_token: int, position: int, seed: int = 0) -> int:
    """The fake draft's proposal after `prev_token` at `position`: fake_token's token for about 70% of (prev_token,
    position) pairs, a wrong one (the next id) for the rest, so verify steps accept a varying number of drafts."""
    tok = fake_token(prev_token, position, seed)
    return tok if fake_token(tok, position, 7) % 10 < 7 else (tok + 1) % FAKE_VOCAB


@dataclass
class FakeRequest:
    """A request as the fake worker holds it."""

    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    sampling: protocol.SamplingParams
    guide: GuidedRow | None = None


class FakeRunner:
    """A `Runner` (kimi.worker.runner_base) like ModelRunner, with no model: `launch` runs the whole step, so its
    handle is done at once and `finish` only hands out its tokens.

    num_blocks: cache_config.num_blocks, else what `kv_cache_memory_gib` (default 0.5 GiB) of real blocks of
    this config would be. model: the checkpoint folder (or `preset:NAME`) whose tokenizer guided decoding uses (None:
    a constrained request fails). Raises ProtocolError on any plan the real runner would reject and on KV-content
    mismatches (module docstring).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        cache_config: CacheConfig,
        *,
        rank: int = 0,
        world_size: int = 1,
        model: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.block_size = cache_config.block_size
        if cache_config.num_blocks is not None:
            self.num_blocks = cache_config.num_blocks
        else:
            gib = cache_config.kv_cache_memory_gib if cache_config.kv_cache_memory_gib is not None else 0.5
            self.num_blocks = max(2, int(gib * (1 << 30) // kv_cache_bytes_per_block(cfg, self.block_size, _bf16())))
        self.kv = array("q", [-1]) * (self.num_blocks * self.block_size)
        self.requests: dict[int, FakeRequest] = {}
        self.num_requests = 0  # NewRequest entries this rank ran (the worker logs them at exit)
        self.num_sampled = 0
        self.num_idle_steps = 0  # the fake runs no collectives: a rank with no tokens does nothing
        self._outputs: dict[int, list[protocol.TokenOutput]] = {}  # step -> tokens of a launched step, until finish
        self.step_times: list[tuple[float, float, int, int]] = []
        path = envs.KIMI_FAKE_STATS.get()
        self._record = bool(path) and rank == 0
        self.step_s = envs.KIMI_FAKE_STEP_MS.get() / 1000.0
        self.token_s = envs.KIMI_FAKE_TOKEN_US.get() / 1e6
        if path and self._record:
            atexit.register(self._dump, path)
        self.guided = _guided_requests(model, cfg)
        self._bytes_len: list[int] | None = None  # per token id: its byte length (the guided choice), built on use
        self._verify: dict[int, int] = {}  # rid -> draft tokens this step verifies (speculative decoding)

    def close(self) -> None:
        """Stop the guided-decoding compile thread."""
        self.guided.close()

    def warmup_token_counts(self, max_tokens: int) -> list[int]:
        """No kernels: no step size needs warming."""
        return []

    def reset_counters(self) -> None:
        """Zero the served counts and step times (after the start-up warm-up, kimi.worker.warmup)."""
        self.num_requests = self.num_sampled = self.num_idle_steps = 0
        self.step_times.clear()
        self.guided.num_requests = 0

    def _dump(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({"rank": self.rank, "steps": self.step_times}, f)

    def _slot(self, table: list[int], p: int) -> int:
        return table[p // self.block_size] * self.block_size + p % self.block_size

    def _check_table(self, rid: int, table: list[int], end: int) -> None:
        if len(table) * self.block_size < end:
            raise ProtocolError(f"rid {rid}: {len(table)} blocks cannot hold {end} tokens")
        for b in table:
            if not 0 < b < self.num_blocks:
                raise ProtocolError(f"rid {rid}: block id {b} outside [1, {self.num_blocks})")

    def execute(self, plan: protocol.StepPlan) -> list[protocol.TokenOutput]:
        """One step at a time: `finish(launch(plan))`."""
        return self.finish(self.launch(plan))

    def launch(
        self,
        plan: protocol.StepPlan,
        prev: StepHandle | None = None,
        on_prev: Callable[[StepHandle], None] | None = None,
    ) -> StepHandle:
        """Finish `prev` and hand it to `on_prev` (its result is not sent yet), then run the whole step; returns a
        handle that is done (`finish` returns its tokens). Raises ProtocolError as the module docstring says."""
        if prev is not None:
            self.finish(prev)
            if on_prev is not None:
                on_prev(prev)
        self._outputs[plan.step] = self._run(plan)
        return StepHandle(plan.step, [], None, [], {})

    def finish(self, handle: StepHandle) -> list[protocol.TokenOutput]:
        """The launched step's TokenOutputs (the same list on every call)."""
        if handle.outputs is None:
            handle.outputs = self._outputs.pop(handle.step)
        return handle.outputs

    def _run(self, plan: protocol.StepPlan) -> list[protocol.TokenOutput]:
        """Apply the plan's diff, 'compute' this rank's tokens (write them to the slot array), sample."""
        t0 = time.perf_counter()
        for rid in plan.finished:
            self.requests.pop(rid, None)
            self.guided.drop(rid)
        batch: list[tuple[int, FakeRequest, int]] = []
        kv = self.kv
        for nr in plan.new:
            if nr.dp_rank != self.rank:
                continue
            fr = FakeRequest(list(nr.token_ids), nr.num_computed_tokens, list(nr.block_ids), nr.sampling)
            self._check_table(nr.rid, fr.block_table, nr.num_computed_tokens + nr.num_new_tokens)
            for p in range(nr.num_computed_tokens):
                if kv[self._slot(fr.block_table, p)] != fr.token_ids[p]:
                    raise ProtocolError(
                        f"rid {nr.rid}: cached prefix mismatch at position {p} (block "
                        f"{fr.block_table[p // self.block_size]}): slot holds {kv[self._slot(fr.block_table, p)]}, "
                        f"token is {fr.token_ids[p]}"
                    )
            if nr.sampling.grammar is not None:
                n_prompt = nr.num_prompt_tokens if nr.num_prompt_tokens >= 0 else len(nr.token_ids)
                fr.guide = self.guided.add(nr.rid, nr.sampling.grammar, fr.token_ids[n_prompt:])
            self.requests[nr.rid] = fr
            self.num_requests += 1
            batch.append((nr.rid, fr, nr.num_new_tokens))
        for c in plan.cont:
            known = self.requests.get(c.rid)
            if known is None:
                continue  # another DP rank's request
            known.block_table.extend(c.new_block_ids)
            p = known.num_computed_tokens - 1
            if p >= 0 and kv[self._slot(known.block_table, p)] != known.token_ids[p]:
                raise ProtocolError(f"rid {c.rid}: KV slot of position {p} was overwritten by another request")
            batch.append((c.rid, known, c.num_new_tokens))
            if c.num_draft_tokens:
                self._verify[c.rid] = c.num_draft_tokens
        outputs: list[protocol.TokenOutput] = []
        num_tokens = 0
        for rid, fr, n in batch:
            nv = self._verify.pop(rid, 0)
            if nv:
                outputs.append(self._run_verify(rid, fr, n, nv))
                num_tokens += n
                continue
            start = fr.num_computed_tokens
            end = start + n
            if n <= 0 or end > len(fr.token_ids):
                raise ProtocolError(f"plan asks rid {rid} for tokens [{start}, {end}) of {len(fr.token_ids)}")
            if len(fr.block_table) * self.block_size < end:
                raise ProtocolError(f"rid {rid}: {len(fr.block_table)} blocks cannot hold {end} tokens")
            table, toks, bs = fr.block_table, fr.token_ids, self.block_size
            for p in range(start, end):
                kv[table[p // bs] * bs + p % bs] = toks[p]
            fr.num_computed_tokens = end
            num_tokens += n
            if end == len(toks):
                sp = fr.sampling
                seed = 0 if sp.greedy else sp.seed
                if seed is not None:
                    tok = fake_token(toks[-1], end, seed)
                else:
                    tok = random.randrange(FAKE_VOCAB)
                err = None
                if fr.guide is not None:
                    tok = self._guided_token(fr.guide, tok)
                    err = fr.guide.accept(tok)
                toks.append(tok)
                self.num_sampled += 1
                lp = None if sp.num_logprobs < 0 else -1.0
                top_ids = [tok] * sp.num_logprobs if sp.num_logprobs > 0 else None
                top_lps = [-1.0] * sp.num_logprobs if sp.num_logprobs > 0 else None
                outputs.append(protocol.TokenOutput(rid, tok, lp, top_ids, top_lps, error=err))
        if (self.step_s > 0 or self.token_s > 0) and batch:
            left = self.step_s + self.token_s * num_tokens - (time.perf_counter() - t0)
            if left > 0:
                time.sleep(left)
        if self._record:
            self.step_times.append((t0, time.perf_counter(), len(batch), num_tokens))
        return outputs

    def _run_verify(self, rid: int, fr: FakeRequest, n: int, nv: int) -> protocol.TokenOutput:
        """A speculative decoding verify step of nv draft tokens (ContinueRequest.num_draft_tokens): the fake draft's
        proposal (`fake_draft_token`) is written to the KV slots after the last token, accepted while it equals
        fake_token's, then the correction or bonus token; computed tokens end at the accepted length, so the
        rejected slots are overwritten by later steps. The output is the tokens of one step at a time."""
        toks, table, bs, kv = fr.token_ids, fr.block_table, self.block_size, self.kv
        start, L = fr.num_computed_tokens, len(fr.token_ids)
        if start != L - 1 or n != nv + 1 or fr.sampling.grammar is not None:
            raise ProtocolError(f"rid {rid}: verify {nv} drafts over tokens [{start}, {start + n}) of {L}")
        if len(table) * bs < L + nv:
            raise ProtocolError(f"rid {rid}: {len(table)} blocks cannot hold {L + nv} tokens")
        sp = fr.sampling
        seed = 0 if sp.greedy else (sp.seed if sp.seed is not None else random.randrange(1 << 32))
        kv[table[start // bs] * bs + start % bs] = toks[start]
        emitted: list[int] = []
        prev = toks[-1]
        for i in range(nv + 1):
            true = fake_token(prev, L + i, seed)
            if i == nv:
                emitted.append(true)
                break
            d = fake_draft_token(prev, L + i, seed)
            p = L + i
            kv[table[p // bs] * bs + p % bs] = d
            emitted.append(true)
            if d != true:
                break
            prev = d
        toks.extend(emitted)
        fr.num_computed_tokens = len(toks) - 1
        self.num_sampled += len(emitted)
        lp = None if sp.num_logprobs < 0 else -1.0
        more = emitted[1:] or None
        return protocol.TokenOutput(
            rid,
            emitted[0],
            lp,
            [emitted[0]] * sp.num_logprobs if sp.num_logprobs > 0 else None,
            [-1.0] * sp.num_logprobs if sp.num_logprobs > 0 else None,
            next_token_ids=more,
            next_logprobs=[lp] * len(more) if more and lp is not None else None,
            next_top_ids=[[t] * sp.num_logprobs for t in more] if more and sp.num_logprobs > 0 else None,
            next_top_logprobs=[[-1.0] * sp.num_logprobs for _ in more] if more and sp.num_logprobs > 0 else None,
        )

    def _guided_token(self, guide: GuidedRow, draw: int) -> int:
        """The fake's token for a constrained row (module docstring); `draw` is the unconstrained rule's token."""
        import torch

        from kimi.model.sampling import unpack_bitmask

        got = self.guided.fill([(0, guide)], 1)
        if got is None:  # terminated (or failed: accept reports it)
            return draw
        allowed: list[int] = torch.nonzero(unpack_bitmask(got[1][:1], self.guided.vocab_size)[0]).flatten().tolist()
        if not allowed:
            return draw
        backend = self.guided.backend()
        stops = [t for t in allowed if t in backend.stop_ids]
        if stops:
            return stops[0]
        lens = self._token_lengths()
        shortest = min(lens[t] for t in allowed)
        pool = [t for t in allowed if lens[t] == shortest]
        return pool[draw % len(pool)]

    def _token_lengths(self) -> list[int]:
        if self._bytes_len is None:
            backend = self.guided.backend()
            # a marker token (tool call, think) counts as one character: the fake closes a tool section as
            # readily as it opens another call
            self._bytes_len = [
                (1 if i >= SPECIAL_ID_START else len(b)) if b else 1 << 30
                for i, b in enumerate(backend.encoded_vocab())
            ]
        return self._bytes_len


def _guided_requests(model: str | None, cfg: ModelConfig) -> GuidedRequests:
    from kimi.structured_output.backend import GrammarBackend
    from kimi.structured_output.vocab import load_tokenizer

    def backend() -> GrammarBackend:
        if model is None:
            raise ConfigError("guided decoding on a fake worker needs the checkpoint's tokenizer (model)")
        return GrammarBackend(load_tokenizer(model), cfg.vocab_size, cfg.eos_token_ids)

    return GuidedRequests(backend, cfg.vocab_size)


def _bf16() -> torch.dtype:
    import torch

    return torch.bfloat16
