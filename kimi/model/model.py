"""KimiForCausalLM: the DeepSeek-V3 / Kimi-K2 text backbone, one class for the CPU and the GPU path.

Layer (docs/model-format.md, Math): `h = x + attn(rmsnorm(x)); out = h + mlp(rmsnorm(h))`; layers below
first_k_dense_replace use a dense SwiGLU MLP, the rest MoE (noaux_tc router + routed experts + shared
experts); final `model.norm`, untied `lm_head`. Attention is MLA over the paged latent cache
(kimi/model/attention.py). Inference only.

Backends, chosen when the model is built, never by subclassing:
- attention: each step's plan (`plan_eager`, stored as `AttentionMetadata.plan`) comes from a kimi.backends.attention
  backend: the reference on CPU tensors and for latent sizes FlashInfer has no kernel for; on CUDA FlashInfer, or the
  Triton decode kernel for pure decode batches with `decode_attention` "triton";
- forward: `fused` False (the default, the CPU path) runs the plain PyTorch reference math; `fused` True (the GPU
  model, kimi/model/weights.py) runs kimi/model/gpu_forward.py on CUDA (fused Triton kernels, the planned attention
  run, and CUDA-graph replay of decode batches: kimi/worker/cuda_graph.py). That module is imported only then.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, overload

import torch
from torch import nn

from kimi.backends.attention import DECODE_BACKENDS, AttentionBackend, AttentionPlan, make_attention_backend
from kimi.config import ModelConfig
from kimi.model.attention import AttentionMetadata, MLAAttention, build_attention_metadata
from kimi.model.moe import AllToAllBackend, DenseMLP, MoELayer
from kimi.model.norm import rms_norm
from kimi.model.rope import RotaryEmbedding

if TYPE_CHECKING:
    from kimi.worker.cuda_graph import CudaGraphRunner
    from kimi.worker.prefill_graph import PrefillGraphRunner

log = logging.getLogger(__name__)

# Names some dumps carry that the model does not use (docs/model-format.md, Tensors).
_IGNORED_SUFFIXES = ("self_attn.rotary_emb.inv_freq",)


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class DecoderLayer(nn.Module):
    """One transformer block: input_layernorm [D], self_attn (MLA), post_attention_layernorm [D], mlp."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        ep_rank: int,
        ep_size: int,
        a2a: AllToAllBackend | None,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.is_moe = cfg.is_moe_layer(layer)
        self.input_layernorm = _param((cfg.hidden_size,), dtype, device)
        self.post_attention_layernorm = _param((cfg.hidden_size,), dtype, device)
        self.self_attn = MLAAttention(cfg, dtype, device)
        self.mlp: MoELayer | DenseMLP
        if self.is_moe:
            self.mlp = MoELayer(cfg, ep_rank, ep_size, a2a, dtype, device)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, dtype, device)

    def forward(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,
        rope: RotaryEmbedding,
    ) -> torch.Tensor:
        """h [T, D] -> [T, D] (pre-norm residual block)."""
        h = h + self.self_attn(rms_norm(h, self.input_layernorm, self.eps), positions, attn, kv_cache, rope)
        out: torch.Tensor = h + self.mlp(rms_norm(h, self.post_attention_layernorm, self.eps))
        return out


class DecoderLayers(nn.ModuleList):
    """The model's decoder layers: an nn.ModuleList whose items the type checker knows as DecoderLayer."""

    if TYPE_CHECKING:

        @overload
        def __getitem__(self, idx: slice) -> nn.ModuleList: ...

        @overload
        def __getitem__(self, idx: int) -> DecoderLayer: ...

        def __getitem__(self, idx: int | slice) -> DecoderLayer | nn.ModuleList: ...

        def __iter__(self) -> Iterator[DecoderLayer]: ...


