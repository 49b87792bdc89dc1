#!/usr/bin/env python
"""Regenerate the tables of docs/performance.md from the benchmark snapshots (benchmarks/snapshots/<device>/*.json).

Every block between `<!-- snapshot: <device>/<name> -->` and `<!-- end snapshot -->` is rewritten from that
snapshot's summary, conditions and command (kimi.benchmarks.performance); the text around the blocks is kept.
--check writes nothing and exits 1 when the document is out of date or a snapshot has no block (the CPU test
tests/unit/test_performance_doc.py runs the same check).

    python tools/performance_tables.py [--check] [--doc docs/performance.md] [--snapshots benchmarks/snapshots]
"""

import argparse
import sys
from pathlib import Path

from kimi.benchmarks.performance import DOC, check, render
from kimi.benchmarks.snapshot import DEFAULT_ROOT, HelpFormatter, load_all


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--doc", type=Path, default=DOC, help="the document to regenerate")
    ap.add_argument("--snapshots", type=Path, default=DEFAULT_ROOT, help="the snapshot root")
    ap.add_argument("--check", action="store_true", help="only check that the document is up to date")
    args = ap.parse_args(argv)
    if args.check:
        problems = check(args.doc, args.snapshots)
        for p in problems:
            print(p, file=sys.stderr)
        return 1 if problems else 0
    text = args.doc.read_text()
    new = render(text, load_all(args.snapshots))
    if new != text:
        args.doc.write_text(new)
        print(f"wrote {args.doc}")
    else:
        print(f"{args.doc} is up to date")
    for p in check(args.doc, args.snapshots):
        print(p, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
