"""Command line: `kimi serve ...` (see `kimi serve --help`) and `kimi make-tiny-checkpoint OUT`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kimi", description="Inference server for the Kimi-K2 family")
    sub = p.add_subparsers(dest="cmd", required=True)
    from kimi.server import ServeArgs, add_serve_args

    add_serve_args(sub.add_parser("serve", help="serve a checkpoint over OpenAI-compatible HTTP and ZeroMQ"))
    args = p.parse_args(argv)
    if args.cmd == "serve":
        from kimi.server import run

        d = {k: v for k, v in vars(args).items() if k != "cmd"}
        return run(ServeArgs(**d))
    return 2


if __name__ == "__main__":
    sys.exit(main())
