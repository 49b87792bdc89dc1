"""kimi.checkpoint: tensor lists for the real formats, tiny-checkpoint round trips, EP slicing, errors."""

from __future__ import annotations

import functools
import io
import json
import os
import re
import shutil
from collections.abc import Callable

import pytest
import safetensors
import torch
from safetensors.torch import load_file, save_file

from kimi.checkpoint import INDEX_FILE, CheckpointError, expected_tensors, load_checkpoint, local_expert_range
from kimi.config import ModelConfig
from kimi.presets import load_preset
from kimi.tiny_checkpoint import LAYOUTS, make_tiny_checkpoint
from kimi.tiny_checkpoint import generate_tiny_weights as _generate

# The generator is deterministic; share its output between tests (they never modify it).
generate_tiny_weights = functools.lru_cache(maxsize=None)(_generate)

BF16, F32, I32, FP8 = torch.bfloat16, torch.float32, torch.int32, torch.float8_e4m3fn


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny_ckpt")
    return {layout: make_tiny_checkpoint(root / layout, layout, seed=0, tokenizer_source=None) for layout in LAYOUTS}


# ---- expected_tensors at real sizes (docs/model-format.md, Tensors) ---------------------------------------------


def test_expected_tensors_k26_int4_real_shapes() -> None:
    cfg = ModelConfig.from_dict(load_preset("kimi-k2.6"))
    exp = expected_tensors(cfg)
    p = "language_model.model.layers."
    assert exp["language_model.model.embed_tokens.weight"] == ((163840, 7168), BF16)
    assert exp["language_model.lm_head.weight"] == ((163840, 7168), BF16)
    assert exp["language_model.model.norm.weight"] == ((7168,), BF16)
    assert exp[p + "5.input_layernorm.weight"] == ((7168,), BF16)
    assert exp[p + "5.self_attn.q_a_proj.weight"] == ((1536, 7168), BF16)
    assert exp[p + "5.self_attn.q_a_layernorm.weight"] == ((1536,), BF16)
    assert exp[p + "5.self_attn.q_b_proj.weight"] == ((12288, 1536), BF16)
    assert exp[p + "5.self_attn.kv_a_proj_with_mqa.weight"] == ((576, 7168), BF16)
    assert exp[p + "5.self_attn.kv_a_layernorm.weight"] == ((512,), BF16)
    assert exp[p + "5.self_attn.kv_b_proj.weight"] == ((16384, 512), BF16)
    assert exp[p + "5.self_attn.o_proj.weight"] == ((7168, 8192), BF16)
    assert exp[p + "0.mlp.gate_proj.weight"] == ((18432, 7168), BF16)
    assert exp[p + "0.mlp.down_proj.weight"] == ((7168, 18432), BF16)
    assert p + "0.mlp.gate.weight" not in exp and p + "0.mlp.experts.0.gate_proj.weight_packed" not in exp
    assert exp[p + "60.mlp.gate.weight"] == ((384, 7168), BF16)
    assert exp[p + "60.mlp.gate.e_score_correction_bias"] == ((384,), F32)
    assert exp[p + "60.mlp.shared_experts.up_proj.weight"] == ((2048, 7168), BF16)
    assert exp[p + "60.mlp.shared_experts.down_proj.weight"] == ((7168, 2048), BF16)
    assert exp[p + "1.mlp.experts.383.gate_proj.weight_packed"] == ((2048, 896), I32)
    assert exp[p + "1.mlp.experts.383.up_proj.weight_scale"] == ((2048, 224), BF16)
    assert exp[p + "1.mlp.experts.0.down_proj.weight_packed"] == ((7168, 256), I32)
    assert exp[p + "1.mlp.experts.0.down_proj.weight_scale"] == ((7168, 64), BF16)
    assert exp[p + "1.mlp.experts.0.down_proj.weight_shape"] == ((2,), I32)
    assert p + "1.mlp.experts.0.down_proj.weight" not in exp
    # 3 top-level + 9 per layer + 3 dense MLP + 60 MoE layers x (3 shared + 2 router + 384 experts x 3 x 3).
    assert len(exp) == 3 + 61 * 9 + 3 + 60 * (5 + 384 * 9)
    # Sizes from docs/model-format.md, Tensors: one INT4 expert is 22.0 MB packed + 2.75 MB scales.
    e = {k: v for k, v in exp.items() if ".layers.1.mlp.experts.0." in k}
    packed = sum(torch.Size(s).numel() * 4 for k, (s, _) in e.items() if k.endswith("weight_packed"))
    scales = sum(torch.Size(s).numel() * 2 for k, (s, _) in e.items() if k.endswith("weight_scale"))
    assert (packed, scales) == (3 * 2048 * 7168 // 2, 3 * 2048 * 7168 // 16)


def test_expected_tensors_k2_instruct_fp8_real_shapes() -> None:
    text = load_preset("kimi-k2.6")["text_config"]
    text["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    cfg = ModelConfig.from_dict(text)
    exp = expected_tensors(cfg)
    p = "model.layers."
    assert exp["model.embed_tokens.weight"] == ((163840, 7168), BF16) and exp["lm_head.weight"] == (
        (163840, 7168),
        BF16,
    )
    assert exp[p + "3.self_attn.q_a_proj.weight"] == ((1536, 7168), FP8)
    assert exp[p + "3.self_attn.q_a_proj.weight_scale_inv"] == ((12, 56), F32)
    assert exp[p + "3.self_attn.kv_a_proj_with_mqa.weight_scale_inv"] == ((5, 56), F32)  # 576 rows: ragged
    for name in ("q_b_proj", "kv_b_proj", "o_proj"):
        assert exp[p + f"3.self_attn.{name}.weight"][1] == FP8
    assert exp[p + "0.mlp.up_proj.weight"] == ((18432, 7168), FP8)
    assert exp[p + "0.mlp.down_proj.weight_scale_inv"] == ((56, 144), F32)
    assert exp[p + "3.mlp.shared_experts.gate_proj.weight"] == ((2048, 7168), FP8)
    assert exp[p + "3.mlp.experts.7.gate_proj.weight"] == ((2048, 7168), FP8)
    assert exp[p + "3.mlp.experts.7.gate_proj.weight_scale_inv"] == ((16, 56), F32)
    assert exp[p + "3.mlp.gate.weight"] == ((384, 7168), BF16)
    assert exp[p + "3.input_layernorm.weight"] == ((7168,), BF16)
    assert exp[p + "3.self_attn.kv_a_layernorm.weight"] == ((512,), BF16)
    assert not any(k.endswith(("weight_packed", "weight_scale")) for k in exp)


def test_expected_tensors_ep_slice_and_layer_override() -> None:
    cfg = ModelConfig.from_dict(load_preset("kimi-k2.6"))
    assert local_expert_range(cfg, 3, 8) == (144, 192)
    exp = expected_tensors(cfg, ep_rank=3, ep_size=8)
    experts = {int(k.split(".")[6]) for k in exp if ".mlp.experts." in k}
    assert experts == set(range(144, 192))
    with pytest.raises(ValueError):
        expected_tensors(cfg, ep_rank=0, ep_size=5)  # 384 % 5 != 0
    with pytest.raises(ValueError):
        expected_tensors(cfg, ep_rank=8, ep_size=8)
    small = expected_tensors(cfg.with_overrides(num_hidden_layers=2))
    assert not any(".layers.2." in k for k in small) and any(".layers.1.mlp.experts.0." in k for k in small)


# ---- round trips -----------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_roundtrip_dequantised(tiny: dict[str, str], layout: str) -> None:
    d = tiny[layout]
    cfg = ModelConfig.from_dir(d)
    got = load_checkpoint(d, cfg, progress=False)
    _, truth = generate_tiny_weights(layout, seed=0)
    assert set(got) == set(truth)
    for name, t in truth.items():
        assert got[name].dtype == torch.float32, name
        assert torch.equal(got[name], t), name
    assert not any(k.startswith(("vision_tower", "mm_projector", "language_model")) for k in got)
    assert got["model.layers.1.mlp.experts.15.down_proj.weight"].shape == (128, 64)
    # The router bias and norms are not trivial (so tests downstream exercise them).
    assert got["model.layers.2.mlp.gate.e_score_correction_bias"].abs().min() > 0
    assert 0.05 < got["model.layers.0.input_layernorm.weight"].std() < 0.2

    half = load_checkpoint(d, cfg, dtype=torch.bfloat16, progress=False)
    assert half["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert half["model.layers.1.mlp.experts.3.up_proj.weight"].dtype == torch.bfloat16
    assert torch.equal(
        half["model.layers.1.mlp.experts.3.up_proj.weight"],
        truth["model.layers.1.mlp.experts.3.up_proj.weight"].to(torch.bfloat16),
    )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_roundtrip_raw(tiny: dict[str, str], layout: str) -> None:
    d = tiny[layout]
    cfg = ModelConfig.from_dir(d)
    got = load_checkpoint(d, cfg, dequantize=False, progress=False)
    stored, _ = generate_tiny_weights(layout, seed=0)
    pre = cfg.weight_prefix
    e = "model.layers.2.mlp.experts.5.gate_proj."
    if cfg.quant.method == "int4":
        assert torch.equal(got[e + "weight_packed"], stored[pre + e + "weight_packed"])
        assert got[e + "weight_scale"].dtype == torch.bfloat16
        assert torch.equal(got[e + "weight_scale"], stored[pre + e + "weight_scale"])
        assert e + "weight" not in got and e + "weight_shape" not in got
        assert got["model.layers.2.self_attn.o_proj.weight"].dtype == torch.float32
    else:
        assert got[e + "weight"].dtype == FP8
        assert torch.equal(got[e + "weight"].view(torch.uint8), stored[e + "weight"].view(torch.uint8))
        assert torch.equal(got[e + "weight_scale_inv"], stored[e + "weight_scale_inv"])
        assert got["model.layers.2.self_attn.o_proj.weight"].dtype == FP8
        assert got["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (1, 2)
        assert got["lm_head.weight"].dtype == torch.float32  # not quantised


class _Recorder:
    """Wraps safetensors.safe_open and records every tensor whose data or metadata is touched."""

    def __init__(self, real: Callable) -> None:
        self.real = real
        self.touched: list[str] = []

    def __call__(self, *a, **kw):
        rec = self

        class Handle:
            def __init__(self) -> None:
                self.h = rec.real(*a, **kw)

            def __enter__(self):
                self.f = self.h.__enter__()
                return self

            def __exit__(self, *exc):
                return self.h.__exit__(*exc)

            def keys(self):
                return self.f.keys()

            def get_slice(self, name):
                rec.touched.append(name)
                return self.f.get_slice(name)

            def get_tensor(self, name):
                rec.touched.append(name)
                return self.f.get_tensor(name)

        return Handle()


@pytest.mark.parametrize("layout", ["k2.6", "k2-instruct"])
def test_ep_rank_reads_only_local_experts(tiny: dict[str, str], layout: str, monkeypatch) -> None:
    d = tiny[layout]
    cfg = ModelConfig.from_dir(d)
    rec = _Recorder(safetensors.safe_open)
    monkeypatch.setattr(safetensors, "safe_open", rec)
    got = load_checkpoint(d, cfg, ep_rank=2, ep_size=4, progress=False)
    read_experts = {int(n.split(".mlp.experts.")[1].split(".")[0]) for n in rec.touched if ".mlp.experts." in n}
    assert read_experts == {8, 9, 10, 11}
    for layer in (1, 2):
        loaded = {int(k.split(".")[5]) for k in got if k.startswith(f"model.layers.{layer}.mlp.experts.")}
        assert loaded == {8, 9, 10, 11}
    _, truth = generate_tiny_weights(layout, seed=0)
    assert torch.equal(
        got["model.layers.2.mlp.experts.10.down_proj.weight"], truth["model.layers.2.mlp.experts.10.down_proj.weight"]
    )
    # Everything else is shared by all ranks.
    assert set(got) == {k for k in truth if ".mlp.experts." not in k or int(k.split(".")[5]) in range(8, 12)}


def test_layer_override_ignores_later_layers(tiny: dict[str, str]) -> None:
    d = tiny["k2.6"]
    cfg = ModelConfig.from_dir(d).with_overrides(num_hidden_layers=2)
    got = load_checkpoint(d, cfg, progress=False)
    assert any(k.startswith("model.layers.1.") for k in got)
    assert not any(k.startswith("model.layers.2.") for k in got)
    assert "lm_head.weight" in got and "model.norm.weight" in got


def test_progress_bar_goes_to_stderr(tiny: dict[str, str], capfd) -> None:
    d = tiny["k2-thinking"]
    cfg = ModelConfig.from_dir(d)
    load_checkpoint(d, cfg, progress=True)
    out, err = capfd.readouterr()
    assert "Loading checkpoint" in err and "Loading checkpoint" not in out
    load_checkpoint(d, cfg, progress=False)
    out, err = capfd.readouterr()
    assert "Loading checkpoint" not in err


def _frames(text: str) -> list[str]:
    return [f for f in text.replace("\n", "\r").split("\r") if f.startswith("Loading checkpoint")]


def test_progress_bar_draws_100_percent_once(tiny: dict[str, str], capfd) -> None:
    """The 100% frame is written once, by the bar's close, not also by the last tensor's update: with every
    update drawn (as a slow real load draws its last tensor's), and through a real load."""
    from tqdm import tqdm

    from kimi.checkpoint import _LoadProgress

    plain, f = io.StringIO(), io.StringIO()
    bar = tqdm(total=5, desc="Loading checkpoint", file=plain, mininterval=0, miniters=1)
    ours = _LoadProgress(5, file=f, mininterval=0, miniters=1)
    for _ in range(5):
        bar.update(1)
        ours.advance()
    bar.close()
    ours.close()
    assert sum("100%" in x for x in _frames(plain.getvalue())) == 2  # what tqdm alone writes
    frames = _frames(f.getvalue())
    assert [x.split("%")[0][-3:] for x in frames] == ["  0", " 20", " 40", " 60", " 80", "100"], frames
    d = tiny["k2-thinking"]
    load_checkpoint(d, ModelConfig.from_dir(d), progress=True)
    frames = _frames(capfd.readouterr().err)
    assert sum("100%" in x for x in frames) == 1 and "100%" in frames[-1], frames[-3:]


# ---- broken checkpoints -------------------------------------------------------------------------------


def _rewrite(src: str, dst, edit: Callable[[dict[str, torch.Tensor]], None], index: bool = True) -> str:
    """Copy a checkpoint's config and shards to dst, applying `edit` to the name -> tensor dict of all
    shards (new names go to the first shard), and regenerate the index (or drop it)."""
    dst = str(dst)
    os.makedirs(dst, exist_ok=True)
    for f in ("config.json", "generation_config.json"):
        shutil.copy(os.path.join(src, f), dst)
    with open(os.path.join(src, INDEX_FILE)) as f:
        wmap = json.load(f)["weight_map"]
    files = sorted(set(wmap.values()))
    tensors: dict[str, torch.Tensor] = {}
    for fn in files:
        tensors.update(load_file(os.path.join(src, fn)))
    edit(tensors)
    new_map = {}
    for fn in files:
        shard = {k: v.contiguous() for k, v in tensors.items() if wmap.get(k, files[0]) == fn}
        save_file(shard, os.path.join(dst, fn))
        new_map.update(dict.fromkeys(shard, fn))
    if index:
        with open(os.path.join(dst, INDEX_FILE), "w") as f:
            json.dump({"metadata": {}, "weight_map": new_map}, f)
    return dst


P = "language_model."


def test_missing_tensor(tiny: dict[str, str], tmp_path) -> None:
    name = P + "model.layers.1.self_attn.kv_b_proj.weight"
    d = _rewrite(tiny["k2.6"], tmp_path, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=r"missing tensor.*layers\.1\.self_attn\.kv_b_proj\.weight"):
        load_checkpoint(d, ModelConfig.from_dir(d), progress=False)


def test_missing_local_expert_part(tiny: dict[str, str], tmp_path) -> None:
    name = P + "model.layers.2.mlp.experts.9.up_proj.weight_scale"
    d = _rewrite(tiny["k2.6"], tmp_path, lambda t: t.pop(name))
    cfg = ModelConfig.from_dir(d)
    with pytest.raises(CheckpointError, match=r"experts\.9\.up_proj\.weight_scale"):
        load_checkpoint(d, cfg, ep_rank=2, ep_size=4, progress=False)
    load_checkpoint(d, cfg, ep_rank=0, ep_size=4, progress=False)  # another rank does not need it


def test_misshapen_tensor(tiny: dict[str, str], tmp_path) -> None:
    name = P + "model.layers.2.self_attn.o_proj.weight"

    def edit(t):
        t[name] = t[name][:, :100].clone()

    d = _rewrite(tiny["k2.6"], tmp_path, edit)
    with pytest.raises(CheckpointError, match=r"layers\.2\.self_attn\.o_proj\.weight.*model-0000\d-of-00003.*shape"):
        load_checkpoint(d, ModelConfig.from_dir(d), progress=False)


@pytest.mark.parametrize(
    "layout,name",
    [
        ("k2-instruct", "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"),
        ("k2-instruct", "model.layers.0.self_attn.o_proj.weight_scale_inv"),
        ("k2.6", P + "model.layers.2.mlp.experts.5.gate_proj.weight_scale"),
    ],
)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_scale_is_refused(tiny: dict[str, str], tmp_path, layout: str, name: str, bad: float) -> None:
    """A NaN / inf quantisation scale (FP8 weight_scale_inv, INT4 weight_scale) stops loading with an error naming
    the tensor, raw or dequantised, rather than loading and answering garbage."""

    def edit(t):
        t[name] = t[name].clone()
        t[name].view(-1)[-1] = bad

    d = _rewrite(tiny[layout], tmp_path, edit)
    cfg = ModelConfig.from_dir(d)
    for dq in (False, True):
        with pytest.raises(CheckpointError, match=re.escape(name) + ".*NaN or infinite"):
            load_checkpoint(d, cfg, dequantize=dq, progress=False)


def test_wrong_dtype(tiny: dict[str, str], tmp_path) -> None:
    name = "model.layers.1.mlp.gate.e_score_correction_bias"

    def edit(t):
        t[name] = t[name].to(torch.bfloat16)

    d = _rewrite(tiny["k2-thinking"], tmp_path, edit)
    with pytest.raises(CheckpointError, match=r"e_score_correction_bias.*dtype"):
        load_checkpoint(d, ModelConfig.from_dir(d), progress=False)


def test_unexpected_tensor(tiny: dict[str, str], tmp_path) -> None:
    name = P + "model.layers.1.self_attn.q_proj.weight"

    def edit(t):
        t[name] = torch.zeros(4, 4, dtype=torch.bfloat16)

    d = _rewrite(tiny["k2.6"], tmp_path, edit)
    with pytest.raises(CheckpointError, match=r"unexpected tensor.*layers\.1\.self_attn\.q_proj\.weight.*model-00001"):
        load_checkpoint(d, ModelConfig.from_dir(d), progress=False)


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.3.self_attn.o_proj.weight",  # a layer the config does not have
        "model.layers.1.mlp.experts.16.gate_proj.weight",  # an expert id past n_routed_experts
        "model.layers.0.mlp.experts.0.gate_proj.weight",  # experts in the dense layer
        "model.layers.2.mlp.experts.3.gate_proj.weight_packed",  # INT4 parts in an FP8 checkpoint
    ],
)
def test_unexpected_tensor_even_for_other_ranks(tiny: dict[str, str], tmp_path, name: str) -> None:
    def edit(t):
        t[name] = torch.zeros(2, 2, dtype=torch.bfloat16)

    d = _rewrite(tiny["k2-instruct"], tmp_path, edit)
    with pytest.raises(CheckpointError, match="unexpected tensor.*" + name.replace(".", r"\.")):
        load_checkpoint(d, ModelConfig.from_dir(d), ep_rank=1, ep_size=2, progress=False)


def test_bad_weight_shape(tiny: dict[str, str], tmp_path) -> None:
    name = P + "model.layers.1.mlp.experts.0.down_proj.weight_shape"

    def edit(t):
        t[name] = torch.tensor([64, 128], dtype=torch.int32)

    d = _rewrite(tiny["k2.6"], tmp_path, edit)
    with pytest.raises(CheckpointError, match=r"experts\.0\.down_proj\.weight_shape.*\[64, 128\]"):
        load_checkpoint(d, ModelConfig.from_dir(d), progress=False)


def test_skips_vision_rotary_and_foreign_tensors_without_index(tiny: dict[str, str], tmp_path) -> None:
    def edit(t):
        assert any(k.startswith("vision_tower.") for k in t) and any(k.startswith("mm_projector.") for k in t)
        t[P + "model.layers.1.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
        t["some_other_head.weight"] = torch.ones(3)  # outside the text prefix of a nested checkpoint

    d = _rewrite(tiny["k2.6"], tmp_path, edit, index=False)
    assert not os.path.exists(os.path.join(d, INDEX_FILE))
    got = load_checkpoint(d, ModelConfig.from_dir(d), progress=False)
    _, truth = generate_tiny_weights("k2.6", seed=0)
    assert set(got) == set(truth)
    assert all(torch.equal(got[k], truth[k]) for k in truth)


def test_index_names_missing_file(tiny: dict[str, str], tmp_path) -> None:
    d = _rewrite(tiny["k2-thinking"], tmp_path, lambda t: None)
    os.remove(os.path.join(d, "model-00002-of-00003.safetensors"))
    with pytest.raises(CheckpointError, match=r"model-00002-of-00003\.safetensors"):
        load_checkpoint(d, ModelConfig.from_dir(d), progress=False)


@pytest.mark.parametrize("index", [True, False], ids=["index", "no_index"])
@pytest.mark.parametrize("keep", [1000, 0.9], ids=["header_cut", "data_cut"])
def test_truncated_shard_names_its_file(tiny: dict[str, str], tmp_path, index: bool, keep) -> None:
    """A shard cut short (inside its header, or inside its data) is a CheckpointError naming that file, with and
    without the index (safetensors alone says only "invalid header length" / "file not fully covered")."""
    d = _rewrite(tiny["k2.6"], tmp_path, lambda t: None, index=index)
    path = os.path.join(d, "model-00002-of-00003.safetensors")
    size = os.path.getsize(path)
    os.truncate(path, keep if isinstance(keep, int) else int(size * keep))
    with pytest.raises(CheckpointError, match=r"model-00002-of-00003\.safetensors: cannot be read as safetensors"):
        load_checkpoint(d, ModelConfig.from_dir(d), progress=False)


def test_generator_is_deterministic_and_seeded() -> None:
    a, ta = _generate("k2-thinking", seed=0)  # a fresh run
    b, tb = generate_tiny_weights("k2-thinking", seed=0)  # cached from an earlier run (or computed now)
    c, _ = _generate("k2-thinking", seed=1)
    name = "model.layers.1.mlp.experts.4.gate_proj.weight_packed"
    assert torch.equal(a[name], b[name]) and not torch.equal(a[name], c[name])
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    # The same float weights underlie every layout (only the storage format differs).
    _, t6 = generate_tiny_weights("k2.6", seed=0)
    assert all(torch.equal(t6[k], ta[k]) for k in ta)


def test_tiny_checkpoint_with_a_missing_tokenizer_folder_writes_nothing(tmp_path, monkeypatch, capsys) -> None:
    """A tokenizer folder without tiktoken.model (given, or $KIMI_TOKENIZER_DIR) is a one-line error before anything
    is written: no config.json (the Makefile's target) is left to make the next build look done."""
    from kimi.tiny_checkpoint import main

    out = tmp_path / "tiny"
    with pytest.raises(FileNotFoundError, match=r"no tiktoken\.model"):
        make_tiny_checkpoint(out, tokenizer_source=str(tmp_path / "nowhere"))
    assert not (out / "config.json").exists()
    monkeypatch.setenv("KIMI_TOKENIZER_DIR", str(tmp_path / "nowhere"))
    assert main([str(out)]) == 1
    err = capsys.readouterr().err
    assert "KIMI_TOKENIZER_DIR" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (out / "config.json").exists()
    monkeypatch.delenv("KIMI_TOKENIZER_DIR")
    assert main([str(out), "--builtin-tokenizer"]) == 0  # the next build completes
    assert (out / "config.json").exists() and (out / "tiktoken.model").exists()
    assert not (out / "config.json.tmp").exists()


def test_make_tiny_checkpoint_says_which_vocabulary(tmp_path, capsys, monkeypatch) -> None:
    """The tool's last line names the vocabulary the checkpoint got (a newcomer's clone elsewhere silently got the
    built-in one before)."""
    from kimi.tiny_checkpoint import main

    assert main([str(tmp_path / "a"), "--builtin-tokenizer"]) == 0
    assert "with the built-in byte-level vocabulary (--builtin-tokenizer)" in capsys.readouterr().err
    monkeypatch.setenv("KIMI_TOKENIZER_DIR", str(tmp_path / "missing"))
    assert main([str(tmp_path / "b")]) == 1  # an explicit folder without tiktoken.model is an error, not a fallback
    assert "no tiktoken.model in the tokenizer folder" in capsys.readouterr().err
    monkeypatch.delenv("KIMI_TOKENIZER_DIR")
    monkeypatch.setattr("kimi.tokenizer.default_tokenizer_source", lambda: None)  # no ../shared/kimi-tokenizer
    assert main([str(tmp_path / "c")]) == 0
    err = capsys.readouterr().err
    assert "with the built-in byte-level vocabulary (no $KIMI_TOKENIZER_DIR" in err, err


@pytest.mark.parametrize(
    "weight_map,match", [(5, "got int"), (["a"], "got list"), ({"x.weight": None}, "'x.weight' maps to None")]
)
def test_index_whose_weight_map_is_not_names_to_files(tiny: dict[str, str], tmp_path, weight_map, match) -> None:
    """An index whose weight_map is not {tensor name: file name} is a CheckpointError naming the index (it was an
    AttributeError in the worker: found by an operator-side tester)."""
    d = _rewrite(tiny["k2.6"], tmp_path, lambda t: None)
    with open(os.path.join(d, INDEX_FILE), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with pytest.raises(CheckpointError, match=f"weight_map must map tensor names to file names.*{match}"):
        load_checkpoint(d, ModelConfig.from_dir(d), progress=False)
