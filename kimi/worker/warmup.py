"""A worker rank's warm-up: before the rank reports Ready (so before `/health` says ok), synthetic steps through the
runner launch every kernel variant a serving step can launch, so no request pays a compile, an autotune or a
library's first-use cost.

The plans (`WarmupPlanner`) are the same on every rank; each rank runs the requests of its own DP rank, so every
rank issues the same collectives. In order:
1. guided: a request constrained to a JSON object is added first (its grammar, and xgrammar's vocabulary, compile in
   the guided-decoding thread while the rest runs) and decoded last (the bitmask fill and apply).
2. prefill: one fresh prompt of each size of `prefill_sizes` (every power of two up to the token budget and the one
   above it, so each M bucket of the tuned GEMM tables and Triton's specializations on a size's divisibility by 16
   run) and of each size at which the routed experts' backend picks another JIT-compiled kernel
   (Runner.warmup_token_counts), the first with prompt logprobs.
3. mixed: a prompt over two steps, its second chunk over the first's cached context, beside decode rows.
4. decode: at each decode batch size (`decode_sizes`: the CUDA-graph buckets up to max_num_seqs), two steps launched
   back to back as the serving loop launches them (the second while the first's tokens are on their way to the
   host): the first greedy, the second with every sampling option present (temperature, top-k / top-p / min-p,
   penalties, logit bias, min_tokens, a seed, logprobs).
Then every warm-up request is finished and the runner's counters are reset. KV blocks are taken from the free pool
(the controller has assigned none yet); what warm-up writes there is overwritten before anything reads it.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from kimi import protocol
from kimi.structured_output.spec import GrammarSpec
from kimi.worker.runner_base import Runner, StepHandle

__all__ = ["WarmupConfig", "WarmupPlanner", "decode_sizes", "prefill_sizes", "warm_up"]

log = logging.getLogger(__name__)

PROMPT_LEN = 2  # tokens of each decode request's prompt
GREEDY = protocol.SamplingParams(temperature=0.0)
CPU_CHUNK = 64  # the chunked prompt's length on the CPU


def sampling_variants(vocab_size: int) -> list[protocol.SamplingParams]:
    """One request per sampling path of kimi.model.sampling beyond greedy (token ids below vocab_size)."""
    ids = [1 % vocab_size, 2 % vocab_size]
    return [
        protocol.SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05),
        protocol.SamplingParams(temperature=1.0, seed=1234, num_logprobs=5),
        protocol.SamplingParams(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1),
        protocol.SamplingParams(
            temperature=0.0, logit_bias_ids=ids, logit_bias_values=[1.0, -1.0], min_tokens=64, min_tokens_block_ids=ids
        ),
        protocol.SamplingParams(temperature=0.0, num_logprobs=0),
    ]


def prefill_sizes(token_budget: int, max_len: int, device_type: str) -> list[int]:
    """Fresh-prompt sizes to warm: on CUDA every power of two up to the token budget, each one plus one (a size that
    is not a multiple of 16) and the budget itself; on the CPU (no compiles: first-use costs only) 1, 17 and 64.
    Sizes above max_len (the longest prompt the KV cache and the model take) or the token budget are dropped."""
    if device_type != "cuda":
        sizes = {1, 17, 64}
    else:
        sizes = {token_budget}
        p = 1
        while p <= token_budget:
            sizes.update((p, min(p + 1, token_budget)))
            p *= 2
    return sorted(s for s in sizes if 1 <= s <= min(max_len, token_budget))


def decode_sizes(max_num_seqs: int, device_type: str) -> list[int]:
    """Decode batch sizes to warm: the CUDA-graph buckets up to max_num_seqs (kimi.worker.cuda_graph.bucket_sizes) on
    CUDA, 1 and 4 on the CPU (no compiles there: a batch of each kind is enough)."""
    if device_type != "cuda":
        return sorted({1, min(4, max_num_seqs)})
    from kimi.worker.cuda_graph import bucket_sizes

    return bucket_sizes(max_num_seqs)


@dataclass(frozen=True)
class WarmupConfig:
    """What a rank warms: world_size (DP ranks, each running its own copy of every request), token_budget (tokens per
    step), max_num_seqs (the largest decode batch), max_model_len, block_size / num_blocks (this rank's KV cache),
    vocab_size, device_type ("cuda" or "cpu"), guided (warm guided decoding: xgrammar installed), model (False: a
    fake runner, only the guided path is warmed), extra_prefill (sizes warmed besides `prefill_sizes`)."""

    world_size: int
    token_budget: int
    max_num_seqs: int
    max_model_len: int
    block_size: int
    num_blocks: int
    vocab_size: int
    device_type: str
    guided: bool = True
    model: bool = True
    extra_prefill: tuple[int, ...] = ()  # more prefill sizes (Runner.warmup_token_counts: kernel variants by size)


@dataclass
class _Req:
    rid: int
    prompt: list[int]
    sampling: protocol.SamplingParams
    blocks: list[int]


@dataclass
class WarmupPlanner:
    """The warm-up's step plans, phase by phase (module docstring). `rids` collects every request it created."""

    cfg: WarmupConfig
    rids: list[int] = field(default_factory=list)
    _next_rid: int = -1  # negative: never a controller's rid
    _next_block: int = 1

    @property
    def max_tokens(self) -> int:
        """The longest context a warm-up request reaches (prompt + decoded tokens) that the KV cache holds."""
        usable = (self.cfg.num_blocks - 1) * self.cfg.block_size
        return min(self.cfg.max_model_len, usable)

    def _blocks(self, tokens: int) -> list[int]:
        """Block ids for `tokens` tokens, taken round-robin from blocks 1..num_blocks-1 (warm-up only writes them)."""
        n = -(-tokens // self.cfg.block_size)
        out = []
        for _ in range(n):
            out.append(self._next_block)
            self._next_block = self._next_block % (self.cfg.num_blocks - 1) + 1
        return out

    def _request(self, prompt_len: int, sampling: protocol.SamplingParams, extra: int) -> list[_Req]:
        """One request per DP rank: a prompt of prompt_len tokens with blocks for `extra` more."""
        out = []
        for _ in range(self.cfg.world_size):
            rid = self._next_rid
            self._next_rid -= 1
            self.rids.append(rid)
            prompt = [(rid * 7919 + j * 104729) % self.cfg.vocab_size for j in range(prompt_len)]
            out.append(_Req(rid, prompt, sampling, self._blocks(prompt_len + extra)))
        return out

    def _new(self, reqs: list[_Req], num_new: int | None = None, plp: int = -1) -> list[protocol.NewRequest]:
        out = []
        for i, r in enumerate(reqs):
            sp = r.sampling if plp < 0 else protocol.SamplingParams(temperature=0.0, prompt_logprobs=plp)
            n = len(r.prompt) if num_new is None else num_new
            out.append(protocol.NewRequest(r.rid, i % self.cfg.world_size, r.prompt, 0, n, r.blocks, sp))
        return out

    def phases(self) -> Iterator[tuple[str, list[list[protocol.StepPlan]]]]:
        """(phase name, its groups of plans); the plans of a group are launched back to back (each while the one
        before it is in flight), the groups one after another. Step numbers are filled in by `warm_up`."""
        cfg = self.cfg
        n_dec = len(decode_sizes(cfg.max_num_seqs, cfg.device_type)) if cfg.model else 0
        decode_extra = 2 * n_dec + 4
        guided_sp = protocol.SamplingParams(temperature=0.0, grammar=GrammarSpec("json_object", ""))
        guided = self._request(PROMPT_LEN, guided_sp, 4) if cfg.guided else []
        if guided:  # the first prompt token only: nothing is sampled, so the grammar compiles while the rest runs
            yield "guided compile", [[_plan(self._new(guided, num_new=1), [])]]
        if cfg.model:
            yield "prefill", [[p] for p in self._prefill_plans()]
            yield from self._decode_phases(decode_extra)
        if guided:  # the prompt's last token (the first masked sampling), then two decode steps
            cont = [protocol.ContinueRequest(r.rid, 1, []) for r in guided]
            yield "guided decode", [[_plan([], cont) for _ in range(3)]]

    def _prefill_plans(self) -> Iterator[protocol.StepPlan]:
        """One fresh prompt per prefill size (the first with prompt logprobs)."""
        limit = self.max_tokens - 1
        sizes = sorted(
            set(prefill_sizes(self.cfg.token_budget, limit, self.cfg.device_type))
            | {t for t in self.cfg.extra_prefill if 1 <= t <= min(limit, self.cfg.token_budget)}
        )
        for i, t in enumerate(sizes):
            yield _plan(self._new(self._request(t, GREEDY, 1), plp=2 if i == 0 else -1), [])

    def _decode_phases(self, extra: int) -> Iterator[tuple[str, list[list[protocol.StepPlan]]]]:
        cfg = self.cfg
        sizes = [b for b in decode_sizes(cfg.max_num_seqs, cfg.device_type) if b <= cfg.max_num_seqs]
        variants = sampling_variants(cfg.vocab_size)
        greedy = [self._request(PROMPT_LEN, GREEDY, extra) for _ in range(max(sizes))]
        sampled = [self._request(PROMPT_LEN, sp, extra) for sp in variants]
        everyone = [r for group in greedy + sampled for r in group]
        # at most max_num_seqs prompts of token_budget tokens per rank and step, as the scheduler would send them
        per_step = max(1, min(cfg.token_budget // PROMPT_LEN, cfg.max_num_seqs)) * cfg.world_size
        yield (
            "decode prompts",
            [[_plan(self._new(everyone[i : i + per_step]), [])] for i in range(0, len(everyone), per_step)],
        )
        chunk_len = min(cfg.token_budget, self.max_tokens - 1, CPU_CHUNK if cfg.device_type != "cuda" else 1 << 62)
        if chunk_len >= 2:  # a prompt in two chunks, the second beside decode rows
            long = self._request(chunk_len, GREEDY, 1)
            first = self._new(long, num_new=chunk_len // 2)
            rest = chunk_len - chunk_len // 2
            n_rows = max(0, min(8, len(greedy), cfg.token_budget - rest, cfg.max_num_seqs - 1))
            rows = [protocol.ContinueRequest(r.rid, 1, []) for g in greedy[:n_rows] for r in g]
            second = [protocol.ContinueRequest(r.rid, rest, []) for r in long]
            yield "mixed", [[_plan(first, [])], [_plan([], rows + second)]]
        groups = []
        for b in sizes:
            plain = [protocol.ContinueRequest(r.rid, 1, []) for g in greedy[:b] for r in g]
            k = min(len(sampled), b)
            mixed = [protocol.ContinueRequest(r.rid, 1, []) for g in greedy[: b - k] + sampled[:k] for r in g]
            groups.append([_plan([], plain), _plan([], mixed)])
        yield "decode", groups


def _plan(new: list[protocol.NewRequest], cont: list[protocol.ContinueRequest]) -> protocol.StepPlan:
    return protocol.StepPlan(0, new, cont, [])


def warm_up(runner: Runner, cfg: WarmupConfig) -> list[tuple[str, float, int]]:
    """Run the warm-up's plans through `runner` (every rank must call it with the same cfg), then finish its requests
    and reset the runner's counters. Returns (phase, seconds, steps) per phase. Raises what the runner raises."""
    if cfg.guided and importlib.util.find_spec("xgrammar") is None:
        cfg = WarmupConfig(**{**cfg.__dict__, "guided": False})
    planner = WarmupPlanner(cfg)
    step = 0
    report = []
    pending: StepHandle | None = None
    for name, groups in planner.phases():
        t0 = time.monotonic()
        n = 0
        for group in groups:
            for plan in group:
                step += 1
                n += 1
                pending = runner.launch(protocol.StepPlan(step, plan.new, plan.cont, plan.finished), pending)
            if pending is not None:
                runner.finish(pending)
                pending = None
        report.append((name, time.monotonic() - t0, n))
    runner.finish(runner.launch(protocol.StepPlan(step + 1, [], [], list(planner.rids))))
    runner.reset_counters()
    return report
