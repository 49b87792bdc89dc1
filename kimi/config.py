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

import argparse
import json
import math
import os
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from kimi.errors import ConfigError

IM_END_ID = 163586  # `<|im_end|>`; always a stop token for chat (docs/model-format.md, Checkpoint variants)
# --moe-backend choices (kimi.backends.experts: what each runs); here so the controller's CLI needs no torch import
MOE_BACKENDS = ("auto", "humming", "cuda", "triton", "ref")
# --log-level of `kimi serve` and of each worker rank: uvicorn's levels (trace is its most verbose; Python's logging
# has none, so kimi logs it as debug)
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


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
        f = _ConfigFields.of(cfg, generation_config)
        need, opt, as_int, as_float, as_bool = f.need, f.opt, f.as_int, f.as_float, f.as_bool
        text = f.text
        for name, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
            if opt(name, want) != want:
                raise ConfigError(f"config.json: {name}={text.get(name)!r} is not supported (need {want!r})")
        if opt("hidden_act", "silu") != "silu":
            raise ConfigError(f"config.json: hidden_act={text.get('hidden_act')!r} is not supported (need 'silu')")
        if opt("n_group", 1) != 1 or opt("topk_group", 1) != 1:
            # Group-limited routing is a no-op with one group; Kimi uses one group.
            raise ConfigError("config.json: only n_group=1, topk_group=1 is supported")
        rope_scaling = _rope_scaling(f)
        quant = _quant_config(f)
        eos, max_new_tokens = _eos_and_max_new_tokens(f, cfg, generation_config)
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
            weight_prefix=f.prefix,
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


class _ConfigFields:
    """The text model's fields of a config.json (`text`: flat, or its text_config), with typed readers whose errors
    name the field (`where`: "config.json: " or "config.json: text_config."); prefix: the tensors' name prefix."""

    def __init__(self, text: dict[str, Any], prefix: str, where: str) -> None:
        self.text, self.prefix, self.where = text, prefix, where

    @classmethod
    def of(cls, cfg: Any, generation_config: Any) -> _ConfigFields:
        """Check the two files' top levels and pick the text model's fields. Raises ConfigError."""
        if not isinstance(cfg, dict):
            raise ConfigError(f"config.json must be a JSON object, got {type(cfg).__name__}")
        if generation_config is not None and not isinstance(generation_config, dict):
            raise ConfigError(f"generation_config.json must be a JSON object, got {type(generation_config).__name__}")
        if cfg.get("text_config") is not None and not isinstance(cfg["text_config"], dict):  # null: absent
            raise ConfigError(f"config.json: text_config must be an object, got {cfg['text_config']!r:.60}")
        if "text_config" in cfg and isinstance(cfg["text_config"], dict):
            text = dict(cfg["text_config"])
            # Some nested dumps keep quantization_config at the top level only.
            if "quantization_config" not in text and "quantization_config" in cfg:
                text["quantization_config"] = cfg["quantization_config"]
            return cls(text, "language_model.", "config.json: text_config.")
        return cls(cfg, "", "config.json: ")

    def need(self, name: str) -> Any:
        if name not in self.text:
            raise ConfigError(f"{self.where.removesuffix('.').removesuffix(': ')}: missing field {name!r}")
        return self.text[name]

    def opt(self, name: str, default: Any) -> Any:
        v = self.text.get(name, default)
        return default if v is None else v

    def as_int(self, name: str, v: Any, lo: int = 1, file: str | None = None) -> int:
        """An integer field (JSON integer, or a float with an integral value) >= lo; file: where it is
        (default: config.json's model fields)."""
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ConfigError(f"{file or self.where}{name} must be an integer >= {lo}, got {v!r:.60}")
        return v

    def as_float(self, name: str, v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ConfigError(f"{self.where}{name} must be a finite number, got {v!r:.60}")
        return float(v)

    def as_bool(self, name: str, v: Any) -> bool:
        if not isinstance(v, bool):
            raise ConfigError(f"{self.where}{name} must be true or false, got {v!r:.60}")
        return v


def _rope_scaling(f: _ConfigFields) -> RopeScaling | None:
    """config.json's rope_scaling (YaRN only); None without one. Raises ConfigError."""
    rs = f.text.get("rope_scaling")
    if rs is not None and not isinstance(rs, dict):
        raise ConfigError(f"{f.where}rope_scaling must be an object, got {rs!r:.60}")
    if not rs:
        return None
    kind = rs.get("type", rs.get("rope_type"))
    if kind != "yarn":
        raise ConfigError(f"config.json: rope_scaling type {kind!r} is not supported (need 'yarn')")
    if "factor" not in rs:
        raise ConfigError(f"{f.where}rope_scaling has no 'factor'")
    return RopeScaling(
        factor=f.as_float("rope_scaling.factor", rs["factor"]),
        original_max_position_embeddings=f.as_int(
            "rope_scaling.original_max_position_embeddings", rs.get("original_max_position_embeddings", 4096)
        ),
        beta_fast=f.as_float("rope_scaling.beta_fast", rs.get("beta_fast", 32)),
        beta_slow=f.as_float("rope_scaling.beta_slow", rs.get("beta_slow", 1)),
        mscale=f.as_float("rope_scaling.mscale", rs.get("mscale", 1.0)),
        mscale_all_dim=f.as_float("rope_scaling.mscale_all_dim", rs.get("mscale_all_dim", 0.0)),
    )


def _quant_config(f: _ConfigFields) -> QuantConfig | None:
    """config.json's quantization_config: INT4 compressed-tensors or FP8 blocks; None without one. Raises
    ConfigError."""
    qc = f.text.get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        raise ConfigError(f"config.json: quantization_config must be an object, got {qc!r:.60}")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _int4_config(f, qc)
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ConfigError(f"config.json: fp8 format {qc.get('fmt')!r} is not supported")
        blk = qc.get("weight_block_size", [128, 128])
        if not isinstance(blk, list) or len(blk) != 2:
            raise ConfigError(f"config.json: weight_block_size must be [rows, columns], got {blk!r:.60}")
        return QuantConfig(
            method="fp8", block=(f.as_int("weight_block_size[0]", blk[0]), f.as_int("weight_block_size[1]", blk[1]))
        )
    raise ConfigError(f"config.json: quant_method {method!r} is not supported")


def _int4_config(f: _ConfigFields, qc: dict[str, Any]) -> QuantConfig:
    """A compressed-tensors quantization_config: symmetric, group-wise, 4-bit pack-quantized. Raises ConfigError."""
    if qc.get("format") != "pack-quantized":
        raise ConfigError(f"config.json: compressed-tensors format {qc.get('format')!r} is not supported")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict):
        raise ConfigError(f"config.json: quantization_config.config_groups must be an object, got {groups!r:.60}")
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
    return QuantConfig(
        method="int4", group_size=f.as_int("quantization_config group_size", weights.get("group_size", 32))
    )


