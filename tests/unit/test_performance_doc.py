"""docs/performance.md's tables are the snapshots' (tools/performance_tables.py regenerates them): the committed page
matches benchmarks/snapshots/, and a changed or unshown snapshot is caught."""

import json
import shutil

from kimi.benchmarks import performance
from kimi.benchmarks.snapshot import DEFAULT_ROOT, load_all


def test_docs_performance_md_is_up_to_date_with_the_snapshots():
    problems = performance.check()
    assert not problems, "\n".join(problems)


def test_every_snapshot_is_valid_and_every_block_names_one_file():
    names = performance.blocks(performance.DOC.read_text())
    assert len(names) == len(set(names)) and "h200/decode_int4-ep8" in names
    for p in DEFAULT_ROOT.glob("*/*.json"):
        doc = json.loads(p.read_text())
        assert set(doc) == {"benchmark", "config", "command", "conditions", "summary", "results"}, p
        assert doc["command"].startswith("python tools/"), p


def test_a_changed_snapshot_or_one_without_a_block_is_reported(tmp_path):
    root = tmp_path / "snapshots"
    shutil.copytree(DEFAULT_ROOT, root)
    doc = tmp_path / "performance.md"
    doc.write_text(performance.DOC.read_text())
    assert performance.check(doc, root) == []
    snap = root / "h200" / "decode_int4-ep8.json"
    d = json.loads(snap.read_text())
    d["summary"]["rows"][0][4] = 99.99
    snap.write_text(json.dumps(d))
    assert any("out of date" in p for p in performance.check(doc, root))
    doc.write_text(performance.render(doc.read_text(), load_all(root)))
    assert "| 99.99 |" in doc.read_text() and performance.check(doc, root) == []
    (root / "cpu").mkdir(exist_ok=True)
    (root / "cpu" / "extra.json").write_text(snap.read_text())
    assert performance.check(doc, root) == [f"{root}/cpu/extra.json: no block of {doc} shows it"]
