"""scripts/wheelhouse.sh's argument handling (no download: only --help and a bad option, which exit first)."""

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "wheelhouse.sh"


def test_help_prints_the_usage_and_creates_nothing(tmp_path):
    r = subprocess.run(["bash", str(SCRIPT), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "Usage: bash scripts/wheelhouse.sh [DIR]" in r.stdout
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_option_is_refused_before_anything_is_downloaded(tmp_path):
    r = subprocess.run(["bash", str(SCRIPT), "-x"], cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert "unknown option -x" in r.stderr
    assert list(tmp_path.iterdir()) == []
