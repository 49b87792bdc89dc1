"""KimiForCausalLM: the DeepSeek-V3 / Kimi-K2 text backbone in plain PyTorch (the CPU reference path).

Layer (docs/model-format.md, Math): `h = x + attn(rmsnorm(x)); out = h + mlp(rmsnorm(h))`; layers below
first_k_dense_replace use a dense SwiGLU MLP, the rest MoE (noaux_tc router + routed experts + shared
experts); final `model.norm`, untied `lm_head`. Attention is MLA over the paged latent cache
(kimi/model/attention.py). Inference only.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, overload

import torch
from torch import nn

from kimi.config import ModelConfig
from kimi.model.attention import AttentionMetadata, MLAAttention
from kimi.model.moe import AllToAllBackend, DenseMLP, MoELayer
from kimi.model.norm import rms_norm
from kimi.model.rope import RotaryEmbedding

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
        attention_class: type[MLAAttention] = MLAAttention,
    ):
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.is_moe = cfg.is_moe_layer(layer)
        self.input_layernorm = _param((cfg.hidden_size,), dtype, device)
        self.post_attention_layernorm = _param((cfg.hidden_size,), dtype, device)
        self.self_attn = attention_class(cfg, dtype, device)
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
    (default cfg.max_position_embeddings). `attention_class`: the MLA layer each decoder layer is built with (the
    reference here; the GPU model's layer in kimi.model.gpu_model).
    """

    attention_class: type[MLAAttention] = MLAAttention

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
    ):
        super().__init__()
        self.cfg = cfg
        self.ep_rank, self.ep_size = ep_rank, ep_size
        self.dtype = dtype
        self.embed_tokens = _param((cfg.vocab_size, cfg.hidden_size), dtype, device)
        self.layers = DecoderLayers(
            DecoderLayer(cfg, i, ep_rank, ep_size, a2a, dtype, device, self.attention_class)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = _param((cfg.hidden_size,), dtype, device)
        self.lm_head = None if cfg.tie_word_embeddings else _param((cfg.vocab_size, cfg.hidden_size), dtype, device)
        self.rope = RotaryEmbedding(cfg, max_positions, device)

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

    # ---- forward ---------------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """input_ids [T] int64, positions [T] int64 -> hidden [T, D] after the final norm (model dtype).

        Writes the new tokens' latents into kv_caches[layer] ([num_blocks, bs, L + R]) at attn.slot_mapping.
        Raises ValueError if the number of caches differs from num_hidden_layers.
        """
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} kv caches for {len(self.layers)} layers")
        h = self.embed_tokens[input_ids]  # [T, D]
        for layer, cache in zip(self.layers, kv_caches):
            h = layer(h, positions, attn, cache, self.rope)  # [T, D]
        return rms_norm(h, self.norm, self.cfg.rms_norm_eps)  # [T, D]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, D] -> logits [N, vocab_size] float32 (untied lm_head; embed_tokens when tied)."""
        w = self.lm_head if self.lm_head is not None else self.embed_tokens
        return torch.nn.functional.linear(hidden, w).float()  # [N, V]
