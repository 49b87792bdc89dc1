"""A small random Kimi-K2 checkpoint in one of the real layouts (for tests and CPU end-to-end runs).

Command line: `python tools/make_tiny_checkpoint.py OUT_DIR [--layout k2.6|k2-thinking|k2-instruct] [--seed N]
[--tokenizer-dir DIR | --builtin-tokenizer] [--eagle3-draft DIR]` (`main` below; `make tiny` runs it; `--eagle3-draft`
also writes the tiny EAGLE3 draft, `make_tiny_eagle3_draft`).

Layouts (docs/model-format.md, "Checkpoint variants" and "Tensors"):

- `k2.6`: nested config (outer `model_type: kimi_k25`, the text model under `text_config`), tensors
  prefixed `language_model.`, a few tiny `vision_tower.*` / `mm_projector.*` tensors (the loader skips
  them), INT4 compressed-tensors routed experts, yarn factor 64 / beta_fast 32 / beta_slow 1, eps 1e-5,
  eos 163586.
- `k2-thinking`: flat `kimi_k2` config, INT4 routed experts, yarn factor 64 / beta 1 / 1, eps 1e-5,
  eos 163586 (K2-Thinking's eps, betas and eos are not given by its model card; these are assumptions).
- `k2-instruct`: flat, FP8 e4m3 128x128 blocks on every linear except lm_head / router, yarn factor 32 /
  beta 1 / 1, max_position_embeddings 131072, eps 1e-6, config eos 163585 (generation_config adds 163586).

The text model keeps the real structure at tiny width (TINY_DIMS: hidden 128, 3 layers with layer 0 dense,
16 experts top-4, one shared expert, MLA with q_lora 96 / kv_lora 64 / heads 4 x (32 nope + 16 rope),
v 32) and the real vocabulary size 163840, so the embedding and lm_head (2 x 40 MiB bf16) dominate.

Weights are drawn per tensor from a generator seeded by (seed, tensor name), so a layout's weights are
deterministic and the same float weights underlie every layout: linear layers N(0, (gain / sqrt(fan_in))^2)
(gain 1; 0.5 for o_proj / down_proj that write the residual; 3 for lm_head so logits have std ~3),
embedding N(0, 1), norms 1 + N(0, 0.1^2), router bias N(0, 0.05^2). Quantised tensors are generated in
float32 and then quantised (kimi.model.quant), so their dequantised values are the "true" weights, which
`generate_tiny_weights` returns next to the stored tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib
from typing import Any

import torch
from torch import Tensor

from kimi import envs
from kimi.checkpoint import INDEX_FILE, expected_tensors
from kimi.config import ModelConfig
from kimi.model.quant import dequant_fp8_block, dequant_int4, pack_int4, quant_fp8_block
from kimi.presets import load_preset

__all__ = [
    "LAYOUTS",
    "TINY_DIMS",
    "TINY_DRAFT_DIMS",
    "generate_tiny_weights",
    "main",
    "make_tiny_checkpoint",
    "make_tiny_eagle3_draft",
    "tiny_config",
    "tiny_draft_config",
]

LAYOUTS = ("k2.6", "k2-thinking", "k2-instruct")

TINY_DIMS: dict[str, Any] = {
    "hidden_size": 128,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_shared_experts": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 96,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "vocab_size": 163840,
    "routed_scaling_factor": 2.827,
    "rope_theta": 50000.0,
    "tie_word_embeddings": False,
}

_FP8_QUANT_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}

# Per-layout differences (docs/model-format.md, "Checkpoint variants").
_VARIANT: dict[str, dict[str, Any]] = {
    "k2.6": dict(factor=64.0, beta_fast=32.0, beta_slow=1.0, max_pos=262144, eps=1e-5, eos=163586, gen_eos=163586),
    "k2-thinking": dict(
        factor=64.0, beta_fast=1.0, beta_slow=1.0, max_pos=262144, eps=1e-5, eos=163586, gen_eos=163586
    ),
    "k2-instruct": dict(
        factor=32.0, beta_fast=1.0, beta_slow=1.0, max_pos=131072, eps=1e-6, eos=163585, gen_eos=163586
    ),
}

# Tiny stand-ins for the K2.5/K2.6 vision tower and projector (must be skipped by the text loader).
_VISION_TENSORS = {
    "vision_tower.patch_embed.proj.weight": (8, 3, 2, 2),
    "vision_tower.patch_embed.proj.bias": (8,),
    "vision_tower.encoder.blocks.0.wqkv.weight": (24, 8),
    "vision_tower.encoder.final_layernorm.weight": (8,),
    "mm_projector.pre_norm.weight": (32,),
    "mm_projector.proj.0.weight": (32, 32),
    "mm_projector.proj.2.weight": (128, 32),
}

_DEFAULT = object()

# The tiny EAGLE3 draft (docs/speculative.md): one Llama-style layer at the tiny target's width, grouped-query
# attention, a reduced draft vocabulary of every 40th target id, the target's three layers fused.
TINY_DRAFT_DIMS: dict[str, Any] = {
    "hidden_size": TINY_DIMS["hidden_size"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 256,
    "draft_vocab_size": 4096,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
}


def tiny_config(layout: str = "k2.6") -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json, generation_config.json) of the tiny checkpoint of `layout`, as dicts.

    Built from the K2.6 preset's text config with TINY_DIMS and the layout's rope / eps / eos / quantisation.
    Raises ValueError for an unknown layout.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}")
    v = _VARIANT[layout]
    preset = load_preset("kimi-k2.6")
    text = dict(preset["text_config"])
    text.update(TINY_DIMS)
    text["rope_scaling"] = {
        "type": "yarn",
        "factor": v["factor"],
        "beta_fast": v["beta_fast"],
        "beta_slow": v["beta_slow"],
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
    }
    text["max_position_embeddings"] = v["max_pos"]
    text["rms_norm_eps"] = v["eps"]
    text["eos_token_id"] = v["eos"]
    if layout == "k2-instruct":
        text["quantization_config"] = dict(_FP8_QUANT_CONFIG)
    gen = {"max_length": v["max_pos"], "eos_token_id": v["gen_eos"]}
    if layout == "k2.6":
        outer = {k: val for k, val in preset.items() if k != "text_config"}
        outer["eos_token_id"] = v["eos"]
        outer["vision_config"] = {
            "model_type": "kimi_k25_vision",
            "hidden_size": 8,
            "patch_size": 2,
            "num_hidden_layers": 1,
            "mm_hidden_size": 8,
            "text_hidden_size": TINY_DIMS["hidden_size"],
        }
        outer["text_config"] = text
        return outer, gen
    return text, gen


def _generator(seed: int, name: str) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return g


def _float_init(name: str, shape: tuple[int, ...], seed: int) -> Tensor:
    """float32 "true" value of a tensor, by canonical name (see module docstring for the scheme)."""
    g = _generator(seed, name)
    x = torch.randn(shape, generator=g, dtype=torch.float32)
    if name.endswith("norm.weight"):  # input/post_attention/q_a/kv_a layernorms and model.norm
        return 1.0 + 0.1 * x
    if name.endswith("e_score_correction_bias"):
        return 0.05 * x
    if name == "model.embed_tokens.weight" or len(shape) != 2:
        return x
    gain = 1.0
    if name == "lm_head.weight":
        gain = 3.0
    elif ".o_proj." in name or ".down_proj." in name:
        gain = 0.5
    return x * (gain / shape[1] ** 0.5)


def _model_order(spec: dict[str, Any]):
    """Sort key placing a truth name where its stored tensors are in `spec` (model order)."""
    pos = {name: i for i, name in enumerate(spec)}

    def key(name: str) -> int:
        return pos.get(name, pos.get(name[: -len(".weight")] + ".weight_packed", 0))

    return key


def generate_tiny_weights(layout: str = "k2.6", seed: int = 0) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The tensors of the tiny checkpoint of `layout` and their true values.

    Returns:
        stored: file name (with the layout's prefix) -> tensor exactly as written (bf16 / f32 / int32 /
            float8_e4m3fn), including the K2.6 vision stand-ins.
        truth: canonical name -> float32 true weight; quantised linears appear as `<module>.weight`
            (dequantised), `e_score_correction_bias` as itself. This is what
            `load_checkpoint(..., dequantize=True, dtype=torch.float32)` must return.
    """
    cfg_json, gen = tiny_config(layout)
    cfg = ModelConfig.from_dict(cfg_json, gen)
    pre = cfg.weight_prefix
    spec = {k[len(pre) :]: val for k, val in expected_tensors(cfg).items()}
    stored: dict[str, Tensor] = {}
    truth: dict[str, Tensor] = {}
    int4_modules: list[tuple[str, Tensor]] = []
    for name, (shape, dtype) in spec.items():
        module, _, part = name.rpartition(".")
        if part in ("weight_scale", "weight_shape", "weight_scale_inv"):
            continue  # written together with their weight
        if part == "weight_packed":
            int4_modules.append((module, _float_init(module + ".weight", (shape[0], shape[1] * 8), seed)))
        elif dtype == torch.float8_e4m3fn:
            w = _float_init(name, shape, seed)
            q, scale_inv = quant_fp8_block(w, cfg.quant.block)  # type: ignore[union-attr]
            stored[name] = q
            stored[module + ".weight_scale_inv"] = scale_inv
            truth[name] = dequant_fp8_block(q, scale_inv, cfg.quant.block)  # type: ignore[union-attr]
        else:
            t = _float_init(name, shape, seed).to(dtype)
            stored[name] = t
            truth[name] = t.float()
    # INT4 quantisation is row-wise, so the experts of one shape are packed in one call (fewer small ops).
    by_shape: dict[tuple[int, int], list[tuple[str, Tensor]]] = {}
    for module, w in int4_modules:
        n_out, n_in = w.shape
        by_shape.setdefault((n_out, n_in), []).append((module, w))
    for (o, i), group in by_shape.items():
        gs = cfg.quant.group_size  # type: ignore[union-attr]
        packed_all, scale_all = pack_int4(torch.cat([w for _, w in group]), gs, torch.bfloat16)
        truth_all = dequant_int4(packed_all, scale_all, gs)
        for j, (module, _) in enumerate(group):
            rows = slice(j * o, (j + 1) * o)
            stored[module + ".weight_packed"] = packed_all[rows].clone()
            stored[module + ".weight_scale"] = scale_all[rows].clone()
            stored[module + ".weight_shape"] = torch.tensor([o, i], dtype=torch.int32)
            truth[module + ".weight"] = truth_all[rows].clone()
    stored = {name: stored[name] for name in spec if name in stored}  # model order
    truth = {name: truth[name] for name in sorted(truth, key=_model_order(spec))}
    stored = {pre + k: val for k, val in stored.items()}
    if layout == "k2.6":
        for name, shape in _VISION_TENSORS.items():
            stored[name] = (0.1 * torch.randn(shape, generator=_generator(seed, name))).to(torch.bfloat16)
    return stored, truth


