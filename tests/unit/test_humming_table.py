"""The measured humming schedule table (kimi.backends.experts.humming.load_humming_table / humming_table_config): the
shipped file parses, ranges select the right entry, another GPU gets none, $KIMI_HUMMING_TABLE switches or disables it,
malformed files raise ValueError naming the file."""

import json

import pytest

from kimi.backends.experts import humming as mb
from kimi.kernels import tuning


def _write(tmp_path, entries, gpu="GPU-A"):
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"gpu": gpu, "date": "2026-01-01", "tuner": "test", "entries": entries}))
    return p


@pytest.fixture(autouse=True)
def _fresh_cache():
    previous = mb.use_humming_table(None)  # each test reads its table afresh
    yield
    mb.use_humming_table(previous)


def test_shipped_table_parses():
    t = mb.load_humming_table(tuning.DIR / "humming.json")
    assert t["gpu"] == "NVIDIA H200"
    for (n, k), v in t["entries"].items():
        assert n > 0 and k > 0
        for lo, hi, cfg, over in v:
            assert 1 <= lo <= hi and "block_shape" in cfg and isinstance(over, bool)


def test_ranges_and_gpu(tmp_path, monkeypatch):
    p = _write(
        tmp_path,
        [
            {"n": 10, "k": 20, "m_min": 1, "m_max": 64, "config": {"block_shape": [8, 1, 1]}},
            {"n": 10, "k": 20, "m_min": 161, "m_max": 256, "config": {"block_shape": [8, 2, 2]}},
        ],
    )
    monkeypatch.setenv("KIMI_HUMMING_TABLE", str(p))
    assert mb.humming_table_config(10, 20, 1, "GPU-A") == {"block_shape": [8, 1, 1]}
    assert mb.humming_table_config(10, 20, 64, "GPU-A") == {"block_shape": [8, 1, 1]}
    assert mb.humming_table_config(10, 20, 100, "GPU-A") is None  # between the ranges: heuristic
    assert mb.humming_table_config(10, 20, 256, "GPU-A") == {"block_shape": [8, 2, 2]}
    assert mb.humming_table_config(10, 20, 257, "GPU-A") is None
    assert mb.humming_table_config(10, 21, 64, "GPU-A") is None  # other shape
    assert mb.humming_table_config(10, 20, 64, "GPU-B") is None  # other GPU
    c = mb.humming_table_config(10, 20, 64, "GPU-A")
    c["block_shape"] = None  # a copy: the table is not changed through it
    assert mb.humming_table_config(10, 20, 64, "GPU-A") == {"block_shape": [8, 1, 1]}


def test_over_heuristic_entry(tmp_path, monkeypatch):
    """An over_heuristic entry replaces its fields in the heuristic schedule given; the rest are kept."""
    p = _write(
        tmp_path,
        [
            {
                "n": 10,
                "k": 20,
                "m_min": 100,
                "m_max": 300,
                "over_heuristic": True,
                "config": {"block_shape": [8, 512, 64], "num_ctas_per_sm": 2},
            },
        ],
    )
    monkeypatch.setenv("KIMI_HUMMING_TABLE", str(p))
    h = {"block_shape": [8, 128, 64], "num_ctas_per_sm": 4, "use_stream_k": True}
    c = mb.humming_table_config(10, 20, 256, "GPU-A", h)
    assert c == {"block_shape": [8, 512, 64], "num_ctas_per_sm": 2, "use_stream_k": True}
    c["block_shape"][1] = 0  # a copy: neither the table nor the heuristic is changed through it
    assert h["block_shape"] == [8, 128, 64]
    assert mb.humming_table_config(10, 20, 256, "GPU-A", h)["block_shape"] == [8, 512, 64]
    assert mb.humming_table_config(10, 20, 64, "GPU-A", h) is None  # outside the range: the caller's heuristic
    with pytest.raises(ValueError, match="heuristic"):
        mb.humming_table_config(10, 20, 256, "GPU-A")


def test_weight_and_e_local_scope(tmp_path, monkeypatch):
    """An entry applies only to its weight kind (int4 when not named) and, when it names e_local, to layers with that
    many local experts; the first entry in scope wins."""
    p = _write(
        tmp_path,
        [
            {
                "n": 10,
                "k": 20,
                "m_min": 1,
                "m_max": 300,
                "weight": "fp8",
                "e_local": 24,
                "config": {"block_shape": [16, 1, 1]},
            },
            {"n": 10, "k": 20, "m_min": 1, "m_max": 300, "weight": "fp8", "config": {"block_shape": [8, 2, 2]}},
            {"n": 10, "k": 20, "m_min": 1, "m_max": 300, "config": {"block_shape": [8, 3, 3]}},
        ],
    )
    monkeypatch.setenv("KIMI_HUMMING_TABLE", str(p))
    assert mb.humming_table_config(10, 20, 256, "GPU-A", weight="fp8", e_local=24) == {"block_shape": [16, 1, 1]}
    assert mb.humming_table_config(10, 20, 256, "GPU-A", weight="fp8", e_local=48) == {"block_shape": [8, 2, 2]}
    assert mb.humming_table_config(10, 20, 256, "GPU-A", weight="fp8") == {"block_shape": [8, 2, 2]}
    assert mb.humming_table_config(10, 20, 256, "GPU-A") == {"block_shape": [8, 3, 3]}  # int4
    assert mb.humming_table_config(10, 20, 256, "GPU-A", weight="int4", e_local=24) == {"block_shape": [8, 3, 3]}


def test_shipped_fp8_entry_is_scoped():
    """The shipped table's FP8 gate_up entry (measured at EP16) applies to FP8 layers with 24 local experts only; the
    INT4 entries are unchanged for INT4 layers."""
    mb.use_humming_table(mb.load_humming_table(tuning.DIR / "humming.json"))
    h = {"block_shape": [8, 128, 64], "mma_type": "wgmma", "num_ctas_per_sm": 4}
    fp8 = mb.humming_table_config(4096, 7168, 256, "NVIDIA H200", h, "fp8", 24)
    assert fp8["block_shape"] == [16, 256, 64] and fp8["mma_type"] == "mma"
    assert mb.humming_table_config(4096, 7168, 256, "NVIDIA H200", h, "fp8", 48) is None
    assert mb.humming_table_config(4096, 7168, 256, "NVIDIA H200", h)["block_shape"] == [8, 512, 64]


@pytest.mark.parametrize("value", ["", "off", "OFF"])
def test_env_off(value, monkeypatch):
    monkeypatch.setenv("KIMI_HUMMING_TABLE", value)
    assert mb.load_humming_table() == {"gpu": None, "entries": {}, "scope": {}}


def test_missing_file(tmp_path):
    assert mb.load_humming_table(tmp_path / "none.json")["entries"] == {}


@pytest.mark.parametrize(
    "entries",
    [
        [{"n": 1, "k": 1, "m_min": 5, "m_max": 4, "config": {}}],  # empty range
        [{"n": 1, "k": 1, "m_min": 0, "m_max": 4, "config": {}}],  # m_min < 1
        [{"n": 1, "k": 1, "m_max": 4, "config": {}}],  # no m_min
        [{"n": 1, "k": 1, "m_min": 1, "m_max": 4, "over_heuristic": "yes", "config": {}}],  # not a bool
        [{"n": 1, "k": 1, "m_min": 1, "m_max": 4, "weight": "int8", "config": {}}],  # unknown weight kind
        "not a list",
    ],
)
def test_malformed(tmp_path, entries):
    p = _write(tmp_path, entries)
    with pytest.raises(ValueError, match="bad humming table"):
        mb.load_humming_table(p)
