"""Kimi-K2 safetensors checkpoints -> per-rank tensors (canonical names, optionally dequantised).

Formats (docs/model-format.md, Checkpoint variants, and docs/model-format.md, Tensors):

- BF16 everywhere by default; the router `mlp.gate.weight` is bf16 and `mlp.gate.e_score_correction_bias`
  float32 in every variant.
- FP8 (K2-Instruct, `quant_method: fp8`): every linear weight except `lm_head` and the router gate -
  q_a / q_b (or q) / kv_a / kv_b / o projections, the layer-0 dense MLP, shared experts, routed experts - is
  `.weight` float8_e4m3fn [out, in] + `.weight_scale_inv` float32 [ceil(out/128), ceil(in/128)].
- INT4 (K2-Thinking, K2.5, K2.6, compressed-tensors pack-quantized): only the routed experts, as
  `.weight_packed` int32 [out, in/8], `.weight_scale` bf16 [out, in/32], `.weight_shape` int32 [2] = [out, in].

Nested K2.5/K2.6 checkpoints prefix the text model with `language_model.` (`cfg.weight_prefix`); canonical
names drop it. Every tensor is read lazily through `safe_open`, so an EP rank reads only its own experts.
Loading stops with a CheckpointError naming the tensor when one is missing, misshapen, of the wrong dtype,
unexpected, or a quantisation scale (`.weight_scale_inv`, `.weight_scale`) holds a NaN or infinity, and naming
the file when safetensors cannot read it (truncated, bad header).
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Collection, Iterator
from typing import TYPE_CHECKING, Any, TextIO

import torch
from torch import Tensor

from kimi.config import ModelConfig, QuantConfig
from kimi.errors import CheckpointError
from kimi.model.quant import dequant_fp8_block, dequant_int4

if TYPE_CHECKING:
    from safetensors import safe_open

__all__ = [
    "INDEX_FILE",
    "CheckpointError",
    "expected_tensors",
    "linear_shapes",
    "load_checkpoint",
    "local_expert_range",
]

INDEX_FILE = "model.safetensors.index.json"

# Tensors that are never part of the text model: vision tower, multimodal projector, rotary caches.
_SKIP_PREFIXES = ("vision_tower.", "mm_projector.")
_SKIP_SUFFIXES = (".rotary_emb.inv_freq",)

_ST_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")


def _open_shard(path: str, device: str = "cpu") -> safe_open:
    """safetensors' `safe_open(path, framework="pt", device=device)`; a file it cannot read (truncated, bad header, not
    safetensors, unreadable) raises CheckpointError naming the file instead of safetensors' bare message."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(path, framework="pt", device=device)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: cannot be read as safetensors ({type(e).__name__}: {e})") from e


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def local_expert_range(cfg: ModelConfig, ep_rank: int = 0, ep_size: int = 1) -> tuple[int, int]:
    """Routed experts held by EP rank `ep_rank` of `ep_size`: `[ep_rank*E/ep_size, (ep_rank+1)*E/ep_size)`.

    Raises:
        ValueError: ep_size does not divide n_routed_experts, or ep_rank is out of range.
    """
    e = cfg.n_routed_experts
    if ep_size < 1 or not 0 <= ep_rank < ep_size:
        raise ValueError(f"bad EP rank {ep_rank} of {ep_size}")
    if e % ep_size:
        raise ValueError(f"n_routed_experts={e} is not divisible by ep_size={ep_size}")
    n = e // ep_size
    return ep_rank * n, (ep_rank + 1) * n


