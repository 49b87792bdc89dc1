"""kimi.errors: one base class for kimi's exceptions, each subclass still the builtin it replaced (callers'
`except ValueError` / `except RuntimeError` keep working), the old public names are the same classes, the
structured fields a caller needs are set, and no bare RuntimeError is raised outside the modules the ops refactor
converts. Also kimi.log's rank-0 helper and that loggers are named by module."""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path

import pytest

from kimi import errors, protocol
from kimi.config import CacheConfig, SchedulerConfig

REPO = Path(__file__).resolve().parents[2]

# Modules that still raise bare RuntimeErrors (none; the stale check below fails for an entry without one).
RUNTIME_ERRORS_NOT_YET_CONVERTED: set[str] = set()
BARE = re.compile(r"\braise RuntimeError\(")


@pytest.mark.parametrize(
    "cls,builtin",
    [
        (errors.ConfigError, ValueError),
        (errors.CheckpointError, ValueError),
        (errors.KVCacheSizeError, ValueError),
        (errors.AdmissionError, ValueError),
        (errors.QueueFullError, ValueError),
        (errors.EngineDeadError, RuntimeError),
        (errors.WorkerFailedError, RuntimeError),
        (errors.PeerFailure, RuntimeError),
        (errors.ProtocolError, RuntimeError),
    ],
)
def test_each_error_is_a_kimi_error_and_its_builtin(cls, builtin):
    assert issubclass(cls, errors.KimiError) and issubclass(cls, builtin)


def test_old_names_are_the_same_classes():
    from kimi import checkpoint, config
    from kimi.backends import all_to_all
    from kimi.controller import admission, engine
    from kimi.worker import kv_cache

    assert config.ConfigError is errors.ConfigError
    assert checkpoint.CheckpointError is errors.CheckpointError
    assert kv_cache.KVCacheSizeError is errors.KVCacheSizeError
    assert admission.AdmissionError is engine.AdmissionError is errors.AdmissionError
    assert admission.QueueFull is engine.QueueFull is errors.QueueFullError
    assert engine.EngineDead is errors.EngineDeadError
    assert all_to_all.PeerFailure is errors.PeerFailure is errors.PeerFailureError
    # a rank reports `<class name>: <message>`; docs/multinode.md quotes "PeerFailure: all-to-all ..."
    assert errors.PeerFailure.__name__ == "PeerFailure"


def test_module_errors_are_kimi_errors():
    from kimi import client
    from kimi.controller.block_pool import NoFreeBlocks
    from kimi.controller.validation import BadRequest
    from kimi.structured_output.backend import GrammarError

    assert issubclass(BadRequest, errors.KimiError)
    assert issubclass(GrammarError, errors.KimiError) and issubclass(GrammarError, ValueError)
    assert issubclass(NoFreeBlocks, errors.KimiError) and issubclass(NoFreeBlocks, RuntimeError)
    # kimi.client.KimiError (what its users catch) is the base class; what the client raises is a RuntimeError too
    assert client.KimiError is errors.KimiError
    assert issubclass(client.ClientError, errors.KimiError) and issubclass(client.ClientError, RuntimeError)


def test_admission_error_message_and_fields():
    e = errors.QueueFullError(errors.AdmissionReason.QUEUE_FULL, None, limit=8)
    assert str(e) == "the server's waiting queue is full (8 requests); retry later"
    assert (e.reason, e.limit, e.retry_after_s) == (errors.AdmissionReason.QUEUE_FULL, 8, 1)


def test_worker_failed_error_fields():
    one = errors.WorkerFailedError("worker rank 1 failed: x", ranks=(1,), step=7)
    assert (str(one), one.ranks, one.rank, one.step) == ("worker rank 1 failed: x", (1,), 1, 7)
    many = errors.WorkerFailedError("silent", ranks=(0, 2))
    assert (many.rank, many.step) == (None, None)


def test_no_bare_runtime_error_outside_the_not_yet_converted_modules():
    found = sorted(
        str(p.relative_to(REPO))
        for p in (REPO / "kimi").rglob("*.py")
        if str(p.relative_to(REPO)) not in RUNTIME_ERRORS_NOT_YET_CONVERTED and BARE.search(p.read_text())
    )
    assert not found, f"raise a kimi.errors class instead of RuntimeError in {found}"
    stale = sorted(
        f
        for f in RUNTIME_ERRORS_NOT_YET_CONVERTED
        if not (REPO / f).is_file() or not BARE.search((REPO / f).read_text())
    )
    assert not stale, f"converted or moved: remove from RUNTIME_ERRORS_NOT_YET_CONVERTED: {stale}"