def _shard_of(name: str, num_layers: int) -> int:
    """0-based shard: 0 = embedding, layer 0 and the vision stand-ins; 1 = the middle layers; 2 = the last
    layer, final norm and lm_head (the real checkpoints spread layers over shards the same way)."""
    canon = name.split("language_model.", 1)[-1]
    if canon.startswith("model.layers."):
        layer = int(canon.split(".")[2])
        return 0 if layer == 0 else (2 if layer == num_layers - 1 else 1)
    if canon.startswith(("model.norm.", "lm_head.")):
        return 2
    return 0


def resolve_tokenizer_source(tokenizer_source: Any = _DEFAULT) -> Any:
    """The tokenizer folder a build writes from: `tokenizer_source`, or `kimi.tokenizer.default_tokenizer_source()`
    when it is left out; None = the built-in byte-level vocabulary. Raises FileNotFoundError when the folder has no
    tiktoken.model (naming $KIMI_TOKENIZER_DIR when that is where the default came from)."""
    from kimi import tokenizer as kimi_tokenizer

    src = kimi_tokenizer.default_tokenizer_source() if tokenizer_source is _DEFAULT else tokenizer_source
    if src is not None and not os.path.isfile(os.path.join(os.fspath(src), "tiktoken.model")):
        why = " ($KIMI_TOKENIZER_DIR)" if tokenizer_source is _DEFAULT and envs.KIMI_TOKENIZER_DIR.get() else ""
        raise FileNotFoundError(f"no tiktoken.model in the tokenizer folder {src}{why}")
    return src