def linear_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, int]]:
    """The non-expert linear layers of one decoder layer: canonical module name -> [out, in].

    Covers attention (q_a/q_b or q, kv_a, kv_b, o), and either the dense MLP (layers < first_k_dense_replace
    or not MoE) or the shared experts (intermediate = moe_intermediate_size * n_shared_experts). The router
    gate is not included (it is never quantised). Routed experts are listed by `expected_tensors`.
    """
    h = cfg.hidden_size
    nh = cfg.num_attention_heads
    p = f"model.layers.{layer}."
    out: dict[str, tuple[int, int]] = {}
    if cfg.q_lora_rank:
        out[p + "self_attn.q_a_proj"] = (cfg.q_lora_rank, h)
        out[p + "self_attn.q_b_proj"] = (nh * cfg.qk_head_dim, cfg.q_lora_rank)
    else:
        out[p + "self_attn.q_proj"] = (nh * cfg.qk_head_dim, h)
    out[p + "self_attn.kv_a_proj_with_mqa"] = (cfg.kv_lora_rank + cfg.qk_rope_head_dim, h)
    out[p + "self_attn.kv_b_proj"] = (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
    out[p + "self_attn.o_proj"] = (h, nh * cfg.v_head_dim)
    if cfg.is_moe_layer(layer):
        if cfg.n_shared_experts:
            si = cfg.moe_intermediate_size * cfg.n_shared_experts
            out[p + "mlp.shared_experts.gate_proj"] = (si, h)
            out[p + "mlp.shared_experts.up_proj"] = (si, h)
            out[p + "mlp.shared_experts.down_proj"] = (h, si)
    else:
        out[p + "mlp.gate_proj"] = (cfg.intermediate_size, h)
        out[p + "mlp.up_proj"] = (cfg.intermediate_size, h)
        out[p + "mlp.down_proj"] = (h, cfg.intermediate_size)
    return out


def _expert_shapes(cfg: ModelConfig, layer: int, expert: int) -> dict[str, tuple[int, int]]:
    p = f"model.layers.{layer}.mlp.experts.{expert}."
    i, h = cfg.moe_intermediate_size, cfg.hidden_size
    return {p + "gate_proj": (i, h), p + "up_proj": (i, h), p + "down_proj": (h, i)}


def _canonical_expected(cfg: ModelConfig, ep_rank: int, ep_size: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """expected_tensors without the file prefix."""
    method = cfg.quant.method if cfg.quant is not None else None
    bf16, f32 = torch.bfloat16, torch.float32
    h, v = cfg.hidden_size, cfg.vocab_size
    lo, hi = local_expert_range(cfg, ep_rank, ep_size)
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}

    def linear(name: str, shape: tuple[int, int], quant: QuantConfig | None) -> None:
        o, i = shape
        if quant is not None and quant.method == "fp8":
            b0, b1 = quant.block
            out[name + ".weight"] = ((o, i), torch.float8_e4m3fn)
            out[name + ".weight_scale_inv"] = ((_ceil(o, b0), _ceil(i, b1)), f32)
        elif quant is not None and quant.method == "int4":
            g = quant.group_size
            if i % g or i % 8:
                raise ValueError(f"{name}: input dim {i} is not a multiple of group_size {g} and 8")
            out[name + ".weight_packed"] = ((o, i // 8), torch.int32)
            out[name + ".weight_scale"] = ((o, i // g), bf16)
            out[name + ".weight_shape"] = ((2,), torch.int32)
        else:
            out[name + ".weight"] = ((o, i), bf16)

    out["model.embed_tokens.weight"] = ((v, h), bf16)
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        out[p + "input_layernorm.weight"] = ((h,), bf16)
        out[p + "post_attention_layernorm.weight"] = ((h,), bf16)
        if cfg.q_lora_rank:
            out[p + "self_attn.q_a_layernorm.weight"] = ((cfg.q_lora_rank,), bf16)
        out[p + "self_attn.kv_a_layernorm.weight"] = ((cfg.kv_lora_rank,), bf16)
        for name, shape in linear_shapes(cfg, layer).items():
            linear(name, shape, cfg.quant if method == "fp8" else None)
        if cfg.is_moe_layer(layer):
            e = cfg.n_routed_experts
            out[p + "mlp.gate.weight"] = ((e, h), bf16)
            out[p + "mlp.gate.e_score_correction_bias"] = ((e,), f32)
            for expert in range(lo, hi):
                for name, shape in _expert_shapes(cfg, layer, expert).items():
                    linear(name, shape, cfg.quant)
    out["model.norm.weight"] = ((h,), bf16)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = ((v, h), bf16)
    return out


def expected_tensors(
    cfg: ModelConfig, ep_rank: int = 0, ep_size: int = 1
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor of `cfg`'s checkpoint format that EP rank `ep_rank` of `ep_size` needs.

    Returns file names (with `cfg.weight_prefix`, e.g. "language_model.model.layers.1.mlp.gate.weight")
    -> (shape, dtype), in model order. Routed experts are limited to `local_expert_range`. Layers are
    `range(cfg.num_hidden_layers)` (so an overridden, smaller layer count lists fewer tensors).
    Format per docs/model-format.md, Tensors; see the module docstring.

    Raises:
        ValueError: ep_size does not divide n_routed_experts, or an INT4 input dim is not group-aligned.
    """
    pre = cfg.weight_prefix
    return {pre + k: val for k, val in _canonical_expected(cfg, ep_rank, ep_size).items()}


# ---- reading -------------------------------------------------------------------------------------------


def _file_map(model_dir: str) -> dict[str, str]:
    """File name of every tensor in the checkpoint: from the index's weight_map, else every *.safetensors."""
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
        if not isinstance(weight_map, dict):
            raise CheckpointError(
                f"{index}: weight_map must map tensor names to file names, got {type(weight_map).__name__}"
            )
        bad = next(((k, v) for k, v in weight_map.items() if not isinstance(v, str)), None)
        if bad is not None:
            raise CheckpointError(
                f"{index}: weight_map must map tensor names to file names; {bad[0]!r} maps to {bad[1]!r:.60}"
            )
        for fname in sorted(set(weight_map.values())):
            if not os.path.isfile(os.path.join(model_dir, fname)):
                raise CheckpointError(f"{index}: lists file {fname!r}, which does not exist in {model_dir}")
        return dict(weight_map)
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no {INDEX_FILE} and no *.safetensors files")
    out: dict[str, str] = {}
    for fname in files:
        with _open_shard(os.path.join(model_dir, fname)) as f:
            for key in f.keys():  # noqa: SIM118  # a safetensors handle: keys() is its API, `in` is not
                if key in out:
                    raise CheckpointError(f"tensor {key!r} is in both {out[key]} and {fname}")
                out[key] = fname
    return out


def _raw_num_layers(cfg: ModelConfig) -> int:
    """Decoder layers the checkpoint itself holds (config.json's count, incl. MTP layers), >= cfg's."""
    raw = cfg.raw or {}
    nested = raw.get("text_config")
    text = nested if isinstance(nested, dict) else raw
    n = int(text.get("num_hidden_layers", cfg.num_hidden_layers)) + int(text.get("num_nextn_predict_layers") or 0)
    return max(n, cfg.num_hidden_layers)


def _classify(
    file_map: dict[str, str], cfg: ModelConfig, ep_rank: int, ep_size: int
) -> tuple[dict[str, tuple[str, str]], dict[str, tuple[tuple[int, ...], torch.dtype]]]:
    """Split the checkpoint's names: returns ({canonical: (file name, file)} to read, local expected).

    Raises CheckpointError for a text-model tensor that the config does not describe.
    """
    pre = cfg.weight_prefix
    local = _canonical_expected(cfg, ep_rank, ep_size)
    lo, hi = local_expert_range(cfg, ep_rank, ep_size)
    raw_layers = _raw_num_layers(cfg)
    # Names of an expert's parts ("gate_proj.weight_packed", ...), to accept other ranks' experts unread.
    expert_suffixes = {name[m.end() :] for name in local if (m := _EXPERT_RE.match(name))}
    to_read: dict[str, tuple[str, str]] = {}
    for fname, fpath in file_map.items():
        if fname.startswith(_SKIP_PREFIXES) or fname.endswith(_SKIP_SUFFIXES):
            continue
        if pre:
            if not fname.startswith(pre):
                continue  # outside the text model of a nested checkpoint
            name = fname[len(pre) :]
        else:
            name = fname
        if name in local:
            to_read[name] = (fname, fpath)
            continue
        m = _LAYER_RE.match(name)
        if m:
            layer = int(m.group(1))
            if cfg.num_hidden_layers <= layer < raw_layers:
                continue  # layer count overridden below the checkpoint's: ignore later layers
            me = _EXPERT_RE.match(name)
            if me and layer < cfg.num_hidden_layers and cfg.is_moe_layer(layer):
                expert = int(me.group(2))
                if 0 <= expert < cfg.n_routed_experts and not lo <= expert < hi and name[me.end() :] in expert_suffixes:
                    continue  # another EP rank's expert: not read
        raise CheckpointError(f"unexpected tensor {fname!r} in {fpath} (not part of the configured text model)")
    return to_read, local


def _iter_by_file(to_read: dict[str, tuple[str, str]], order: list[str]) -> Iterator[tuple[str, list[str]]]:
    """Group canonical names by file, files in first-use order of `order` (model order)."""
    groups: dict[str, list[str]] = {}
    for name in order:
        if name in to_read:
            groups.setdefault(to_read[name][1], []).append(name)
    yield from groups.items()


class _LoadProgress:
    """The checkpoint-loading progress bar (tqdm, to `file`, default stderr): `advance()` once per tensor read,
    then `close()`, which draws the final frame (100%, the overall rate) once. The last `advance()` only counts:
    drawn by tqdm's update as well, the 100% frame would be written twice (both show in a log, where the carriage
    returns between frames do not overwrite). enabled=False draws nothing."""

    def __init__(
        self,
        total: int,
        *,
        enabled: bool = True,
        file: TextIO | None = None,
        mininterval: float = 0.1,
        miniters: int | None = None,
    ) -> None:
        """mininterval (seconds) / miniters (tensors): tqdm's least time / count between two drawn frames (its
        defaults; miniters None: adaptive)."""
        from tqdm import tqdm

        self.total = total
        self.bar = tqdm(
            total=total,
            desc="Loading checkpoint",
            unit="tensor",
            file=file if file is not None else sys.stderr,
            disable=not enabled,
            dynamic_ncols=True,
            mininterval=mininterval,
            miniters=miniters,
        )

    def advance(self) -> None:
        """One more tensor read."""
        if self.bar.n + 1 < self.total:
            self.bar.update(1)
        else:
            self.bar.n = self.total  # drawn by close()

    def close(self) -> None:
        self.bar.close()


def load_checkpoint(
    model_dir: str | os.PathLike[str],
    cfg: ModelConfig,
    *,
    ep_rank: int = 0,
    ep_size: int = 1,
    dequantize: bool = True,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> dict[str, Tensor]:
    """Read the tensors EP rank `ep_rank` of `ep_size` needs from a safetensors checkpoint.

    Reads `model.safetensors.index.json` (its weight_map) or, without one, every `*.safetensors` in
    `model_dir`; each tensor is read lazily (safetensors `safe_open`), so a rank reads only its routed
    experts `[ep_rank*E/ep_size, (ep_rank+1)*E/ep_size)`. Skips `vision_tower.*`, `mm_projector.*`,
    `*.rotary_emb.inv_freq`, everything outside `cfg.weight_prefix` of a nested checkpoint, and layers at
    or past `cfg.num_hidden_layers` when the layer count was overridden below the checkpoint's.

    Returns canonical names (prefix stripped) -> tensors on `device`:
      - dequantize=True: every weight a floating `<module>.weight` of `dtype` ([out, in] for linears; INT4
        and FP8 dequantised via kimi.model.quant); `mlp.gate.e_score_correction_bias` stays float32.
      - dequantize=False: INT4 experts keep `.weight_packed` (int32) / `.weight_scale` (bf16) (the validated
        `.weight_shape` is dropped); FP8 linears keep `.weight` (float8_e4m3fn) + `.weight_scale_inv`
        (float32); all other floating tensors are cast to `dtype` as above.
      With tie_word_embeddings, `lm_head.weight` is the embedding tensor.

    A tqdm progress bar goes to stderr when `progress` is true.

    Raises:
        CheckpointError: a missing tensor, a tensor of the wrong shape or dtype, a `weight_shape` that
            disagrees with the config, an unexpected text-model tensor, an index naming a missing file, a file
            safetensors cannot read (truncated, bad header), or no safetensors at all; the message names the
            tensor and its file (the file alone for an unreadable one).
        ValueError: bad EP rank / size.
    """
    model_dir = os.fspath(model_dir)
    file_map = _file_map(model_dir)
    to_read, local = _classify(file_map, cfg, ep_rank, ep_size)
    _check_present(cfg, model_dir, to_read, local)

    out: dict[str, Tensor] = {}
    pending: dict[str, dict[str, Tensor]] = {}  # quantised module -> parts read so far
    method = cfg.quant.method if cfg.quant is not None else None

    bar = _LoadProgress(len(to_read), enabled=progress)
    try:
        for fpath, names in _iter_by_file(to_read, list(local)):
            path = os.path.join(model_dir, fpath)
            with _open_shard(path, device="cpu") as f:
                for name in names:
                    fname = to_read[name][0]
                    t = _read_tensor(f, name, fname, fpath, local[name])
                    module, _, part = name.rpartition(".")
                    if _is_quantised_part(method, name, local):
                        parts = pending.setdefault(module, {})
                        parts[part] = t
                        if all(p in parts for p in _QUANT_PARTS[method]):
                            out.update(
                                _finish_module(cfg, module, pending.pop(module), fpath, dequantize, dtype, device)
                            )
                    else:
                        out[name] = _cast(name, t, dtype).to(device)
                    bar.advance()
    finally:
        bar.close()
    assert not pending, f"incomplete quantised modules: {sorted(pending)[:3]}"  # all parts were checked present
    if cfg.tie_word_embeddings and "lm_head.weight" not in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


_QUANT_PARTS: dict[str | None, tuple[str, ...]] = {  # quantisation method -> the tensors of one quantised module
    "int4": ("weight_packed", "weight_scale", "weight_shape"),
    "fp8": ("weight", "weight_scale_inv"),
}


def _check_present(cfg: ModelConfig, model_dir: str, to_read: Collection[str], local: Collection[str]) -> None:
    """Raise CheckpointError naming the first expected tensor (of `local`) the checkpoint lacks, if any."""
    missing = [n for n in local if n not in to_read]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"missing tensor {cfg.weight_prefix + missing[0]!r}{more} in checkpoint {model_dir}")


def _cast(name: str, t: Tensor, dtype: torch.dtype) -> Tensor:
    """t cast to `dtype` when floating, except `mlp.gate.e_score_correction_bias` (kept as stored)."""
    if t.is_floating_point() and not name.endswith("e_score_correction_bias"):
        t = t.to(dtype)
    return t


def _is_quantised_part(method: str | None, name: str, local: Collection[str]) -> bool:
    """Whether canonical tensor `name` is one part of a quantised module (`_QUANT_PARTS[method]`): an INT4
    routed expert's part, or an FP8 linear's part where the checkpoint expects the module's weight_scale_inv."""
    module, _, part = name.rpartition(".")
    return (method == "int4" and part in _QUANT_PARTS["int4"] and ".mlp.experts." in name) or (
        method == "fp8" and module + ".weight_scale_inv" in local and part in _QUANT_PARTS["fp8"]
    )


def _read_tensor(f: Any, name: str, fname: str, fpath: str, want: tuple[tuple[int, ...], torch.dtype]) -> Tensor:
    """Tensor `fname` of the open shard `f` (file `fpath`), checked against `want` (shape, dtype); a scale
    tensor (canonical `name` ending `.weight_scale_inv` / `.weight_scale`) must be finite.

    Raises:
        CheckpointError: the tensor is absent, of another shape or dtype, or a scale holds NaN / inf.
    """
    want_shape, want_dtype = want
    try:
        sl = f.get_slice(fname)
    except Exception as e:  # the index lists a tensor the file lacks
        raise CheckpointError(f"tensor {fname!r} is not in {fpath}: {e}") from e
    shape = tuple(int(x) for x in sl.get_shape())
    got_dtype = _ST_DTYPES.get(sl.get_dtype())
    if shape != tuple(want_shape):
        raise CheckpointError(f"tensor {fname!r} in {fpath} has shape {list(shape)}, expected {list(want_shape)}")
    if got_dtype != want_dtype:
        raise CheckpointError(f"tensor {fname!r} in {fpath} has dtype {sl.get_dtype()}, expected {want_dtype}")
    t: Tensor = f.get_tensor(fname)
    if name.endswith((".weight_scale_inv", ".weight_scale")) and not bool(torch.isfinite(t).all()):
        # a NaN / inf scale would silently turn every output of the module into garbage
        raise CheckpointError(f"tensor {fname!r} in {fpath} holds NaN or infinite scales")
    return t


def _finish_module(
    cfg: ModelConfig,
    module: str,
    parts: dict[str, Tensor],
    fpath: str,
    dequantize: bool,
    dtype: torch.dtype,
    device: str | torch.device,
) -> dict[str, Tensor]:
    """The output tensors (canonical name -> tensor on `device`) of one quantised module from its parts
    (INT4: weight_packed, weight_scale, weight_shape; FP8: weight, weight_scale_inv), dequantised to `dtype`
    with `dequantize`, else kept as stored (INT4's weight_shape dropped).

    Raises:
        CheckpointError: an INT4 weight_shape that disagrees with weight_packed's shape.
    """
    quant = cfg.quant
    assert quant is not None, "only a quantised checkpoint has modules in parts"
    if "weight_packed" in parts:
        o, i = parts["weight_packed"].shape[0], parts["weight_packed"].shape[1] * 8
        ws = parts["weight_shape"].tolist()
        if ws != [o, i]:
            raise CheckpointError(
                f"tensor {cfg.weight_prefix + module + '.weight_shape'!r} in {fpath} is {ws}, expected [{o}, {i}]"
            )
        if dequantize:
            w = dequant_int4(parts["weight_packed"], parts["weight_scale"], quant.group_size, dtype)
            return {module + ".weight": w.to(device)}
        return {
            module + ".weight_packed": parts["weight_packed"].to(device),
            module + ".weight_scale": parts["weight_scale"].to(device),
        }
    if dequantize:
        w = dequant_fp8_block(parts["weight"], parts["weight_scale_inv"], quant.block, dtype)
        return {module + ".weight": w.to(device)}
    return {
        module + ".weight": parts["weight"].to(device),
        module + ".weight_scale_inv": parts["weight_scale_inv"].to(device),
    }
