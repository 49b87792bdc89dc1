"""kimi.kernels.tuning: every shipped table loads under the one schema, names its tuner (a tools/ script that
exists), and parses into its kernel's config type; the launch tables' values are the ones the kernels use; files off
the schema raise ValueError naming the table; `dump` writes what `load` reads."""

import json
import re
from pathlib import Path

import pytest

from kimi.backends.experts import humming as mb
from kimi.kernels import tuning
from kimi.kernels.cuda import moe_w4a16 as mc
from kimi.kernels.triton import bmm_small_m as bmm
from kimi.kernels.triton import linear_fp8 as lf
from kimi.kernels.triton import linear_small_m as lsm

try:  # the Triton kernels' modules import triton at module level
    from kimi.kernels.triton import fused
    from kimi.kernels.triton import mla_decode as mdt
    from kimi.kernels.triton import moe_w4a16 as mi
except ImportError:  # a CPU install without Triton
    fused = mdt = mi = None

REPO = Path(__file__).resolve().parents[2]
needs_triton = pytest.mark.skipif(fused is None, reason="Triton not installed")


def test_every_shipped_table_loads_and_names_its_tuner():
    assert sorted(p.name for p in tuning.DIR.glob("*.json")) == sorted(s.file for s in tuning.TABLES.values())
    for name, spec in tuning.TABLES.items():
        t = tuning.load(name, tuning.DIR / spec.file)
        assert t.gpu and t.date, name
        assert (t.launch and not t.entries) if spec.keys == "launch" else (t.entries and not t.launch), name
        assert t.tuner.startswith("python tools/"), (name, t.tuner)
        scripts = re.findall(r"tools/[\w/]+\.py", t.tuner)
        missing = [p for p in scripts if not (REPO / p).is_file()]
        assert scripts and not missing, (name, missing)


@needs_triton
def test_launch_tables_are_what_the_kernels_use():
    small = tuning.load("small_kernels", tuning.DIR / "small_kernels.json")
    assert tuning.launch_configs(small, fused.LAUNCH_FIELDS) == fused.LAUNCH
    assert tuning.launch_configs(small, mi.COMBINE_LAUNCH_FIELDS)["combine"] == mi.COMBINE_LAUNCH
    # every entry of the table is read by a kernel, and router_logits_large's row threshold is the entry's m_min
    assert {e.name for e in small.launch} == set(fused.LAUNCH_FIELDS) | set(mi.COMBINE_LAUNCH_FIELDS)
    large = next(e for e in small.launch if e.name == "router_logits_large")
    assert large.m_min is not None and fused.LAUNCH["router_logits_large"]["m_min"] == large.m_min
    (stage1,) = tuning.load("mla_decode", tuning.DIR / "mla_decode.json").launch
    assert mdt.DEFAULT_CONFIG == mdt.MLADecodeConfig(**stage1.config) == mdt.load_config()
    assert mdt.DEFAULT_CONFIG in mdt.CONFIGS  # the tuner picks among CONFIGS


@needs_triton
def test_launch_is_a_parameter_and_use_launch_swaps_the_default():
    warps = fused.LAUNCH["rmsnorm"]["warps"]
    other = fused.LAUNCH | {"rmsnorm": {"warps": 16}}
    assert fused._nw(4096, other) == 16
    assert fused._nw(4096) == (warps or 8) and fused.LAUNCH["rmsnorm"]["warps"] == warps  # the default untouched
    old = fused.use_launch(other)
    try:
        assert fused._nw(4096) == 16
    finally:
        assert fused.use_launch(old) == other
    assert old == fused.LAUNCH
    with pytest.raises(ValueError, match="use_launch"):
        fused.use_launch(fused.LAUNCH | {"rmsnorm": {"warps": 2, "block": 8}})
    with pytest.raises(ValueError, match="use_combine_launch"):
        mi.use_combine_launch({"block_n": 512})


def test_shipped_tables_parse_into_kernel_configs():
    for mod, name, cls in ((lsm, "linear_small_m", lsm.SmallMConfig), (lf, "linear_fp8", lf.Fp8Config)):
        parsed = mod.load_table(tuning.DIR / tuning.TABLES[name].file)
        assert parsed["entries"] and all(isinstance(c, cls) for c in parsed["entries"].values())
        assert all(b in lsm.M_BUCKETS for b, _, _ in parsed["entries"])
    b = tuning.by_bucket(tuning.load("bmm_small_m", tuning.DIR / "bmm_small_m.json"), bmm.BmmConfig)
    assert b["entries"] and all(isinstance(c, bmm.BmmConfig) for c in b["entries"].values())
    h = mb.load_humming_table(tuning.DIR / "humming.json")
    assert h["gpu"] == "NVIDIA H200" and h["entries"]
    for picks in mc.TABLE.values():
        assert picks[-1][0] is None  # the last range is unbounded
        assert all(c in mc.CONFIGS for _, c in picks)
    for n, k in mc.TABLE:
        assert mc.config_valid(mc.config_for(n, k, 10_000), n, k)


