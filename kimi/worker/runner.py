"""ModelRunner: one rank's weights, KV cache and per-request state; turns a StepPlan into sampled tokens.

The runner holds no request policy: it computes exactly the tokens the plan names and samples the next
token of every request whose computed tokens reach the end of its known tokens (protocol.py).

Many ranks (DP attention x EP MoE): each rank runs the requests whose `dp_rank` is its rank and the routed
experts it owns; the MoE all-to-all (kimi/backends/all_to_all.py) is collective, so a rank with nothing to run
still takes part: `_idle_step` runs every MoE layer's dispatch / combine with zero tokens, in layer order,
exactly as a forward would. Every rank also tracks which rank owns every live request (all plans reach all
ranks), so all ranks pick the same all-to-all mode for a step (`step_mode`).

Decode CUDA graphs (cuda, `cuda_graph_max_bs` > 0): with a collective all-to-all whose decode steps have static shapes
(nccl's static layout, DeepEP's low-latency mode; kimi.worker.cuda_graph.decode_graph_plan) every rank captures the
same buckets in the same order, and in a decode step every rank replays the bucket of the largest local batch over
all ranks (`step_bucket`, from the plan: DecodeGraphPlan), a rank without rows of its own too (`_idle_replay`); the
static all-to-all's capacity is that bucket. Prefill and mixed steps run eagerly on every rank.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from kimi import protocol
from kimi.backends.all_to_all import DECODE, Backend, step_mode
from kimi.config import CacheConfig, ModelConfig, SpeculativeConfig
from kimi.errors import ConfigError, KVCacheSizeError, ProtocolError
from kimi.model.attention import build_attention_metadata
from kimi.model.model import KimiForCausalLM
from kimi.model.sampling import prompt_logprobs, sample_launch
from kimi.structured_output.backend import GrammarBackend
from kimi.structured_output.bitmask import GuidedRequests
from kimi.structured_output.vocab import load_tokenizer
from kimi.worker.cuda_graph import DecodeGraphPlan, decode_graph_plan
from kimi.worker.inputs import ScheduledRow, StepInputs, WorkerRequest, prepare_inputs
from kimi.worker.kv_cache import allocate_kv_caches, check_kv_cache_fits, kv_cache_bytes_per_block
from kimi.worker.runner_base import PromptLogprobs, StepHandle

if TYPE_CHECKING:
    from kimi.model.eagle3 import Eagle3Draft

log = logging.getLogger(__name__)


_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded request's draw at `position` (the index of the token drawn): a function of
    (seed, position) only, so a request recomputed after preemption draws what it would have drawn. seed: any
    signed 64-bit integer (the API's range). Returns an int in [0, 2^64), torch.Generator.manual_seed's range.

    x = seed * 1_000_003 + position mod 2^64 is injective in seed for a fixed position (1_000_003 is odd, so
    multiplying by it permutes the residues mod 2^64); then splitmix64's finaliser (Steele, Lea, Flood, "Fast
    splittable pseudorandom number generators", OOPSLA 2014: xor-shifts and odd multiplications, each a bijection
    of 64-bit words) mixes every bit of x into the low 32. So on CUDA (Philox takes all 64 bits) distinct API seeds
    never share a stream at the same position, and on the CPU, whose generator (mt19937) takes only the seed's low
    32 bits, seeds that differ by a multiple of 2^32 (e.g. -1 and 2^63 - 1, or a request's choices n = 2 at the
    seed range's end) no longer share one: two seeds collide there only by chance, 1 in 2^32."""
    x = (seed * 1_000_003 + position) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class ModelRunner:
    """Loads this rank's shard and runs steps.

    rank / world_size: this worker's DP rank and EP rank (the same under DP attention + EP MoE).
    a2a: the MoE all-to-all backend (kimi.backends.all_to_all; None = local, world_size 1 only).
    ll_max_tokens_per_rank: decode steps with at most this many tokens on every rank use the backend's
    low-latency mode (DeepEP) or static layout (gloo / nccl with static capacities); others use its normal mode
    (variable splits). `update_states` gives the backend the step's mode, its tokens and its most tokens on one rank.
    gpu_options["cuda_graph_max_bs"] > 0 captures decode CUDA graphs when the all-to-all allows it (`graph_plan`, the
    module docstring) and, with one rank and gpu_options["prefill_graph_max_tokens"] > 0, prefill / mixed-step graphs
    of up to that many tokens (kimi/worker/prefill_graph.py); `step_bucket`: the bucket every rank replays in the
    current step (None: eager).
    Guided decoding (SamplingParams.grammar): `guided` holds this rank's matchers (kimi.structured_output.bitmask):
    each sampled token is accepted in `finish`, and the next bitmask is filled after the previous step is finished,
    just before this step's sampling is launched (on CUDA while this step's forward runs).
    Counters (logged at exit, read by tests): num_requests (NewRequest entries this rank ran; a preempted and
    re-sent request counts again), num_sampled (tokens it
    sampled), num_idle_steps (steps it ran with no local tokens), num_overlapped (steps launched while the
    previous one's tokens were still on their way to the host: `launch`).
    Raises CheckpointError / ConfigError while loading, ProtocolError on plan inconsistencies.
    """

    def __init__(
        self,
        model_dir: str,
        cfg: ModelConfig,
        cache_config: CacheConfig,
        *,
        rank: int = 0,
        world_size: int = 1,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        progress: bool = True,
        a2a: Backend | None = None,
        ll_max_tokens_per_rank: int = 128,
        gpu_options: dict[str, Any] | None = None,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        self.cfg = cfg
        self.a2a = a2a
        self.ll_max_tokens_per_rank = ll_max_tokens_per_rank
        self.rank_of: dict[int, int] = {}  # rid -> dp_rank, for every live request of every rank
        self.num_requests = 0
        self.num_sampled = 0
        self.num_idle_steps = 0
        self.num_overlapped = 0  # steps launched before the previous step's tokens reached the host (`launch`)
        self.overlap_cpu = False  # overlap on a CPU device too (tests: there it gains nothing but runs the same path)
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        self.dtype = dtype
        self.block_size = cache_config.block_size
        t0 = time.monotonic()
        # gpu_options (cuda only, kimi/model/weights.py): moe_backend, load_format, fp8_dense, cuda_graph_max_bs
        # (0 = eager), emulate_ep_size (WorkerConfig)
        gpu_opts = dict(gpu_options or {})
        graph_max_bs = int(gpu_opts.pop("cuda_graph_max_bs", 0))
        prefill_graph_tokens = int(gpu_opts.pop("prefill_graph_max_tokens", 0))
        # emulate_ep_size N > 1 (benchmarks, one rank): hold EP rank 0 of N's experts; other experts' pairs are dropped
        emulate = int(gpu_opts.pop("emulate_ep_size", 1))
        ep_rank, ep_size = (0, emulate) if emulate > 1 else (rank, world_size)
        self._check_requested_cache(cache_config)  # before the weights: a cache that cannot fit fails at once
        self.model: KimiForCausalLM
        fused_model = None  # the same model when it is the fused (GPU) one
        from kimi.model.weights import load_gpu_model, load_reference_model

        if self.device.type == "cuda":
            self.model = fused_model = load_gpu_model(
                model_dir,
                cfg,
                ep_rank=ep_rank,
                ep_size=ep_size,
                a2a=a2a,
                dtype=dtype,
                device=self.device,
                progress=progress,
                **gpu_opts,
            )
        else:
            self.model = load_reference_model(
                model_dir, cfg, ep_rank=rank, ep_size=world_size, a2a=a2a, dtype=dtype, progress=progress
            )
        log.info("rank %d: weights loaded in %.1f s", rank, time.monotonic() - t0)
        self.num_blocks = self._num_blocks(cache_config)
        self.kv_caches = allocate_kv_caches(cfg, self.num_blocks, self.block_size, dtype, self.device)
        self.graph_plan: DecodeGraphPlan | None = None  # the captured decode graphs' buckets (None: none captured)
        self.step_bucket: int | None = None  # the bucket every rank replays this step (lockstep graphs; None: eager)
        if fused_model is not None and graph_max_bs > 0:
            self._capture_graphs(fused_model, graph_max_bs)
            if prefill_graph_tokens > 0 and world_size == 1 and fused_model.graphs is not None:
                # prefill / mixed steps of up to the token budget and max_num_seqs sequences (prefill_graph.py)
                max_blocks = -(-cfg.max_position_embeddings // self.block_size)
                fused_model.capture_prefill_graphs(
                    self.kv_caches, self.block_size, prefill_graph_tokens, graph_max_bs, max_blocks
                )
        self.requests: dict[int, WorkerRequest] = {}
        self.guided = guided_requests(model_dir, cfg)
        self.draft: Eagle3Draft | None = None
        self.num_speculative_tokens = 0
        self.num_draft_tokens = self.num_accepted_tokens = 0  # verified / accepted draft tokens (logged at exit)
        if speculative is not None:
            self._load_draft(speculative)

    def _load_draft(self, spec: SpeculativeConfig) -> None:
        """Load the EAGLE3 draft (kimi.model.eagle3) and make the target keep its aux hidden states; steps then run
        through kimi.worker.speculative. Raises ConfigError on CUDA (the fused forward keeps no aux states yet) and
        ConfigError / CheckpointError naming the field or tensor for a draft that does not fit the target."""
        from kimi.model.eagle3 import load_eagle3_draft

        if self.device.type != "cpu":
            raise ConfigError("--speculative-config: speculative decoding runs on the CPU reference path only for now")
        self.draft = load_eagle3_draft(
            spec.model,
            self.cfg,
            self.model.embed_tokens.detach(),
            dtype=self.dtype,
            device=self.device,
            dummy=spec.load_format == "dummy",
        )
        self.model.aux_layer_ids = self.draft.aux_layer_ids
        self.num_speculative_tokens = spec.num_speculative_tokens

    def _capture_graphs(self, model: KimiForCausalLM, max_batch: int) -> None:
        """Capture the decode graphs `decode_graph_plan` allows (logged on rank 0 when none). Lockstep (a collective
        all-to-all): the all-to-all is set to each bucket's static shapes before it is captured (DECODE mode, capacity
        the bucket, every rank's tokens at most the bucket); this is collective: every rank runs it, in the same
        order."""
        plan, why = decode_graph_plan(max_batch, self.world_size, self.a2a, self.ll_max_tokens_per_rank)
        if plan is None:
            if self.rank == 0:
                log.warning("CUDA graphs %s", why)
            return
        a2a, n = self.a2a, self.world_size
        on_bucket = None
        if plan.lockstep and a2a is not None:

            def on_bucket(bs: int) -> None:
                a2a.set_mode(DECODE, n * bs, bs, capacity=bs)

        max_blocks = -(-self.cfg.max_position_embeddings // self.block_size)
        model.capture_cuda_graphs(
            self.kv_caches,
            self.block_size,
            plan.buckets[-1],
            max_blocks,
            buckets=list(plan.buckets),
            on_bucket=on_bucket,
        )
        if model.graphs is not None:
            self.graph_plan = plan
        reset_a2a = getattr(a2a, "reset_counters", None)
        if reset_a2a is not None:
            reset_a2a()  # the captures' set_mode calls are no served steps

    def _check_requested_cache(self, cc: CacheConfig) -> None:
        """Raise KVCacheSizeError when an explicit cache size (--num-blocks, --kv-cache-memory-gib) exceeds the
        device's free memory before any weight is loaded (it could only fail after the load)."""
        if cc.num_blocks is not None:
            n, flag = cc.num_blocks, "--num-blocks"
        elif cc.kv_cache_memory_gib is not None:
            n, flag = self._num_blocks(cc), "--kv-cache-memory-gib"
        else:
            return
        check_kv_cache_fits(self.cfg, n, cc.block_size, self.dtype, self.device, flag)

    def _num_blocks(self, cc: CacheConfig) -> int:
        per_block = kv_cache_bytes_per_block(self.cfg, cc.block_size, self.dtype)
        if cc.num_blocks is not None:
            return cc.num_blocks
        if cc.kv_cache_memory_gib is not None:
            budget = cc.kv_cache_memory_gib * (1 << 30)
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = max(0.0, free - (1 - cc.gpu_memory_utilization) * total)
        else:
            budget = 0.5 * (1 << 30)
        n = int(budget // per_block)
        if n < 2:
            what = "--kv-cache-memory-gib" if cc.kv_cache_memory_gib is not None else "the free memory"
            raise KVCacheSizeError(
                f"no room for the KV cache: {what} leaves {budget / 2**20:.1f} MiB, less than two "
                f"blocks of {per_block} bytes (block 0 is the null block)"
            )
        return n

    # ---- one step -------------------------------------------------------------------------------------
    def _new_generator(self, sp: protocol.SamplingParams) -> torch.Generator | None:
        """A seeded request's generator, on the model's device (a CUDA generator when the runner is on cuda).

        `sample` draws the row's exponentials on the generator's device, so keeping it on the logits' device
        means no extra copy or sync; `execute` reseeds it per position before each draw.
        """
        if sp.seed is None:
            return None
        dev = self.device
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())  # the logits' device, spelled the same way
        g = torch.Generator(device=dev)
        g.manual_seed(sp.seed)
        return g

    @torch.inference_mode()
    def execute(self, plan: protocol.StepPlan) -> list[protocol.TokenOutput]:
        """Apply the plan's diff, run one forward over this rank's scheduled tokens, sample, return tokens."""
        return self.finish(self.launch(plan))

    def finish(self, handle: StepHandle) -> list[protocol.TokenOutput]:
        """Wait for a launched step's sampled tokens (one event), append them to their requests, return the step's
        TokenOutputs (the same list on every call)."""
        if handle.outputs is not None:
            return handle.outputs
        outputs: list[protocol.TokenOutput] = []
        if handle.launch is not None:
            res = handle.launch.result()
            for j, (rid, wr) in enumerate(handle.sampled):
                tok = res.token_ids[j]
                wr.token_ids.append(tok)
                wr.pending = False
                self.num_sampled += 1
                err = wr.guide.accept(tok) if wr.guide is not None else None
                outputs.append(
                    protocol.TokenOutput(
                        rid, tok, res.logprobs[j], res.top_ids[j], res.top_logprobs[j], *handle.plp[j], error=err
                    )
                )
        handle.outputs = outputs
        return outputs

    def _finish_prev(self, prev: StepHandle | None, on_prev: Callable[[StepHandle], None] | None) -> None:
        """Finish `prev` if it is not (a speculative step's handle comes back finished) and hand it to `on_prev`:
        the caller has not sent its result yet, whether or not it is finished."""
        if prev is not None:
            self.finish(prev)
            if on_prev is not None:
                on_prev(prev)

    @torch.inference_mode()
    def launch(
        self,
        plan: protocol.StepPlan,
        prev: StepHandle | None = None,
        on_prev: Callable[[StepHandle], None] | None = None,
    ) -> StepHandle:
        """Start a step: apply the plan's diff, launch the forward over this rank's scheduled tokens and the
        sampling; returns its StepHandle (`finish` waits for the tokens).

        Phases: `update_states` (the plan's diff), `prepare_inputs` (kimi.worker.inputs: the flat batch),
        `execute_model` (the forward), `sample` (logits of the rows that reach their request's end, sampling launched).
        prev: the step launched before this one, not finished yet (None: every earlier step is finished). On CUDA,
        when prev sampled anything, this step's forward is queued before prev is finished: a request
        whose input is the token prev sampled gets it on the device (prev's sampled ids, one gather into the
        step's inputs), so the GPU runs the two steps back to back while the host waits for prev's tokens. prev is
        finished before this step's sampling is launched (seeded draws, penalties and min_tokens read the token
        histories) and before prompt logprobs are read back, and `on_prev(prev)` is called as soon as it is, so its
        result can go out first. Otherwise prev is finished first. A runner with a draft runs the step through
        kimi.worker.speculative (synchronous: no overlap). Raises ProtocolError on plan inconsistencies.
        """
        if self.draft is not None:
            from kimi.worker.speculative import speculative_step

            return speculative_step(self, plan, prev, on_prev, position_seed)
        batch = self.update_states(plan)
        if not batch:
            self._finish_prev(prev, on_prev)
            if self.step_bucket is not None:
                self._idle_replay(self.step_bucket)
            elif self.world_size > 1:
                self._idle_step()
            return StepHandle(plan.step, [], None, [], {})
        if prev is not None and (
            (self.device.type != "cuda" and not self.overlap_cpu) or prev.launch is None or prev.outputs is not None
        ):
            self._finish_prev(prev, on_prev)  # nothing to overlap
        overlap = prev is not None and prev.outputs is None
        self.num_overlapped += overlap
        inputs = prepare_inputs(batch, self.block_size, prev.row_of if prev is not None else {})
        hidden = self.execute_model(inputs, prev)  # [T, D]
        if overlap:
            self._finish_prev(prev, on_prev)  # the GPU has this step queued; the host now waits for prev's tokens
        for _, wr, n in batch:
            wr.num_computed_tokens += n
        self._gather_prompt_logprobs(batch, inputs.plp_rows, hidden)
        if not inputs.sample_rows:
            return StepHandle(plan.step, [], None, [], {})
        return self.sample(plan.step, batch, inputs, hidden)

    def update_states(self, plan: protocol.StepPlan) -> list[ScheduledRow]:
        """Apply the plan's diff: drop its finished rids, add this rank's new requests, extend the continuing ones'
        block tables, set the all-to-all mode and (lockstep decode graphs) `step_bucket`, the bucket every rank replays:
        DecodeGraphPlan.bucket of every rank's tokens, which is the static all-to-all's capacity then; returns this
        rank's batch. Raises ProtocolError for a continuing rid never sent as new."""
        for rid in plan.finished:
            self.requests.pop(rid, None)
            self.rank_of.pop(rid, None)
            self.guided.drop(rid)
        per_rank = [0] * self.world_size
        for nr in plan.new:
            self.rank_of[nr.rid] = nr.dp_rank
            per_rank[nr.dp_rank] += nr.num_new_tokens
        for c in plan.cont:
            if c.rid not in self.rank_of:
                raise ProtocolError(f"step {plan.step}: continuing rid {c.rid} was never sent as new")
            per_rank[self.rank_of[c.rid]] += c.num_new_tokens
        single = all(nr.num_new_tokens == 1 for nr in plan.new) and all(c.num_new_tokens == 1 for c in plan.cont)
        mode = step_mode(per_rank, single, self.ll_max_tokens_per_rank)
        gp = self.graph_plan
        self.step_bucket = gp.bucket(per_rank, mode == DECODE) if gp is not None and gp.lockstep else None
        if self.a2a is not None:
            self.a2a.set_mode(mode, sum(per_rank), max(per_rank, default=0), capacity=self.step_bucket)
        batch: list[ScheduledRow] = []
        for nr in plan.new:
            if nr.dp_rank == self.rank:
                batch.append((nr.rid, self._add_request(nr), nr.num_new_tokens))
        for c in plan.cont:
            req = self.requests.get(c.rid)
            if req is None:
                continue  # another DP rank's request
            req.block_table.extend(c.new_block_ids)
            batch.append((c.rid, req, c.num_new_tokens))
        return batch

    def _add_request(self, nr: protocol.NewRequest) -> WorkerRequest:
        """A new (or re-sent after preemption) request of this rank: its state, guide and prompt-logprob lists."""
        self.num_requests += 1
        wr = WorkerRequest(
            list(nr.token_ids),
            nr.num_computed_tokens,
            list(nr.block_ids),
            nr.sampling,
            self._new_generator(nr.sampling),
            num_prompt_tokens=nr.num_prompt_tokens if nr.num_prompt_tokens >= 0 else len(nr.token_ids),
        )
        if nr.sampling.grammar is not None:  # re-sent after preemption: its outputs so far are replayed
            wr.guide = self.guided.add(nr.rid, nr.sampling.grammar, wr.token_ids[wr.num_prompt_tokens :])
        if nr.sampling.prompt_logprobs >= 0:
            n_p = wr.num_prompt_tokens
            wr.prompt_lp, wr.prompt_top_ids, wr.prompt_top_lps = [None] * n_p, [None] * n_p, [None] * n_p
        self.requests[nr.rid] = wr
        return wr

    def execute_model(self, inputs: StepInputs, prev: StepHandle | None) -> torch.Tensor:
        """Run the forward over the step's flat batch; returns the hidden states [T, hidden] (after the final norm).

        Tokens still on the device (`inputs.fills`) are gathered from prev's sampled ids into the inputs first. A pure
        decode batch on a model with captured CUDA graphs (`model.graphs`) goes from the host lists straight to
        `forward_decode` (a graph replay, kimi/worker/cuda_graph.py); anything else builds its AttentionMetadata and
        runs the model. Lockstep graphs (`graph_plan.lockstep`): the replay is of `step_bucket`, the bucket every rank
        replays, and only when it is set; an eager step is planned first, so it never replays a graph of another
        bucket (its static all-to-all runs at the step's capacity, the shapes of the other ranks' collectives)."""
        dev = self.device
        fill = None
        if inputs.fills:  # (input rows, prev's sampled ids, their rows): applied on the device before the forward
            assert prev is not None and prev.launch is not None, "pending tokens come from prev's sampling"
            idx = torch.tensor(inputs.fills, dtype=torch.long)  # [P, 2]
            if dev.type == "cuda":
                idx = idx.pin_memory().to(dev, non_blocking=True)
            fill = (idx[:, 0], prev.launch.ids, idx[:, 1])
        lockstep = self.graph_plan is not None and self.graph_plan.lockstep
        replay = self.model.graphs is not None and not inputs.plp_rows and all(q == 1 for q in inputs.query_lens)
        if replay and (not lockstep or self.step_bucket is not None):
            hidden: torch.Tensor = self.model.forward_decode(
                inputs.input_ids,
                inputs.positions,
                inputs.seq_lens,
                inputs.tables,
                self.block_size,
                self.kv_caches,
                fill=fill,
                bucket=self.step_bucket if lockstep else None,
            )
            return hidden
        attn = build_attention_metadata(inputs.query_lens, inputs.seq_lens, inputs.tables, self.block_size, dev)
        if lockstep:
            self.model.plan_eager(attn)  # attn.plan set: the forward runs eagerly, never a graph
        ids = torch.tensor(inputs.input_ids, dtype=torch.long, device=dev)
        if fill is not None:
            ids.index_copy_(0, fill[0], fill[1].index_select(0, fill[2]))
        positions = torch.tensor(inputs.positions, dtype=torch.long, device=dev)
        out: torch.Tensor = self.model(ids, positions, attn, self.kv_caches)
        return out

    def _gather_prompt_logprobs(
        self, batch: list[ScheduledRow], plp_rows: list[tuple[int, int, int]], hidden: torch.Tensor
    ) -> None:
        """Store the prompt logprobs of the rows predicting prompt tokens (after num_computed_tokens advanced)."""
        dev = self.device
        for i, first_row, start in plp_rows:
            wr = batch[i][1]
            stop = min(wr.num_computed_tokens, wr.num_prompt_tokens - 1)  # last position whose next token is prompt
            rows = torch.arange(first_row, first_row + stop - start, device=dev)
            lp, tids, tlps = prompt_logprobs(
                self.model.compute_logits(hidden[rows]), wr.token_ids[start + 1 : stop + 1], wr.sampling.prompt_logprobs
            )
            p_lp, p_ids, p_lps = wr.prompt_lp, wr.prompt_top_ids, wr.prompt_top_lps
            assert p_lp is not None and p_ids is not None and p_lps is not None, "execute sets all three"
            for j in range(stop - start):
                p_lp[start + 1 + j] = lp[j]
                if tids is not None and tlps is not None:
                    p_ids[start + 1 + j] = tids[j]
                    p_lps[start + 1 + j] = tlps[j]

    def sample(self, step: int, batch: list[ScheduledRow], inputs: StepInputs, hidden: torch.Tensor) -> StepHandle:
        """Launch the sampling of the rows in `inputs.sample_rows` (logits [S, vocab] f32 from hidden [T, D]); the
        sampled requests' next tokens are then pending. Returns the step's StepHandle."""
        sample_rows, sample_idx = inputs.sample_rows, inputs.sample_idx
        if len(sample_rows) == hidden.shape[0]:  # every row is sampled (decode): no gather
            logits = self.model.compute_logits(hidden)  # [S, vocab] f32
        else:
            logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])  # [S, vocab] f32
        params = [batch[i][1].sampling for i in sample_idx]
        gens = [batch[i][1].generator for i in sample_idx]
        for i, g in zip(sample_idx, gens):
            if g is not None:
                # A seeded draw depends only on (seed, position), so a request recomputed after preemption
                # (a fresh WorkerRequest) samples exactly what it would have sampled uninterrupted.
                wr = batch[i][1]
                assert wr.sampling.seed is not None, "only a seeded request has a generator"
                g.manual_seed(position_seed(wr.sampling.seed, len(wr.token_ids)))
        guides = [(j, gd) for j, i in enumerate(sample_idx) if (gd := batch[i][1].guide) is not None]
        res = sample_launch(  # batched on the logits' device; one device->host copy for the whole step
            logits,
            params,
            gens,
            [batch[i][1].token_ids for i in sample_idx],
            [batch[i][1].num_prompt_tokens for i in sample_idx],
            bitmask=self.guided.fill(guides, len(sample_idx)) if guides else None,
        )
        sampled, row_of = [], {}
        plp: list[PromptLogprobs] = []
        for j, i in enumerate(sample_idx):
            rid, wr, _ = batch[i]
            wr.pending = True
            sampled.append((rid, wr))
            row_of[rid] = j
            plp.append(
                (wr.prompt_lp, wr.prompt_top_ids, wr.prompt_top_lps) if wr.prompt_lp is not None else (None, None, None)
            )
            wr.prompt_lp = wr.prompt_top_ids = wr.prompt_top_lps = None  # sent once
        return StepHandle(step, sampled, res, plp, row_of)

    def close(self) -> None:
        """Release what outlives a step (the guided-decoding compile thread)."""
        self.guided.close()

    def warmup_token_counts(self, max_tokens: int) -> list[int]:
        """Step sizes T <= max_tokens at which the routed experts' backend switches to another JIT-compiled kernel
        (its `kernel_variants`; every MoE layer has the same shapes, so the first one's), for the start-up warm-up;
        [] when the backend compiles nothing per size."""
        for layer in self.model.layers:
            variants = getattr(getattr(layer.mlp, "experts_impl", None), "kernel_variants", None)
            if variants is not None:
                return list(variants(max_tokens, self.cfg.num_experts_per_tok))
        return []

    def reset_counters(self) -> None:
        """Zero the served counts (after the start-up warm-up, kimi.worker.warmup): requests, sampled tokens, idle and
        overlapped steps, constrained requests, the all-to-all's layout counts, and the CUDA graphs' replay and
        plan-ahead counts."""
        self.num_requests = self.num_sampled = self.num_idle_steps = self.num_overlapped = 0
        self.guided.num_requests = 0
        reset_a2a = getattr(self.a2a, "reset_counters", None)
        if reset_a2a is not None:
            reset_a2a()
        graphs = getattr(self.model, "graphs", None)
        if graphs is not None:
            graphs.reset_counters()

    def _idle_replay(self, bucket: int) -> None:
        """No local tokens in a decode step where other ranks decode (lockstep graphs): replay `bucket`, the one every
        rank replays, with every row padding (row_valid 0: no expert; their cache writes go to the null block), so
        this rank issues the other ranks' collectives in their shapes; the output is dropped."""
        self.model.forward_decode([], [], [], [], self.block_size, self.kv_caches, bucket=bucket)
        self.num_idle_steps += 1

    def _idle_step(self) -> None:
        """No local tokens this step: run every MoE layer's dispatch / combine on a [0, hidden] batch, in layer
        order, so this rank issues the same collectives as the ranks that run a forward (nothing is written to
        the KV cache; attention and dense layers have no collectives)."""
        empty = torch.empty(0, self.cfg.hidden_size, dtype=self.dtype, device=self.device)  # [0, D]
        for layer in self.model.layers:
            if layer.is_moe:
                layer.mlp(empty)
        self.num_idle_steps += 1


def guided_requests(model: str, cfg: ModelConfig) -> GuidedRequests:
    """A rank's GuidedRequests for the checkpoint `model` (its tokenizer, or the controller's for `preset:` models,
    is loaded at the first constrained request; kimi.structured_output.vocab.load_tokenizer)."""
    return GuidedRequests(
        lambda: GrammarBackend(load_tokenizer(model), cfg.vocab_size, cfg.eos_token_ids),
        cfg.vocab_size,
    )
