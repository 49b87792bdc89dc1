"""kimi.envs: every environment variable kimi reads is declared there and read nowhere else, values are read when
asked (not cached at import), parsed as the code before them did, and a bad value is a ConfigError naming the
variable. docs/cli.md lists each declaration."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kimi import envs
from kimi.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
KIMI = REPO / "kimi"

# os.environ.get("X" / os.environ["X"] / os.getenv("X" / environ.get("X": a read of variable X
READ = re.compile(r"""(?:\benviron\s*(?:\.get\s*\(|\[)|\bgetenv\s*\()\s*(?P<q>["'])(?P<name>[A-Za-z_][A-Za-z0-9_]*)""")

# Modules that still read the environment themselves instead of through kimi.envs (none: the list may only shrink,
# and the test below fails for an entry whose file no longer reads).
NOT_YET_CONVERTED: set[str] = set()


def _reads(path: Path) -> list[str]:
    return [m["name"] for m in READ.finditer(path.read_text())]


def _modules() -> list[Path]:
    return sorted(p for p in KIMI.rglob("*.py") if p != KIMI / "envs.py")


def test_the_read_pattern_sees_each_form():
    """The checks below rely on the pattern: it matches every way of reading a variable and no write."""
    src = 'os.environ.get("KIMI_A")\nos.environ["KIMI_B"]\nos.getenv(\'KIMI_C\', "1")\nenviron.get("RANK")\n'
    assert [m["name"] for m in READ.finditer(src)] == ["KIMI_A", "KIMI_B", "KIMI_C", "RANK"]
    assert not list(READ.finditer('env = {**os.environ, envs.KIMI_X.name: "f"}\ndict(os.environ, KIMI_Y="1")'))


def test_no_module_reads_a_kimi_variable_outside_envs():
    found = {
        rel: names
        for p in _modules()
        if (rel := str(p.relative_to(REPO))) not in NOT_YET_CONVERTED
        and (names := [n for n in _reads(p) if n.startswith("KIMI_")])
    }
    assert not found, f"read these through kimi.envs: {found}"


def test_no_module_reads_any_variable_outside_envs():
    """The torchrun and Triton variables too (RANK, WORLD_SIZE, LOCAL_RANK, TRITON_INTERPRET, OPENAI_API_KEY)."""
    found = {
        str(p.relative_to(REPO)): names
        for p in _modules()
        if str(p.relative_to(REPO)) not in NOT_YET_CONVERTED and (names := _reads(p))
    }
    assert not found, f"read these through kimi.envs: {found}"


def test_the_not_yet_converted_list_only_names_modules_that_still_read():
    stale = sorted(f for f in NOT_YET_CONVERTED if not (REPO / f).is_file() or not _reads(REPO / f))
    assert not stale, f"converted or moved: remove from NOT_YET_CONVERTED: {stale}"


def test_every_variable_read_is_declared():
    """Each name read anywhere (the not-yet-converted modules, tools, tests) and each KIMI_* name the code and docs
    mention is a declaration of kimi.envs."""
    declared = {v.name for v in envs.VARIABLES}
    read: set[str] = set()
    for f in NOT_YET_CONVERTED:
        read.update(_reads(REPO / f))
    mentioned: set[str] = set()
    for root in ("kimi", "tools", "tests", "scripts", "docs"):
        for p in (REPO / root).rglob("*"):
            if p.suffix in (".py", ".sh", ".md") and p != Path(__file__):
                text = p.read_text()
                mentioned.update(re.findall(r"\bKIMI_[A-Z0-9_]*[A-Z0-9]\b", text))
                if p.suffix == ".py" and root != "tests":
                    read.update(_reads(p))
    assert not (read - declared), f"read but not declared in kimi.envs: {sorted(read - declared)}"
    assert not (mentioned - declared), f"mentioned but not declared in kimi.envs: {sorted(mentioned - declared)}"


def test_declarations_are_unique_and_documented():
    names = [v.name for v in envs.VARIABLES]
    assert len(names) == len(set(names))
    for v in envs.VARIABLES:
        assert getattr(envs, v.name) is v, v.name  # each declaration is the module attribute of its own name
        assert v.doc and v.reader, v.name
    cli = (REPO / "docs" / "cli.md").read_text()
    missing = [n for n in names if f"`{n}`" not in cli]
    assert not missing, f"docs/cli.md does not list {missing}"


def test_get_reads_the_environment_at_each_call(monkeypatch):
    monkeypatch.delenv("KIMI_FAKE_STEP_MS", raising=False)
    assert envs.KIMI_FAKE_STEP_MS.get() == 0.0 and not envs.KIMI_FAKE_STEP_MS.is_set()
    monkeypatch.setenv("KIMI_FAKE_STEP_MS", "3")
    assert envs.KIMI_FAKE_STEP_MS.get() == 3.0 and envs.KIMI_FAKE_STEP_MS.is_set()
    monkeypatch.setenv("KIMI_FAKE_STEP_MS", "4")
    assert envs.KIMI_FAKE_STEP_MS.get() == 4.0


@pytest.mark.parametrize(
    "var,raw,value",
    [
        (envs.TRITON_INTERPRET, "1", True),
        (envs.TRITON_INTERPRET, "yes", False),  # off-by-default switches: only "1" turns them on
        (envs.KIMI_API_KEY, "", None),
        (envs.KIMI_API_KEY, "k", "k"),
        (envs.KIMI_TOKENIZER_DIR, "", None),
        (envs.KIMI_HUMMING_TABLE, "", ""),  # "" (humming's heuristic only) differs from unset (the shipped table)
        (envs.KIMI_FAKE_STEP_MS, "", 0.0),
        (envs.KIMI_FAKE_STEP_MS, "2.5", 2.5),
        (envs.RANK, "3", 3),
    ],
)
def test_values_parse_as_before(monkeypatch, var, raw, value):
    monkeypatch.setenv(var.name, raw)
    assert var.get() == value


@pytest.mark.parametrize(
    "var,raw,want",
    [
        (envs.WORLD_SIZE, "two", "WORLD_SIZE='two': want an int"),
        (envs.KIMI_FAKE_TOKEN_US, "fast", "KIMI_FAKE_TOKEN_US='fast': want number"),
        (envs.KIMI_LONG_CTX, "1e3", "KIMI_LONG_CTX='1e3': want an int"),
    ],
)
def test_a_bad_value_is_a_config_error_naming_the_variable(monkeypatch, var, raw, want):
    monkeypatch.setenv(var.name, raw)
    with pytest.raises(ConfigError) as e:
        var.get()
    assert str(e.value) == want
    assert isinstance(e.value, ValueError)


def test_require(monkeypatch):
    monkeypatch.delenv("KIMI_SMALL_KERNELS_TABLE_ALT", raising=False)
    with pytest.raises(ConfigError, match=r"^\$KIMI_SMALL_KERNELS_TABLE_ALT is not set: small_kernels launch table"):
        envs.KIMI_SMALL_KERNELS_TABLE_ALT.require()
    monkeypatch.setenv("KIMI_SMALL_KERNELS_TABLE_ALT", "/tmp/small_kernels.json")
    assert envs.KIMI_SMALL_KERNELS_TABLE_ALT.require() == "/tmp/small_kernels.json"


def test_csrc_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("KIMI_CSRC_CACHE", str(tmp_path))
    assert envs.csrc_cache_dir() == tmp_path
    monkeypatch.delenv("KIMI_CSRC_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert envs.csrc_cache_dir() == tmp_path / "home" / ".cache" / "kimi" / "csrc"


def test_a_spawned_process_reads_its_own_environment(tmp_path):
    """What kimi serve relies on for its workers: a child started with a variable set reads it through envs."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "KIMI_FAKE_STEP_MS": "7", "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", "from kimi import envs; print(envs.KIMI_FAKE_STEP_MS.get())"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "7.0"