def test_off_schema_launch_tables_raise(tmp_path):
    head = {"gpu": "G", "date": "d", "tuner": "t"}
    bad = [
        [{"name": "a", "config": {"warps": "4"}}],  # a config value not an int
        [{"name": "a", "config": {"warps": True}}],
        [{"name": "a", "config": {}}, {"name": "a", "config": {}}],  # one name twice
        [{"name": "a", "m_min": 0, "config": {}}],
        [{"name": "a"}],  # no config
        [{"m": 1, "n": 1, "k": 1, "config": {}}],  # a GEMM entry
    ]
    for entries in bad:
        with pytest.raises(ValueError, match="bad small_kernels table"):
            tuning.load("small_kernels", _write(tmp_path, head | {"entries": entries}))
    with pytest.raises(ValueError, match="bad linear_small_m table"):  # a launch entry in a GEMM table
        tuning.load("linear_small_m", _write(tmp_path, head | {"entries": [{"name": "a", "config": {}}]}))
    t = tuning.load("small_kernels", _write(tmp_path, head | {"entries": [{"name": "a", "config": {"w": 1}}]}))
    with pytest.raises(ValueError, match="no entry 'b'"):
        tuning.launch_configs(t, {"b": ("w",)})
    with pytest.raises(ValueError, match="entry 'a': fields"):
        tuning.launch_configs(t, {"a": ("w", "m_min")})


def test_launch_dump_then_load(tmp_path):
    p = tmp_path / "t.json"
    configs = {"a": {"warps": None}, "b": {"m_min": 64, "bt": 16, "warps": 4}}
    tuning.dump(p, "GPU-A", "python tools/sweep_small_kernels.py --table-out T", tuning.launch_entries(configs))
    t = tuning.load("small_kernels", p)
    assert t.launch == (
        tuning.LaunchEntry(name="a", config={"warps": None}),
        tuning.LaunchEntry(name="b", config={"bt": 16, "warps": 4}, m_min=64),
    )
    assert tuning.launch_configs(t, {"a": ("warps",), "b": ("m_min", "bt", "warps")}) == configs


def _write(tmp_path, raw):
    p = tmp_path / "t.json"
    p.write_text(json.dumps(raw))
    return p


@pytest.mark.parametrize(
    "raw",
    [
        {"gpu": "G", "tuner": "t", "entries": []},  # no date
        {"gpu": "G", "date": "d", "entries": []},  # no tuner
        {"gpu": "G", "date": "d", "tuner": "t", "table": {}},  # the entries are a list
        {"gpu": "G", "date": "d", "tuner": "t", "entries": [{"n": 1, "k": 1, "m_min": 1, "config": {}}]},  # range
        {"gpu": "G", "date": "d", "tuner": "t", "entries": [{"m": 0, "n": 1, "k": 1, "config": {}}]},  # bucket 0
        {"gpu": "G", "date": "d", "tuner": "t", "entries": [{"m": 1, "n": 1, "k": 1}]},  # no config
        {"gpu": None, "date": "d", "tuner": "t", "entries": []},
    ],
)
def test_off_schema_raises(tmp_path, raw):
    with pytest.raises(ValueError, match="bad linear_small_m table"):
        tuning.load("linear_small_m", _write(tmp_path, raw))


def test_missing_or_disabled_is_empty(tmp_path, monkeypatch):
    assert tuning.load("humming", tmp_path / "none.json").gpu is None
    monkeypatch.setenv("KIMI_BMM_SMALL_M_TABLE", "off")
    assert tuning.path_of("bmm_small_m") is None and tuning.load("bmm_small_m").entries == ()
    monkeypatch.setenv("KIMI_BMM_SMALL_M_TABLE", str(tmp_path / "x.json"))
    assert tuning.path_of("bmm_small_m") == tmp_path / "x.json"


def test_dump_then_load(tmp_path):
    p = tmp_path / "t.json"
    entries = [{"m": 8, "n": 64, "k": 128, "config": {"block_n": 64}, "name": "kept"}]
    tuning.dump(p, "GPU-A", "python tools/bench_gemm.py --table-out T", entries, notes="n")
    t = tuning.load("linear_small_m", p)
    assert (t.gpu, t.tuner, t.notes) == ("GPU-A", "python tools/bench_gemm.py --table-out T", "n")
    assert t.entries == (tuning.TableEntry(n=64, k=128, config={"block_n": 64}, m=8),)
    assert json.loads(p.read_text())["entries"][0]["name"] == "kept"
    with pytest.raises(ValueError):
        tuning.dump(p, "GPU-A", "t", [{"m": 8, "n": "x", "k": 1, "config": {}}])