class KimiForCausalLM(nn.Module):
    """The Kimi-K2 causal LM (docs/architecture.md, Interfaces), one expert-parallel rank of it.

    cfg: the text backbone's ModelConfig; ep_rank / ep_size: this rank holds routed experts [ep_rank * E / ep_size,
    (ep_rank + 1) * E / ep_size); a2a: the MoE all-to-all backend (None = local, only valid for ep_size 1); dtype /
    device of the weights (float32 on CPU for tests, bfloat16 on GPU); max_positions: size of the rope cos/sin cache
    (default cfg.max_position_embeddings); fused: run the fused GPU forward (kimi.model.gpu_forward) on CUDA tensors
    (kimi.model.weights.build_gpu_model sets it; False: the reference math everywhere). See the module docstring.
    """

    graphs: CudaGraphRunner | None = None  # the captured decode graphs (capture_cuda_graphs), or None
    # the captured prefill / mixed-step graphs (capture_prefill_graphs, one rank), or None
    prefill_graphs: PrefillGraphRunner | None = None
    # pure decode attention on CUDA: "triton" (kimi.kernels.triton.mla_decode, no host plan) or "flashinfer" (the
    # default); prefill and mixed batches always run FlashInfer (kimi.backends.attention.DECODE_BACKENDS)
    decode_attention = "flashinfer"
    # in captured graphs, run the shared expert on a side stream, concurrently with the routed experts
    overlap_shared = True
    # GEMM prologues: the q_a norm / SiLU * up fused into the following GEMM's loads (kimi.backends.linear.
    # prologue_config_for; off, the measured-faster choice). Set it with set_fuse_prologue (the attention layers too)
    fuse_prologue = False
    # plan FlashInfer's next decode step during a replay (kimi.worker.cuda_graph.CudaGraphRunner's plan_ahead); read
    # when the graphs are captured
    plan_ahead = True
    _side: torch.cuda.Stream | None = None  # the shared expert's side stream (gpu_forward, on first use)
    # EAGLE3 speculative decoding (kimi.model.eagle3): the reference forward keeps the residual stream entering these
    # layers, concatenated in this order, as `last_aux` [T, len(ids) * D]; () = none kept (the fused path keeps none)
    aux_layer_ids: tuple[int, ...] = ()
    last_aux: torch.Tensor | None = None

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        ep_rank: int = 0,
        ep_size: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        a2a: AllToAllBackend | None = None,
        max_positions: int | None = None,
        fused: bool = False,
    ):
        super().__init__()
        self.cfg = cfg
        self.fused = fused
        self.ep_rank, self.ep_size = ep_rank, ep_size
        self.dtype = dtype
        self.embed_tokens = _param((cfg.vocab_size, cfg.hidden_size), dtype, device)
        self.layers = DecoderLayers(
            DecoderLayer(cfg, i, ep_rank, ep_size, a2a, dtype, device) for i in range(cfg.num_hidden_layers)
        )
        self.norm = _param((cfg.hidden_size,), dtype, device)
        self.lm_head = None if cfg.tie_word_embeddings else _param((cfg.vocab_size, cfg.hidden_size), dtype, device)
        self.rope = RotaryEmbedding(cfg, max_positions, device)
        self._attention: dict[str, AttentionBackend] = {}  # name -> backend, made on first use (`attention_backend`)
        if fused:
            from kimi.model import gpu_forward

            for layer in self.layers:
                layer.self_attn.planned_forward = gpu_forward.mla_forward

    # ---- weights ---------------------------------------------------------------------------------------
    def _weight_targets(self) -> dict[str, torch.Tensor]:
        """Canonical checkpoint name -> the parameter (or slice of a stacked expert parameter) it fills."""
        t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": self.embed_tokens, "model.norm.weight": self.norm}
        if self.lm_head is not None:
            t["lm_head.weight"] = self.lm_head
        inter = self.cfg.moe_intermediate_size
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            t[p + "input_layernorm.weight"] = layer.input_layernorm
            t[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm
            for n, param in layer.self_attn.named_parameters(recurse=False):
                t[f"{p}self_attn.{n}.weight"] = param
            mlp = layer.mlp
            if isinstance(mlp, MoELayer):
                t[p + "mlp.gate.weight"] = mlp.gate
                t[p + "mlp.gate.e_score_correction_bias"] = mlp.e_score_correction_bias
                if mlp.shared_experts is not None:
                    for n in ("gate_proj", "up_proj", "down_proj"):
                        t[f"{p}mlp.shared_experts.{n}.weight"] = getattr(mlp.shared_experts, n)
                for j in range(mlp.num_local_experts):
                    e = p + f"mlp.experts.{mlp.expert_offset + j}."
                    t[e + "gate_proj.weight"] = mlp.w13[j, :inter]
                    t[e + "up_proj.weight"] = mlp.w13[j, inter:]
                    t[e + "down_proj.weight"] = mlp.w2[j]
            else:
                for n in ("gate_proj", "up_proj", "down_proj"):
                    t[f"{p}mlp.{n}.weight"] = getattr(mlp, n)
        return t

    def expected_weight_names(self) -> list[str]:
        """Every canonical tensor name load_weights needs for this rank (only local experts)."""
        return list(self._weight_targets())

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy a canonical, dequantised tensor dict into the model (as from `load_checkpoint(..., dequantize=True)`).

        Names are canonical (no `language_model.` prefix), experts per expert
        (`model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight` [out, in], only this rank's E), stacked
        here into w13 / w2. Values are cast to the parameter dtype (the correction bias stays float32).
        `*.self_attn.rotary_emb.inv_freq` entries (and `lm_head.weight` when tied) are ignored. Raises ValueError naming
        missing or unexpected tensors, or a tensor whose shape differs; nothing is copied in that case.
        """
        targets = self._weight_targets()
        names = {n for n in weights if not n.endswith(_IGNORED_SUFFIXES)}
        if self.lm_head is None:
            names.discard("lm_head.weight")  # tied: the loader may hand the embedding under this name too
        missing = sorted(set(targets) - names)
        unexpected = sorted(names - set(targets))
        bad_shape = [
            f"{n}: got {tuple(weights[n].shape)}, want {tuple(targets[n].shape)}"
            for n in sorted(names & set(targets))
            if tuple(weights[n].shape) != tuple(targets[n].shape)
        ]
        if missing or unexpected or bad_shape:
            parts = []
            if missing:
                parts.append(f"{len(missing)} missing: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
            if unexpected:
                parts.append(
                    f"{len(unexpected)} unexpected: {', '.join(unexpected[:8])}{' ...' if len(unexpected) > 8 else ''}"
                )
            if bad_shape:
                parts.append(f"{len(bad_shape)} with wrong shape: {'; '.join(bad_shape[:8])}")
            raise ValueError("load_weights: " + "; ".join(parts))
        for n, dst in targets.items():
            dst.copy_(weights[n].to(device=dst.device, dtype=dst.dtype))

    # ---- attention backends ---------------------------------------------------------------------------
    @property
    def flashinfer_ok(self) -> bool:
        """FlashInfer's MLA kernels exist for a 512 latent + 64 rope (Kimi / DeepSeek-V3); tiny test models use
        the reference attention and run without CUDA graphs."""
        return self.cfg.kv_lora_rank == 512 and self.cfg.qk_rope_head_dim == 64

    def attention_backend(self, name: str) -> AttentionBackend:
        """The model's attention backend `name` (kimi.backends.attention.ATTENTION_BACKENDS), made on first use on
        the model's device and dtype. Raises ValueError on an unknown name."""
        backend = self._attention.get(name)
        if backend is None:
            backend = self._attention[name] = make_attention_backend(name, self.cfg, self.norm.device, self.dtype)
        return backend

    def step_attention(self, attn: AttentionMetadata) -> AttentionBackend:
        """The backend that plans attn's step: for a fused model on CUDA tensors where FlashInfer has kernels
        (flashinfer_ok), "triton" for a pure decode batch with decode_attention "triton", else "flashinfer";
        otherwise "reference"."""
        if not (self.fused and self.flashinfer_ok and attn.slot_mapping.is_cuda):
            return self.attention_backend("reference")
        if self.decode_attention == "triton" and all(q == 1 for q in attn.query_lens_cpu):
            return self.attention_backend("triton")
        return self.attention_backend("flashinfer")

    def decode_attention_backend(self) -> AttentionBackend:
        """The backend of pure decode batches on CUDA, whose hooks the decode CUDA graphs use: `decode_attention`
        ("flashinfer" or "triton", kimi.backends.attention.DECODE_BACKENDS). Raises ValueError on another value."""
        if self.decode_attention not in DECODE_BACKENDS:
            raise ValueError(f"decode_attention {self.decode_attention!r}: want one of {', '.join(DECODE_BACKENDS)}")
        return self.attention_backend(self.decode_attention)

    @property
    def fi_eager(self) -> object | None:
        """The FlashInferMLA of eager steps (None before the first FlashInfer-planned step)."""
        backend = self._attention.get("flashinfer")
        return getattr(backend, "fi_eager", None)

    def plan_eager(self, attn: AttentionMetadata) -> AttentionPlan:
        """Plan attn's step with its backend (`step_attention`; host work, once per step for all layers) and attach
        the plan as attn.plan. Returns it."""
        plan = self.step_attention(attn).plan(attn)
        attn.plan = plan
        return plan

    def set_fuse_prologue(self, flag: bool) -> None:
        """Turn the fused GEMM prologues on or off in this model's layers (benchmarks A/B them; fused path only)."""
        self.fuse_prologue = bool(flag)
        for layer in self.layers:
            layer.self_attn.fuse_prologue = bool(flag)

    # ---- forward ---------------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """input_ids [T] int64, positions [T] int64 -> hidden [T, D] after the final norm (model dtype).

        Writes the new tokens' latents into kv_caches[layer] ([num_blocks, bs, L + R]) at attn.slot_mapping. The
        reference forward also keeps `last_aux` when `aux_layer_ids` is set (EAGLE3 speculative decoding).
        Without attn.plan: a pure decode batch that fits a captured graph replays it (`graphs`), any other step that
        fits a prefill graph replays that (`prefill_graphs`); otherwise the step is planned (`plan_eager`) and runs
        eagerly: the fused forward for a fused model on CUDA, else the reference.
        Raises ValueError if the number of caches differs from num_hidden_layers.
        """
        if attn.plan is None:
            if self.graphs is not None and self.graphs.can_run(attn):
                return self.graphs.run(input_ids, positions, attn)
            if self.prefill_graphs is not None and self.prefill_graphs.can_run(attn):
                return self.prefill_graphs.run(input_ids, positions, attn)
            self.plan_eager(attn)
        if self.fused and input_ids.is_cuda:
            from kimi.model import gpu_forward

            return gpu_forward.forward_fused(self, input_ids, positions, attn, kv_caches)
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} kv caches for {len(self.layers)} layers")
        h = self.embed_tokens[input_ids]  # [T, D]
        aux_ids = self.aux_layer_ids
        kept: dict[int, torch.Tensor] = {}
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            if aux_ids and i in aux_ids:
                kept[i] = h  # the residual stream entering layer i
            h = layer(h, positions, attn, cache, self.rope)  # [T, D]
        if aux_ids:
            self.last_aux = torch.cat([kept[i] for i in aux_ids], dim=-1)  # [T, len(aux_ids) * D]
        return rms_norm(h, self.norm, self.cfg.rms_norm_eps)  # [T, D]

    def forward_decode(
        self,
        input_ids: list[int],
        positions: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        kv_caches: list[torch.Tensor],
        fill: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        bucket: int | None = None,
    ) -> torch.Tensor:
        """One decode step from host lists (one new token per sequence: positions[b] = seq_lens[b] - 1) ->
        hidden [B, D] after the final norm. Replays a CUDA graph through `CudaGraphRunner.run_host` when one
        fits (no AttentionMetadata is built), else builds the metadata and runs `forward`.

        fill: None, or (rows [P] int64, values [M] int64, value rows [P] int64) on the device: input_ids[rows[i]]
        is replaced by values[value rows[i]] on the device before the forward reads it (tokens the previous step
        sampled that the host does not have yet: ModelRunner.launch). bucket: replay exactly this captured bucket
        (kimi.worker.cuda_graph.DecodeGraphPlan: the one every rank replays; B may be 0 then); never eager, so a
        batch that does not fit raises ValueError instead of issuing other collectives than the other ranks."""
        g = self.graphs
        if bucket is not None:
            if g is None:
                raise ValueError(f"forward_decode: bucket {bucket} asked of a model without CUDA graphs")
            return g.run_host(input_ids, positions, seq_lens, block_tables, fill=fill, bucket=bucket)
        if g is not None and g.can_run_host(seq_lens, block_size):
            return g.run_host(input_ids, positions, seq_lens, block_tables, fill=fill)
        dev = self.norm.device
        attn = build_attention_metadata([1] * len(input_ids), seq_lens, block_tables, block_size, dev)
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        if fill is not None:
            ids.index_copy_(0, fill[0], fill[1].index_select(0, fill[2]))
        out: torch.Tensor = self(ids, torch.tensor(positions, dtype=torch.int64, device=dev), attn, kv_caches)
        return out

    def embed_fused(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """kimi.model.gpu_forward.embed_fused of this model (fused, CUDA): input_ids [T] -> (h, x) [T, D] each."""
        from kimi.model import gpu_forward

        return gpu_forward.embed_fused(self, input_ids)

    def layers_fused(
        self,
        h: torch.Tensor,
        x: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: list[torch.Tensor],
        start: int,
        end: int,
        row_valid: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """kimi.model.gpu_forward.layers_fused of this model (fused, CUDA): layers [start, end), (h, x) -> (h, x)."""
        from kimi.model import gpu_forward

        return gpu_forward.layers_fused(self, h, x, positions, attn, kv_caches, start, end, row_valid)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, D] -> logits [N, vocab_size] float32 (untied lm_head; embed_tokens when tied). A fused model
        runs the GEMM through kimi.backends.linear.dense_linear, the reference through F.linear."""
        if self.fused:
            from kimi.model import gpu_forward

            return gpu_forward.compute_logits(self, hidden)
        w = self.lm_head if self.lm_head is not None else self.embed_tokens
        return torch.nn.functional.linear(hidden, w).float()  # [N, V]

    # ---- CUDA graphs -----------------------------------------------------------------------------------
    def _graphs_possible(self) -> bool:
        """Whether this model can be captured: FlashInfer has a kernel for its latent size and every MoE backend is
        graph-safe (both follow from the config and the flags, so every rank decides the same); a warning says why
        not."""
        if not self.flashinfer_ok:
            log.warning(
                "CUDA graphs off: no FlashInfer MLA kernel for kv_lora_rank %d / rope %d",
                self.cfg.kv_lora_rank,
                self.cfg.qk_rope_head_dim,
            )
            return False
        bad = [
            type(layer.mlp.experts_impl).__name__
            for layer in self.layers
            if isinstance(layer.mlp, MoELayer) and not getattr(layer.mlp.experts_impl, "graph_safe", False)
        ]
        if bad:
            log.warning("CUDA graphs off: MoE backend %s cannot be captured", bad[0])
            return False
        return True

    def capture_prefill_graphs(
        self,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_tokens: int,
        max_seqs: int,
        max_blocks_per_seq: int,
        buckets: list[int] | None = None,
        mha_min_bucket: int | None = None,
        fresh_mha: bool | None = None,
    ) -> None:
        """Capture the prefill / mixed-step graphs of one rank (kimi/worker/prefill_graph.py; a fused model on CUDA)
        for steps of up to max_tokens rows and max_seqs sequences, in the decode graphs' memory pool when they were
        captured first, and keep them as `prefill_graphs`; buckets: these token buckets instead of the default ones;
        mha_min_bucket / fresh_mha: the fresh-step graphs from this bucket on / on or off, instead of
        prefill_graph.MHA_MIN_BUCKET / FRESH_MHA_GRAPHS. Captures
        nothing (with a warning) when the model cannot be captured (`capture_cuda_graphs`)."""
        from kimi.worker.prefill_graph import FRESH_MHA_GRAPHS, MHA_MIN_BUCKET, PrefillGraphRunner

        if not self._graphs_possible():
            return
        runner = PrefillGraphRunner(
            self,
            kv_caches,
            block_size,
            max_tokens,
            max_seqs,
            max_blocks_per_seq,
            buckets=buckets,
            pool=self.graphs.pool if self.graphs is not None else None,
            fresh_mha=FRESH_MHA_GRAPHS if fresh_mha is None else fresh_mha,
            mha_min_bucket=MHA_MIN_BUCKET if mha_min_bucket is None else mha_min_bucket,
        )
        runner.capture()
        self.prefill_graphs = runner

    def capture_cuda_graphs(
        self,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_batch: int,
        max_blocks_per_seq: int,
        layers_per_graph: int | None = None,
        buckets: list[int] | None = None,
        on_bucket: Callable[[int], None] | None = None,
    ) -> None:
        """Capture decode graphs for every bucket up to max_batch (kimi/worker/cuda_graph.py; a fused model on CUDA)
        and keep them as `graphs`; layers_per_graph: layers per graph segment (default cuda_graph.LAYERS_PER_GRAPH;
        0: one graph); buckets / on_bucket: see CudaGraphRunner (the buckets of a DecodeGraphPlan, and the hook that
        sets the all-to-all to each bucket's static shapes before it is captured). Logs a warning and captures nothing
        when FlashInfer has no kernel for the latent size or an MoE backend cannot be captured (both follow from the
        config and the flags, so every rank decides the same)."""
        from kimi.worker.cuda_graph import LAYERS_PER_GRAPH, CudaGraphRunner

        if not self._graphs_possible():
            return
        t0 = time.monotonic()
        runner = CudaGraphRunner(
            self,
            kv_caches,
            block_size,
            max_batch,
            max_blocks_per_seq,
            buckets=buckets,
            layers_per_graph=LAYERS_PER_GRAPH if layers_per_graph is None else layers_per_graph,
            plan_ahead=self.plan_ahead,
            on_bucket=on_bucket,
        )
        runner.capture()
        self.graphs = runner
        log.info(
            "captured %d decode CUDA graphs (buckets %s) in %.1f s",
            len(runner.buckets),
            runner.buckets,
            time.monotonic() - t0,
        )
