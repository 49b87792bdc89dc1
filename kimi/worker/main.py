"""torchrun entry point of a GPU/CPU worker: `torchrun --nproc-per-node N -m kimi.worker.main ...`.

Each rank connects to the controller (SUB for plans, PUSH for results), loads its shard of the weights,
sizes its KV cache, answers the controller's ping with `Ready`, then runs one step per plan. It exits
when the controller says `Shutdown`, when the controller goes silent for `--controller-timeout` seconds,
or (non-zero, after sending `WorkerError`) on any failure, including a gap in step numbers.

Many ranks: torch.distributed is initialised from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) with gloo on CPU and nccl on CUDA, and the MoE all-to-all backend is built from
`--a2a-backend` (kimi/backends/all_to_all.py; default local for one rank, gloo on CPU, nccl on CUDA). Rank r
runs DP rank r's requests and owns experts [r*E/N, (r+1)*E/N). A `Heartbeat` thread answers the
controller's pings while steps run, and ends the process when the controller's pings stop for
`--controller-timeout` + 5 s even if the main thread is stuck in a collective. Several nodes: run the same
command under `torchrun --nnodes M --node-rank i --master-addr ...` on each node (docs/multinode.md).
"""

from __future__ import annotations

import logging
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kimi import cache_dir, envs, protocol
from kimi.config import CacheConfig, ModelConfig, SpeculativeConfig, WorkerConfig
from kimi.errors import CheckpointError, ConfigError, KVCacheSizeError, ProtocolError
from kimi.ipc import Heartbeat, WorkerTransport

if TYPE_CHECKING:
    from kimi.backends.all_to_all import Backend
    from kimi.worker.runner_base import Runner, StepHandle

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    """Run one rank until Shutdown (returns 0), controller silence or a failure (returns 1)."""
    args = WorkerConfig.from_argv(argv)
    rank = envs.RANK.get()
    world_size = envs.WORLD_SIZE.get()
    local_rank = envs.LOCAL_RANK.get()
    level = "DEBUG" if args.log_level == "trace" else args.log_level.upper()
    logging.basicConfig(level=level, format=f"%(asctime)s rank{rank} %(levelname)s %(message)s")
    quiet = logging.getLevelName(level) > logging.INFO  # warning and above: no progress bar either
    transport = WorkerTransport(args.plan_addr, args.result_addr)
    heartbeat = Heartbeat(args.plan_addr, args.result_addr, rank, args.controller_timeout + 5.0).start()
    try:
        dirs = cache_dir.configure(args.cache_dir or cache_dir.default_dir())  # before any kernel library loads
        files_before = cache_dir.count_files(dirs)
        device = "cpu"
        if args.device == "cuda":
            torch.cuda.set_device(local_rank)
            device = f"cuda:{local_rank}"
        runner, a2a = build_runner(args, rank, world_size, device, progress=not (args.no_progress or quiet))
        if not args.skip_warmup:
            run_warmup(runner, args, world_size, device, rank)
        if rank == 0:
            _log_compiled(dirs, files_before)
    except Exception as e:
        if not isinstance(e, (CheckpointError, ConfigError, KVCacheSizeError)):  # these name the file / field / flag
            traceback.print_exc()
        transport.send(protocol.WorkerError(rank, f"start-up failed: {type(e).__name__}: {e}"))
        heartbeat.stop()
        transport.close()
        return 1
    loop = StepLoop(runner, transport, heartbeat, rank, world_size, device, args)
    try:
        return loop.run(a2a)
    except Exception as e:
        traceback.print_exc()
        transport.send(protocol.WorkerError(rank, f"{type(e).__name__}: {e}"))
        return 1
    finally:
        _log_exit(runner, rank, loop.last_step)
        heartbeat.stop()
        transport.close()