def make_tiny_checkpoint(
    out_dir: str | os.PathLike[str],
    layout: str = "k2.6",
    seed: int = 0,
    tokenizer_source: Any = _DEFAULT,
    max_new_tokens: int | None = None,
) -> str:
    """Write the tiny checkpoint of `layout` into `out_dir` (created if needed); returns out_dir as a str.

    Files: config.json, generation_config.json, model-0000{1,2,3}-of-00003.safetensors,
    model.safetensors.index.json and the tokenizer files of `kimi.tokenizer.write_tokenizer_files`
    (`tokenizer_source` defaults to `kimi.tokenizer.default_tokenizer_source()`; None = the built-in
    byte-level vocabulary). max_new_tokens: written into generation_config.json, where it is the default
    `max_tokens` of a chat request (kimi.config.ModelConfig.max_new_tokens); None: none (the real checkpoints' way:
    the default is the rest of the context).

    config.json is written last: a build that fails leaves no config.json (the Makefile's target), so the next
    `make tiny` / `make serve` builds again instead of serving a half-written folder.

    Raises ValueError for an unknown layout, FileNotFoundError when the tokenizer folder (given, or
    $KIMI_TOKENIZER_DIR) has no tiktoken.model; both before anything is written.
    """
    from safetensors.torch import save_file

    from kimi import tokenizer as kimi_tokenizer

    src = resolve_tokenizer_source(tokenizer_source)
    cfg_json, gen = tiny_config(layout)  # ValueError for an unknown layout
    out = os.fspath(out_dir)
    os.makedirs(out, exist_ok=True)
    stored, _ = generate_tiny_weights(layout, seed)
    n_shards = 3
    shards: list[dict[str, Tensor]] = [{} for _ in range(n_shards)]
    for name, t in stored.items():
        shards[_shard_of(name, TINY_DIMS["num_hidden_layers"])][name] = t.contiguous()
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        save_file(shard, os.path.join(out, fname), metadata={"format": "pt"})
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    with open(os.path.join(out, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    if max_new_tokens is not None:
        gen = {**gen, "max_new_tokens": max_new_tokens}
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
    kimi_tokenizer.write_tokenizer_files(out, src)
    tmp = os.path.join(out, "config.json.tmp")
    with open(tmp, "w") as f:
        json.dump(cfg_json, f, indent=2)
    os.replace(tmp, os.path.join(out, "config.json"))  # last, atomically: the checkpoint is complete
    return out


def tiny_draft_config(layout: str = "k2.6", attention: str = "llama") -> dict[str, Any]:
    """config.json of the tiny EAGLE3 draft for the tiny checkpoint of `layout`, in the published layout
    (`eagle_config.eagle_aux_hidden_state_layer_ids`, `draft_vocab_size`): attention "llama"
    (`LlamaForCausalLMEagle3`, TINY_DRAFT_DIMS) or "mla" (`Eagle3DeepseekV2ForCausalLM`, the `-mla` drafts' layout,
    with the tiny target's MLA sizes and YaRN). ValueError for another attention or layout."""
    if attention not in ("llama", "mla"):
        raise ValueError(f"unknown draft attention {attention!r}; choose llama or mla")
    cfg, _ = tiny_config(layout)
    text = cfg.get("text_config", cfg)
    mla: dict[str, Any] = {}
    if attention == "mla":
        keys = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_scaling")
        mla = {k: text[k] for k in keys}
        mla |= {
            "architectures": ["Eagle3DeepseekV2ForCausalLM"],
            "model_type": "kimi_k2",
            "num_key_value_heads": text["num_attention_heads"],
            "rope_theta": text["rope_theta"],
            "rms_norm_eps": text["rms_norm_eps"],
        }
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "vocab_size": text["vocab_size"],
        "max_position_embeddings": text["max_position_embeddings"],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2], "use_aux_hidden_state": True},
        **TINY_DRAFT_DIMS,
        **mla,
    }


