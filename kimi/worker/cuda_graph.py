"""CUDA graphs for decode steps (docs/design.md, Forward on the GPU).

Per decode batch bucket (`bucket_sizes`: 1, 2, 4, 8, 16, 24, 32, 48, 64, then every 32 up to the largest, which
is max_batch), captured largest first into one shared memory pool: the whole model forward (embedding -> final
norm) of `bucket` decode rows over static input buffers, as one graph or (LAYERS_PER_GRAPH > 0) a chain of graphs
of that many layers each (the first also embeds), replayed in order; each segment's (residual, normed) outputs are
the next one's inputs.
The logits and sampling run eagerly after it on the rows in use.

Padding: a batch of B <= bucket sequences fills rows [0, B); rows [B, bucket) get token 0 at position 0, slot 0
of the null block 0 (their cache writes land there), and attend over that block with seq_len 1. A fourth static
input row, `row_valid` (1 for rows [0, B), 0 past them), goes to the MoE router
(kimi.kernels.triton.fused.router_topk), which
gives padding rows no expert: the expert GEMMs see only the batch's own (token, expert) pairs. Padding rows still
run the dense layers and attention (a bucket's static shape); their outputs are dropped.

Many ranks (`DecodeGraphPlan`, `decode_graph_plan`): with a collective all-to-all of static decode shapes (nccl's static
layout, DeepEP's low-latency mode) the graphs hold the MoE layers' collectives, so every rank captures the same buckets
in the same order (`on_bucket` sets the all-to-all to the bucket's shapes first; the warm-up runs issue the collectives
eagerly before each capture) and every rank replays the same bucket in a step: the bucket of the busiest rank, chosen
from the step plan (`run_host`'s `bucket`; a rank with no rows replays it with padding rows only).

Attention: the model's decode attention backend (`KimiForCausalLM.decode_attention_backend`, kimi.backends.attention)
gives the runner its capture / replay hooks (`AttentionBackend.graph_attention` -> DecodeGraphAttention, the contract
in kimi/backends/attention/__init__.py): per bucket the run its graphs capture (`fi`), the eager plan of a bucket
(`_plan`), what is sent or planned before each replay (`stage`, `plan_replay`) and the plan of the bucket's next step
while a replay runs (`plan_ahead`: same batch, every length + 1). A backend that reads page ids from the static input
(`graph_page_rows`: FlashInfer) gets them in the runner's one pinned copy: row b's pages at b * page_stride, kept from
step to step, only the ones the device does not hold yet (`_stage_pages`). The Triton decode kernel sends its own
lengths and tables (two more pinned copies) and plans nothing; FlashInfer plans on the host (nothing to do when the
previous replay planned this step ahead: FlashInferMLA.plan_ahead).
"""

from __future__ import annotations

import functools
import logging
import operator
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kimi.backends.attention import AttentionPlan, AttentionRun
from kimi.model.attention import AttentionMetadata

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

__all__ = ["CudaGraphRunner", "DecodeGraphPlan", "bucket_sizes", "decode_graph_plan", "run_before_capture"]

log = logging.getLogger(__name__)

_BASE = (1, 2, 4, 8, 16, 24, 32, 48, 64)
# Layers per captured graph (0: the whole forward in one graph). A chain of smaller graphs lets the GPU run segment
# k while the host launches segment k + 1. On the H200 (K2.6, 61 layers) that gains nothing: one graph 23.44 / 32.25
# ms at 8 / 32 local seqs, 8-layer segments 23.51 / 32.40, 2 and 4 likewise (segments are faster only after a
# torch.profiler run in the same process; docs/performance.md), so one graph is the default.
LAYERS_PER_GRAPH = 0


# run_host copies its staging buffer's used prefix rounded up to a multiple of this many int64 words
_COPY_ROUND = 256
# run_host's marker of a padded row's page table (the null block 0)
_PAD_ROW = [0]
# the fewest pages per row of run_host's page layout (CudaGraphRunner.page_stride)
_MIN_PAGE_STRIDE = 16

