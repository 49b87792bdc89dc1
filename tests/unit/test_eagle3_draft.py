"""The EAGLE3 draft (kimi.model.eagle3): the tiny draft in the published layout loads and runs; drafts that do not
match the target (layout, vocabulary, tensors) are refused naming the field or tensor; --speculative-config parsing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kimi.config import ModelConfig, SpeculativeConfig
from kimi.errors import CheckpointError, ConfigError
from kimi.model.eagle3 import default_aux_layer_ids, load_eagle3_draft
from kimi.tiny_checkpoint import make_tiny_eagle3_draft, tiny_config


@pytest.fixture(scope="module")
def target() -> ModelConfig:
    cfg, gen = tiny_config("k2.6")
    return ModelConfig.from_dict(cfg, gen)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(make_tiny_eagle3_draft(tmp_path_factory.mktemp("draft")))


@pytest.fixture(scope="module")
def mla_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(make_tiny_eagle3_draft(tmp_path_factory.mktemp("mla"), attention="mla"))


def _embed(target: ModelConfig) -> torch.Tensor:
    return torch.randn(target.vocab_size, target.hidden_size, generator=torch.Generator().manual_seed(0))


def _copy(src: Path, dst: Path, edit_cfg=None, edit_tensors=None) -> Path:
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    if edit_cfg:
        edit_cfg(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    t = load_file(str(src / "model.safetensors"))
    if edit_tensors:
        edit_tensors(t)
    save_file(t, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("attention", ["llama", "mla"])
def test_tiny_draft_loads_and_proposes(draft_dir: Path, mla_dir: Path, target: ModelConfig, attention: str) -> None:
    ddir = draft_dir if attention == "llama" else mla_dir
    names = set(load_file(str(ddir / "model.safetensors")))
    assert {"fc.weight", "midlayer.hidden_norm.weight", "d2t", "t2d"} <= names
    assert "embed_tokens.weight" not in names  # shared with the target
    d = load_eagle3_draft(str(ddir), target, _embed(target))
    assert d.aux_layer_ids == (0, 1, 2)
    H = target.hidden_size
    assert tuple(d.params["fc.weight"].shape) == (H, 3 * H)
    if attention == "llama":
        assert tuple(d.params["midlayer.self_attn.q_proj.weight"].shape) == (4 * 32, 2 * H)
    else:  # the tiny target's MLA sizes: q_lora 96, kv_lora 64, 4 heads x (32 nope + 16 rope), v 32
        assert tuple(d.params["midlayer.self_attn.q_a_proj.weight"].shape) == (96, 2 * H)
        assert tuple(d.params["midlayer.self_attn.kv_a_proj_with_mqa.weight"].shape) == (64 + 16, 2 * H)
        assert tuple(d.params["midlayer.self_attn.kv_b_proj.weight"].shape) == (4 * (32 + 32), 64)
        assert d.cfg.rope_scaling is not None and d.cfg.rope_scaling.factor == 64.0
    kv = d.new_kv()
    aux = torch.randn(5, 3 * H)
    logits, h = d(torch.tensor([1, 2, 3, 4, 5]), d.fuse(aux), torch.arange(7, 12), kv)
    assert logits.shape == (5, 4096) and h.shape == (5, H) and kv.base == 7 and kv.length == 5
    ids = d.to_target(logits.argmax(-1))
    assert bool(((ids >= 0) & (ids < target.vocab_size)).all()) and bool((ids % 40 == 0).all())
    # one position at a time through the cache gives the same logits as the batch (causal attention)
    kv2 = d.new_kv()
    feat = d.fuse(aux)
    rows = [d(torch.tensor([i + 1]), feat[i : i + 1], torch.tensor([7 + i]), kv2)[0] for i in range(5)]
    torch.testing.assert_close(torch.cat(rows), logits, rtol=1e-4, atol=1e-4)
    # truncation drops the speculative entries; appending again at the cut works, a gap does not
    kv2.truncate(9)
    assert kv2.length == 2
    d(torch.tensor([3]), feat[2:3], torch.tensor([9]), kv2)
    with pytest.raises(ValueError):
        d(torch.tensor([3]), feat[2:3], torch.tensor([12]), kv2)


def test_default_aux_layers() -> None:
    assert default_aux_layer_ids(61) == (2, 30, 58)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda t: t.__setitem__("fc.weight", torch.zeros(128, 256)), "fc.weight"),
        (lambda t: t.pop("midlayer.self_attn.k_proj.weight"), "midlayer.self_attn.k_proj.weight"),
        (lambda t: t.__setitem__("midlayer.extra.weight", torch.zeros(3)), "midlayer.extra.weight"),
        (lambda t: t.__setitem__("d2t", t["d2t"] + 10**6), "d2t"),
        (lambda t: t.__setitem__("d2t", t["d2t"].to(torch.int32)), "d2t"),
        (lambda t: t.__setitem__("t2d", torch.ones(163840, dtype=torch.bool)), "t2d"),
        (lambda t: t.__setitem__("lm_head.weight", torch.zeros(4000, 128)), "lm_head.weight"),
    ],
)
def test_mismatched_tensors_are_refused(draft_dir: Path, target: ModelConfig, tmp_path: Path, edit, match) -> None:
    bad = _copy(draft_dir, tmp_path / "bad", edit_tensors=edit)
    with pytest.raises(CheckpointError, match=match.replace(".", r"\.")):
        load_eagle3_draft(str(bad), target, _embed(target))


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda c: c.__setitem__("vocab_size", 32000), "vocab_size"),
        (lambda c: c.__setitem__("rope_scaling", {"type": "yarn", "factor": 4.0}), "rope_scaling"),
        (lambda c: c.__setitem__("architectures", ["Eagle3DeepseekV2ForCausalLM"]), "kv_lora_rank"),
        (lambda c: c.__setitem__("architectures", ["LlamaForCausalLM"]), "architectures"),
        (lambda c: c["eagle_config"].__setitem__("eagle_aux_hidden_state_layer_ids", [2, 30, 58]), "outside"),
        (lambda c: c.__setitem__("target_hidden_size", 7168), "draft target_hidden_size 7168 != "),
        (lambda c: c.__setitem__("hidden_size", 96), "draft hidden_size 96 .* no target_hidden_size"),
        (lambda c: c.__setitem__("num_hidden_layers", 2), "num_hidden_layers"),
    ],
)
def test_mismatched_config_is_refused(draft_dir: Path, target: ModelConfig, tmp_path: Path, edit, match) -> None:
    bad = _copy(draft_dir, tmp_path / "bad", edit_cfg=edit)
    with pytest.raises(ConfigError, match=match):
        load_eagle3_draft(str(bad), target, _embed(target))


def test_dummy_weights_skip_the_files(draft_dir: Path, target: ModelConfig, tmp_path: Path) -> None:
    only_cfg = tmp_path / "cfg"
    only_cfg.mkdir()
    (only_cfg / "config.json").write_text((draft_dir / "config.json").read_text())
    d = load_eagle3_draft(str(only_cfg), target, _embed(target), dummy=True)
    assert d.target_ids.shape == (4096,)


def test_speculative_config_json() -> None:
    c = SpeculativeConfig.from_json('{"method": "eagle3", "model": "/d", "num_speculative_tokens": 3}')
    assert (c.method, c.model, c.num_speculative_tokens) == ("eagle3", "/d", 3)
    assert SpeculativeConfig.from_json(c.to_json()) == c
    for text, field in [
        ('{"method": "ngram", "model": "/d", "num_speculative_tokens": 3}', "method"),
        ('{"method": "eagle3", "num_speculative_tokens": 3}', "model"),
        ('{"method": "eagle3", "model": "/d", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "eagle3", "model": "/d", "num_speculative_tokens": 2, "foo": 1}', "foo"),
        ("{not json", "not JSON"),
    ]:
        with pytest.raises(ConfigError, match=field):
            SpeculativeConfig.from_json(text)


def test_mla_draft_refuses_a_llama_tensor(mla_dir: Path, target: ModelConfig, tmp_path: Path) -> None:
    def edit(t):
        t.pop("midlayer.self_attn.kv_b_proj.weight")
        t["midlayer.self_attn.k_proj.weight"] = torch.zeros(64, 256)

    bad = _copy(mla_dir, tmp_path / "bad", edit_tensors=edit)
    with pytest.raises(CheckpointError, match=r"midlayer\.self_attn\.kv_b_proj\.weight missing"):
        load_eagle3_draft(str(bad), target, _embed(target))


def test_full_vocabulary_draft_needs_no_d2t(draft_dir: Path, target: ModelConfig, tmp_path: Path) -> None:
    """A draft over the whole target vocabulary may leave d2t out (the identity)."""

    def cfg(c):
        c["draft_vocab_size"] = c["vocab_size"]

    def tensors(t):
        t.pop("d2t")
        t.pop("t2d")
        t["lm_head.weight"] = torch.zeros(163840, 128, dtype=torch.bfloat16)

    full = _copy(draft_dir, tmp_path / "full", edit_cfg=cfg, edit_tensors=tensors)
    d = load_eagle3_draft(str(full), target, _embed(target))
    assert torch.equal(d.target_ids, torch.arange(163840))