def make_tiny_eagle3_draft(
    out_dir: str | os.PathLike[str], layout: str = "k2.6", seed: int = 0, attention: str = "llama"
) -> str:
    """Write the tiny EAGLE3 draft of the tiny `layout` checkpoint into `out_dir`: config.json (`tiny_draft_config`
    of `attention`) and model.safetensors with `fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`
    in bf16 / int64 / bool (no embed_tokens: shared with the target). Weights: kimi.model.eagle3.random_draft_weights.
    Returns out_dir as a str; ValueError for an unknown layout or attention."""
    from safetensors.torch import save_file

    from kimi.model.eagle3 import Eagle3Config, random_draft_weights

    draft_cfg = tiny_draft_config(layout, attention)
    cfg_json, gen = tiny_config(layout)
    target = ModelConfig.from_dict(cfg_json, gen)
    weights = random_draft_weights(Eagle3Config.from_dict(draft_cfg), target, seed)
    stored = {n: (t.to(torch.bfloat16) if t.is_floating_point() else t).contiguous() for n, t in weights.items()}
    out = os.fspath(out_dir)
    os.makedirs(out, exist_ok=True)
    save_file(stored, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    tmp = os.path.join(out, "config.json.tmp")
    with open(tmp, "w") as f:
        json.dump(draft_cfg, f, indent=2)
    os.replace(tmp, os.path.join(out, "config.json"))
    return out


def main(argv: list[str] | None = None) -> int:
    """The command line of tools/make_tiny_checkpoint.py: write the checkpoint, name its vocabulary on stderr; 0, or
    1 with a one-line error."""
    p = argparse.ArgumentParser(
        prog="make_tiny_checkpoint.py",
        description="Write a small random Kimi-K2 checkpoint in one of the real layouts (for tests and CPU "
        "end-to-end runs).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("out_dir", help="folder to write (created if needed)")
    p.add_argument("--layout", choices=LAYOUTS, default="k2.6", help="the checkpoint layout to copy")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    tok = p.add_mutually_exclusive_group()
    tok.add_argument(
        "--tokenizer-dir",
        default=None,
        help="folder with the real tiktoken.model (None: kimi.tokenizer.default_tokenizer_source())",
    )
    tok.add_argument("--builtin-tokenizer", action="store_true", help="write the built-in byte-level vocabulary")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="generation_config.json's max_new_tokens: the default max_tokens of a chat request (None: the rest of "
        "the context, as real checkpoints)",
    )
    p.add_argument(
        "--eagle3-draft",
        default=None,
        metavar="DIR",
        help="also write a tiny EAGLE3 draft for this checkpoint into DIR (docs/speculative.md)",
    )
    p.add_argument(
        "--eagle3-attention",
        choices=("llama", "mla"),
        default="llama",
        help="the tiny draft's attention: Llama's (LlamaForCausalLMEagle3) or MLA (the -mla drafts' layout)",
    )
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    source: Any = None if a.builtin_tokenizer else (a.tokenizer_dir if a.tokenizer_dir else _DEFAULT)
    try:
        source = resolve_tokenizer_source(source)  # once: the build and the message below use the same folder
        out = make_tiny_checkpoint(a.out_dir, a.layout, a.seed, source, a.max_new_tokens)
        if a.eagle3_draft:
            make_tiny_eagle3_draft(a.eagle3_draft, a.layout, a.seed, a.eagle3_attention)
    except (OSError, ValueError) as e:
        print(f"make_tiny_checkpoint: {e}", file=sys.stderr)
        return 1
    if source is not None:
        vocab = f"the Kimi vocabulary from {source}"
    elif a.builtin_tokenizer:
        vocab = "the built-in byte-level vocabulary (--builtin-tokenizer)"
    else:
        vocab = (
            "the built-in byte-level vocabulary (no $KIMI_TOKENIZER_DIR, no ../shared/kimi-tokenizer/ next to the "
            "repository folder)"
        )
    print(
        f"wrote {a.layout} tiny checkpoint to {out} with {vocab} in {time.perf_counter() - t0:.2f} s", file=sys.stderr
    )
    return 0