# CudaGraphRunner.host_marks: host times of the last run_host, us from its start, at these points (tables_built: the
# tables checked; inputs_staged: ids, positions, slots and the page rows written to the staging buffer)
HOST_MARKS = ("tables_built", "staging_free", "inputs_staged", "copy_launched", "attention_planned", "replay_launched")


def run_before_capture(fn: Callable[[], object], device: torch.device, runs: int = 2) -> None:
    """Run fn `runs` times eagerly on a side stream (what a capture will record: Triton's JIT and first-use work
    happen here, not inside the capture), then wait for the device."""
    s = torch.cuda.Stream(device)
    s.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(s):
        for _ in range(runs):
            fn()
    torch.cuda.current_stream(device).wait_stream(s)
    torch.cuda.synchronize(device)


def bucket_sizes(max_batch: int) -> list[int]:
    """Decode batch buckets up to max_batch (always included): 1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, ...

    Raises ValueError when max_batch < 1.
    """
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    out = [b for b in _BASE if b < max_batch]
    b = 96
    while b < max_batch:
        out.append(b)
        b += 32
    out.append(max_batch)
    return out


@dataclass(frozen=True)
class DecodeGraphPlan:
    """Which decode graph every rank replays in a step, chosen from the step plan alone (no collective), so that every
    rank issues the same collectives in the same shapes.

    buckets: the captured buckets, ascending, the same list on every rank. lockstep: the all-to-all is collective
    (kimi.backends.all_to_all: TorchAllToAll on its static layout, DeepEP in low-latency mode; also with one rank):
    every rank then replays the bucket of the LARGEST local decode batch over all DP ranks (`bucket`), its own rows
    [0, B) valid and the rest padding (row_valid 0: no expert, id -1 in the static layout), a rank with no local rows
    too (all rows padding, its output dropped); the static all-to-all's capacity in that step is the bucket (the shape
    the graph's collectives were captured with). Not lockstep (the `local` backend, one rank): a rank replays the
    bucket of its own batch, as before.
    """

    buckets: tuple[int, ...]
    lockstep: bool

    def bucket(self, per_rank: Sequence[int], decode: bool) -> int | None:
        """The bucket every rank replays this step: the smallest bucket >= max(per_rank) (per_rank: each DP rank's
        tokens this step, from the plan); None (every rank runs eagerly) when the step is not a decode step of
        static shapes (`decode`: lockstep, the all-to-all's DECODE mode; else every request computes one token), no
        rank has tokens, or the busiest rank has more than the largest bucket."""
        most = max(per_rank, default=0)
        if not decode or most == 0:
            return None
        return next((b for b in self.buckets if b >= most), None)


def decode_graph_plan(
    max_batch: int, world_size: int, a2a: object | None, ll_max_tokens_per_rank: int
) -> tuple[DecodeGraphPlan | None, str]:
    """The decode graphs a rank captures: (plan, "") or (None, the reason none are). max_batch: the largest bucket asked
    for (`--cuda-graph-max-bs`; 0: none); a2a: the rank's all-to-all backend (kimi.backends.all_to_all; None: local).
    A backend that exchanges nothing (`collective` False) serves one rank only; any decode batch up to max_batch
    replays. A collective one needs `graph_capturable` (nccl: the static decode layout; DeepEP: low-latency mode)
    and its buckets stop at ll_max_tokens_per_rank, the most tokens per rank of a DECODE step (larger steps run the
    variable splits / normal mode, eagerly). Every rank computes the same from the same flags."""
    if max_batch <= 0:
        return None, "off (--cuda-graph-max-bs 0 / --enforce-eager)"
    collective = bool(getattr(a2a, "collective", False))
    if not collective:
        if world_size != 1:
            return None, f"off: the all-to-all backend exchanges nothing, with {world_size} ranks"
        return DecodeGraphPlan(tuple(bucket_sizes(max_batch)), lockstep=False), ""
    if not getattr(a2a, "graph_capturable", False):
        return None, "off: the all-to-all's variable splits read counts on the host (use --a2a-static-decode)"
    return DecodeGraphPlan(tuple(bucket_sizes(min(max_batch, ll_max_tokens_per_rank))), lockstep=True), ""