def build_runner(
    args: WorkerConfig, rank: int, world_size: int, device: str, progress: bool
) -> tuple[Runner, Backend | None]:
    """This rank's runner (a FakeRunner with `--fake`, else a ModelRunner with its all-to-all backend, which is
    returned too). Raises CheckpointError / ConfigError / KVCacheSizeError naming the file, field or flag."""
    from kimi.backends.all_to_all import default_backend, init_distributed, make_all_to_all
    from kimi.worker.cuda_graph import bucket_sizes
    from kimi.worker.runner import ModelRunner

    if args.model.startswith("preset:"):
        from kimi.presets import load_preset

        cfg = ModelConfig.from_dict(load_preset(args.model[len("preset:") :]))
    else:
        cfg = ModelConfig.from_dir(args.model)
    if args.num_hidden_layers is not None:
        cfg = cfg.with_overrides(num_hidden_layers=args.num_hidden_layers)
    cache = CacheConfig(
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_memory_gib=args.kv_cache_memory_gib,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    if args.fake:
        from kimi.worker.fake import FakeRunner

        return FakeRunner(cfg, cache, rank=rank, world_size=world_size, model=args.model), None
    if args.emulate_ep_size > 1 and (world_size != 1 or args.device != "cuda" or args.load_format != "dummy"):
        raise ConfigError("--emulate-ep-size: benchmarks only, one rank on cuda with --load-format dummy")
    if cfg.n_routed_experts % args.emulate_ep_size:
        n = args.emulate_ep_size
        raise ConfigError(f"--emulate-ep-size {n}: the {cfg.n_routed_experts} experts do not split evenly over {n}")
    backend = args.a2a_backend or default_backend(world_size, args.device)
    group = init_distributed(backend, torch.device(device), args.dist_timeout)
    # the static decode layout's capacities: the decode batch buckets (kimi.worker.cuda_graph) up to --ll-max-tokens;
    # on nccl, decode CUDA graphs (--cuda-graph-max-bs > 0) imply the static layout (the variable splits cannot be
    # captured)
    capacities = bucket_sizes(args.ll_max_tokens) if static_decode(args, backend) else []
    a2a = make_all_to_all(
        backend,
        num_experts=cfg.n_routed_experts,
        hidden=cfg.hidden_size,
        ep_rank=rank,
        ep_size=world_size,
        group=group,
        ll_max_tokens_per_rank=args.ll_max_tokens,
        static_capacities=capacities,
    )
    static = f", static decode layout at capacities {capacities}" if capacities else ""
    log.info("rank %d of %d: all-to-all backend %s%s", rank, world_size, backend, static)
    runner = ModelRunner(
        args.model,
        cfg,
        cache,
        rank=rank,
        world_size=world_size,
        device=device,
        dtype=DTYPES[args.dtype or ("bfloat16" if args.device == "cuda" else "float32")],
        progress=progress and rank == 0,
        a2a=a2a,
        ll_max_tokens_per_rank=args.ll_max_tokens,
        gpu_options=dict(
            moe_backend=args.moe_backend,
            load_format=args.load_format,
            cuda_graph_max_bs=args.cuda_graph_max_bs,
            prefill_graph_max_tokens=args.prefill_graph_max_tokens,
            fp8_dense=args.fp8_dense,
            emulate_ep_size=args.emulate_ep_size,
        ),
        speculative=SpeculativeConfig.from_json(args.speculative_config) if args.speculative_config else None,
    )
    return runner, a2a


def static_decode(args: WorkerConfig, backend: str) -> bool:
    """Whether the all-to-all `backend` runs decode steps in the static layout: gloo / nccl with
    --a2a-static-decode, and nccl whenever decode CUDA graphs are asked for (--cuda-graph-max-bs > 0 with
    --device cuda; `kimi serve --device cuda` asks unless --enforce-eager)."""
    if backend == "nccl" and args.device == "cuda" and args.cuda_graph_max_bs > 0:
        return True
    return args.a2a_static_decode and backend in ("gloo", "nccl")


def run_warmup(runner: Runner, args: WorkerConfig, world_size: int, device: str, rank: int) -> None:
    """The start-up warm-up (kimi.worker.warmup) of this rank, logged phase by phase on rank 0."""
    from kimi.worker.warmup import WarmupConfig, warm_up

    cfg = runner.cfg
    t0 = time.monotonic()
    variants = tuple(runner.warmup_token_counts(args.token_budget))  # host work: the backends' schedule choices
    t_variants = time.monotonic() - t0
    wcfg = WarmupConfig(
        world_size=world_size,
        token_budget=args.token_budget,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len or cfg.max_position_embeddings,
        block_size=args.block_size,
        num_blocks=runner.num_blocks,
        vocab_size=cfg.vocab_size,
        device_type=torch.device(device).type,
        model=not args.fake,
        extra_prefill=variants,
    )
    report = [("kernel variants", t_variants, 0), *warm_up(runner, wcfg)]
    if rank == 0:
        parts = ", ".join(f"{name} {s:.1f} s ({n} steps)" for name, s, n in report)
        log.info("warm-up in %.1f s: %s", time.monotonic() - t0, parts)


def _log_compiled(dirs: dict[str, Path], before: dict[str, int]) -> None:
    """One line: the files each kernel library added to the cache dir during start-up (its compiles)."""
    after = cache_dir.count_files(dirs)
    new = {lib: after[lib] - before.get(lib, 0) for lib in after}
    log.info(
        "start-up compiled %s (kernel cache: %s)",
        ", ".join(f"{lib} {n} files" for lib, n in new.items()) if any(new.values()) else "nothing",
        ", ".join(f"{lib} {d}" for lib, d in dirs.items()),
    )


class StepLoop:
    """The rank's message loop: answers the first Ping with Ready, runs one step per plan, sends results in step order.

    A launched step whose result is not sent yet is `pending` (Runner.launch / finish). While it runs, the loop waits
    for whichever comes first: the next plan (launched right away, its forward queued behind this step; the
    controller sends it early with async scheduling), or the step's end (then its result goes out).
    """

    def __init__(
        self,
        runner: Runner,
        transport: WorkerTransport,
        heartbeat: Heartbeat,
        rank: int,
        world_size: int,
        device: str,
        args: WorkerConfig,
    ) -> None:
        self.runner = runner
        self.transport = transport
        self.heartbeat = heartbeat
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.args = args
        self.last_step = 0
        self.last_sent = 0  # the last step whose result went out

    def send_result(self, h: StepHandle) -> None:
        """Send a launched step's result (waiting for its tokens) and report its step to the heartbeat."""
        self.transport.send(protocol.StepResult(h.step, self.rank, self.runner.finish(h)))
        self.heartbeat.step = h.step
        self.last_sent = h.step

    def run(self, a2a: object) -> int:
        """Serve messages until Shutdown (0) or controller silence (1). Raises ProtocolError on a step-number gap and
        whatever the runner raises."""
        transport, runner = self.transport, self.runner
        ready = False
        pending: StepHandle | None = None
        while True:
            if pending is not None:
                msg = transport.recv(0)
                while msg is None and not pending.done():
                    time.sleep(50e-6)
                    msg = transport.recv(0)
                if msg is None:
                    self.send_result(pending)
                    pending = None
                    continue
            else:
                msg = transport.recv(self.args.controller_timeout)
            if msg is None:
                log.error("no message from the controller for %.0f s; exiting", self.args.controller_timeout)
                return 1
            if isinstance(msg, protocol.Ping):
                if not ready:
                    ready_msg = protocol.Ready(
                        self.rank, self.world_size, runner.num_blocks, self.args.block_size, self.device
                    )
                    transport.send(ready_msg)
                    ready = True
                continue
            if isinstance(msg, protocol.Shutdown):
                log.info("shutdown: %s", msg.reason)
                _close_distributed(a2a)
                return 0
            if msg.step != self.last_step + 1:
                raise ProtocolError(f"step plan gap: expected step {self.last_step + 1}, got {msg.step}")
            self.last_step = msg.step
            prev, pending = pending, runner.launch(msg, pending, on_prev=self.send_result)  # sends prev's result
            if prev is not None and self.last_sent < prev.step:  # a runner that did not hand prev back: no hang
                self.send_result(prev)


def _log_exit(runner: Runner, rank: int, last_step: int) -> None:
    """The rank's exit lines (tests read them): requests, tokens and steps served; guided decoding; the all-to-all
    layouts (static decode layout only); CUDA graphs."""
    log.info(
        "rank %d served %d requests, sampled %d tokens, %d steps (%d idle)",
        rank,
        runner.num_requests,
        runner.num_sampled,
        last_step,
        runner.num_idle_steps,
    )
    if getattr(runner, "draft", None) is not None:  # tests read this line
        log.info(
            "rank %d speculative decoding: %d draft tokens verified, %d accepted",
            rank,
            getattr(runner, "num_draft_tokens", 0),
            getattr(runner, "num_accepted_tokens", 0),
        )
    guided = runner.guided  # tests read this line: a live request's matcher only is held
    log.info(
        "rank %d: guided decoding: %d constrained requests, %d still held", rank, guided.num_requests, guided.num_held
    )
    guided.close()
    from kimi.backends.all_to_all import TorchAllToAll

    a2a = getattr(runner, "a2a", None)
    if isinstance(a2a, TorchAllToAll) and a2a.static_capacities:  # the static decode layout
        log.info(
            "rank %d: all-to-all layout: %d static steps, %d variable-split steps",
            rank,
            a2a.num_static_steps,
            a2a.num_variable_steps,
        )
    graphs = getattr(getattr(runner, "model", None), "graphs", None)
    if graphs is not None:  # CUDA-graph decode: replays, and decode steps whose attention was planned ahead
        fis = [f for f in getattr(graphs, "fi", {}).values() if hasattr(f, "ahead_hits")]
        log.info(
            "rank %d: %d graph replays; plan ahead %d hits, %d misses",
            rank,
            graphs.num_replays,
            sum(f.ahead_hits for f in fis),
            sum(f.ahead_misses for f in fis),
        )


def _close_distributed(a2a: object) -> None:
    """Clean shutdown only (every rank got Shutdown): release the backend's buffers and the process group."""
    import torch.distributed as dist

    close = getattr(a2a, "close", None)
    if close is not None:
        close()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
