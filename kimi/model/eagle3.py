"""EAGLE3 draft model: the plain PyTorch reference (docs/speculative.md).

An EAGLE3 draft (Li et al., "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via Training-Time
Test", 2025) is one Llama-style decoder layer that reads, at position p, the embedding of token p + 1 next to a
feature of position p, and predicts token p + 2 over a reduced draft vocabulary:

- first draft step: the feature is `fc(aux)`, `aux` [T, 3 * Ht] the target's residual stream entering three of its
  layers (`aux_layer_ids`, in that order), `fc` [H, 3 * Ht];
- later steps: the feature is the draft's own pre-norm output of the previous position.

Layer: `e = input_layernorm(embed)`, `f = hidden_norm(feature)`, residual = feature (or f with
`norm_before_residual`); attention over `cat(e, f)` [T, 2H] (q / k / v projections take 2H); `h = attn + residual`;
`h = h + mlp(post_attention_layernorm(h))`; logits = `lm_head(norm(h))` [T, Vd]; a draft id i is the target id
`i + d2t[i]`. The pre-norm `h` is the next step's feature.

Checkpoint layout (the published Hugging Face one, docs/speculative.md): `fc.weight`, `midlayer.*`, `norm.weight`,
`lm_head.weight`, `d2t` int64 [Vd] (optional when Vd == V: the identity), `t2d` bool [V] (optional),
`embed_tokens.weight` (optional: shared with the target when absent). A leading `model.` on any name is accepted.

Attention: Llama's (`LlamaForCausalLMEagle3`: q / k / v / o projections, grouped-query, rotate-half rotary) or
DeepSeek's MLA (`Eagle3DeepseekV2ForCausalLM`, the `-mla` drafts: q_a / q_b (or q_proj), kv_a_proj_with_mqa,
kv_b_proj, o_proj; interleaved rotary with YaRN when configured; the naive form, the draft caching the normed latent
and the roped k_pe per position). The MLA latent norms use the config's rms_norm_eps, as vLLM's draft does.

The draft keeps its own per-request KV (`DraftKV`, a dense host-side cache on the worker): speculation on the CPU
reference path only.
"""

from __future__ import annotations

import glob
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kimi.config import ModelConfig, RopeScaling, yarn_get_mscale
from kimi.errors import CheckpointError, ConfigError
from kimi.model.norm import rms_norm
from kimi.model.rope import apply_rope_interleaved, rope_inv_freq, rope_mscale