def _eos_and_max_new_tokens(
    f: _ConfigFields, cfg: dict[str, Any], generation_config: dict[str, Any] | None
) -> tuple[list[int], int | None]:
    """The EOS ids of config.json and generation_config.json (in order, once each) and generation_config.json's
    max_new_tokens (None without one). Raises ConfigError."""
    eos: list[int] = []

    def add_eos(v: Any, file: str | None) -> None:
        if v is None:
            return
        for x in v if isinstance(v, list) else [v]:
            x = f.as_int("eos_token_id", x, lo=0, file=file)
            if x not in eos:
                eos.append(x)

    add_eos(f.text.get("eos_token_id", cfg.get("eos_token_id")), None)
    max_new_tokens = None
    if generation_config:
        add_eos(generation_config.get("eos_token_id"), "generation_config.json: ")
        if generation_config.get("max_new_tokens") is not None:
            max_new_tokens = f.as_int(
                "max_new_tokens", generation_config["max_new_tokens"], file="generation_config.json: "
            )
    return eos, max_new_tokens


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
    # speculative decoding (docs/speculative.md): draft tokens verified per decode row per step; 0 = off
    num_speculative_tokens: int = 0


SPECULATIVE_METHODS = ("eagle3",)
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """`--speculative-config`, vLLM's JSON (docs/speculative.md): `method` "eagle3", `model` (the draft's folder),
    `num_speculative_tokens` k in [1, MAX_SPECULATIVE_TOKENS]; optional `load_format` "auto" | "dummy" (random draft
    weights of the config's shapes, for benchmarks) and `draft_tensor_parallel_size` (1 only: the draft runs on every
    rank whole)."""

    method: str
    model: str
    num_speculative_tokens: int
    load_format: str = "auto"

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parse the flag's JSON; ConfigError naming the field for a value kimi cannot run with (bad JSON, an unknown
        key, a method other than eagle3, k out of range, no model)."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--speculative-config: not JSON: {e}") from None
        if not isinstance(d, dict):
            raise ConfigError("--speculative-config: want a JSON object")
        known = {"method", "model", "num_speculative_tokens", "load_format", "draft_tensor_parallel_size"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(
                f"--speculative-config: unknown field {unknown[0]!r} (kimi reads {', '.join(sorted(known))})"
            )
        method = d.get("method")
        if method not in SPECULATIVE_METHODS:
            raise ConfigError(
                f"--speculative-config: method {method!r}: only {', '.join(SPECULATIVE_METHODS)} is served"
            )
        model = d.get("model")
        if not isinstance(model, str) or not model:
            raise ConfigError("--speculative-config: model: want the EAGLE3 draft's folder")
        k = d.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(
                f"--speculative-config: num_speculative_tokens {k!r}: want an integer in [1, {MAX_SPECULATIVE_TOKENS}]"
            )
        fmt = d.get("load_format", "auto")
        if fmt not in ("auto", "dummy"):
            raise ConfigError(f"--speculative-config: load_format {fmt!r}: want auto or dummy")
        tp = d.get("draft_tensor_parallel_size", 1)
        if tp != 1:
            raise ConfigError(
                f"--speculative-config: draft_tensor_parallel_size {tp!r}: only 1 (the draft is whole on every rank)"
            )
        return cls(method, model, k, fmt)

    def to_json(self) -> str:
        """The JSON `from_json` reads back to this config (the worker's flag)."""
        return json.dumps(
            {
                "method": self.method,
                "model": self.model,
                "num_speculative_tokens": self.num_speculative_tokens,
                "load_format": self.load_format,
            }
        )


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


def _flag(
    default: Any, help: str, *, type: Any = None, choices: tuple[str, ...] | None = None, required: bool = False
) -> Any:
    """A WorkerConfig field and its command-line flag: default, help text, value type (the parser of one argv
    word; None: a bare switch for a bool, else str) and choices. A required field has no default."""
    meta = {"help": help, "type": type, "choices": choices}
    return field(metadata=meta) if required else field(default=default, metadata=meta)


DTYPE_NAMES = ("float32", "bfloat16", "float16")
A2A_BACKENDS = ("local", "gloo", "nccl", "deepep")


@dataclass(frozen=True)
class WorkerConfig:
    """One worker rank's settings, each a flag of `python -m kimi.worker.main` declared here once.

    `kimi serve` builds one (kimi.server.worker_config) and turns it into the worker's command line with `to_argv`;
    the worker parses it back with `from_argv` (`from_argv(c.to_argv()) == c`). `kimi serve` declares the flags it
    shares with the worker (`worker_flag`) from the same fields. Units: seconds for timeouts, GiB for
    kv_cache_memory_gib, tokens for block_size and ll_max_tokens.
    """

    model: str = _flag(None, "checkpoint folder (config.json, safetensors, tokenizer files)", required=True)
    plan_addr: str = _flag(None, "controller PUB address, e.g. tcp://127.0.0.1:5555", required=True)
    result_addr: str = _flag(None, "controller PULL address", required=True)
    device: str = _flag("cpu", "where the workers run the model", choices=("cpu", "cuda"))
    dtype: str | None = _flag(
        None,
        "weights, activations and KV cache (default: float32 on cpu, bfloat16 on cuda)",
        choices=DTYPE_NAMES,
    )
    block_size: int = _flag(64, "KV-cache block size in tokens", type=int)
    num_blocks: int | None = _flag(
        None, "KV-cache blocks per rank (default: from free memory, 0.5 GiB on cpu)", type=int
    )
    kv_cache_memory_gib: float | None = _flag(
        None, "KV-cache memory per rank in GiB, instead of --num-blocks (default: from free memory)", type=float
    )
    gpu_memory_utilization: float = _flag(
        0.9, "share of GPU memory kimi may use (weights, activations and the KV cache)", type=float
    )
    num_hidden_layers: int | None = _flag(
        None, "use only the first N layers (benchmarks; default: all of the config's)", type=int
    )
    controller_timeout: float = _flag(
        15.0, "exit after this long without a message (the controller pings every second)", type=float
    )
    no_progress: bool = _flag(False, "no checkpoint-loading progress bar")
    log_level: str = _flag(
        "info",
        "log level (trace: uvicorn's most verbose; kimi logs it as debug); a worker rank's log level above info turns "
        "its checkpoint-loading progress bar off too",
        type=str.lower,
        choices=LOG_LEVELS,
    )
    a2a_backend: str | None = _flag(
        None,
        "MoE all-to-all between ranks (default: local for 1 rank, gloo on cpu, nccl on cuda)",
        choices=A2A_BACKENDS,
    )
    a2a_static_decode: bool = _flag(
        False,
        "gloo / nccl: decode steps exchange a fixed number of rows per rank pair (the step's decode bucket, padded), "
        "with no counts read on the host (CUDA-graph capturable); prefill and mixed steps keep variable splits",
    )
    dist_timeout: float = _flag(600.0, "torch.distributed collective timeout, seconds", type=float)
    ll_max_tokens: int = _flag(
        128,
        "decode steps with at most this many tokens per rank use low-latency all-to-all (deepep) or the static "
        "layout (--a2a-static-decode)",
        type=int,
    )
    fake: bool = _flag(False, "load no weights; return pseudo-random tokens (kimi.worker.fake)")
    moe_backend: str = _flag(
        "auto",
        "--device cuda only: routed-expert kernels, INT4 kept packed (auto = humming-kernels' layout, "
        "kimi's csrc kernel at decode sizes and humming's at prefill sizes; humming; cuda = kimi's "
        "csrc kernel at every size, Hopper, bf16; triton) or dequantised (ref)",
        choices=MOE_BACKENDS,
    )
    load_format: str = _flag(
        "auto",
        "--device cuda only: dummy = random weights of the checkpoint's shapes, generated on the GPU",
        choices=("auto", "dummy"),
    )
    emulate_ep_size: int = _flag(
        1,
        "--device cuda, benchmarks only (--nproc 1, --load-format dummy): the one rank holds EP rank 0 of N's experts "
        "(1 / N of them, as one rank of an N-GPU deployment) and drops the routed pairs of the other N - 1 ranks' "
        "experts, so outputs are not the model's; start-up and step times are those of one such rank",
        type=int,
    )
    cuda_graph_max_bs: int = _flag(0, "cuda: largest decode CUDA graph bucket (0 = eager)", type=int)
    prefill_graph_max_tokens: int = _flag(
        0,
        "cuda, one rank, with decode graphs: largest prefill / mixed-step CUDA graph, in tokens (0 = those steps run "
        "eagerly)",
        type=int,
    )
    fp8_dense: str = _flag(
        "off",
        "--device cuda only: FP8 checkpoints (K2-Instruct): keep the dense projections FP8 (half their "
        "memory) on kimi's Triton kernel or humming-kernels; off = dequantise them to bf16, the faster "
        "decode",
        choices=("off", "triton", "humming"),
    )

    max_num_seqs: int = _flag(
        256, "running requests per DP rank (also the largest decode CUDA graph and warmed batch)", type=int
    )
    token_budget: int = _flag(
        2048, "tokens per step per rank; longer prompts are prefilled in chunks (the largest warmed prefill)", type=int
    )
    max_model_len: int | None = _flag(
        None, "prompt + output tokens per request (default: the config's max_position_embeddings)", type=int
    )
    speculative_config: str | None = _flag(
        None,
        'speculative decoding, vLLM\'s JSON: {"method": "eagle3", "model": DRAFT_DIR, "num_speculative_tokens": K} '
        "(docs/speculative.md; the CPU reference path only for now)",
    )
    skip_warmup: bool = _flag(
        False, "report ready without the start-up warm-up (kimi.worker.warmup): the first requests pay the compiles"
    )
    cache_dir: str | None = _flag(
        None,
        "the folder of compiled kernels shared by kimi, FlashInfer, humming and Triton (default: $KIMI_CACHE_DIR, "
        "else ~/.cache/kimi; kimi.cache_dir)",
    )

    def to_argv(self) -> list[str]:
        """The worker's command-line arguments: the required flags, then every field that differs from its default
        (a true bool as a bare switch)."""
        argv: list[str] = []
        for f in fields(self):
            v = getattr(self, f.name)
            if f.default is not MISSING and v == f.default:
                continue
            flag = "--" + f.name.replace("_", "-")
            if isinstance(v, bool):
                argv.append(flag)
            else:
                argv += [flag, str(v)]
        return argv

    @classmethod
    def arg_parser(cls, prog: str = "kimi.worker.main") -> argparse.ArgumentParser:
        """An argparse parser with one flag per field (the worker's command line)."""
        p = argparse.ArgumentParser(prog=prog)
        for f in fields(cls):
            p.add_argument("--" + f.name.replace("_", "-"), **worker_flag(f.name))
        return p

    @classmethod
    def from_argv(cls, argv: list[str] | None = None) -> WorkerConfig:
        """Parse the worker's command line (None: sys.argv[1:]); exits 2 naming the flag on a bad value (argparse)."""
        return cls(**vars(cls.arg_parser().parse_args(argv)))


def worker_flag(name: str, **overrides: Any) -> dict[str, Any]:
    """`argparse.add_argument` keywords of WorkerConfig's field `name` (default, help, type, choices, or
    action="store_true" for a bool; `required` for a field without default), updated with `overrides`."""
    f = next(f for f in fields(WorkerConfig) if f.name == name)
    kw: dict[str, Any] = {"help": f.metadata["help"]}
    if f.default is MISSING:
        kw["required"] = True
    elif isinstance(f.default, bool):
        kw.update(action="store_true", default=f.default)
    else:
        kw["default"] = f.default
    if f.metadata["type"] is not None:
        kw["type"] = f.metadata["type"]
    if f.metadata["choices"] is not None:
        kw["choices"] = list(f.metadata["choices"])
    kw.update(overrides)
    return kw
