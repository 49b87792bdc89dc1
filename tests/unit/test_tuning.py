"""kimi.kernels.tuning: every shipped table loads under the one schema, names its tuner, and parses into its kernel's
config type; files off the schema raise ValueError naming the table; `dump` writes what `load` reads."""

import json

import pytest

from kimi.backends.experts import humming as mb
from kimi.kernels import tuning
from kimi.kernels.cuda import moe_w4a16 as mc
from kimi.kernels.triton import bmm_small_m as bmm
from kimi.kernels.triton import linear_fp8 as lf
from kimi.kernels.triton import linear_small_m as lsm


def test_every_shipped_table_loads_and_names_its_tuner():
    assert sorted(p.name for p in tuning.DIR.glob("*.json")) == sorted(s.file for s in tuning.TABLES.values())
    for name, spec in tuning.TABLES.items():
        t = tuning.load(name, tuning.DIR / spec.file)
        assert t.gpu and t.date and t.entries, name
        assert t.tuner.startswith("python tools/"), (name, t.tuner)


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
