"""Command line: `kimi serve ...` (see `kimi serve --help`), `kimi warmup ...` (the same flags: start, warm up, stop),
`kimi --version`. The tiny test checkpoint is made by
`tools/make_tiny_checkpoint.py OUT` (`make tiny`)."""

from __future__ import annotations

import argparse
import signal
import sys
from types import FrameType


def _stop_during_start_up(signum: int, frame: FrameType | None) -> None:
    """SIGINT / SIGTERM / SIGHUP before the server's own handlers are installed (imports, flag checks, the model's
    config and tokenizer, binding the sockets; no worker has been started yet): one line and exit 0, as a stop signal
    later gives, instead of a KeyboardInterrupt traceback or death by the signal (exit 128 + N)."""
    print(f"kimi serve: stopped by {signal.Signals(signum).name} during start-up", file=sys.stderr, flush=True)
    raise SystemExit(0)


def _install_start_up_signal_handlers() -> None:
    """`_stop_during_start_up` for SIGINT, SIGTERM and SIGHUP (SIGHUP left alone when ignored, as under `nohup`). The
    server's event loop replaces them with its own (kimi.server.serve) before any worker is launched."""
    hup = () if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN else (signal.SIGHUP,)
    for sig in (signal.SIGINT, signal.SIGTERM, *hup):
        signal.signal(sig, _stop_during_start_up)


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the command line (`kimi serve` / `python -m kimi`), not a call from Python code
        _install_start_up_signal_handlers()
    from kimi import __version__
    from kimi.server import HelpFormatter, ServeArgs, add_serve_args, check_serve_args

    p = argparse.ArgumentParser(prog="kimi", description="Inference server for the Kimi-K2 family")
    p.add_argument("--version", action="version", version=f"kimi {__version__}")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    serve_p = sub.add_parser(
        "serve",
        help="serve a checkpoint over OpenAI-compatible HTTP and ZeroMQ",
        description="Serve a Kimi-K2 checkpoint over OpenAI-compatible HTTP and the ZeroMQ API (docs/cli.md).",
        formatter_class=HelpFormatter,
    )
    add_serve_args(serve_p)
    warmup_p = sub.add_parser(
        "warmup",
        help="start as `kimi serve` would, warm up (filling the kernel cache, --cache-dir), and exit: for image builds",
        description="Run `kimi serve`'s start-up and warm-up with the same flags, then stop: every kernel a server "
        "with these flags launches is compiled into --cache-dir, so a server started later on this machine (or from "
        "an image holding that folder) reuses them (docs/cli.md). It binds the same HTTP and ZeroMQ ports as the "
        "server would (pass free ones with --port / --zmq-submit-addr when a server runs). Exit status 0 once every "
        "rank has warmed up, 1 when stopped or failed before that.",
        formatter_class=HelpFormatter,
    )
    add_serve_args(warmup_p)
    for action in warmup_p._actions:  # the one serve flag kimi warmup refuses
        if action.dest == "skip_warmup":
            action.help = argparse.SUPPRESS
    args = p.parse_args(argv)  # exits 2 naming the flag on a value no server can run with
    if args.cmd is None:  # bare `kimi`: what it can do, not an argparse error
        p.print_help()
        return 0
    if args.cmd in ("serve", "warmup"):
        from kimi.server import run

        a = ServeArgs(**{k: v for k, v in vars(args).items() if k != "cmd"}, warmup_only=args.cmd == "warmup")
        err = check_serve_args(a)  # the checks that involve two flags
        if err is not None:
            (serve_p if args.cmd == "serve" else warmup_p).error(err)
        if a.warmup_only and a.skip_warmup:
            warmup_p.error("--skip-warmup: kimi warmup exists to run the warm-up")
        return run(a)
    return 2


if __name__ == "__main__":
    sys.exit(main())
