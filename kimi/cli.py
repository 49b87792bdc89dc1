"""Command line: `kimi serve ...` (see `kimi serve --help`). The tiny test checkpoint is made by
`tools/make_tiny_checkpoint.py OUT` (`make tiny`)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kimi", description="Inference server for the Kimi-K2 family")
    sub = p.add_subparsers(dest="cmd", required=True)
    from kimi.server import ServeArgs, add_serve_args, check_serve_args

    serve_p = sub.add_parser("serve", help="serve a checkpoint over OpenAI-compatible HTTP and ZeroMQ")
    add_serve_args(serve_p)
    args = p.parse_args(argv)  # exits 2 naming the flag on a value no server can run with
    if args.cmd == "serve":
        from kimi.server import run

        a = ServeArgs(**{k: v for k, v in vars(args).items() if k != "cmd"})
        err = check_serve_args(a)  # the checks that involve two flags
        if err is not None:
            serve_p.error(err)
        return run(a)
    return 2


if __name__ == "__main__":
    sys.exit(main())
