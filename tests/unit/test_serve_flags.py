"""`kimi serve` flag validation: every numeric flag is range-checked at parse time (exit 2, the flag named),
before anything is loaded or launched; the same checks guard programmatic callers of `serve`."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from kimi import cli
from kimi.server import NUMERIC_LIMITS, ServeArgs, add_serve_args, check_serve_args, cuda_only_flags_set, serve

BAD = [
    ("--port", "99999"),
    ("--port", "0"),
    ("--port", "-1"),
    ("--port", "http"),
    ("--nproc", "0"),
    ("--block-size", "0"),
    ("--block-size", "-16"),
    ("--num-blocks", "0"),
    ("--num-blocks", "1"),
    ("--kv-cache-memory-gib", "0"),
    ("--kv-cache-memory-gib", "inf"),
    ("--gpu-memory-utilization", "0"),
    ("--gpu-memory-utilization", "1.5"),
    ("--gpu-memory-utilization", "nan"),
    ("--max-model-len", "0"),
    ("--max-num-seqs", "0"),
    ("--token-budget", "0"),
    ("--num-hidden-layers", "0"),
    ("--worker-timeout", "0"),
    ("--worker-timeout", "-5"),
    ("--max-waiting", "0"),
    ("--max-body-bytes", "0"),
    ("--request-body-timeout", "0"),
    ("--request-header-timeout", "0"),
    ("--request-header-timeout", "inf"),
    ("--heartbeat-timeout", "-1"),
    ("--heartbeat-timeout", "nan"),
    ("--heartbeat-timeout", "0.001"),
    ("--heartbeat-timeout", "1.9"),
    ("--startup-timeout", "0"),
    ("--startup-timeout", "-1"),
    ("--emulate-ep-size", "0"),
]


@pytest.mark.parametrize("flag,value", BAD)
def test_bad_numeric_flag_exits_2_naming_the_flag(flag, value, capsys, monkeypatch):
    # nothing may be loaded or launched: `run` must never be reached
    monkeypatch.setattr("kimi.server.run", lambda a: pytest.fail("run() reached with a bad flag"))
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--model", "/nonexistent", flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}:" in err, err


def test_every_numeric_serve_flag_is_checked():
    """A numeric flag added later without a range check fails here."""
    p = argparse.ArgumentParser()
    add_serve_args(p)
    numeric = {a.dest for a in p._actions if a.type is not None and a.type.__name__ in ("int", "float")}
    assert numeric == set(NUMERIC_LIMITS)
    assert {f.lstrip("-").replace("-", "_") for f, _ in BAD} == set(NUMERIC_LIMITS)


def test_port_65535_needs_a_zmq_submit_addr(capsys, monkeypatch):
    monkeypatch.setattr("kimi.server.run", lambda a: pytest.fail("run() reached with a bad flag"))
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--model", "/nonexistent", "--port", "65535"])
    assert e.value.code == 2 and "--port 65535" in capsys.readouterr().err
    monkeypatch.setattr("kimi.server.run", lambda a: 0)
    assert cli.main(["serve", "--model", "/x", "--port", "65535", "--zmq-submit-addr", "tcp://127.0.0.1:7000"]) == 0


@pytest.mark.parametrize("value", ["1", "0.5", "1e3"])
def test_good_values_pass(value, monkeypatch):
    seen = []
    monkeypatch.setattr("kimi.server.run", lambda a: seen.append(a) or 0)
    assert (
        cli.main(
            [
                "serve",
                "--model",
                "/x",
                "--kv-cache-memory-gib",
                value,
                "--heartbeat-timeout",
                "0",
                "--gpu-memory-utilization",
                "1",
                "--block-size",
                "48",
                "--num-blocks",
                "2",
            ]
        )
        == 0
    )
    assert seen[0].kv_cache_memory_gib == float(value) and seen[0].block_size == 48 and seen[0].heartbeat_timeout == 0


def test_programmatic_serve_rejects_bad_args():
    assert check_serve_args(ServeArgs(model="/x")) is None
    assert "--max-num-seqs" in check_serve_args(ServeArgs(model="/x", max_num_seqs=0))
    assert "--max-model-len" in check_serve_args(ServeArgs(model="/x", max_model_len=0))
    assert "--emulate-ep-size" in check_serve_args(ServeArgs(model="/x", emulate_ep_size=0))
    emulated = dict(model="preset:kimi-k2.6", device="cuda", emulate_ep_size=8)
    assert check_serve_args(ServeArgs(**emulated, load_format="dummy")) is None
    assert "--emulate-ep-size" in check_serve_args(ServeArgs(**emulated))  # a real checkpoint: outputs would be wrong
    assert "--emulate-ep-size" in check_serve_args(ServeArgs(**emulated, load_format="dummy", nproc=2))
    assert asyncio.run(serve(ServeArgs(model="/nonexistent", token_budget=0))) == 2


@pytest.mark.parametrize("value", ["", "   "])
def test_empty_served_model_name_exits_2(value, capsys, monkeypatch):
    monkeypatch.setattr("kimi.server.run", lambda a: pytest.fail("run() reached with a bad flag"))
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--model", "/nonexistent", "--served-model-name", value])
    assert e.value.code == 2 and "--served-model-name" in capsys.readouterr().err
    assert "--served-model-name" in check_serve_args(ServeArgs(model="/x", served_model_name=value))
    assert check_serve_args(ServeArgs(model="/x", served_model_name="kimi")) is None


def test_cuda_only_flags_are_named_when_the_device_is_cpu():
    assert cuda_only_flags_set(ServeArgs(model="/x")) == []
    assert cuda_only_flags_set(ServeArgs(model="/x", device="cuda", moe_backend="cuda", enforce_eager=True)) == []
    assert cuda_only_flags_set(ServeArgs(model="/x", moe_backend="cuda", enforce_eager=True)) == [
        "--moe-backend",
        "--enforce-eager",
    ]
    assert cuda_only_flags_set(ServeArgs(model="/x", fp8_dense="triton")) == ["--fp8-dense"]
    assert cuda_only_flags_set(ServeArgs(model="/x", emulate_ep_size=8)) == ["--emulate-ep-size"]


def test_fp8_dense_reaches_the_worker():
    """`kimi serve --fp8-dense triton --device cuda` puts the flag on the worker command line, which the worker's
    parser reads back (default off); a bad value is refused by argparse."""
    from kimi.config import WorkerConfig
    from kimi.server import worker_command

    parse_args = WorkerConfig.from_argv

    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert p.parse_args(["--model", "/x"]).fp8_dense == "off"
    with pytest.raises(SystemExit):
        p.parse_args(["--model", "/x", "--fp8-dense", "on"])
    cmd = worker_command(ServeArgs(model="/x", device="cuda", fp8_dense="triton"), "tcp://a", "tcp://b")
    worker_argv = cmd[cmd.index("kimi.worker.main") + 1 :]
    assert parse_args(worker_argv).fp8_dense == "triton"
    cmd = worker_command(ServeArgs(model="/x"), "tcp://a", "tcp://b")
    assert parse_args(cmd[cmd.index("kimi.worker.main") + 1 :]).fp8_dense == "off"


@pytest.mark.parametrize("level", ["warning", "trace", "info"])
def test_log_level_reaches_the_worker(level):
    """`kimi serve --log-level L` puts L on the worker command line, which the worker's parser reads back."""
    from kimi.config import WorkerConfig
    from kimi.server import worker_command

    parse_args = WorkerConfig.from_argv

    cmd = worker_command(ServeArgs(model="/x", log_level=level), "tcp://a", "tcp://b")
    assert parse_args(cmd[cmd.index("kimi.worker.main") + 1 :]).log_level == level


