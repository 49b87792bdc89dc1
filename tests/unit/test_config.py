"""ModelConfig parsing of the three tiny layouts and of the K2.6 preset (values from docs/model-format.md, Checkpoint
variants)."""

from __future__ import annotations

import json
import os

import pytest

from kimi.config import ConfigError, ModelConfig
from kimi.presets import list_presets, load_preset
from kimi.tiny_checkpoint import LAYOUTS, make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny_cfg")
    return {layout: make_tiny_checkpoint(root / layout, layout, seed=0, tokenizer_source=None) for layout in LAYOUTS}


def test_k26_preset_values() -> None:
    assert "kimi-k2.6" in list_presets()
    raw = load_preset("kimi-k2.6")
    assert raw["model_type"] == "kimi_k25" and raw["text_config"]["model_type"] == "kimi_k2"
    cfg = ModelConfig.from_dict(raw)
    assert cfg.weight_prefix == "language_model."
    assert cfg.model_type == "kimi_k2"
    assert cfg.quant is not None and cfg.quant.method == "int4" and cfg.quant.group_size == 32
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.first_k_dense_replace, cfg.intermediate_size) == (
        7168,
        61,
        1,
        18432,
    )
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_shared_experts, cfg.moe_intermediate_size) == (
        384,
        8,
        1,
        2048,
    )
    assert (cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank) == (64, 1536, 512)
    assert (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (128, 64, 128)
    assert cfg.qk_head_dim == 192 and cfg.kv_cache_dim == 576
    assert (cfg.n_group, cfg.topk_group, cfg.topk_method, cfg.scoring_func) == (1, 1, "noaux_tc", "sigmoid")
    assert cfg.norm_topk_prob is True and cfg.routed_scaling_factor == 2.827 and cfg.rope_theta == 50000
    assert cfg.max_position_embeddings == 262144 and cfg.rms_norm_eps == 1e-5
    assert cfg.vocab_size == 163840 and cfg.tie_word_embeddings is False
    assert cfg.eos_token_ids == (163586,)
    rs = cfg.rope_scaling
    assert rs is not None
    assert (rs.factor, rs.beta_fast, rs.beta_slow, rs.original_max_position_embeddings) == (64, 32, 1, 4096)
    assert (rs.mscale, rs.mscale_all_dim) == (1.0, 1.0)
    assert cfg.softmax_scale == pytest.approx(0.144680, abs=5e-7)
    assert not cfg.is_moe_layer(0) and all(cfg.is_moe_layer(i) for i in range(1, 61))
    # The INT4 config keeps only routed experts quantised.
    qc = raw["text_config"]["quantization_config"]
    assert qc["ignore"] == [
        "lm_head",
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
    ]


def test_softmax_scale_factor_32_at_real_head_dims() -> None:
    raw = load_preset("kimi-k2.6")
    raw["text_config"]["rope_scaling"]["factor"] = 32.0
    assert ModelConfig.from_dict(raw).softmax_scale == pytest.approx(0.130861, abs=5e-7)
    raw["text_config"].pop("rope_scaling")
    assert ModelConfig.from_dict(raw).softmax_scale == pytest.approx(192**-0.5)


def test_load_preset_returns_a_copy_and_rejects_unknown() -> None:
    a = load_preset("kimi-k2.6")
    a["text_config"]["hidden_size"] = 1
    assert load_preset("kimi-k2.6")["text_config"]["hidden_size"] == 7168
    with pytest.raises(KeyError, match=r"kimi-k2\.6"):
        load_preset("no-such-model")


EXPECT = {
    # layout: (prefix, quant method, eos ids, max_pos, eps, (factor, beta_fast, beta_slow), softmax scale)
    "k2.6": (
        "language_model.",
        "int4",
        (163586,),
        262144,
        1e-5,
        (64, 32, 1),
        (48**-0.5) * (0.1 * 4.1588830833596715 + 1) ** 2,
    ),
    "k2-thinking": ("", "int4", (163586,), 262144, 1e-5, (64, 1, 1), (48**-0.5) * (0.1 * 4.1588830833596715 + 1) ** 2),
    "k2-instruct": (
        "",
        "fp8",
        (163585, 163586),
        131072,
        1e-6,
        (32, 1, 1),
        (48**-0.5) * (0.1 * 3.4657359027997265 + 1) ** 2,
    ),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tiny_layouts_parse(tiny_dirs: dict[str, str], layout: str) -> None:
    d = tiny_dirs[layout]
    with open(os.path.join(d, "config.json")) as f:
        raw = json.load(f)
    prefix, method, eos, max_pos, eps, (factor, bf, bs), scale = EXPECT[layout]
    if layout == "k2.6":
        assert raw["model_type"] == "kimi_k25" and "text_config" in raw and "hidden_size" not in raw
        assert raw["architectures"] == ["KimiK25ForConditionalGeneration"]
        text = raw["text_config"]
    else:
        assert "text_config" not in raw
        text = raw
    assert text["model_type"] == "kimi_k2" and text["architectures"] == ["DeepseekV3ForCausalLM"]
    if method == "fp8":
        assert text["quantization_config"] == {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        }
    else:
        qc = text["quantization_config"]
        assert (qc["quant_method"], qc["format"]) == ("compressed-tensors", "pack-quantized")
        w = qc["config_groups"]["group_0"]["weights"]
        assert (w["num_bits"], w["type"], w["symmetric"], w["strategy"], w["group_size"]) == (
            4,
            "int",
            True,
            "group",
            32,
        )
        assert qc["config_groups"]["group_0"]["input_activations"] is None
        assert "re:.*self_attn.*" in qc["ignore"] and "lm_head" in qc["ignore"]

    cfg = ModelConfig.from_dir(d)
    assert cfg.weight_prefix == prefix
    assert cfg.quant is not None and cfg.quant.method == method
    if method == "fp8":
        assert cfg.quant.block == (128, 128)
    else:
        assert cfg.quant.group_size == 32
    assert cfg.eos_token_ids == eos  # config.json's eos, then generation_config.json's (union, in order)
    assert cfg.max_position_embeddings == max_pos and cfg.rms_norm_eps == eps
    assert cfg.rope_scaling is not None
    assert (cfg.rope_scaling.factor, cfg.rope_scaling.beta_fast, cfg.rope_scaling.beta_slow) == (factor, bf, bs)
    assert cfg.softmax_scale == pytest.approx(scale, rel=1e-12)
    # Tiny dims, real structure.
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.first_k_dense_replace) == (128, 3, 1)
    assert (cfg.intermediate_size, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok) == (
        256,
        64,
        16,
        4,
    )
    assert (cfg.n_shared_experts, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank) == (1, 4, 96, 64)
    assert (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.vocab_size) == (32, 16, 32, 163840)
    assert cfg.routed_scaling_factor == 2.827 and cfg.rope_theta == 50000 and cfg.tie_word_embeddings is False
    with open(os.path.join(d, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] in cfg.eos_token_ids


def test_config_errors(tmp_path) -> None:
    raw = load_preset("kimi-k2.6")
    del raw["text_config"]["hidden_size"]
    with pytest.raises(ConfigError, match="hidden_size"):
        ModelConfig.from_dict(raw)
    raw = load_preset("kimi-k2.6")
    raw["text_config"]["quantization_config"] = {"quant_method": "gptq"}
    with pytest.raises(ConfigError, match="gptq"):
        ModelConfig.from_dict(raw)
    raw = load_preset("kimi-k2.6")
    raw["text_config"]["scoring_func"] = "softmax"
    with pytest.raises(ConfigError, match="scoring_func"):
        ModelConfig.from_dict(raw)
    with pytest.raises(ConfigError, match=r"no config\.json"):
        ModelConfig.from_dir(tmp_path)
    with pytest.raises(ConfigError, match="no such directory"):
        ModelConfig.from_dir(tmp_path / "missing")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="JSON"):
        ModelConfig.from_dir(tmp_path)


def _with(path: list[str], value):
    raw = load_preset("kimi-k2.6")
    d = raw
    for k in path[:-1]:
        d = d[k]
    d[path[-1]] = value
    return raw


@pytest.mark.parametrize(
    "raw,match",
    [
        ([1, 2], "must be a JSON object"),
        (_with(["text_config"], 5), "text_config must be an object"),
        (_with(["text_config", "quantization_config", "config_groups"], ["x"]), "config_groups must be an object"),
        (_with(["text_config", "hidden_size"], None), "hidden_size must be an integer"),
        (_with(["text_config", "hidden_size"], "abc"), "config.json: text_config.hidden_size must be an integer"),
        (_with(["text_config", "hidden_size"], "128"), "hidden_size must be an integer"),
        (_with(["text_config", "num_hidden_layers"], 3.5), "num_hidden_layers must be an integer"),
        (_with(["text_config", "max_position_embeddings"], -5), "max_position_embeddings must be an integer >= 1"),
        (_with(["text_config", "rope_scaling"], "yarn"), "rope_scaling must be an object"),
        (_with(["text_config", "rope_scaling"], {"type": "yarn"}), "rope_scaling has no 'factor'"),
        (_with(["text_config", "rope_scaling", "factor"], "x"), "rope_scaling.factor must be a finite number"),
        (_with(["text_config", "quantization_config"], "int4"), "quantization_config must be an object"),
        (_with(["text_config", "eos_token_id"], "x"), "eos_token_id must be an integer"),
        (_with(["text_config", "norm_topk_prob"], "yes"), "norm_topk_prob must be true or false"),
        (_with(["text_config", "rms_norm_eps"], float("nan")), "rms_norm_eps must be a finite number"),
    ],
    ids=[
        "list",
        "text_config-number",
        "config-groups-list",
        "null",
        "string",
        "numeric-string",
        "fraction",
        "negative",
        "rope-string",
        "rope-no-factor",
        "rope-factor-string",
        "quant-string",
        "eos-string",
        "bool-string",
        "nan",
    ],
)
def test_malformed_config_values_name_the_field(raw, match) -> None:
    """A wrong value or type in config.json is a ConfigError naming the field (it was an AttributeError, TypeError or
    KeyError traceback at start-up, a message without the field, or silently truncated: found by an operator-side
    tester); 61.0 layers (an integral float) is still 61."""
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict(raw)
    assert ModelConfig.from_dict(_with(["text_config", "num_hidden_layers"], 61.0)).num_hidden_layers == 61


def test_config_file_errors_name_the_folder_and_file(tmp_path) -> None:
    """from_dir's errors name the checkpoint folder (config.json's field errors) or the file (generation_config.json
    that is not JSON)."""
    (tmp_path / "config.json").write_text(json.dumps(_with(["text_config", "hidden_size"], "abc")))
    with pytest.raises(ConfigError, match=f"^{tmp_path}: config.json: text_config.hidden_size"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(load_preset("kimi-k2.6")))
    (tmp_path / "generation_config.json").write_text("{bad")
    with pytest.raises(ConfigError, match=r"generation_config\.json: not valid JSON"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ConfigError, match=f"^{tmp_path}: generation_config.json: eos_token_id must be an integer"):
        ModelConfig.from_dir(tmp_path)


def test_generation_config_max_new_tokens(tiny_dirs: dict[str, str]) -> None:
    """generation_config.json's max_new_tokens becomes ModelConfig.max_new_tokens; a bad value names the file."""
    cfg = ModelConfig.from_dir(tiny_dirs["k2.6"]).raw
    assert ModelConfig.from_dict(cfg, {"eos_token_id": 163586}).max_new_tokens is None
    assert ModelConfig.from_dict(cfg, {"max_new_tokens": 256}).max_new_tokens == 256
    for bad in (0, -1, "256", 1.5, True):
        with pytest.raises(ConfigError, match=r"generation_config\.json: max_new_tokens"):
            ModelConfig.from_dict(cfg, {"max_new_tokens": bad})
