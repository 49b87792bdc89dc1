"""Both runners the worker's main loop drives (ModelRunner, FakeRunner) implement the `Runner` protocol, and the loop's
pipelined use of it (launch the next step with the unfinished one as `prev`) gives each the tokens of one step at a
time, with results handed out in step order."""

from __future__ import annotations

import inspect

import pytest

from kimi import protocol
from kimi.config import CacheConfig, ModelConfig
from kimi.tiny_checkpoint import make_tiny_checkpoint
from kimi.worker.fake import FakeRunner
from kimi.worker.runner import ModelRunner
from kimi.worker.runner_base import Runner, StepHandle

BS = 16
STEP_METHODS = ("launch", "finish", "execute", "close")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "k2.6", "k2.6", seed=0, tokenizer_source=None)


def _make(kind: str, ckpt) -> Runner:
    cfg = ModelConfig.from_dir(ckpt)
    cache = CacheConfig(block_size=BS, num_blocks=32)
    if kind == "fake":
        return FakeRunner(cfg, cache, model=str(ckpt))
    return ModelRunner(str(ckpt), cfg, cache, progress=False)


def _plans() -> list[protocol.StepPlan]:
    """Two requests: a prompt in two chunks, then decodes; a second prompt joining at step 2; drops at the end."""
    greedy = protocol.SamplingParams(temperature=0.0)
    p1, p2 = list(range(3, 23)), list(range(40, 47))
    plans = [
        protocol.StepPlan(1, [protocol.NewRequest(1, 0, p1, 0, 12, [1, 2], greedy)], [], []),
        protocol.StepPlan(
            2, [protocol.NewRequest(2, 0, p2, 0, len(p2), [3], greedy)], [protocol.ContinueRequest(1, 8, [])], []
        ),
    ]
    for step in range(3, 9):
        plans.append(
            protocol.StepPlan(step, [], [protocol.ContinueRequest(1, 1, []), protocol.ContinueRequest(2, 1, [])], [])
        )
    plans.append(protocol.StepPlan(9, [], [], [1, 2]))
    return plans


@pytest.mark.parametrize("kind", ["model", "fake"])
def test_runner_satisfies_the_protocol(kind, ckpt):
    runner = _make(kind, ckpt)
    try:
        assert isinstance(runner, Runner)
        for name in STEP_METHODS:  # the same parameters as the protocol's (runtime_checkable checks names only)
            want = list(inspect.signature(getattr(Runner, name)).parameters)[1:]
            assert list(inspect.signature(getattr(runner, name)).parameters) == want, name
        assert runner.num_blocks == 32
    finally:
        runner.close()


@pytest.mark.parametrize("kind", ["model", "fake"])
def test_pipelined_steps_equal_one_step_at_a_time(kind, ckpt):
    """The main loop's use: each plan launched with the previous, unfinished handle; `on_prev` sends that one."""
    ref_runner, runner = _make(kind, ckpt), _make(kind, ckpt)
    try:
        ref = {p.step: ref_runner.execute(p) for p in _plans()}
        sent: list[int] = []
        got: dict[int, list[protocol.TokenOutput]] = {}

        def on_prev(h: StepHandle) -> None:
            sent.append(h.step)
            got[h.step] = runner.finish(h)

        pending: StepHandle | None = None
        for p in _plans():
            pending = runner.launch(p, pending, on_prev=on_prev)
            assert pending.step == p.step
        assert pending is not None
        on_prev(pending)
        assert sent == list(range(1, 10))
        assert got == ref
        assert [len(got[s]) for s in range(1, 10)] == [0, 2, 2, 2, 2, 2, 2, 2, 0]  # step 1 is a prompt's first chunk
        assert runner.finish(pending) is got[9]  # the same list on every call
        assert (runner.num_requests, runner.num_sampled) == (2, 14)
    finally:
        ref_runner.close()
        runner.close()
