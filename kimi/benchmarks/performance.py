"""docs/performance.md's tables, rendered from the benchmark snapshots (kimi.benchmarks.snapshot).

The document holds marked blocks, each naming one snapshot:

    <!-- snapshot: h200/decode_int4-ep8 -->
    ...generated: the snapshot's summary table, its notes, conditions and command...
    <!-- end snapshot -->

`render(text, snapshots)` regenerates every block from `snapshots` ({"<device>/<name>": snapshot}, as
snapshot.load_all reads benchmarks/snapshots/) and leaves the rest of the text as written. A block whose snapshot is
missing says so. tools/performance_tables.py writes the result (or, with --check, fails when the document is out of
date); a CPU test runs the check. This module imports neither torch nor a GPU package.
"""

from __future__ import annotations

import re
from pathlib import Path

from kimi.benchmarks.snapshot import DEFAULT_ROOT, REPO, load_all

DOC = REPO / "docs" / "performance.md"
BLOCK = re.compile(r"(<!-- snapshot: (?P<name>[A-Za-z0-9._/-]+) -->\n)(?P<body>.*?)(<!-- end snapshot -->)", re.S)


def cell(v: object) -> str:
    """A table cell: "–" for None, floats without a trailing .0 (6 significant digits at most), '|' escaped."""
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v).replace("|", "\\|")


def table(columns: list[str], rows: list[list]) -> str:
    """A Markdown table."""
    out = ["| " + " | ".join(cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(out)


def conditions_line(c: dict) -> str:
    """One sentence of a snapshot's conditions: device, driver, versions, commit, date, and the clocks or copy
    bandwidth where the benchmark recorded them; a converted snapshot says where it came from."""
    parts = []
    if c.get("gpu"):
        parts.append(c["gpu"] + (f" (driver {c['driver']})" if c.get("driver") else ""))
        if c.get("power_limit_W"):
            parts.append(f"power limit {c['power_limit_W']:.0f} W")
    else:
        parts.append(f"CPU only ({c.get('host', 'host not recorded')})")
    versions = [f"{k} {c[k]}" for k in ("torch", "triton", "flashinfer", "humming") if c.get(k)]
    if c.get("cuda"):
        versions.append(f"CUDA {c['cuda']}")
    if c.get("python"):
        versions.append(f"Python {c['python']}")
    parts.append(", ".join(versions))
    clocks = c.get("sm_clock_MHz_during_graph_timing")
    if clocks:
        med = [f"{k} sequences {v['median']:.0f} MHz" for k, v in clocks.items() if v]
        if med:
            parts.append("SM clock during the graph timings (median): " + ", ".join(med))
    if c.get("copy_GBps"):
        parts.append(f"copy bandwidth {c['copy_GBps']:.0f} GB/s")
    if c.get("server"):
        parts.append(f"server: `{c['server']}`")
    commit = c.get("commit")
    parts.append(f"commit {commit[:12]}{'-dirty' if commit.endswith('-dirty') else ''}" if commit else "commit unknown")
    parts.append(c.get("date", "date unknown"))
    if c.get("source"):
        parts.append(c["source"])
    return "; ".join(p for p in parts if p) + "."


def render_block(name: str, snap: dict | None) -> str:
    """The generated body of one block (ending in a newline)."""
    if snap is None:
        return (
            f"_No snapshot yet (benchmarks/snapshots/{name}.json): docs/benchmarks.md, "
            '"Snapshots", says which script makes it._\n'
        )
    s = snap["summary"]
    out = [table(s["columns"], s["rows"]), ""]
    out += [f"- {n}" for n in s.get("notes", [])]
    out.append(f"- Conditions: {conditions_line(snap['conditions'])}")
    out.append(f"- Command: `{snap['command']}`")
    return "\n".join(out) + "\n"


def render(text: str, snapshots: dict[str, dict]) -> str:
    """`text` with every marked block regenerated from `snapshots`."""
    return BLOCK.sub(lambda m: m.group(1) + render_block(m["name"], snapshots.get(m["name"])) + m.group(4), text)


def blocks(text: str) -> list[str]:
    """The snapshot names the document's blocks refer to, in order."""
    return [m["name"] for m in BLOCK.finditer(text)]


def check(doc: Path = DOC, root: Path = DEFAULT_ROOT) -> list[str]:
    """What keeps the document from matching the snapshots: [] when it is up to date; else one line each for a
    block out of date and a snapshot no block shows."""
    text = doc.read_text()
    snaps = load_all(root)
    problems = []
    if render(text, snaps) != text:
        problems.append(f"{doc}: out of date with {root} (run python tools/performance_tables.py)")
    shown = set(blocks(text))
    problems += [f"{root}/{n}.json: no block of {doc} shows it" for n in sorted(set(snaps) - shown)]
    return problems
