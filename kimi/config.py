"""Frozen configuration dataclasses.

`ModelConfig` is read from a checkpoint's `config.json` (and `generation_config.json`); it understands every
Kimi-K2 text-backbone layout (see docs/model-format.md, Checkpoint variants):

- flat K2-Instruct / K2-Instruct-0905 (`model_type: kimi_k2`, FP8 128x128 block-quantised weights),
- flat K2-Thinking (INT4 compressed-tensors routed experts),
- nested K2.5 / K2.6 (outer `model_type: kimi_k25`, the text model under `text_config`, tensors prefixed
  `language_model.`; `vision_tower.*` and `mm_projector.*` are skipped).

The other configs (cache, scheduler, parallel, server) are plain frozen dataclasses that components take
individually (a component takes the sub-config it uses, not the aggregate).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

IM_END_ID = 163586  # `<|im_end|>`; always a stop token for chat (docs/model-format.md, Checkpoint variants)
# --moe-backend choices (kimi.backends.experts: what each runs); here so the controller's CLI needs no torch import
MOE_BACKENDS = ("auto", "humming", "cuda", "triton", "ref")
# --log-level of `kimi serve` and of each worker rank: uvicorn's levels (trace is its most verbose; Python's logging
# has none, so kimi logs it as debug)
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


class ConfigError(ValueError):
    """Raised when a checkpoint's config.json is missing, malformed or describes an unsupported model."""


@dataclass(frozen=True)
class QuantConfig:
    """How a checkpoint's weights are quantised.

    method: "int4" (compressed-tensors pack-quantized, symmetric, group-wise; only routed experts),
            "fp8" (float8_e4m3fn with a float32 `weight_scale_inv` per `block` x `block` tile).
    group_size: INT4 group length along the input dim (32 for Kimi).
    block: FP8 tile edge ([128, 128] for K2-Instruct).
    """

    method: str
    group_size: int = 32
    block: tuple[int, int] = (128, 128)


@dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters (DeepSeek-V3 reference `yarn_find_correction_range` / `yarn_get_mscale`)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    mscale: float
    mscale_all_dim: float