# architectures of a Llama-attention EAGLE3 draft (SpecForge / vLLM / SGLang spell it either way)
LLAMA_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
MLA_ARCHITECTURES = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """The target layers whose input residual stream EAGLE3 fuses when the draft's config names none:
    (2, L // 2, L - 3), vLLM's and SGLang's default (61 layers: 2, 30, 58)."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class Eagle3Config:
    """An EAGLE3 draft's config.json, the fields the draft uses.

    hidden_size H, target_hidden_size Ht (the target's hidden size, fc's input is 3 * Ht), heads / kv heads of
    head_dim, intermediate_size of the SwiGLU MLP, rms_norm_eps, rope_theta (plain rotary embedding, no scaling),
    vocab_size V (the target's), draft_vocab_size Vd, aux_layer_ids (None: `default_aux_layer_ids` of the target),
    norm_before_residual (the residual is the normed feature); attention "llama" or "mla" with, for MLA, q_lora_rank
    (None: a plain q_proj), kv_lora_rank, qk_nope / qk_rope / v head dims and rope_scaling (YaRN or None).
    """

    hidden_size: int
    target_hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...] | None
    norm_before_residual: bool = False
    # MLA drafts (attention "mla"): DeepSeek's MLA sizes and YaRN; unused by Llama drafts
    attention: str = "llama"
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_scaling: RopeScaling | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "config.json") -> Eagle3Config:
        """Parse a draft's config dict. Raises ConfigError naming the field for a draft kimi cannot run: another
        architecture, num_hidden_layers other than 1, use_aux_hidden_state false, rope_scaling on a Llama draft (an
        MLA draft's must be YaRN), a missing or non-positive size."""
        arch = d.get("architectures") or []
        mla = any(a in MLA_ARCHITECTURES for a in arch)
        if not mla and not any(a in LLAMA_ARCHITECTURES for a in arch):
            raise ConfigError(
                f"{where}: architectures {arch}: want one of {', '.join(LLAMA_ARCHITECTURES + MLA_ARCHITECTURES)}"
            )
        if d.get("num_hidden_layers", 1) != 1:
            raise ConfigError(f"{where}: num_hidden_layers {d.get('num_hidden_layers')}: only 1-layer drafts load")
        eagle = d.get("eagle_config") or {}
        if not eagle.get("use_aux_hidden_state", True):
            raise ConfigError(f"{where}: eagle_config.use_aux_hidden_state false: EAGLE3 fuses aux hidden states")
        if d.get("rope_scaling") and not mla:
            raise ConfigError(f"{where}: rope_scaling {d['rope_scaling']}: only plain rotary Llama drafts load")

        def need(name: str) -> int:
            v = d.get(name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"{where}: {name} {v!r}: want a positive integer")
            return v

        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        head_dim = d.get("head_dim") or hidden // heads
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        if ids is not None and (not isinstance(ids, list) or len(ids) != 3 or not all(isinstance(i, int) for i in ids)):
            raise ConfigError(f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids {ids!r}: want 3 layer ids")
        vocab = need("vocab_size")
        mla_fields: dict[str, Any] = {}
        if mla:
            q_lora = d.get("q_lora_rank")
            mla_fields = dict(
                attention="mla",
                q_lora_rank=None if q_lora is None else need("q_lora_rank"),
                kv_lora_rank=need("kv_lora_rank"),
                qk_nope_head_dim=need("qk_nope_head_dim"),
                qk_rope_head_dim=need("qk_rope_head_dim"),
                v_head_dim=need("v_head_dim"),
                rope_scaling=_yarn(d.get("rope_scaling"), where),
            )
        return cls(
            **mla_fields,
            hidden_size=hidden,
            target_hidden_size=int(d.get("target_hidden_size") or hidden),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            intermediate_size=need("intermediate_size"),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(d.get("rope_theta", 10000.0)),
            vocab_size=vocab,
            draft_vocab_size=int(d.get("draft_vocab_size") or vocab),
            aux_layer_ids=tuple(ids) if ids is not None else None,
            norm_before_residual=bool(d.get("norm_before_residual", False)),
            raw=d,
        )

    def check_target(self, target: ModelConfig) -> tuple[int, ...]:
        """The aux layer ids against `target`; raises ConfigError naming the field when the draft does not fit it
        (vocab_size, target_hidden_size, a layer id outside [0, num_hidden_layers))."""
        if self.vocab_size != target.vocab_size:
            raise ConfigError(f"draft vocab_size {self.vocab_size} != the target's {target.vocab_size}")
        if self.target_hidden_size != target.hidden_size:
            if self.raw.get("target_hidden_size"):
                raise ConfigError(
                    f"draft target_hidden_size {self.target_hidden_size} != the target's hidden_size "
                    f"{target.hidden_size}"
                )
            raise ConfigError(
                f"draft hidden_size {self.hidden_size} != the target's hidden_size {target.hidden_size}, and its "
                "config.json has no target_hidden_size (the width of the target states fc reads) to say so"
            )
        ids = self.aux_layer_ids or default_aux_layer_ids(target.num_hidden_layers)
        bad = [i for i in ids if not 0 <= i < target.num_hidden_layers]
        if bad:
            raise ConfigError(
                f"draft eagle_aux_hidden_state_layer_ids {list(ids)}: {bad} outside the target's "
                f"{target.num_hidden_layers} layers"
            )
        return tuple(ids)

    def tensor_shapes(self, with_embedding: bool) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
        """Every tensor of the published layout: name -> (shape, dtype; None = any float). `t2d` is optional and
        not listed (checked by the loader when present); `embed_tokens.weight` only when `with_embedding`."""
        H, Ht, I = self.hidden_size, self.target_hidden_size, self.intermediate_size
        s: dict[str, tuple[tuple[int, ...], torch.dtype | None]] = {
            "fc.weight": ((H, 3 * Ht), None),
            "midlayer.hidden_norm.weight": ((H,), None),
            "midlayer.input_layernorm.weight": ((H,), None),
            "midlayer.post_attention_layernorm.weight": ((H,), None),
        }
        a = "midlayer.self_attn."
        if self.attention == "mla":
            nh, N, R, V, L = (
                self.num_attention_heads,
                self.qk_nope_head_dim,
                self.qk_rope_head_dim,
                self.v_head_dim,
                self.kv_lora_rank,
            )
            if self.q_lora_rank is not None:
                s[a + "q_a_proj.weight"] = ((self.q_lora_rank, 2 * H), None)
                s[a + "q_a_layernorm.weight"] = ((self.q_lora_rank,), None)
                s[a + "q_b_proj.weight"] = ((nh * (N + R), self.q_lora_rank), None)
            else:
                s[a + "q_proj.weight"] = ((nh * (N + R), 2 * H), None)
            s[a + "kv_a_proj_with_mqa.weight"] = ((L + R, 2 * H), None)
            s[a + "kv_a_layernorm.weight"] = ((L,), None)
            s[a + "kv_b_proj.weight"] = ((nh * (N + V), L), None)
            s[a + "o_proj.weight"] = ((H, nh * V), None)
        else:
            q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
            s[a + "q_proj.weight"] = ((q, 2 * H), None)
            s[a + "k_proj.weight"] = ((kv, 2 * H), None)
            s[a + "v_proj.weight"] = ((kv, 2 * H), None)
            s[a + "o_proj.weight"] = ((H, q), None)
        s |= {
            "midlayer.mlp.gate_proj.weight": ((I, H), None),
            "midlayer.mlp.up_proj.weight": ((I, H), None),
            "midlayer.mlp.down_proj.weight": ((H, I), None),
            "norm.weight": ((H,), None),
            "lm_head.weight": ((self.draft_vocab_size, H), None),
            "d2t": ((self.draft_vocab_size,), torch.int64),
        }
        if with_embedding:
            s["embed_tokens.weight"] = ((self.vocab_size, H), None)
        return s


@dataclass
class DraftKV:
    """One request's draft KV: keys / values of positions [base, base + length), float, [cap, kv_heads, head_dim]
    each, grown by doubling. `truncate(p)` drops positions >= p (rejected or speculative entries)."""

    k: torch.Tensor
    v: torch.Tensor
    base: int = -1
    length: int = 0

    def truncate(self, position: int) -> None:
        """Keep positions < `position` (none when it is below base)."""
        if self.base >= 0:
            self.length = max(0, min(self.length, position - self.base))

    def append(self, position: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k / v [T, kv_heads, head_dim] at positions [position, position + T); position must be
        base + length (or any, for an empty cache). Raises ValueError on a gap."""
        if self.length == 0:
            self.base = position
        elif position != self.base + self.length:
            raise ValueError(f"draft KV holds [{self.base}, {self.base + self.length}); cannot append at {position}")
        need = self.length + k.shape[0]
        if need > self.k.shape[0]:
            cap = max(need, 2 * self.k.shape[0])
            nk = self.k.new_empty((cap, *self.k.shape[1:]))
            nv = self.v.new_empty((cap, *self.v.shape[1:]))
            nk[: self.length] = self.k[: self.length]
            nv[: self.length] = self.v[: self.length]
            self.k, self.v = nk, nv
        self.k[self.length : need] = k
        self.v[self.length : need] = v
        self.length = need


def _yarn(rs: Any, where: str) -> RopeScaling | None:
    """An MLA draft's rope_scaling: None, or YaRN (`type` / `rope_type` "yarn") as the target's. ConfigError else."""
    if not rs:
        return None
    if not isinstance(rs, dict) or rs.get("type", rs.get("rope_type")) != "yarn" or "factor" not in rs:
        raise ConfigError(f"{where}: rope_scaling {rs!r:.80}: want null or YaRN with a factor")
    return RopeScaling(
        factor=float(rs["factor"]),
        original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 4096)),
        beta_fast=float(rs.get("beta_fast", 32)),
        beta_slow=float(rs.get("beta_slow", 1)),
        mscale=float(rs.get("mscale", 1.0)),
        mscale_all_dim=float(rs.get("mscale_all_dim", 0.0)),
    )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Eagle3Draft(nn.Module):
    """The EAGLE3 draft (module docstring), float weights on one device.

    embed: the target's embedding [V, H] when the draft has none of its own (shared, not copied).
    """

    def __init__(
        self,
        cfg: Eagle3Config,
        aux_layer_ids: tuple[int, ...],
        embed: torch.Tensor | None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.aux_layer_ids = aux_layer_ids
        self.dtype = dtype
        self.params: dict[str, torch.Tensor] = {
            n: torch.empty(shape, dtype=dt or dtype, device=device)
            for n, (shape, dt) in cfg.tensor_shapes(with_embedding=embed is None).items()
        }
        self.embed = embed if embed is not None else self.params["embed_tokens.weight"]
        if cfg.attention == "mla":
            R = cfg.qk_rope_head_dim
            self.inv_freq = rope_inv_freq(R, cfg.rope_theta, cfg.rope_scaling).to(device)  # [R / 2]
            self.rope_mscale = rope_mscale(cfg.rope_scaling)
            scale = (cfg.qk_nope_head_dim + R) ** -0.5
            if cfg.rope_scaling is not None:
                m = yarn_get_mscale(cfg.rope_scaling.factor, cfg.rope_scaling.mscale_all_dim)
                scale = scale * m * m
            self.scale = scale
        else:
            hd = cfg.head_dim
            self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=device) / hd))
            self.rope_mscale = 1.0
            self.scale = hd**-0.5
        self.target_ids = torch.empty(0, dtype=torch.long)  # [Vd], set by load_weights

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy the checked tensors (`check_draft_weights`) in; derives the draft -> target id map."""
        for n, dst in self.params.items():
            dst.copy_(weights[n].to(device=dst.device, dtype=dst.dtype))
        d2t = self.params["d2t"]
        self.target_ids = torch.arange(d2t.shape[0], device=d2t.device) + d2t  # [Vd] int64

    def new_kv(self) -> DraftKV:
        """An empty per-request draft cache: keys / values [cap, kv_heads, head_dim] (Llama), or the latent
        [cap, 1, kv_lora_rank + qk_rope_head_dim] as keys and no values (MLA)."""
        c = self.cfg
        if c.attention == "mla":
            ks: tuple[int, ...] = (16, 1, c.kv_lora_rank + c.qk_rope_head_dim)
            vs: tuple[int, ...] = (16, 1, 0)
        else:
            ks = vs = (16, c.num_key_value_heads, c.head_dim)
        dev = self.params["fc.weight"].device
        return DraftKV(torch.empty(ks, dtype=self.dtype, device=dev), torch.empty(vs, dtype=self.dtype, device=dev))

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [T, 3 * Ht] (the target's residual stream entering aux_layer_ids, concatenated) -> feature [T, H]."""
        return torch.nn.functional.linear(aux.to(self.dtype), self.params["fc.weight"])

    def forward(
        self, input_ids: torch.Tensor, feature: torch.Tensor, positions: torch.Tensor, kv: DraftKV
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One request's draft positions: input_ids [T] int64 (token p + 1 at position p), feature [T, H],
        positions [T] int64 consecutive, starting at the cache's end (kv.truncate first). Appends their K / V to kv.
        Returns (logits [T, Vd] float32, pre-norm hidden [T, H], the next step's feature)."""
        c, p = self.cfg, self.params
        eps = c.rms_norm_eps
        e = rms_norm(self.embed[input_ids].to(self.dtype), p["midlayer.input_layernorm.weight"], eps)  # [T, H]
        f = rms_norm(feature, p["midlayer.hidden_norm.weight"], eps)  # [T, H]
        residual = f if c.norm_before_residual else feature
        x = torch.cat([e, f], dim=-1)  # [T, 2H]
        attend = self._attend_mla if c.attention == "mla" else self._attend_llama
        h = residual + attend(x, positions, kv)  # [T, H]
        m = rms_norm(h, p["midlayer.post_attention_layernorm.weight"], eps)
        gate = torch.nn.functional.linear(m, p["midlayer.mlp.gate_proj.weight"])
        up = torch.nn.functional.linear(m, p["midlayer.mlp.up_proj.weight"])
        h = h + torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, p["midlayer.mlp.down_proj.weight"])
        logits = torch.nn.functional.linear(rms_norm(h, p["norm.weight"], eps), p["lm_head.weight"]).float()
        return logits, h

    def _causal(self, scores: torch.Tensor, positions: torch.Tensor, kv: DraftKV) -> torch.Tensor:
        """Softmax over the cached positions of scores [heads, T, S], the keys after each query's position masked."""
        key_pos = torch.arange(kv.base, kv.base + kv.length, device=scores.device)
        mask = key_pos.unsqueeze(0) > positions.unsqueeze(1)  # [T, S]: future keys
        return torch.softmax(scores.masked_fill(mask.unsqueeze(0), float("-inf")), dim=-1)

    def _attend_llama(self, x: torch.Tensor, positions: torch.Tensor, kv: DraftKV) -> torch.Tensor:
        """Llama attention of x [T, 2H] at positions [T] over kv (appending the T positions) -> [T, H]."""
        c, p = self.cfg, self.params
        T = x.shape[0]
        nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        lin = torch.nn.functional.linear
        q = lin(x, p["midlayer.self_attn.q_proj.weight"]).view(T, nh, hd)
        k = lin(x, p["midlayer.self_attn.k_proj.weight"]).view(T, nkv, hd)
        v = lin(x, p["midlayer.self_attn.v_proj.weight"]).view(T, nkv, hd)
        ang = positions.to(torch.float32).unsqueeze(1) * self.inv_freq.unsqueeze(0)  # [T, hd / 2]
        cos = torch.cat([ang.cos(), ang.cos()], dim=-1).unsqueeze(1).to(q.dtype)  # [T, 1, hd]
        sin = torch.cat([ang.sin(), ang.sin()], dim=-1).unsqueeze(1).to(q.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        kv.append(int(positions[0]), k, v)
        S = kv.length
        keys = kv.k[:S].repeat_interleave(nh // nkv, dim=1)  # [S, nh, hd]
        vals = kv.v[:S].repeat_interleave(nh // nkv, dim=1)
        scores = torch.einsum("thd,shd->hts", q.float(), keys.float()) * self.scale  # [nh, T, S]
        o = torch.einsum("hts,shd->thd", self._causal(scores, positions, kv), vals.float()).to(x.dtype)  # [T, nh, hd]
        out: torch.Tensor = lin(o.reshape(T, nh * hd), p["midlayer.self_attn.o_proj.weight"])
        return out

    def _attend_mla(self, x: torch.Tensor, positions: torch.Tensor, kv: DraftKV) -> torch.Tensor:
        """MLA (naive form) of x [T, 2H] at positions [T] over kv's cached `[rmsnorm(ckv) | roped k_pe]` (appending
        the T positions) -> [T, H]. Math as kimi.model.attention's prefill reference, over a dense cache."""
        c, p = self.cfg, self.params
        T = x.shape[0]
        nh, N, R, V, L = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        eps = c.rms_norm_eps
        lin = torch.nn.functional.linear
        a = "midlayer.self_attn."
        if c.q_lora_rank is not None:
            q_lat = rms_norm(lin(x, p[a + "q_a_proj.weight"]), p[a + "q_a_layernorm.weight"], eps)  # [T, q_lora]
            q = lin(q_lat, p[a + "q_b_proj.weight"])
        else:
            q = lin(x, p[a + "q_proj.weight"])
        q = q.view(T, nh, N + R)
        kv_a = lin(x, p[a + "kv_a_proj_with_mqa.weight"])  # [T, L + R]
        ckv = rms_norm(kv_a[:, :L], p[a + "kv_a_layernorm.weight"], eps)  # [T, L]
        ang = positions.to(torch.float64).unsqueeze(1) * self.inv_freq.double().unsqueeze(0)  # [T, R / 2]
        cos, sin = (ang.cos() * self.rope_mscale).float(), (ang.sin() * self.rope_mscale).float()
        q_pe = apply_rope_interleaved(q[..., N:], cos, sin)  # [T, nh, R]
        k_pe = apply_rope_interleaved(kv_a[:, L:], cos, sin)  # [T, R]
        kv.append(int(positions[0]), torch.cat([ckv, k_pe], dim=-1).unsqueeze(1), kv.v.new_empty((T, 1, 0)))
        S = kv.length
        lat = kv.k[:S, 0].float()  # [S, L + R]
        kvb = lin(lat[:, :L], p[a + "kv_b_proj.weight"].float()).view(S, nh, N + V)  # [S, nh, N + V]
        scores = torch.einsum("thn,shn->hts", q[..., :N].float(), kvb[..., :N])
        scores = (scores + torch.einsum("thr,sr->hts", q_pe.float(), lat[:, L:])) * self.scale  # [nh, T, S]
        o = torch.einsum("hts,shv->thv", self._causal(scores, positions, kv), kvb[..., N:]).to(x.dtype)  # [T, nh, V]
        out: torch.Tensor = lin(o.reshape(T, nh * V), p[a + "o_proj.weight"])
        return out

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft vocabulary ids [N] -> target ids [N] (`i + d2t[i]`)."""
        return self.target_ids[draft_ids]


def read_draft_config(draft_dir: str) -> Eagle3Config:
    """The draft folder's config.json as an Eagle3Config; ConfigError when it is missing, malformed or unsupported."""
    path = os.path.join(draft_dir, "config.json")
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"speculative model {draft_dir}: cannot read config.json: {e}") from e
    if not isinstance(d, dict):
        raise ConfigError(f"speculative model {path}: not a JSON object")
    return Eagle3Config.from_dict(d, where=path)


def read_draft_tensors(draft_dir: str) -> dict[str, torch.Tensor]:
    """Every tensor of the draft folder's *.safetensors files, names without a leading `model.`; CheckpointError when
    there are none or a name occurs twice."""
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(draft_dir, "*.safetensors")))
    if not files:
        raise CheckpointError(f"speculative model {draft_dir}: no *.safetensors files")
    out: dict[str, torch.Tensor] = {}
    for fn in files:
        for name, t in load_file(fn).items():
            canon = name[len("model.") :] if name.startswith("model.") else name
            if canon in out:
                raise CheckpointError(f"speculative model {draft_dir}: tensor {canon} in two files ({fn})")
            out[canon] = t
    return out


def check_draft_weights(cfg: Eagle3Config, target: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """Raise CheckpointError naming the tensor when `weights` do not match cfg's layout: a missing or unexpected
    tensor, a wrong shape or dtype, `d2t` mapping outside the target vocabulary, `t2d` of another size or not
    marking exactly the d2t targets, no embed_tokens while the draft's hidden size differs from the target's."""
    with_embed = "embed_tokens.weight" in weights
    if not with_embed and cfg.hidden_size != target.hidden_size:
        raise CheckpointError(
            f"draft has no embed_tokens.weight and its hidden_size {cfg.hidden_size} differs from the target's "
            f"{target.hidden_size}: it cannot share the target's embedding"
        )
    want = cfg.tensor_shapes(with_embed)
    for name, (shape, dtype) in want.items():
        t = weights.get(name)
        if t is None:
            raise CheckpointError(f"draft tensor {name} missing (want {list(shape)})")
        if tuple(t.shape) != shape:
            raise CheckpointError(f"draft tensor {name}: shape {list(t.shape)}, want {list(shape)}")
        if dtype is not None and t.dtype != dtype:
            raise CheckpointError(f"draft tensor {name}: dtype {t.dtype}, want {dtype}")
        if dtype is None and not t.is_floating_point():
            raise CheckpointError(f"draft tensor {name}: dtype {t.dtype}, want a float dtype")
    extra = sorted(set(weights) - set(want) - {"t2d"})
    if extra:
        raise CheckpointError(f"draft tensor {extra[0]} unexpected ({len(extra)} unexpected tensors)")
    targets = torch.arange(cfg.draft_vocab_size) + weights["d2t"]
    if bool(((targets < 0) | (targets >= target.vocab_size)).any()):
        raise CheckpointError(f"draft tensor d2t maps draft ids outside the target vocabulary [0, {target.vocab_size})")
    t2d = weights.get("t2d")
    if t2d is not None:
        if tuple(t2d.shape) != (target.vocab_size,) or t2d.dtype != torch.bool:
            raise CheckpointError(
                f"draft tensor t2d: {t2d.dtype} {list(t2d.shape)}, want torch.bool [{target.vocab_size}]"
            )
        mark = torch.zeros(target.vocab_size, dtype=torch.bool)
        mark[targets] = True
        if not torch.equal(mark, t2d):
            raise CheckpointError("draft tensor t2d does not mark exactly the target ids d2t maps to")


def load_eagle3_draft(
    draft_dir: str,
    target: ModelConfig,
    target_embed: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    dummy: bool = False,
    seed: int = 0,
) -> Eagle3Draft:
    """Read, check (`Eagle3Config.check_target`, `check_draft_weights`) and load the draft in `draft_dir` for the
    target `target` (whose embedding [V, Ht] the draft shares when it has none). dummy: random weights of the config's
    shapes (`random_draft_weights`), no safetensors read. Raises ConfigError / CheckpointError naming the field or
    tensor."""
    cfg = read_draft_config(draft_dir)
    ids = cfg.check_target(target)
    weights = random_draft_weights(cfg, target, seed) if dummy else read_draft_tensors(draft_dir)
    if "d2t" not in weights and cfg.draft_vocab_size == cfg.vocab_size:
        weights["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)  # the full vocabulary: identity
    check_draft_weights(cfg, target, weights)
    embed = None if "embed_tokens.weight" in weights else target_embed
    draft = Eagle3Draft(cfg, ids, embed, dtype, device)
    draft.load_weights(weights)
    return draft


def random_draft_weights(
    cfg: Eagle3Config, target: ModelConfig, seed: int = 0, with_embedding: bool = False
) -> dict[str, torch.Tensor]:
    """Random float32 weights of cfg's layout (tiny checkpoints, dummy loads): linear layers N(0, 1 / fan_in) (0.5x
    for o_proj / down_proj, 3x for lm_head), norms 1 + N(0, 0.01); d2t maps draft id i to every
    (V // Vd)-th target id (`t2d` marks them). Deterministic in seed."""
    g = torch.Generator()
    g.manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, (shape, dtype) in cfg.tensor_shapes(with_embedding).items():
        if dtype is not None:
            continue
        x = torch.randn(shape, generator=g)
        if name.endswith("norm.weight"):
            x = 1.0 + 0.1 * x
        elif name == "embed_tokens.weight":
            pass
        else:
            gain = (
                0.5 if name.endswith(("o_proj.weight", "down_proj.weight")) else 3.0 if name == "lm_head.weight" else 1
            )
            x = x * (gain / math.sqrt(shape[1]))
        out[name] = x
    stride = max(1, target.vocab_size // cfg.draft_vocab_size)
    targets = torch.arange(cfg.draft_vocab_size, dtype=torch.int64) * stride
    out["d2t"] = targets - torch.arange(cfg.draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[targets] = True
    out["t2d"] = t2d
    return out