def test_loggers_are_named_by_module():
    """No hand-written logger name: every logger is named by its module."""
    hand = re.compile(r"""getLogger\(\s*["']kimi""")
    left: set[str] = set()

    found = sorted(
        str(p.relative_to(REPO))
        for p in (REPO / "kimi").rglob("*.py")
        if str(p.relative_to(REPO)) not in left and hand.search(p.read_text())
    )
    assert not found, found


def test_rank0_info(caplog, monkeypatch):
    from kimi.log import is_rank0, rank0_info

    log = logging.getLogger("kimi.test_rank0")
    with caplog.at_level(logging.INFO, logger="kimi.test_rank0"):
        rank0_info(log, "on rank %d", 0, rank=0)
        rank0_info(log, "on rank %d", 1, rank=1)
        monkeypatch.setenv("RANK", "2")
        rank0_info(log, "from $RANK")
        monkeypatch.setenv("RANK", "0")
        rank0_info(log, "from $RANK %s", "zero")
    assert [r.getMessage() for r in caplog.records] == ["on rank 0", "from $RANK zero"]
    assert all(r.filename == "test_errors.py" for r in caplog.records)  # the caller's line, not kimi/log.py
    monkeypatch.delenv("RANK")
    assert is_rank0()


class _Transport:
    """ControllerTransport stand-in for Engine.start: answers the first Ping with the given messages."""

    def __init__(self, replies: list[object]) -> None:
        self.replies = replies

    async def send(self, msg: object) -> None:
        pass

    async def recv(self) -> object:
        if self.replies:
            return self.replies.pop(0)
        await asyncio.sleep(3600)


def _engine(tmp_path, replies):
    from kimi.controller.engine import Engine
    from kimi.tokenizer import KimiTokenizer, write_tokenizer_files

    write_tokenizer_files(tmp_path)
    return Engine(
        KimiTokenizer.from_dir(tmp_path),
        frozenset({1}),
        SchedulerConfig(max_num_seqs=4, token_budget=64, max_model_len=256),
        CacheConfig(block_size=16, num_blocks=8),
        _Transport(replies),
        vocab_size=163840,
    )


def test_engine_start_raises_worker_failed_with_the_rank(tmp_path):
    engine = _engine(tmp_path, [protocol.Ready(0, 2, 8, 16, "cpu"), protocol.WorkerError(1, "boom")])
    with pytest.raises(errors.WorkerFailedError) as e:
        asyncio.run(engine.start(2, timeout_s=30))
    assert str(e.value) == "worker rank 1 failed during start-up: boom"
    assert (e.value.rank, e.value.step) == (1, None)


def test_engine_start_timeout_names_the_missing_ranks(tmp_path):
    engine = _engine(tmp_path, [protocol.Ready(1, 3, 8, 16, "cpu")])
    with pytest.raises(errors.WorkerFailedError) as e:
        asyncio.run(engine.start(3, timeout_s=0.5))
    assert str(e.value).startswith("workers not ready after 0.5 s (1/3 ranks; --startup-timeout)")
    assert e.value.ranks == (0, 2)


def test_engine_start_block_size_mismatch_is_a_config_error(tmp_path):
    engine = _engine(tmp_path, [protocol.Ready(0, 1, 8, 32, "cpu")])
    with pytest.raises(errors.ConfigError, match=r"^workers use block_size 32, controller 16$"):
        asyncio.run(engine.start(1, timeout_s=30))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_small_kv_cache_warning_names_the_flags_of_the_device(tmp_path, caplog, device):
    """8 blocks of 16 tokens (112 usable) under a max model length of 256: the warning names what sizes the cache
    on the ranks' device (a CPU rank's cache ignores --gpu-memory-utilization)."""
    engine = _engine(tmp_path, [protocol.Ready(0, 1, 8, 16, device)])
    with caplog.at_level(logging.WARNING, logger="kimi.controller.engine"):
        asyncio.run(engine.start(1, timeout_s=30, warm_up=False))
    (msg,) = [r.getMessage() for r in caplog.records if "KV cache holds 112 tokens" in r.getMessage()]
    assert "--kv-cache-memory-gib" in msg and "--num-blocks" in msg and "--max-model-len" in msg
    assert ("--gpu-memory-utilization" in msg) == (device == "cuda"), msg