class CudaGraphRunner:
    """Captures and replays decode graphs of a fused KimiForCausalLM (kimi/model/gpu_forward.py).

    model: the fused model on CUDA; kv_caches: the per-layer cache buffers the graphs bind to (never reallocated);
    block_size: tokens per block; max_batch: largest bucket; max_blocks_per_seq: widest block table a
    replayed batch may have (a page-row backend's buckets share one kv_indices buffer of max_batch * this many
    pages);
    buckets: capture only these sizes (default bucket_sizes(max_batch)); layers_per_graph: layers per graph
    segment (None or <= 0: one graph for the whole forward); plan_ahead: plan the next decode step while a
    replay runs (`run_host`; backends whose hooks plan ahead only: FlashInfer); on_bucket: called with each bucket
    before its warm-up runs and capture (the all-to-all set to that bucket's static shapes: its collectives are
    captured; with many ranks every rank captures the same buckets in the same order, largest first).
    """

    # padding rows get no expert (row_valid 0, see the module docstring); False routes them like real rows (for
    # comparisons; tests/gpu/test_gpu_model.py checks the batch's outputs are bit-equal either way); read by each
    # run_host
    mask_padding = True

    def __init__(
        self,
        model,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_batch: int,
        max_blocks_per_seq: int,
        buckets: list[int] | None = None,
        layers_per_graph: int | None = LAYERS_PER_GRAPH,
        plan_ahead: bool = True,
        on_bucket: Callable[[int], None] | None = None,
    ):
        self.model = model
        self.on_bucket = on_bucket
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.buckets = sorted(buckets) if buckets else bucket_sizes(max_batch)  # explicit buckets: benchmarks
        self.max_batch = self.buckets[-1]
        self.device = model.embed_tokens.device
        self.attention = model.decode_attention_backend()
        self.page_rows = self.attention.graph_page_rows  # page ids travel in the static input (`_stage_pages`)
        self._init_inputs()
        # the attention's capture / replay hooks; per bucket its attention run: `fi`
        self.graph_attention = self.attention.graph_attention(
            self.buckets, block_size, max_blocks_per_seq, self.kv_indices if self.page_rows else None
        )
        self.fi: Mapping[int, AttentionRun] = self.graph_attention.runs
        # layer segments, one CUDA graph each (see the module docstring): [(start, end), ...] covering all layers
        n = len(model.layers)
        per = n if layers_per_graph is None or layers_per_graph <= 0 else layers_per_graph
        self.segments = [(a, min(a + per, n)) for a in range(0, n, per)] or [(0, 0)]
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool: _POOL_HANDLE | None = None
        self.num_replays = 0
        # plan ahead: after launching a decode replay, plan the bucket's next step for the same batch one token
        # further (the hooks' plan_ahead) while the GPU runs, so a steady decode step skips the host planning before
        # its replay
        self.plan_ahead = plan_ahead and self.graph_attention.plans_ahead
        self._ahead_failed = False  # a plan-ahead error was logged (once)
        # host times of the last run_host (benchmarks), us from its start, in the order of HOST_MARKS
        self.host_marks = (0.0,) * len(HOST_MARKS)

    def _init_inputs(self) -> None:
        """The static inputs: one int64 device buffer holding [4, max_batch] (token ids, positions, cache slots,
        row_valid) and, for a page-row backend, the page ids (int32, the buckets' shared kv_indices buffer: one bucket
        runs at a time; row b's pages at b * page_stride in every bucket, kept from step to step: _stage_pages), so
        the host fast path (run_host) sends a step's inputs in ONE pinned, non-blocking copy; its pinned staging
        buffer of the same layout."""
        dev = self.device
        mb, nb = self.max_batch, 4 * self.max_batch
        kv_words = -(-self.max_batch * self.max_blocks_per_seq // 2) if self.page_rows else 0
        self.dev_in = torch.zeros(nb + kv_words, dtype=torch.int64, device=dev)
        self.static_in = self.dev_in[:nb].view(4, mb)
        self.input_ids = self.static_in[0]  # [max_batch]
        self.positions = self.static_in[1]  # [max_batch]
        self.slot_mapping = self.static_in[2]  # [max_batch]
        self.row_valid = self.static_in[3]  # [max_batch]: 1 for a batch's rows, 0 for padding (the MoE router's mask)
        self.kv_indices = self.dev_in[nb:].view(torch.int32)  # [>= max_batch * max_blocks_per_seq] page ids
        self.host_in = torch.zeros(nb + kv_words, dtype=torch.int64, pin_memory=True)  # staging, same layout
        self._host_np = self.host_in[:nb].numpy().reshape(4, mb)
        self._host_kv = self.host_in[nb:].numpy().view(np.int32)
        self._host_in_free: torch.cuda.Event | None = None  # recorded after the staging copy
        self.page_stride = _MIN_PAGE_STRIDE  # run_host's pages per row of kv_indices (`_page_stride`)
        self._forget_pages()  # run_host's page rows: which table each row of kv_indices holds
        self.page_rows_copied = 0  # the last run_host's copy covered page rows [0, this) (0: none changed; tests)
        self._copy_views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # words -> (dev_in, host_in) prefixes

    def bucket_for(self, batch: int) -> int:
        """Smallest bucket >= batch; raises ValueError when batch exceeds the largest."""
        for b in self.buckets:
            if b >= batch:
                return b
        raise ValueError(f"batch {batch} exceeds the largest CUDA graph bucket {self.max_batch}")

    def can_run(self, attn: AttentionMetadata) -> bool:
        """A pure decode batch (every query_len 1) of at most max_batch sequences with narrow enough tables."""
        B = attn.num_seqs
        return (
            0 < B <= self.max_batch
            and all(q == 1 for q in attn.query_lens_cpu)
            and attn.block_tables.shape[1] <= self.max_blocks_per_seq
            and attn.block_size == self.block_size
        )

    def _plan(self, bs: int, seq_lens_cpu: list[int], block_tables: torch.Tensor) -> AttentionRun:
        """Plan bucket bs with rows past len(seq_lens_cpu) padded (seq_len 1 over the null block 0): the hooks'
        plan_capture (eager, outside any graph; a page-row backend writes kv_indices in its own layout, so the
        page rows run_host kept are forgotten)."""
        if self.page_rows:
            self._forget_pages()
        return self.graph_attention.plan_capture(bs, seq_lens_cpu, block_tables)

    def _meta(self, bs: int, fi: AttentionRun) -> AttentionMetadata:
        attn = AttentionMetadata(
            query_start_loc=torch.arange(bs + 1, dtype=torch.int64, device=self.device),
            seq_lens=torch.ones(bs, dtype=torch.int64, device=self.device),
            block_tables=torch.zeros((bs, 1), dtype=torch.int64, device=self.device),
            slot_mapping=self.slot_mapping[:bs],
            block_size=self.block_size,
            query_lens_cpu=[1] * bs,
            seq_lens_cpu=[1] * bs,
        )
        attn.plan = AttentionPlan(fi, self.slot_mapping[:bs], True)
        return attn

    @torch.inference_mode()
    def reset_counters(self) -> None:
        """Zero num_replays and the FlashInfer wrappers' plan-ahead hits / misses (after the start-up warm-up)."""
        self.num_replays = 0
        for fi in self.fi.values():
            if hasattr(fi, "ahead_hits") and hasattr(fi, "ahead_misses"):  # FlashInfer's (Triton plans nothing)
                fi.ahead_hits = fi.ahead_misses = 0

    def _forward(self, bs: int, attn: AttentionMetadata) -> torch.Tensor:
        """The whole forward of bucket bs over the static inputs, eagerly (what its graph segments hold together)."""
        n = len(self.model.layers)
        h, x = self.model.embed_fused(self.input_ids[:bs])
        _, x = self.model.layers_fused(
            h, x, self.positions[:bs], attn, self.kv_caches, 0, n, row_valid=self.row_valid[:bs]
        )
        return x

    def capture(self) -> None:
        """Capture every bucket, largest first, into one memory pool (warm-up runs first: JIT, autotune)."""
        self.input_ids.zero_()
        self.positions.zero_()
        self.slot_mapping.zero_()
        self.row_valid.fill_(1)
        # with collectives in the graphs (on_bucket), other threads may make CUDA calls during a capture: the process
        # group's watchdog queries the events of the warm-up's collectives; "global" would fail those calls
        capture_mode = "global" if self.on_bucket is None else "thread_local"
        for bs in sorted(self.buckets, reverse=True):
            if self.on_bucket is not None:
                self.on_bucket(bs)
            fi = self._plan(bs, [], torch.zeros((0, 1), dtype=torch.int64, device=self.device))
            attn = self._meta(bs, fi)
            args = (self.input_ids[:bs], self.positions[:bs], attn, self.kv_caches)
            valid = self.row_valid[:bs]
            run_before_capture(functools.partial(self._forward, bs, attn), self.device)  # Triton JIT, autotuning
            chain = []
            h: torch.Tensor | None = None
            x: torch.Tensor | None = None
            for start, end in self.segments:  # one graph per segment of layers, replayed in this order
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool, capture_error_mode=capture_mode):
                    if start == 0:
                        h, x = self.model.embed_fused(args[0])
                    h, x = self.model.layers_fused(
                        h, x, args[1], attn, self.kv_caches, start, end, row_valid=valid
                    )  # [bs, D]
                if self.pool is None:
                    self.pool = g.pool()
                chain.append(g)
            self.graphs[bs] = chain
            assert x is not None, "segments start at layer 0, whose graph runs embed_fused"
            self.outputs[bs] = x
        torch.cuda.synchronize(self.device)

    def can_run_host(self, seq_lens: list[int], block_size: int) -> bool:
        """`can_run` for run_host's host lists (a pure decode batch by construction)."""
        B = len(seq_lens)
        return (
            0 < B <= self.max_batch
            and block_size == self.block_size
            and -(-max(seq_lens) // block_size) <= self.max_blocks_per_seq
        )

    def run_host(
        self,
        input_ids: list[int],
        positions: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        fill=None,
        bucket: int | None = None,
    ) -> torch.Tensor:
        """Replay a decode batch given as host lists (the worker's fast path: no AttentionMetadata, no device
        kernels before the replay): token id, position (= seq_len - 1), context length and block ids per
        sequence -> hidden [B, D] (a view of the graph's output buffer, valid until the next replay).

        The cache slots are computed on the host; ids, positions and slots (padded rows: token 0, position 0,
        slot 0 of the null block) and, for a page-row backend, the page ids the device does not hold yet (row b's
        pages at b * page_stride, kept from step to step: `_stage_pages`, whose contract on block_tables applies) go
        to the static input buffer in ONE pinned non-blocking copy; then the attention hooks' `stage` (Triton: the
        lengths and tables by two more pinned copies) and `plan_replay` (FlashInfer's schedule: nothing to do when
        the previous call planned this step ahead). After launching the replay, with `plan_ahead`, the bucket's next
        step (same batch, every length + 1) is planned while the GPU works. fill: see KimiForCausalLM.forward_decode
        (applied to the static token ids after the staging copy, on the device). bucket: replay this bucket (a
        captured one, >= B) instead of the smallest holding B (DecodeGraphPlan: every rank replays the same one); with
        it B may be 0 (a rank with no rows of its own: every row is padding, the result is [0, D]). Raises ValueError
        when the batch exceeds the largest bucket (or `bucket`), `bucket` was not captured, or a table is too short.
        """
        t0 = time.perf_counter()
        B = len(input_ids)
        if (B == 0 and bucket is None) or not len(positions) == len(seq_lens) == len(block_tables) == B:
            raise ValueError(
                f"run_host: {B} input ids, {len(positions)} positions, {len(seq_lens)} lengths, "
                f"{len(block_tables)} block tables (want the same number, at least 1 without a bucket)"
            )
        if bucket is None:
            bs = self.bucket_for(B)
        elif bucket not in self.graphs or bucket < B:
            raise ValueError(f"run_host: bucket {bucket} for {B} rows; captured buckets {self.buckets}")
        else:
            bs = bucket
        ks = (self._check_tables(seq_lens, block_tables) if B else []) if self.page_rows else None  # pages per sequence
        W = self._page_stride(max(ks)) if ks else self.page_stride
        t_built = time.perf_counter()
        if self._host_in_free is not None:
            self._host_in_free.synchronize()  # the previous step's copy has left the staging buffer
        t_free = time.perf_counter()
        hi = self._stage_inputs(input_ids, positions, block_tables, ks, W, bs)
        t_staged = time.perf_counter()
        self._copy_inputs(hi, W)
        if fill is not None:  # tokens the previous step sampled, still on the device
            self.input_ids.index_copy_(0, fill[0], fill[1].index_select(0, fill[2]))
        t1 = time.perf_counter()
        self.graph_attention.stage(bs, seq_lens, block_tables)
        if self._host_in_free is None:
            self._host_in_free = torch.cuda.Event()
        self._host_in_free.record(torch.cuda.current_stream(self.device))
        self.graph_attention.plan_replay(bs, seq_lens, W)  # the schedule: planned ahead by the previous call, or now
        t2 = time.perf_counter()
        self.replay(bs)
        self.host_marks = tuple((t - t0) * 1e6 for t in (t_built, t_free, t_staged, t1, t2, time.perf_counter()))
        self.num_replays += 1
        if B and self.plan_ahead and self.graph_attention.plans_ahead:
            self._plan_next(bs, seq_lens)
        return self.outputs[bs][:B]

    def _check_tables(self, seq_lens: list[int], block_tables: list[list[int]]) -> list[int]:
        """Pages per sequence (ceil(seq_len / block_size)); raises ValueError naming the first sequence whose table
        is shorter than that or whose pages exceed max_blocks_per_seq."""
        blk = self.block_size
        ks = [-(-n // blk) for n in seq_lens]  # pages per sequence
        mx = self.max_blocks_per_seq
        if max(ks) > mx or any(map(operator.gt, ks, map(len, block_tables))):
            b = next(b for b, (t, k) in enumerate(zip(block_tables, ks)) if k > len(t) or k > mx)
            raise ValueError(
                f"run_host: sequence {b}: {seq_lens[b]} tokens need {ks[b]} blocks; table has "
                f"{len(block_tables[b])}, the graphs at most {mx}"
            )
        return ks

    def _stage_inputs(
        self,
        input_ids: list[int],
        positions: list[int],
        block_tables: list[list[int]],
        ks: list[int] | None,
        W: int,
        bs: int,
    ) -> int:
        """Write a step's ids, positions, slots and row_valid into the staging buffer (rows [B, bs): padding), and
        with ks (a page-row backend: pages per sequence) the page rows at stride W (`_stage_pages`); returns the last
        page row written, -1 if none."""
        B = len(input_ids)
        blk = self.block_size
        pad = bs - B
        h = self._host_np
        h[0, :B] = input_ids
        h[1, :B] = positions
        h[2, :B] = [t[p // blk] * blk + p % blk for t, p in zip(block_tables, positions)]
        h[3, :B] = 1
        if pad:
            h[:, B:bs] = 0
            if not self.mask_padding:
                h[3, B:bs] = 1
        if ks is None:
            return -1
        if self.page_stride != W:  # another layout: every row is written again
            self._forget_pages()
            self.page_stride = W
        hi = self._stage_pages(block_tables, ks, B, bs)
        self.page_rows_copied = hi + 1
        return hi

    def _copy_inputs(self, hi: int, W: int) -> None:
        """The inputs and the page rows [0, hi] of the staging buffer, rounded up to _COPY_ROUND words (past them:
        rows the device holds already, or stale words no kernel reads) so that few (dst, src) views are ever made;
        one pinned non-blocking copy. On an error the page rows are forgotten (they did not reach the device)."""
        words = 4 * self.max_batch + ((hi + 1) * W + 1) // 2
        n_in = min(self.host_in.numel(), -(-words // _COPY_ROUND) * _COPY_ROUND)
        views = self._copy_views.get(n_in)
        try:
            if views is None:
                views = self._copy_views[n_in] = (self.dev_in[:n_in], self.host_in[:n_in])
            views[0].copy_(views[1], non_blocking=True)
        except BaseException:
            self._forget_pages()  # the rows _stage_pages counted as staged did not reach the device
            raise

    def _plan_next(self, bs: int, seq_lens: list[int]) -> None:
        """Plan ahead (after the replay was launched): the same batch one token further (padded rows stay at length
        1); the next run_host of this bucket uses it when its lengths are exactly these, any other plan of the bucket
        discards it. A failure is logged once; the next step then plans before its replay."""
        k_next = -(-(max(seq_lens) + 1) // self.block_size)
        if k_next > self.max_blocks_per_seq:
            return
        try:
            self.graph_attention.plan_ahead(bs, [n + 1 for n in seq_lens], self._page_stride(k_next))
        except Exception as e:
            if not self._ahead_failed:
                self._ahead_failed = True
                log.warning("plan ahead failed (%s: %s); the next step plans before its replay", type(e).__name__, e)

    def _page_stride(self, max_pages: int) -> int:
        """Pages per row of run_host's kv_indices layout for a batch whose longest table needs max_pages: the next
        power of two, at least _MIN_PAGE_STRIDE, at most max_blocks_per_seq. So a step's copy covers at most about
        twice the rectangle of its tables, however long the longest context the graphs allow, and the layout
        changes (every row written again) only when the longest table crosses a power of two."""
        return min(self.max_blocks_per_seq, max(_MIN_PAGE_STRIDE, 1 << (max_pages - 1).bit_length()))

    def _stage_pages(self, block_tables: list[list[int]], ks: list[int], B: int, bs: int) -> int:
        """Write the page ids of rows [0, bs) that the device does not hold yet into the staging buffer, row b's
        ks[b] pages at b * page_stride (padded rows: the null block 0); returns the last row written, -1 if
        none. Row b's pages are known to be on the device when block_tables[b] is the list object staged there last
        (a strong reference is kept): then only its pages past those staged are written. So a table passed again
        must be the same list grown at its end only (the worker's WorkerRequest.block_table: extended by each step's
        new block ids); a table that changes otherwise must come as a new list."""
        W = self.page_stride
        kv = self._host_kv
        tabs, staged = self._row_tables, self._row_pages
        hi = -1
        for b in range(B):
            t, k = block_tables[b], ks[b]
            if t is tabs[b]:
                s = staged[b]
                if k <= s:
                    continue
                kv[b * W + s : b * W + k] = t[s:k]
            else:
                kv[b * W : b * W + k] = t[:k]
                tabs[b] = t
            staged[b] = k
            hi = b
        for b in range(B, bs):
            if tabs[b] is not _PAD_ROW:
                kv[b * W] = 0
                tabs[b], staged[b] = _PAD_ROW, 1
                hi = b
        return hi

    def _forget_pages(self) -> None:
        """Mark every row's page ids unknown (after something else wrote the kv_indices buffer: `_plan`)."""
        self._row_tables: list[list[int] | None] = [
            None
        ] * self.max_batch  # per row: the table list staged there (_PAD_ROW: padding)
        self._row_pages = [0] * self.max_batch  # per row: its pages staged

    def replay(self, bs: int) -> None:
        """Launch bucket bs's graphs (its layer segments, in order) on the current stream, with the attention
        schedule last planned for the bucket: after a `run_host` with plan_ahead that is the NEXT step's, so plan
        again (`_plan`) before replaying a step by hand."""
        for g in self.graphs[bs]:
            g.replay()

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        """`run_host` for a decode batch given as tensors + AttentionMetadata (KimiForCausalLM.forward):
        input_ids / positions [B] -> hidden [B, D]. Copies the ids, positions and block tables to the host first
        (a device sync); the worker's decode path calls run_host with its host lists instead."""
        return self.run_host(
            input_ids.tolist(), positions.tolist(), list(attn.seq_lens_cpu), attn.block_tables.tolist()
        )
