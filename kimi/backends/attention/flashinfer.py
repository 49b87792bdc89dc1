"""Absorbed MLA on the GPU through FlashInfer's paged MLA kernel (`BatchMLAPagedAttentionWrapper`, FA3 on Hopper):
decode, prefill and chunked prefill, mixed in one plan / one run.

Math (docs/model-format.md, Math: the absorbed form; the same function as `kimi.model.attention.mla_decode_ref` for one
query row, and as `mla_prefill_ref` after the W_UK / W_UV absorption): MQA of H query heads over the 576-wide latent
cache. For a sequence with qo_len Q new rows and kv_len S context tokens (the new ones included), query row i
(0 <= i < Q) sits at position S - Q + i and, with ``causal=True``,

    score[i, h, s] = (q_lat[i, h] . ckv_s + q_pe[i, h] . kpe_s) * sm_scale   for s <= S - Q + i,
    o_lat[i, h]    = softmax_s(score[i, h]) @ ckv                             (float32 softmax in the kernel).

Causal alignment (verified in the flashinfer 0.6.4 sources): the mask is bottom-right aligned, i.e. the Q queries
are the LAST Q tokens of the S keys. The FA3 kernel keeps a logit iff ``!(kv_idx + qo_len > kv_len + q_idx)``
(include/flashinfer/attention/mla_hopper.cuh:365, `logits_mask_`; the FA2 kernel mla.cuh:343 / 357 is the same),
the planner's per-tile KV end is "right aligned" ``kv_len - qo_len + ceil(...)`` (scheduler.cuh:811-819,
`packed_causal_kv_end`), and flashinfer/prefill.py:1169-1172 documents the same mask as
``tril(ones(qo_len, kv_len), diagonal=kv_len - qo_len)``. A decode row (Q = 1) sees all S keys, so causal and
non-causal agree there and one causal plan covers a mixed decode + prefill batch.

Kernel facts (flashinfer 0.6.4): the wrapper docstring says the kernel serves "decode, and incremental prefill"
(flashinfer/mla.py:144); the SM90 kernel rejects only MaskMode kCustom, causal is a template flag
(mla_hopper.cuh:975-978). Heads are packed into the row (M) dimension: packed row = q_idx * H + h, tiles of 64
rows per CTA, 1 or 2 CTAs per cluster (2 when the batch's mean qo_len * H > 64; scheduler.cuh:1469-1481), H
arbitrary (a fastdiv); for H dividing 64 (Kimi 64, the "tiny-mla" test model 16) the per-tile causal KV bound
``kv_len - q_len + (q_start + cluster_tile_q) / H`` (mla_hopper.cuh:705) is exact. Limit: `MLAPlan`
(scheduler.cuh:1440-1707; the fa3 and fa2 plans both call it: csrc/batch_mla_sm90_plan.cu, batch_mla_plan.cu:49)
lays out a fixed table of 16384 work items (scheduler.cuh:1600) and does NOT check it; a batch needs at most
sum_b ceil(Q_b * H / cluster_tile_q) + num_clusters of them, so `plan` checks that bound and raises ValueError
past it (Kimi, H 64: ~32k query rows per step; H 16: ~130k). No other per-request qo_len limit in the planner
or the kernel (Q <= S required).

Cost note: in the absorbed form every (query, key, head) costs 2 * (576 + 512) FLOPs against 2 * (192 + 128) in
the naive 192/128 form, but nothing is expanded with kv_b (the naive form re-expands the whole cached prefix for
every chunk). For long fresh prompts a ragged 192/128 prefill kernel may be faster: measure before choosing.

Cache layout (docs/design.md, KV cache): ONE buffer per layer ``kv_cache [num_blocks, block_size, 576]`` (bf16):
``[..., :512]`` is rmsnorm(ckv), ``[..., 512:]`` the roped k_pe. FlashInfer's MLA kernels take ckv and kpe as
separate tensors but read their page / token strides (``ckv_cache.stride(0)``, ``stride(1)``,
csrc/batch_mla_sm90_run.cu:48-57), so two strided *views* of the one buffer are passed without a copy.

Paging: FlashInfer's page = kimi's block (page_size = block_size); per request the pages are
``block_tables[b, :ceil(seq_len / block_size)]``, concatenated into `kv_indices` (int32) with `kv_indptr`
offsets; ``kv_len_arr = seq_lens``; ``qo_indptr = [0, cumsum(qo_lens)]``: the query rows of request b are rows
``qo_indptr[b] .. qo_indptr[b+1] - 1`` of q_lat / q_pe / o_lat (kimi's flat batch order). A decode plan may instead
give each request a fixed slot of `page_stride` pages (``kv_indptr[b] = b * page_stride``, its pages at the slot's
start): FlashInfer's MLA scheduler reads kv_indptr only as each request's first page (MLAPlan, scheduler.cuh
1440-1600: the work split follows kv_len), so the CUDA-graph runner can keep each row's pages in place from step to
step and write only the new ones (kimi.worker.cuda_graph.CudaGraphRunner.run_host).

Usage: ``plan(...)`` once per step OUTSIDE CUDA graphs (host work: FlashInfer's scheduler runs on the host over
the lengths), shared by every layer, then ``run(...)`` per layer (capturable when the wrapper was built with
``use_cuda_graph=True`` and the batch size is fixed). `plan` itself does not synchronise the device: it builds
the index arrays from host lengths and gathers the pages on the device; it waits only for its own previous
plan's host-to-device copy (FlashInfer reuses one pinned staging buffer per wrapper, scheduler.cuh:1675-1697).
A plan made ahead (`plan_ahead`, CUDA-graph decode) is enqueued after the step that is running, so the plan
after it waits for that step to finish: a caller that never synchronises stays at most one step ahead.
The schedule a run uses is the LAST one planned: after `plan_ahead`, a run (or graph replay) before the next
`plan_decode_schedule` / `plan_pages` would use the next step's lengths with the current page ids.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kimi.backends.attention.base import AttentionPlan
from kimi.errors import ProtocolError

if TYPE_CHECKING:
    from typing import Self  # Python 3.11 (annotations only)

    from kimi.config import ModelConfig
    from kimi.model.attention import AttentionMetadata

__all__ = [
    "MAX_PLAN_WORKS",
    "MHA_HEAD_DIMS",
    "PREFILL_ATTENTION",
    "PREFILL_ATTENTION_CHOICES",
    "FlashInferAttention",
    "FlashInferDecodeGraphs",
    "FlashInferMHAPrefill",
    "FlashInferMLA",
    "FlashInferMLADecode",
    "set_prefill_attention",
]

# max_total_num_works of MLAPlan: flashinfer 0.6.4 include/flashinfer/attention/scheduler.cuh:1600
MAX_PLAN_WORKS = 16384

# How FlashInferAttention runs the rows of fresh sequences (no cached context): "mla", the absorbed paged MLA kernel
# like every other row; "mha", FlashInfer's ragged prefill in the non-absorbed form (FlashInferMHAPrefill). Set it
# with set_prefill_attention; read by every FlashInferAttention.plan.
PREFILL_ATTENTION_CHOICES = ("mla", "mha")
PREFILL_ATTENTION = "mla"
# (qk head dim, vo head dim) FlashInfer 0.6.4's SM90 ragged prefill has a kernel for besides equal dims: 192 / 128
# (include/flashinfer/attention/hopper/prefill_sm90.cuh, getCTATileSize); models of other head dims keep "mla"
MHA_HEAD_DIMS = (192, 128)


def set_prefill_attention(name: str) -> str:
    """Make `name` (PREFILL_ATTENTION_CHOICES) the prefill attention of later plans; returns the previous choice.
    Raises ValueError on another name."""
    global PREFILL_ATTENTION
    if name not in PREFILL_ATTENTION_CHOICES:
        raise ValueError(f"prefill attention {name!r}: want one of {', '.join(PREFILL_ATTENTION_CHOICES)}")
    previous, PREFILL_ATTENTION = PREFILL_ATTENTION, name
    return previous


def padded_layout(qo_lens: list[int], seq_lens: list[int], rows: int, max_batch: int) -> tuple[list[int], list[int]]:
    """The (query lengths, context lengths) of `FlashInferMLA.plan_padded`: the B requests, one padding request of
    rows - sum(qo_lens) rows with as long a context, and empty requests (0, 0) up to max_batch. Raises ValueError when
    B >= max_batch, the rows do not fit, the lists differ in length or a qo_len is outside [1, seq_len]."""
    B = len(qo_lens)
    pad = rows - sum(qo_lens)
    if max_batch <= B or pad < 0 or len(seq_lens) != B:
        raise ValueError(
            f"plan_padded: {B} requests of {sum(qo_lens)} rows ({len(seq_lens)} seq_lens) into {max_batch - 1} "
            f"requests and {rows} rows"
        )
    for b, (q, s) in enumerate(zip(qo_lens, seq_lens)):
        if q < 1 or q > s:
            raise ValueError(f"plan_padded: request {b}: qo_len {q} must be in [1, seq_len={s}]")
    empty = max_batch - B - 1
    return [*qo_lens, pad] + [0] * empty, [*seq_lens, pad] + [0] * empty


def _decode_indptr(seq_lens: list[int], block_size: int, page_stride: int | None = None) -> list[int]:
    """kv_indptr [B+1] of a decode plan: request b's ceil(seq_lens[b] / block_size) pages after those of requests
    < b, or (page_stride) at b * page_stride. Raises ValueError on a context length < 1 or a request with more
    pages than page_stride."""
    if min(seq_lens, default=0) < 1:
        raise ValueError(f"decode plan: context lengths must be >= 1, got {seq_lens}")
    if page_stride is not None:
        if max(seq_lens, default=1) > page_stride * block_size:
            raise ValueError(f"decode plan: a context of {max(seq_lens)} tokens needs more than {page_stride} pages")
        return list(range(0, (len(seq_lens) + 1) * page_stride, page_stride))
    indptr = [0] * (len(seq_lens) + 1)
    for b, s in enumerate(seq_lens):
        indptr[b + 1] = indptr[b] + (s + block_size - 1) // block_size
    return indptr


class FlashInferMLA:
    """Paged absorbed MLA over kimi's [num_blocks, block_size, L+R] latent cache, any mix of query lengths.

    Args:
        num_heads: query heads per rank (64 for Kimi).
        sm_scale: softmax scale (cfg.softmax_scale, qk_head_dim 192-based, see docs/model-format.md, Math).
        device: CUDA device.
        kv_lora_rank: L (512); rope_dim: R (64); kimi uses FlashInfer only for 512 / 64
            (KimiForCausalLM.flashinfer_ok), other sizes run the torch references.
        backend: FlashInfer MLA backend ("fa3" on Hopper, "fa2", or "auto"); both support causal qo_len > 1.
        workspace_bytes: float workspace for split-KV partial results (128 MiB as FlashInfer recommends).
        use_cuda_graph / max_batch / max_pages: fixed index buffers for graph capture (then every plan must have
            exactly max_batch requests and at most max_pages pages).
        dtype: q / kv / o dtype (bf16).
        kv_indices: CUDA-graph wrappers only: the int32 device buffer (>= max_pages elements) the kernel reads the
            page ids from, when the caller writes them itself (`plan_decode_schedule`); default: the wrapper's own.
    """

    def __init__(
        self,
        num_heads: int,
        sm_scale: float,
        device: torch.device | str = "cuda",
        kv_lora_rank: int = 512,
        rope_dim: int = 64,
        backend: str = "fa3",
        workspace_bytes: int = 128 * 1024 * 1024,
        use_cuda_graph: bool = False,
        max_batch: int = 0,
        max_pages: int = 0,
        dtype: torch.dtype = torch.bfloat16,
        kv_indices: torch.Tensor | None = None,
    ):
        import flashinfer.mla  # deferred: optional GPU dependency

        self.num_heads = num_heads
        self.sm_scale = float(sm_scale)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.L = kv_lora_rank
        self.R = rope_dim
        self.dtype = dtype
        self.use_cuda_graph = use_cuda_graph
        self.max_batch = max_batch
        self.max_pages = max_pages
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=self.device)
        kwargs = {}
        self._kv_indices_dev: torch.Tensor | None = None  # the CUDA-graph wrapper's fixed kv_indices buffer
        if use_cuda_graph:
            if max_batch <= 0 or max_pages <= 0:
                raise ValueError("use_cuda_graph needs max_batch and max_pages")
            if kv_indices is None:
                kv_indices = torch.empty(max_pages, dtype=torch.int32, device=self.device)
            elif (
                kv_indices.dtype != torch.int32
                or kv_indices.device != self.device
                or kv_indices.dim() != 1
                or not kv_indices.is_contiguous()
                or kv_indices.numel() < max_pages
            ):
                raise ValueError(
                    f"kv_indices: want a contiguous 1-D int32 buffer of >= {max_pages} elements on "
                    f"{self.device}, got {tuple(kv_indices.shape)} {kv_indices.dtype} on {kv_indices.device}"
                )
            kwargs = dict(
                qo_indptr=torch.empty(max_batch + 1, dtype=torch.int32, device=self.device),
                kv_indptr=torch.empty(max_batch + 1, dtype=torch.int32, device=self.device),
                kv_indices=kv_indices,
                kv_len_arr=torch.empty(max_batch, dtype=torch.int32, device=self.device),
            )
            self._kv_indices_dev = kv_indices
        self.wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(
            self.workspace, use_cuda_graph=use_cuda_graph, backend=backend, **kwargs
        )
        self.block_size: int | None = None
        self.batch: int | None = None
        self.num_rows = 0  # sum of qo_lens of the current plan: rows of q_lat / q_pe / o_lat
        self.causal: bool | None = None
        self._plan_done: torch.cuda.Event | None = None
        self._pin: dict[str, torch.Tensor] = {}  # pinned int32 staging buffers of the plan's host arrays
        self._idx_done: torch.cuda.Event | None = None  # recorded after each `_copy_indices` (decode plan_pages)
        # plan ahead (decode, CUDA-graph wrappers): (block_size, page_stride, seq_lens) the wrapper's schedule was
        # planned for by `plan_ahead` with no plan since, else None; `plan_decode_schedule` (also behind a decode
        # `plan_pages`) of exactly those then runs no scheduler (see plan_ahead)
        self._ahead: tuple[int, int | None, tuple[int, ...]] | None = None
        self.ahead_hits = 0  # plan_decode_schedule calls served by a plan made ahead (tests / benchmarks / logs)
        self.ahead_misses = 0  # plan_decode_schedule calls after a plan_ahead whose lengths did not match

    @classmethod
    def for_model(cls, cfg: ModelConfig, device: torch.device | str, **kwargs: Any) -> Self:
        """A wrapper for cfg's attention (its heads, softmax scale, latent and rope widths) on device; kwargs: the
        other arguments of the constructor."""
        return cls(cfg.num_attention_heads, cfg.softmax_scale, device, cfg.kv_lora_rank, cfg.qk_rope_head_dim, **kwargs)

    def _pinned(self, name: str, n: int) -> torch.Tensor:
        """A pinned int32 host buffer `name` of n elements (grown, never shrunk; its previous contents are free once
        `_wait_staging` returned: the copies that read them are done)."""
        buf = self._pin.get(name)
        if buf is None or buf.numel() < n:
            buf = torch.empty(
                max(n, 64, 2 * (buf.numel() if buf is not None else 0)), dtype=torch.int32, pin_memory=True
            )
            self._pin[name] = buf
        return buf[:n]

    def _wait_staging(self) -> None:
        """Wait until the previous plan's host-to-device copies have read the pinned staging buffers (FlashInfer's
        own pinned buffer included), so this plan may overwrite them. After a `plan_ahead` that means waiting for
        the step that was running when it was made."""
        if self._plan_done is not None:
            self._plan_done.synchronize()

    def max_works(self, qo_lens: list[int]) -> int:
        """Upper bound on the work items MLAPlan lays out for these query lengths (see the module docstring):
        sum_b ceil(Q_b * H / cluster_tile_q) + num_clusters, with the cluster size rule of scheduler.cuh:1469-1481."""
        H = self.num_heads
        packed = [q * H for q in qo_lens]
        cluster = 2 if sum(packed) // max(len(packed), 1) > 64 else 1
        tile = 64 * cluster
        return sum(-(-p // tile) for p in packed) + self.num_sms // cluster

    def plan(
        self, qo_lens: list[int], seq_lens: list[int], block_tables: torch.Tensor, block_size: int, causal: bool = True
    ) -> None:
        """Plan one step (host work; call outside CUDA graphs). Does not synchronise the device.

        qo_lens: [B] new query rows per request (>= 1); seq_lens: [B] context lengths including them
            (qo_lens[b] <= seq_lens[b]); the rows of request b are its LAST qo_lens[b] tokens.
        block_tables: [B, max_blocks] int (device or host), padded with the null block 0.
        block_size: tokens per block (= FlashInfer page size).
        causal: bottom-right aligned causal mask (needed for qo_len > 1; a no-op for qo_len 1).
        Raises ValueError on an empty batch, inconsistent lengths, a too narrow table, a batch past FlashInfer's
        work table (MAX_PLAN_WORKS), or (CUDA-graph wrappers) a batch other than max_batch / too many pages.
        """
        B = len(qo_lens)
        if B == 0:
            raise ValueError("plan: empty batch")
        if len(seq_lens) != B:
            raise ValueError(f"plan: {B} qo_lens but {len(seq_lens)} seq_lens")
        for b, (q, s) in enumerate(zip(qo_lens, seq_lens)):
            if q < 1 or q > s:
                raise ValueError(f"plan: request {b}: qo_len {q} must be in [1, seq_len={s}]")
        self._plan_tables(qo_lens, seq_lens, block_tables, block_size, causal)

    def plan_padded(
        self, qo_lens: list[int], seq_lens: list[int], block_tables: torch.Tensor, block_size: int, rows: int
    ) -> None:
        """A causal plan of a step of B requests padded to a CUDA-graph wrapper's fixed shape (prefill graphs,
        kimi/worker/prefill_graph.py): the B requests (as `plan`), then one padding request of the remaining
        rows - sum(qo_lens) query rows over as many positions of the null block 0, then empty requests (no rows, no
        context: FlashInfer schedules no work for them) up to max_batch requests. num_rows is `rows` after it. With
        max_batch and rows fixed the schedule's shape (FlashInfer's cluster size, from the mean query rows per
        request) is the same for every such plan, so one captured graph replays them all. block_tables: [B, W]
        int, device or host. Raises ValueError when B >= max_batch, the rows do not fit, a qo_len is outside [1,
        seq_len], or as `plan`."""
        B, S = len(qo_lens), self.max_batch
        qo_full, seq_full = padded_layout(qo_lens, seq_lens, rows, S)
        n_pad = (qo_full[B] + block_size - 1) // block_size  # the padding request's pages: all the null block 0
        width = max(block_tables.shape[1] if B else 0, n_pad, 1)
        table = torch.zeros((S, width), dtype=torch.int64, device=self.device)  # [S, width]
        if B:
            table[:B, : block_tables.shape[1]] = block_tables.to(self.device)
        self._plan_tables(qo_full, seq_full, table, block_size, True)

    def _plan_tables(
        self, qo_lens: list[int], seq_lens: list[int], block_tables: torch.Tensor, block_size: int, causal: bool
    ) -> None:
        """`plan` after its checks: the used page ids gathered from block_tables on the device, then FlashInfer's
        plan."""
        B = len(qo_lens)
        nblk = [(s + block_size - 1) // block_size for s in seq_lens]
        width = block_tables.shape[1]
        if max(nblk) > width:
            raise ValueError("plan: block_tables too narrow for seq_lens")
        total_pages = sum(nblk)
        self._check_works(qo_lens, B, total_pages)
        self._ahead = None
        self._wait_staging()
        dev = self.device
        nblk_c = torch.tensor(nblk, dtype=torch.int64)  # [B] host
        kv_indptr = torch.zeros(B + 1, dtype=torch.int64)  # [B+1] host
        kv_indptr[1:] = torch.cumsum(nblk_c, 0)
        # flat positions in block_tables of every used page, request by request (host, no device sync)
        rows = torch.repeat_interleave(torch.arange(B, dtype=torch.int64), nblk_c)  # [total_pages]
        cols = torch.arange(total_pages, dtype=torch.int64) - torch.repeat_interleave(kv_indptr[:-1], nblk_c)
        flat = (rows * width + cols).to(dev, non_blocking=True)  # [total_pages]
        bt = block_tables.to(dev).reshape(-1)  # [B * max_blocks]
        kv_indices = bt.index_select(0, flat).to(torch.int32)  # [total_pages] page ids
        self._plan_indices(qo_lens, seq_lens, kv_indptr.tolist(), kv_indices, block_size, causal)

    def _check_works(self, qo_lens: list[int], B: int, total_pages: int) -> None:
        if self.use_cuda_graph and (self.max_batch != B or total_pages > self.max_pages):
            raise ValueError(
                f"plan: CUDA-graph wrapper for {self.max_batch} requests / {self.max_pages} pages got "
                f"{B} requests / {total_pages} pages"
            )
        works = self.max_works(qo_lens)
        if works > MAX_PLAN_WORKS:
            raise ValueError(
                f"plan: {sum(qo_lens)} query rows x {self.num_heads} heads may need {works} FlashInfer "
                f"work items, more than its fixed table of {MAX_PLAN_WORKS}: lower the token budget"
            )

    def plan_pages(
        self, qo_lens: list[int], seq_lens: list[int], pages: list[list[int]], block_size: int, causal: bool = True
    ) -> None:
        """`plan` from host lists: pages[b] = request b's block ids (at least ceil(seq_lens[b] / block_size) of
        them; extra entries are ignored). Everything is built on the host and sent in pinned, non-blocking
        copies: no device kernel (waits as `plan`: see the module docstring). For a CUDA-graph wrapper and a
        decode batch (every qo_len 1, causal False) the page ids go by kimi's own copy and the schedule through
        `plan_decode_schedule` (planned ahead or now). Raises ValueError as `plan` does."""
        B = len(qo_lens)
        if B == 0 or len(seq_lens) != B or len(pages) != B:
            raise ValueError(f"plan_pages: {B} qo_lens, {len(seq_lens)} seq_lens, {len(pages)} page lists")
        flat: list[int] = []
        indptr = [0]
        for b, (q, s, pg) in enumerate(zip(qo_lens, seq_lens, pages)):
            n = (s + block_size - 1) // block_size
            if q < 1 or q > s or n > len(pg):
                raise ValueError(f"plan_pages: request {b}: qo_len {q}, seq_len {s}, {len(pg)} pages")
            flat.extend(pg[:n])
            indptr.append(indptr[-1] + n)
        self._check_works(qo_lens, B, len(flat))
        if self.use_cuda_graph and not causal and all(q == 1 for q in qo_lens):
            self._copy_indices(flat)  # the page ids by our own copy, then the schedule (planned ahead or now)
            self.plan_decode_schedule(seq_lens, block_size)
            return
        self._ahead = None
        self._wait_staging()
        kv_indices = self._pinned("kv_indices", len(flat))  # [total_pages] host, pinned
        kv_indices.numpy()[:] = flat
        self._plan_indices(qo_lens, seq_lens, indptr, kv_indices, block_size, causal)

    def plan_decode_schedule(self, seq_lens: list[int], block_size: int, page_stride: int | None = None) -> None:
        """Plan a decode step (CUDA-graph wrappers only: one query row per request, non-causal, context lengths
        seq_lens >= 1) whose page ids the caller writes into the wrapper's kv_indices buffer itself, before the
        run in stream order (request b's ceil(seq_lens[b] / block_size) pages after those of requests < b, or with
        page_stride from b * page_stride on: see the module docstring).
        When `plan_ahead` planned exactly these lengths and stride (and no plan came since) nothing is done on the
        host (`ahead_hits` counts it); otherwise FlashInfer plans now. Raises ValueError as `plan` does."""
        B = len(seq_lens)
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            if ahead == (block_size, page_stride, tuple(seq_lens)):
                self._ahead_state(block_size, B)
                self.ahead_hits += 1
                return
            self.ahead_misses += 1
        if not self.use_cuda_graph:
            raise ValueError("plan_decode_schedule needs a CUDA-graph wrapper (fixed kv_indices buffer)")
        indptr = _decode_indptr(seq_lens, block_size, page_stride)
        self._check_works([1] * B, B, indptr[-1])
        self._wait_staging()
        self._plan_indices([1] * B, list(seq_lens), indptr, self._pinned("kv_indices", 0), block_size, False)

    def plan_ahead(self, seq_lens: list[int], block_size: int, page_stride: int | None = None) -> bool:
        """Plan the schedule of a decode step whose page ids are not known yet (CUDA-graph wrappers only): one
        query row per request, non-causal, context lengths seq_lens (pages laid out as page_stride says, see
        `plan_decode_schedule`). The next `plan_decode_schedule` (or decode `plan_pages`) with exactly these lengths
        and stride then skips FlashInfer's host scheduler; any other plan discards this one.

        Why this is exact: FlashInfer's MLA plan (the work split over SMs, written to the int workspace) is a
        function of qo_indptr, kv_indptr and kv_len only (with the fixed heads / dims / causal flag); the page ids
        are read by the kernel from the kv_indices buffer at run time. kv_indptr follows from seq_lens and
        block_size, so the schedule of a step is fixed by its lengths alone.

        Use: the CUDA-graph runner calls it right after launching step N's replay with step N's lengths + 1 (the
        same batch one token further), so the host scheduler runs while the GPU works; every copy it enqueues
        follows step N's kernels in stream order, so step N still reads its own plan. Returns False (nothing
        planned, any earlier plan-ahead dropped) when the wrapper is not a CUDA-graph one or the lengths do not
        fit its buffers (batch size, pages, work table)."""
        self._ahead = None
        B = len(seq_lens)
        if not self.use_cuda_graph or self.max_batch != B or min(seq_lens, default=0) < 1:
            return False
        try:
            indptr = _decode_indptr(seq_lens, block_size, page_stride)
        except ValueError:  # a request with more pages than page_stride
            return False
        if indptr[-1] > self.max_pages or self.max_works([1] * B) > MAX_PLAN_WORKS:
            return False
        self._wait_staging()
        self._plan_indices([1] * B, list(seq_lens), indptr, self._pinned("kv_indices", 0), block_size, False)
        self._ahead = (block_size, page_stride, tuple(seq_lens))
        return True

    def _copy_indices(self, flat: list[int]) -> None:
        """Page ids into the CUDA-graph wrapper's kv_indices buffer by one pinned non-blocking copy (its own
        staging buffer, reused once the previous such copy has run)."""
        if self._idx_done is not None:
            self._idx_done.synchronize()
        dev = self._kv_indices_dev
        assert dev is not None, "the CUDA-graph wrapper (use_cuda_graph) owns a kv_indices buffer"
        host = self._pinned("kv_indices_decode", len(flat))  # [total_pages] host, pinned
        host.numpy()[:] = flat
        dev[: len(flat)].copy_(host, non_blocking=True)
        if self._idx_done is None:
            self._idx_done = torch.cuda.Event()
        self._idx_done.record(torch.cuda.current_stream(self.device))

    def _ahead_state(self, block_size: int, B: int) -> None:
        self.block_size = block_size
        self.batch = B
        self.num_rows = B
        self.causal = False

    def _plan_indices(
        self,
        qo_lens: list[int],
        seq_lens: list[int],
        kv_indptr: list[int],
        kv_indices: torch.Tensor,
        block_size: int,
        causal: bool,
    ) -> None:
        """FlashInfer's plan with kv_indptr [B+1] and kv_indices [pages] int32 (device, or pinned host: FlashInfer
        copies it into its buffer non-blocking). The host arrays go through pinned staging buffers, so every
        copy FlashInfer makes is asynchronous; the caller ran `_wait_staging` first."""
        dev = self.device
        B = len(qo_lens)
        qo_indptr = self._pinned("qo_indptr", B + 1)  # [B+1] host, pinned
        qn = qo_indptr.numpy()
        qn[0] = 0
        np.cumsum(np.asarray(qo_lens, dtype=np.int32), out=qn[1:])
        kv_indptr_h = self._pinned("kv_indptr", B + 1)  # [B+1]
        kv_indptr_h.numpy()[:] = kv_indptr
        kv_len = self._pinned("kv_len", B)  # [B]
        kv_len.numpy()[:] = seq_lens
        self.wrapper.plan(
            qo_indptr,
            kv_indptr_h,
            kv_indices,
            kv_len,
            self.num_heads,
            self.L,
            self.R,
            block_size,
            causal,
            self.sm_scale,
            self.dtype,
            self.dtype,
        )
        if self._plan_done is None:
            self._plan_done = torch.cuda.Event()
        self._plan_done.record(torch.cuda.current_stream(dev))
        self.block_size = block_size
        self.batch = B
        self.num_rows = int(qn[-1])
        self.causal = causal

    def plan_from_metadata(self, attn, causal: bool = True) -> None:
        """Plan every sequence of a kimi.model.attention.AttentionMetadata (rows in its flat order)."""
        self.plan(list(attn.query_lens_cpu), list(attn.seq_lens_cpu), attn.block_tables, attn.block_size, causal)

    def run(self, q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor | None = None):
        """q_lat [N, H, L], q_pe [N, H, R] (dtype of the plan, last dim contiguous; N = num_rows of the plan),
        kv_cache [num_blocks, block_size, L+R] -> o_lat [N, H, L] (q dtype; written into `out` when given, same
        shape / dtype). The cache is passed as two strided views (no copy). Raises RuntimeError before plan,
        ValueError on mismatched shapes."""
        if self.batch is None:
            raise ProtocolError("run before plan")
        if kv_cache.shape[1] != self.block_size or kv_cache.shape[2] != self.L + self.R:
            raise ValueError(f"kv_cache {tuple(kv_cache.shape)} does not match block_size {self.block_size}")
        if q_lat.shape[0] != self.num_rows or q_pe.shape[0] != self.num_rows:
            raise ValueError(
                f"q_lat {tuple(q_lat.shape)} / q_pe {tuple(q_pe.shape)}: the plan has {self.num_rows} rows"
            )
        ckv = kv_cache[..., : self.L]  # [num_blocks, bs, L] view, row stride L+R
        kpe = kv_cache[..., self.L :]  # [num_blocks, bs, R] view
        return self.wrapper.run(q_lat, q_pe, ckv, kpe, out=out)


class FlashInferMHAPrefill:
    """Causal non-absorbed prefill of fresh sequences through FlashInfer's ragged prefill
    (`BatchPrefillWithRaggedKVCacheWrapper`, FA3 on Hopper): the keys of a sequence are its own query rows
    (qo_indptr = kv_indptr), q / k [Tp, H, head_dim_qk], v [Tp, H, head_dim_vo], NHD layout, one KV head per query
    head. The math of kimi.model.attention.mha_prefill_ref (float32 softmax in the kernel).

    Args:
        num_heads: query (= key / value) heads per rank (64 for Kimi).
        sm_scale: softmax scale, the MLA path's (cfg.softmax_scale: qk_head_dim 192-based, YaRN mscale^2 included).
        workspace: FlashInfer's float workspace (uint8, on the device); FlashInferAttention passes its MLA wrapper's
            one: the two runs of a layer execute one after the other in stream order, and each run's split-KV partials
            are consumed inside that run.
        head_dim_qk / head_dim_vo: 192 / 128 for Kimi (MHA_HEAD_DIMS).
        dtype: q / k / v / o dtype (bf16).
        use_cuda_graph / max_batch: a wrapper for CUDA graphs (FlashInfer's fixed-size index buffers of max_batch + 1
            entries): every plan holds exactly max_batch sequences and as many rows as the first (`plan_padded`).
    FlashInfer reads the row / head strides of q, k, v and out (csrc/batch_prefill_sm90.cu, RaggedRun), so v may be a
    strided view with a contiguous last dim. `plan` runs on the host, once per step outside CUDA graphs; it waits only
    until the previous plan's host-to-device copy has run (FlashInfer reuses one pinned buffer per wrapper). With a
    fixed batch and row count the SM90 schedule's buffers have fixed offsets (include/flashinfer/attention/
    scheduler.cuh, PrefillSM90Plan: sized by rows / 128 + batch per head), so a graph captured with one plan replays
    every later plan of that wrapper.
    """

    def __init__(
        self,
        num_heads: int,
        sm_scale: float,
        workspace: torch.Tensor,
        head_dim_qk: int = 192,
        head_dim_vo: int = 128,
        dtype: torch.dtype = torch.bfloat16,
        backend: str = "auto",
        use_cuda_graph: bool = False,
        max_batch: int | None = None,
    ):
        import flashinfer  # deferred: optional GPU dependency

        self.num_heads = num_heads
        self.sm_scale = float(sm_scale)
        self.head_dim_qk = head_dim_qk
        self.head_dim_vo = head_dim_vo
        self.dtype = dtype
        self.device = workspace.device
        self.max_batch = max_batch
        kw: dict[str, Any] = {}
        if use_cuda_graph:
            if not max_batch or max_batch < 1:
                raise ValueError(f"FlashInferMHAPrefill: a CUDA-graph wrapper needs max_batch >= 1, got {max_batch}")
            kw = dict(
                use_cuda_graph=True,
                qo_indptr_buf=torch.zeros(max_batch + 1, dtype=torch.int32, device=self.device),
                kv_indptr_buf=torch.zeros(max_batch + 1, dtype=torch.int32, device=self.device),
            )
        self.use_cuda_graph = use_cuda_graph
        self.wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend=backend, **kw)
        self.batch: int | None = None
        self.num_rows = 0  # sum of the planned sequence lengths: rows of q / k / v / out
        self._plan_done: torch.cuda.Event | None = None

    def plan(self, seq_lens: list[int]) -> None:
        """Plan one step over fresh sequences of seq_lens[b] >= 1 rows each (rows in order: sequence b is rows
        [sum(seq_lens[:b]), sum(seq_lens[:b + 1])) of q, k, v). Host work; call outside CUDA graphs. Raises
        ValueError on an empty batch or a length < 1."""
        if not seq_lens or min(seq_lens) < 1:
            raise ValueError(f"MHA prefill plan: want >= 1 sequences of >= 1 rows, got {seq_lens}")
        if self.use_cuda_graph:
            raise ProtocolError("a CUDA-graph MHA prefill wrapper plans with plan_padded")
        self._plan(seq_lens)

    def plan_padded(self, seq_lens: list[int], rows: int) -> None:
        """Plan of a CUDA-graph wrapper (use_cuda_graph): the B fresh sequences (rows as `plan`'s), then one padding
        sequence of the rows up to `rows` (its keys are its own rows: finite garbage nobody reads), then empty
        sequences up to max_batch; num_rows = rows. Host work; call outside CUDA graphs. Raises ValueError when B >=
        max_batch, a length is < 1 or the rows do not fit, ProtocolError on a wrapper without CUDA graphs."""
        if not self.use_cuda_graph or self.max_batch is None:
            raise ProtocolError("plan_padded needs a CUDA-graph wrapper (use_cuda_graph=True)")
        B, pad = len(seq_lens), rows - sum(seq_lens)
        if self.max_batch <= B or pad < 0 or min(seq_lens, default=1) < 1:
            raise ValueError(
                f"MHA plan_padded: {B} sequences of {seq_lens} into {self.max_batch - 1} sequences and {rows} rows"
            )
        self._plan([*seq_lens, pad] + [0] * (self.max_batch - B - 1))

    def _plan(self, seq_lens: list[int]) -> None:
        """The ragged plan of sequences of these lengths (>= 0), rows in order."""
        if self._plan_done is not None:
            self._plan_done.synchronize()
        indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)  # [B+1] host
        indptr[1:] = torch.tensor(seq_lens, dtype=torch.int64).cumsum(0).to(torch.int32)
        H = self.num_heads
        self.wrapper.plan(
            indptr,
            indptr,
            H,
            H,
            self.head_dim_qk,
            self.head_dim_vo,
            causal=True,
            sm_scale=self.sm_scale,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
            o_data_type=self.dtype,
        )
        if self._plan_done is None:
            self._plan_done = torch.cuda.Event()
        self._plan_done.record(torch.cuda.current_stream(self.device))
        self.batch = len(seq_lens)
        self.num_rows = int(indptr[-1])

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """q [Tp, H, Dqk], k [Tp, H, Dqk], v [Tp, H, Dv] (the plan's dtype, last dim contiguous; Tp = num_rows) ->
        o [Tp, H, Dv] (written into `out` when given: same shape, dtype, last two dims contiguous). Raises
        ProtocolError before plan, ValueError on mismatched shapes."""
        if self.batch is None:
            raise ProtocolError("run before plan")
        n, H = self.num_rows, self.num_heads
        if (
            tuple(q.shape) != (n, H, self.head_dim_qk)
            or tuple(k.shape) != (n, H, self.head_dim_qk)
            or tuple(v.shape) != (n, H, self.head_dim_vo)
        ):
            raise ValueError(
                f"q {tuple(q.shape)} / k {tuple(k.shape)} / v {tuple(v.shape)}: the plan has {n} rows of {H} heads "
                f"x {self.head_dim_qk} / {self.head_dim_vo}"
            )
        return self.wrapper.run(q, k, v, out=out)


class FlashInferMLADecode(FlashInferMLA):
    """FlashInferMLA for pure decode batches (one query row per request, non-causal plan): the CUDA-graph
    decode path (kimi/worker/cuda_graph.py) and tools/bench_mla.py. Same constructor as FlashInferMLA."""

    def plan(  # type: ignore[override]  # decode only: no qo_lens (all 1), never causal
        self, seq_lens_cpu: list[int], block_tables: torch.Tensor, block_size: int
    ) -> None:
        """Plan one decode step (host work; call outside CUDA graphs).

        seq_lens_cpu: [B] context lengths including the new token (>= 1).
        block_tables: [B, max_blocks] int (device or host), padded with the null block 0.
        block_size: tokens per block (= FlashInfer page size).
        """
        super().plan([1] * len(seq_lens_cpu), list(seq_lens_cpu), block_tables, block_size, causal=False)

    def plan_from_metadata(self, attn, causal: bool = False) -> None:
        """Plan from a kimi.model.attention.AttentionMetadata of a pure decode batch (every query_len == 1)."""
        if any(q != 1 for q in attn.query_lens_cpu):
            raise ValueError("FlashInferMLADecode handles decode only (query_len 1 per sequence)")
        self.plan(list(attn.seq_lens_cpu), attn.block_tables, attn.block_size)


class FlashInferAttention:
    """The AttentionBackend of FlashInfer's paged MLA: any batch (decode, prefill, mixed) in one causal plan eagerly;
    decode graphs through FlashInferDecodeGraphs. Only for kv_lora_rank 512 / rope 64 (KimiForCausalLM.flashinfer_ok).
    With PREFILL_ATTENTION "mha" (and head dims MHA_HEAD_DIMS) the fresh sequences of a step (query_len > 1, no cached
    context) are planned on a FlashInferMHAPrefill instead and the MLA plan covers the rest (see AttentionPlan).

    cfg: the model's ModelConfig; device: its CUDA device; dtype: q / kv / o dtype (the model's, bf16).
    `fi_eager`: the FlashInferMLA of eager steps (made by the first `plan`); `fi_mha`: the FlashInferMHAPrefill (made
    by the first plan with a fresh sequence under "mha").
    """

    name = "flashinfer"
    graph_page_rows = True  # the decode graphs read page ids from the runner's kv_indices buffer

    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype = torch.bfloat16):
        self.cfg = cfg
        self.device = device
        self.dtype = dtype
        self.fi_eager: FlashInferMLA | None = None
        self.fi_mha: FlashInferMHAPrefill | None = None
        self.mha_ok = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim) == MHA_HEAD_DIMS

    def plan(self, attn: AttentionMetadata) -> AttentionPlan:
        """ONE plan over every sequence of attn, qo_len = query_len (decode rows are qo_len-1 requests), causal
        unless the batch is pure decode (where causal == non-causal). Under PREFILL_ATTENTION "mha": the fresh
        sequences (query_len > 1 == seq_len) on the MHA prefill, the others on the MLA plan. Raises ValueError as
        FlashInferMLA.plan."""
        qlens, slens = attn.query_lens_cpu, attn.seq_lens_cpu
        all_decode = all(q == 1 for q in qlens)
        fi = self._eager(attn.slot_mapping.device)
        if not all_decode and PREFILL_ATTENTION == "mha" and self.mha_ok:
            fresh = [b for b, (q, s) in enumerate(zip(qlens, slens)) if 1 < q == s]
            if fresh:
                return self._plan_split(attn, fresh, fi)
        fi.plan_from_metadata(attn, causal=not all_decode)
        return AttentionPlan(fi, attn.slot_mapping, all_decode)

    def _plan_split(self, attn: AttentionMetadata, fresh: list[int], fi: FlashInferMLA) -> AttentionPlan:
        """The plan of a step with fresh sequences `fresh` (indices into attn) under "mha": those on fi_mha, the rest
        (decode rows, chunks over cached context, one-token prompts) on one causal plan of fi (fi_eager)."""
        qlens, slens = attn.query_lens_cpu, attn.seq_lens_cpu
        if self.fi_mha is None:
            cfg = self.cfg
            self.fi_mha = FlashInferMHAPrefill(
                cfg.num_attention_heads,
                cfg.softmax_scale,
                fi.workspace,
                cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
                cfg.v_head_dim,
                dtype=self.dtype,
            )
        self.fi_mha.plan([qlens[b] for b in fresh])
        plan = AttentionPlan(None, attn.slot_mapping, False, prefill_run=self.fi_mha)
        B = len(qlens)
        if len(fresh) == B:  # every sequence fresh: the MHA rows are rows [0, Tp)
            return plan
        is_fresh = [False] * B
        for b in fresh:
            is_fresh[b] = True
        rest = [b for b in range(B) if not is_fresh[b]]
        qsl = [0]
        for q in qlens:
            qsl.append(qsl[-1] + q)
        dev = attn.slot_mapping.device
        fresh_rows = [r for b in fresh for r in range(qsl[b], qsl[b + 1])]
        rest_rows = [r for b in rest for r in range(qsl[b], qsl[b + 1])]
        plan.prefill_rows = torch.tensor(fresh_rows, dtype=torch.int64, device=dev)  # [Tp]
        plan.run_rows = torch.tensor(rest_rows, dtype=torch.int64, device=dev)  # [Tr]
        rest_t = torch.tensor(rest, dtype=torch.int64, device=attn.block_tables.device)  # [Br]
        rest_q = [qlens[b] for b in rest]
        fi.plan(
            rest_q,
            [slens[b] for b in rest],
            attn.block_tables.index_select(0, rest_t),
            attn.block_size,
            causal=any(q > 1 for q in rest_q),
        )
        plan.run = fi
        return plan

    def _eager(self, device: torch.device) -> FlashInferMLA:
        """fi_eager, made on first use on device."""
        if self.fi_eager is None:
            self.fi_eager = FlashInferMLA.for_model(self.cfg, device, dtype=self.dtype)
        return self.fi_eager

    def graph_attention(
        self, buckets: list[int], block_size: int, max_blocks_per_seq: int, kv_indices: torch.Tensor | None
    ) -> FlashInferDecodeGraphs:
        """The CUDA-graph hooks; kv_indices: the runner's int32 page-id buffer (>= max(buckets) * max_blocks_per_seq).
        Raises ValueError without it."""
        if kv_indices is None:
            raise ValueError("FlashInfer decode graphs read page ids from the runner's kv_indices buffer")
        return FlashInferDecodeGraphs(
            self.cfg, self.device, self.dtype, buckets, block_size, max_blocks_per_seq, kv_indices
        )


class FlashInferDecodeGraphs:
    """DecodeGraphAttention of FlashInfer: per bucket a `use_cuda_graph=True` FlashInferMLADecode whose index buffers
    the graph captured, all reading the page ids from the runner's one kv_indices buffer (one bucket runs at a time).
    FlashInfer's `plan` (host work) runs before each replay, outside the graph (`plan_replay`:
    FlashInferMLA.plan_decode_schedule, nothing to do when `plan_ahead` planned that step during the previous replay).
    """

    plans_ahead = True

    def __init__(
        self,
        cfg: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        buckets: list[int],
        block_size: int,
        max_blocks_per_seq: int,
        kv_indices: torch.Tensor,
    ):
        self.device = device
        self.block_size = block_size
        self.runs = {
            bs: FlashInferMLADecode.for_model(
                cfg,
                device,
                use_cuda_graph=True,
                max_batch=bs,
                max_pages=bs * max_blocks_per_seq,
                dtype=dtype,
                kv_indices=kv_indices,
            )
            for bs in buckets
        }

    def plan_capture(self, bs: int, seq_lens_cpu: list[int], block_tables: torch.Tensor) -> FlashInferMLADecode:
        """FlashInferMLADecode.plan of bucket bs, rows past len(seq_lens_cpu) padded (it writes kv_indices in its own
        concatenated layout: the runner forgets its page rows first)."""
        B = len(seq_lens_cpu)
        width = max(1, block_tables.shape[1] if B else 1)
        bt = torch.zeros((bs, width), dtype=torch.int64, device=self.device)  # [bs, width], 0 = null block
        if B:
            bt[:B, : block_tables.shape[1]] = block_tables
        fi = self.runs[bs]
        fi.plan(list(seq_lens_cpu) + [1] * (bs - B), bt, self.block_size)
        return fi

    def stage(self, bs: int, seq_lens: list[int], block_tables: list[list[int]]) -> None:
        """Nothing: the page ids travel in the runner's static input copy."""

    def plan_replay(self, bs: int, seq_lens: list[int], page_stride: int) -> None:
        """The schedule of this step (planned ahead by the previous replay, or now), pages at b * page_stride."""
        self.runs[bs].plan_decode_schedule(list(seq_lens) + [1] * (bs - len(seq_lens)), self.block_size, page_stride)

    def plan_ahead(self, bs: int, seq_lens: list[int], page_stride: int) -> None:
        """FlashInferMLA.plan_ahead of these lengths (padded rows stay at length 1); on an error the bucket's
        plan-ahead state is dropped and the error re-raised."""
        fi = self.runs[bs]
        try:
            fi.plan_ahead(list(seq_lens) + [1] * (bs - len(seq_lens)), self.block_size, page_stride)
        except Exception:
            fi._ahead = None
            raise