def yarn_get_mscale(scale: float, mscale: float) -> float:
    """`0.1 * mscale * ln(scale) + 1` for scale > 1, else 1 (DeepSeek-V3 reference code)."""
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    """The DeepSeek-V3 / Kimi-K2 text backbone's hyper-parameters, as read from config.json.

    Field names follow config.json. Derived values are properties. `weight_prefix` is "" for flat
    checkpoints and "language_model." for nested (K2.5/K2.6) ones; canonical tensor names used inside kimi
    never carry it. `eos_token_ids` is the union of config.json's and generation_config.json's EOS ids
    (the controller adds `<|im_end|>`). `max_new_tokens`: generation_config.json's `max_new_tokens` when it has one,
    the default `max_tokens` of a chat request that sends none (as vLLM reads it); None: the rest of the context.
    """

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    first_k_dense_replace: int
    moe_layer_freq: int
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_group: int
    topk_group: int
    topk_method: str
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    rms_norm_eps: float
    vocab_size: int
    tie_word_embeddings: bool
    hidden_act: str
    eos_token_ids: tuple[int, ...]
    weight_prefix: str = ""
    quant: QuantConfig | None = None
    max_new_tokens: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ---- derived -------------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        """Query/key head width of the naive form: qk_nope_head_dim + qk_rope_head_dim (192 for Kimi)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Values per token per layer in the latent cache: kv_lora_rank + qk_rope_head_dim (576)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """`qk_head_dim ** -0.5 * m * m`, m = yarn_get_mscale(factor, mscale_all_dim) (docs/model-format.md, Math)."""
        scale: float = self.qk_head_dim**-0.5
        if self.rope_scaling is not None:
            m = yarn_get_mscale(self.rope_scaling.factor, self.rope_scaling.mscale_all_dim)
            scale = scale * m * m
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        """True for layers with routed experts (layer >= first_k_dense_replace, every moe_layer_freq)."""
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    def with_overrides(self, **kw: Any) -> ModelConfig:
        """A copy with some fields replaced (e.g. num_hidden_layers for benchmarks)."""
        from dataclasses import replace

        return replace(self, **kw)

    # ---- loading -------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, cfg: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelConfig:
        """Build from a parsed config.json (flat or nested with `text_config`).

        Raises ConfigError naming the first missing or unsupported field.
        """
        if not isinstance(cfg, dict):
            raise ConfigError(f"config.json must be a JSON object, got {type(cfg).__name__}")
        if generation_config is not None and not isinstance(generation_config, dict):
            raise ConfigError(f"generation_config.json must be a JSON object, got {type(generation_config).__name__}")
        if cfg.get("text_config") is not None and not isinstance(cfg["text_config"], dict):  # null: absent
            raise ConfigError(f"config.json: text_config must be an object, got {cfg['text_config']!r:.60}")
        prefix = ""
        text = cfg
        where = "config.json: "  # how errors name a field of `text` (nested: text_config.NAME)
        if "text_config" in cfg and isinstance(cfg["text_config"], dict):
            text = dict(cfg["text_config"])
            prefix = "language_model."
            where = "config.json: text_config."
            # Some nested dumps keep quantization_config at the top level only.
            if "quantization_config" not in text and "quantization_config" in cfg:
                text["quantization_config"] = cfg["quantization_config"]

        def need(name: str) -> Any:
            if name not in text:
                raise ConfigError(f"{where.removesuffix('.').removesuffix(': ')}: missing field {name!r}")
            return text[name]

        def opt(name: str, default: Any) -> Any:
            v = text.get(name, default)
            return default if v is None else v

        def as_int(name: str, v: Any, lo: int = 1, file: str | None = None) -> int:
            """An integer field (JSON integer, or a float with an integral value) >= lo; file: where it is
            (default: config.json's model fields)."""
            if isinstance(v, float) and v.is_integer():
                v = int(v)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ConfigError(f"{file or where}{name} must be an integer >= {lo}, got {v!r:.60}")
            return v

        def as_float(name: str, v: Any) -> float:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ConfigError(f"{where}{name} must be a finite number, got {v!r:.60}")
            return float(v)

        def as_bool(name: str, v: Any) -> bool:
            if not isinstance(v, bool):
                raise ConfigError(f"{where}{name} must be true or false, got {v!r:.60}")
            return v

        for name, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
            if opt(name, want) != want:
                raise ConfigError(f"config.json: {name}={text.get(name)!r} is not supported (need {want!r})")
        if opt("hidden_act", "silu") != "silu":
            raise ConfigError(f"config.json: hidden_act={text.get('hidden_act')!r} is not supported (need 'silu')")
        if opt("n_group", 1) != 1 or opt("topk_group", 1) != 1:
            # Group-limited routing is a no-op with one group; Kimi uses one group.
            raise ConfigError("config.json: only n_group=1, topk_group=1 is supported")

        rs = text.get("rope_scaling")
        rope_scaling = None
        if rs is not None and not isinstance(rs, dict):
            raise ConfigError(f"{where}rope_scaling must be an object, got {rs!r:.60}")
        if rs:
            kind = rs.get("type", rs.get("rope_type"))
            if kind != "yarn":
                raise ConfigError(f"config.json: rope_scaling type {kind!r} is not supported (need 'yarn')")
            if "factor" not in rs:
                raise ConfigError(f"{where}rope_scaling has no 'factor'")
            rope_scaling = RopeScaling(
                factor=as_float("rope_scaling.factor", rs["factor"]),
                original_max_position_embeddings=as_int(
                    "rope_scaling.original_max_position_embeddings", rs.get("original_max_position_embeddings", 4096)
                ),
                beta_fast=as_float("rope_scaling.beta_fast", rs.get("beta_fast", 32)),
                beta_slow=as_float("rope_scaling.beta_slow", rs.get("beta_slow", 1)),
                mscale=as_float("rope_scaling.mscale", rs.get("mscale", 1.0)),
                mscale_all_dim=as_float("rope_scaling.mscale_all_dim", rs.get("mscale_all_dim", 0.0)),
            )

        quant = None
        qc = text.get("quantization_config")
        if qc is not None and not isinstance(qc, dict):
            raise ConfigError(f"config.json: quantization_config must be an object, got {qc!r:.60}")
        if qc:
            method = qc.get("quant_method")
            if method == "compressed-tensors":
                if qc.get("format") != "pack-quantized":
                    raise ConfigError(f"config.json: compressed-tensors format {qc.get('format')!r} is not supported")
                groups = qc.get("config_groups") or {}
                if not isinstance(groups, dict):
                    raise ConfigError(
                        f"config.json: quantization_config.config_groups must be an object, got {groups!r:.60}"
                    )
                group: Any = next(iter(groups.values()), {}) if groups else {}
                weights = group.get("weights") if isinstance(group, dict) else None
                if weights is None:
                    weights = {}
                if not isinstance(weights, dict):
                    raise ConfigError(
                        f"config.json: quantization_config.config_groups weights must be an object, got {weights!r:.60}"
                    )
                if weights.get("num_bits", 4) != 4 or not weights.get("symmetric", True):
                    raise ConfigError("config.json: only symmetric 4-bit compressed-tensors weights are supported")
                if weights.get("strategy", "group") != "group":
                    raise ConfigError("config.json: only group-wise INT4 scales are supported")
                quant = QuantConfig(
                    method="int4", group_size=as_int("quantization_config group_size", weights.get("group_size", 32))
                )
            elif method == "fp8":
                if qc.get("fmt", "e4m3") != "e4m3":
                    raise ConfigError(f"config.json: fp8 format {qc.get('fmt')!r} is not supported")
                blk = qc.get("weight_block_size", [128, 128])
                if not isinstance(blk, list) or len(blk) != 2:
                    raise ConfigError(f"config.json: weight_block_size must be [rows, columns], got {blk!r:.60}")
                quant = QuantConfig(
                    method="fp8", block=(as_int("weight_block_size[0]", blk[0]), as_int("weight_block_size[1]", blk[1]))
                )
            else:
                raise ConfigError(f"config.json: quant_method {method!r} is not supported")

        eos: list[int] = []

        def add_eos(v: Any, file: str | None) -> None:
            if v is None:
                return
            for x in v if isinstance(v, list) else [v]:
                x = as_int("eos_token_id", x, lo=0, file=file)
                if x not in eos:
                    eos.append(x)

        add_eos(text.get("eos_token_id", cfg.get("eos_token_id")), None)
        max_new_tokens = None
        if generation_config:
            add_eos(generation_config.get("eos_token_id"), "generation_config.json: ")
            if generation_config.get("max_new_tokens") is not None:
                max_new_tokens = as_int(
                    "max_new_tokens", generation_config["max_new_tokens"], file="generation_config.json: "
                )

        q_lora = text.get("q_lora_rank")
        return cls(
            model_type=str(text.get("model_type", cfg.get("model_type", "kimi_k2"))),
            hidden_size=as_int("hidden_size", need("hidden_size")),
            num_hidden_layers=as_int("num_hidden_layers", need("num_hidden_layers")),
            first_k_dense_replace=as_int("first_k_dense_replace", opt("first_k_dense_replace", 0), lo=0),
            moe_layer_freq=as_int("moe_layer_freq", opt("moe_layer_freq", 1)),
            intermediate_size=as_int("intermediate_size", need("intermediate_size")),
            moe_intermediate_size=as_int("moe_intermediate_size", need("moe_intermediate_size")),
            n_routed_experts=as_int("n_routed_experts", need("n_routed_experts")),
            num_experts_per_tok=as_int("num_experts_per_tok", need("num_experts_per_tok")),
            n_shared_experts=as_int("n_shared_experts", opt("n_shared_experts", 0), lo=0),
            num_attention_heads=as_int("num_attention_heads", need("num_attention_heads")),
            q_lora_rank=None if q_lora is None else as_int("q_lora_rank", q_lora),
            kv_lora_rank=as_int("kv_lora_rank", need("kv_lora_rank")),
            qk_nope_head_dim=as_int("qk_nope_head_dim", need("qk_nope_head_dim")),
            qk_rope_head_dim=as_int("qk_rope_head_dim", need("qk_rope_head_dim")),
            v_head_dim=as_int("v_head_dim", need("v_head_dim")),
            n_group=as_int("n_group", opt("n_group", 1)),
            topk_group=as_int("topk_group", opt("topk_group", 1)),
            topk_method=str(opt("topk_method", "noaux_tc")),
            scoring_func=str(opt("scoring_func", "sigmoid")),
            norm_topk_prob=as_bool("norm_topk_prob", opt("norm_topk_prob", True)),
            routed_scaling_factor=as_float("routed_scaling_factor", opt("routed_scaling_factor", 1.0)),
            rope_theta=as_float("rope_theta", opt("rope_theta", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=as_int("max_position_embeddings", need("max_position_embeddings")),
            rms_norm_eps=as_float("rms_norm_eps", opt("rms_norm_eps", 1e-6)),
            vocab_size=as_int("vocab_size", need("vocab_size")),
            tie_word_embeddings=as_bool("tie_word_embeddings", opt("tie_word_embeddings", False)),
            hidden_act="silu",
            eos_token_ids=tuple(eos),
            weight_prefix=prefix,
            quant=quant,
            max_new_tokens=max_new_tokens,
            raw=cfg,
        )

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> ModelConfig:
        """Read `config.json` (and `generation_config.json` when present) from a checkpoint folder.

        Raises ConfigError if config.json is missing or malformed.
        """
        cpath = os.path.join(path, "config.json")
        if not os.path.isdir(path):
            raise ConfigError(f"{path}: no such directory")
        if not os.path.isfile(cpath):
            raise ConfigError(f"{path}: no config.json")
        try:
            with open(cpath) as f:
                cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{cpath}: not valid JSON: {e}") from e
        gen = None
        gpath = os.path.join(path, "generation_config.json")
        if os.path.isfile(gpath):
            try:
                with open(gpath) as f:
                    gen = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{gpath}: not valid JSON: {e}") from e
        try:
            return cls.from_dict(cfg, gen)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None


@dataclass(frozen=True)
class CacheConfig:
    """Paged latent KV cache: `block_size` tokens per block; `num_blocks` None = size from memory.

    `kv_cache_memory_gib` bounds the cache on CPU (or when given on GPU); on GPU the default is
    `gpu_memory_utilization` of total memory minus what the weights and activations use. Block 0 is the
    null block (padded rows write there), so usable blocks are num_blocks - 1.
    """

    block_size: int = 64
    num_blocks: int | None = None
    kv_cache_memory_gib: float | None = None
    gpu_memory_utilization: float = 0.9


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits.

    max_num_seqs: running requests per DP rank; token_budget: tokens (prefill chunk + decodes) per step;
    max_model_len: prompt + generated tokens per request; waiting_reserve: tokens of each step's budget that the
    prompt chunks of running requests leave to waiting requests while some wait (so a short request arriving
    behind a long prompt starts within a step instead of after that whole prompt; 0: none). policy: the order in
    which waiting requests start: "fcfs" (arrival) or "priority" (a request's `priority`, lower first, then
    arrival; vLLM's rule).
    """

    max_num_seqs: int = 256
    token_budget: int = 2048
    max_model_len: int = 8192
    waiting_reserve: int = 512
    policy: str = "fcfs"


@dataclass(frozen=True)
class ParallelConfig:
    """world_size ranks; DP attention over all ranks, EP MoE over all ranks, `a2a_backend` for dispatch/combine."""

    world_size: int = 1
    a2a_backend: str = "local"


@dataclass(frozen=True)
class ServerConfig:
    """HTTP / ZeroMQ front-ends of the controller."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str = "kimi"
    zmq_submit_addr: str | None = None
