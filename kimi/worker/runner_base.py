"""The `Runner` protocol: what the worker's main loop (kimi.worker.main) asks of a rank's runner, one step at a time.

Two implementations: `kimi.worker.runner.ModelRunner` (the model and its KV cache) and `kimi.worker.fake.FakeRunner`
(no model; deterministic tokens). A step is `launch(plan, prev, on_prev)`, which may return before the step's sampled
tokens reach the host, then `finish(handle)`, which waits for them; `execute(plan)` is `finish(launch(plan))`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeAlias, runtime_checkable

from kimi import protocol

if TYPE_CHECKING:
    from kimi.config import ModelConfig
    from kimi.model.sampling import SampleLaunch
    from kimi.structured_output.bitmask import GuidedRequests
    from kimi.worker.inputs import WorkerRequest

PromptLogprobs: TypeAlias = tuple[
    list[float | None] | None, list[list[int] | None] | None, list[list[float] | None] | None
]
"""A request's prompt logprobs, top ids and top logprobs (per prompt token; None where not computed), or Nones."""


@dataclass
class StepHandle:
    """A launched step: its sampled tokens may still be on their way to the host.

    sampled: (rid, request) per sampled row, in row order; launch: the sampling in flight (None: nothing
    sampled on the device); plp: per sampled row, the prompt logprobs it sends with its first token (or Nones);
    row_of: rid -> row of launch.ids; outputs: set by the runner's `finish`."""

    step: int
    sampled: list[tuple[int, WorkerRequest]]
    launch: SampleLaunch | None
    plp: list[PromptLogprobs]
    row_of: dict[int, int]
    outputs: list[protocol.TokenOutput] | None = None

    def done(self) -> bool:
        """Whether finish() would return without waiting."""
        return self.outputs is not None or self.launch is None or self.launch.done()


@runtime_checkable
class Runner(Protocol):
    """One rank's runner as kimi.worker.main drives it.

    cfg: the model's config; num_blocks: KV-cache blocks of this rank (sent in `Ready`); guided: the rank's
    guided-decoding matchers.
    Counters logged at exit: num_requests (NewRequest entries this rank ran), num_sampled (tokens sampled),
    num_idle_steps (steps with no local tokens that still ran the collectives).
    """

    cfg: ModelConfig
    num_blocks: int
    num_requests: int
    num_sampled: int
    num_idle_steps: int
    guided: GuidedRequests

    def launch(
        self,
        plan: protocol.StepPlan,
        prev: StepHandle | None = None,
        on_prev: Callable[[StepHandle], None] | None = None,
    ) -> StepHandle:
        """Apply the plan's diff and start the step. `prev`: the step launched before, whose result is not sent
        yet (finished or not); it is finished and `on_prev(prev)` called once, before this step's tokens are
        sampled, so results go out in step order. Raises ProtocolError on a plan the runner cannot run."""
        ...

    def finish(self, handle: StepHandle) -> list[protocol.TokenOutput]:
        """Wait for a launched step's sampled tokens; the step's TokenOutputs (the same list on every call)."""
        ...

    def execute(self, plan: protocol.StepPlan) -> list[protocol.TokenOutput]:
        """One step at a time: `finish(launch(plan))`."""
        ...

    def close(self) -> None:
        """Release what outlives a step (the guided-decoding compile thread)."""
        ...

    def warmup_token_counts(self, max_tokens: int) -> list[int]:
        """Step sizes <= max_tokens the start-up warm-up runs besides its own (kernel variants chosen by size)."""
        ...

    def reset_counters(self) -> None:
        """Zero the counters above (and the runner's own), after the start-up warm-up (kimi.worker.warmup)."""
        ...