def test_heartbeat_timeout_is_off_or_spans_two_pings(capsys, monkeypatch):
    """Below two ping intervals a healthy rank would be declared dead (the server used to start, then exit 1 a few
    seconds later): refused at parse time with the reason; 0 (off) and 2 s start."""
    monkeypatch.setattr("kimi.server.run", lambda a: pytest.fail("run() reached with a bad flag"))
    with pytest.raises(SystemExit):
        cli.main(["serve", "--model", "/x", "--heartbeat-timeout", "0.9"])
    err = capsys.readouterr().err
    assert "argument --heartbeat-timeout: must be 0 (off) or at least 2 s" in err and "got 0.9" in err, err
    seen = []
    monkeypatch.setattr("kimi.server.run", lambda a: seen.append(a) or 0)
    for v in ("0", "2", "2.5"):
        assert cli.main(["serve", "--model", "/x", "--heartbeat-timeout", v]) == 0
    assert [a.heartbeat_timeout for a in seen] == [0.0, 2.0, 2.5]
    assert seen[0].startup_timeout == 3600.0 and seen[0].worker_timeout == 600.0
    assert "--heartbeat-timeout" in check_serve_args(ServeArgs(model="/x", heartbeat_timeout=1.0))


def test_version_and_bare_kimi(capsys):
    """`kimi --version` prints the installed version; bare `kimi` prints the commands (exit 0), not an error."""
    from kimi import __version__

    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"kimi {__version__}"
    assert __version__ != "0.0.0+unknown"  # the test venv installs the package
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert "usage: kimi" in out and "serve" in out and "required" not in out


def test_every_serve_flag_has_help_and_shows_its_default():
    """Each flag of `kimi serve --help` says what it does, and its default where the default is a value."""
    from kimi.server import HelpFormatter

    p = argparse.ArgumentParser(prog="kimi serve", formatter_class=HelpFormatter)
    add_serve_args(p)
    text = p.format_help()
    for action in p._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{action.option_strings[0]} has no help text"
        shown = HelpFormatter("kimi serve")._get_help_string(action) or ""
        if action.default not in (None, False) and not action.required:
            assert "default" in shown, f"{action.option_strings[0]}: its default {action.default!r} is not shown"
    assert "(default: 8000)" in text and "(default: 0.9)" in text and "(default: cpu)" in text


def test_eos_token_ids_hold_only_ids():
    """The request-ending ids are the checkpoint's EOS ids plus `<|im_end|>` when the vocabulary has one; a
    vocabulary without it adds nothing (a None in the set made min_tokens' sorted block list raise TypeError)."""
    from types import SimpleNamespace

    from kimi.controller.params import SamplingFields, generation_params
    from kimi.server import eos_token_ids
    from kimi.tokenizer import KimiTokenizer

    ranks = {bytes([i]): i for i in range(256)}
    cfg = SimpleNamespace(eos_token_ids=(163585,))
    with_im_end = KimiTokenizer(ranks, {163586: ("<|im_end|>", True)})
    without = KimiTokenizer(ranks, {})
    assert without.im_end_id is None
    assert eos_token_ids(cfg, with_im_end) == frozenset({163585, 163586})
    eos = eos_token_ids(cfg, without)
    assert eos == frozenset({163585})
    sampling, _ = generation_params(
        SamplingFields(1.0, 1.0, 0, 0.0, 0.0, 0.0, 1.0, None),
        logprobs=None,
        prompt_logprobs=-1,
        logit_bias_ids=[],
        logit_bias_values=[],
        stop=(),
        include_stop_str_in_output=False,
        stop_token_ids=[7],
        ignore_eos=False,
        max_tokens=8,
        min_tokens=2,
        eos_token_ids=eos,
    )
    assert sampling.min_tokens_block_ids == [7, 163585]
