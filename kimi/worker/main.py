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

import argparse
import logging
import os
import sys
import time
import traceback
from typing import TYPE_CHECKING

import torch

from kimi import protocol
from kimi.checkpoint import CheckpointError
from kimi.config import LOG_LEVELS, MOE_BACKENDS, CacheConfig, ConfigError, ModelConfig
from kimi.controller.transport import Heartbeat, WorkerTransport
from kimi.worker.kv_cache import KVCacheSizeError

if TYPE_CHECKING:
    from kimi.backends.all_to_all import Backend
    from kimi.worker.fake import FakeRunner
    from kimi.worker.runner import ModelRunner, StepHandle

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kimi.worker.main")
    p.add_argument("--model", required=True, help="checkpoint folder")
    p.add_argument("--plan-addr", required=True, help="controller PUB address, e.g. tcp://127.0.0.1:5555")
    p.add_argument("--result-addr", required=True, help="controller PULL address")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--kv-cache-memory-gib", type=float, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--num-hidden-layers", type=int, default=None, help="override (benchmarks)")
    p.add_argument(
        "--controller-timeout",
        type=float,
        default=15.0,
        help="exit after this long without a message (the controller pings every second)",
    )
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--log-level",
        default="info",
        type=str.lower,
        choices=LOG_LEVELS,
        help="the rank's log level (kimi serve passes its own; trace logs as debug); above info the "
        "checkpoint-loading progress bar is off too",
    )
    p.add_argument(
        "--a2a-backend",
        default=None,
        choices=["local", "gloo", "nccl", "deepep"],
        help="MoE all-to-all (default: local for 1 rank, gloo on cpu, nccl on cuda)",
    )
    p.add_argument("--dist-timeout", type=float, default=600.0, help="torch.distributed collective timeout, seconds")
    p.add_argument(
        "--ll-max-tokens",
        type=int,
        default=128,
        help="decode steps with at most this many tokens per rank use low-latency all-to-all (deepep)",
    )
    p.add_argument(
        "--fake", action="store_true", help="load no weights; return pseudo-random tokens (kimi.worker.fake)"
    )
    p.add_argument(
        "--moe-backend",
        default="auto",
        choices=list(MOE_BACKENDS),
        help="cuda: routed-expert kernels (kimi/backends/experts/)",
    )
    p.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "dummy"],
        help="cuda: dummy = random weights of the real shapes (--model may then be preset:NAME)",
    )
    p.add_argument(
        "--cuda-graph-max-bs", type=int, default=0, help="cuda: largest decode CUDA graph bucket (0 = eager)"
    )
    p.add_argument(
        "--fp8-dense",
        default="off",
        choices=["off", "triton", "humming"],
        help="cuda: FP8 dense projections kept FP8 (kimi.backends.linear.FP8_DENSE_CHOICES)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    level = "DEBUG" if args.log_level == "trace" else args.log_level.upper()
    logging.basicConfig(level=level, format=f"%(asctime)s rank{rank} %(levelname)s %(message)s")
    quiet = logging.getLevelName(level) > logging.INFO  # warning and above: no progress bar either
    log = logging.getLogger("kimi.worker")
    transport = WorkerTransport(args.plan_addr, args.result_addr)
    heartbeat = Heartbeat(args.plan_addr, args.result_addr, rank, args.controller_timeout + 5.0).start()
    a2a: Backend | None = None
    runner: FakeRunner | ModelRunner
    try:
        from kimi.backends.all_to_all import default_backend, init_distributed, make_all_to_all
        from kimi.worker.runner import ModelRunner

        device = "cpu"
        if args.device == "cuda":
            torch.cuda.set_device(local_rank)
            device = f"cuda:{local_rank}"
        dtype = DTYPES[args.dtype or ("bfloat16" if args.device == "cuda" else "float32")]
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

            runner = FakeRunner(cfg, cache, rank=rank, world_size=world_size, model=args.model)
        else:
            backend = args.a2a_backend or default_backend(world_size, args.device)
            group = init_distributed(backend, torch.device(device), args.dist_timeout)
            a2a = make_all_to_all(
                backend,
                num_experts=cfg.n_routed_experts,
                hidden=cfg.hidden_size,
                ep_rank=rank,
                ep_size=world_size,
                group=group,
                ll_max_tokens_per_rank=args.ll_max_tokens,
            )
            log.info("rank %d of %d: all-to-all backend %s", rank, world_size, backend)
            runner = ModelRunner(
                args.model,
                cfg,
                cache,
                rank=rank,
                world_size=world_size,
                device=device,
                dtype=dtype,
                progress=not (args.no_progress or quiet) and rank == 0,
                a2a=a2a,
                ll_max_tokens_per_rank=args.ll_max_tokens,
                gpu_options=dict(
                    moe_backend=args.moe_backend,
                    load_format=args.load_format,
                    cuda_graph_max_bs=args.cuda_graph_max_bs,
                    fp8_dense=args.fp8_dense,
                ),
            )
    except Exception as e:
        if not isinstance(e, (CheckpointError, ConfigError, KVCacheSizeError)):  # these name the file / field / flag
            traceback.print_exc()
        transport.send(protocol.WorkerError(rank, f"start-up failed: {type(e).__name__}: {e}"))
        heartbeat.stop()
        transport.close()
        return 1

    ready = False
    last_step = 0
    # A launched step whose result is not sent yet (ModelRunner.launch / finish). While it runs, the worker
    # waits for whichever comes first: the next plan (launched right away, its forward queued behind this step;
    # the controller sends it early with async scheduling), or the step's end (then its result goes out).
    pending: StepHandle | None = None
    pipelined = runner if isinstance(runner, ModelRunner) else None  # a FakeRunner runs one step at a time

    def send_result(h: StepHandle) -> None:
        assert pipelined is not None, "only a ModelRunner launches steps"
        transport.send(protocol.StepResult(h.step, rank, pipelined.finish(h)))
        heartbeat.step = h.step

    try:
        while True:
            if pending is not None:
                msg = transport.recv(0)
                while msg is None and not pending.done():
                    time.sleep(50e-6)
                    msg = transport.recv(0)
                if msg is None:
                    send_result(pending)
                    pending = None
                    continue
            else:
                msg = transport.recv(args.controller_timeout)
            if msg is None:
                log.error("no message from the controller for %.0f s; exiting", args.controller_timeout)
                return 1
            if isinstance(msg, protocol.Ping):
                if not ready:
                    transport.send(protocol.Ready(rank, world_size, runner.num_blocks, args.block_size, device))
                    ready = True
                continue
            if isinstance(msg, protocol.Shutdown):
                log.info("shutdown: %s", msg.reason)
                _close_distributed(a2a)
                return 0
            if msg.step != last_step + 1:
                raise RuntimeError(f"step plan gap: expected step {last_step + 1}, got {msg.step}")
            last_step = msg.step
            if pipelined is not None:
                pending = pipelined.launch(msg, pending, on_prev=send_result)  # sends pending's result when it is done
            else:
                transport.send(protocol.StepResult(msg.step, rank, runner.execute(msg)))
                heartbeat.step = msg.step
    except Exception as e:
        traceback.print_exc()
        transport.send(protocol.WorkerError(rank, f"{type(e).__name__}: {e}"))
        return 1
    finally:
        log.info(
            "rank %d served %d requests, sampled %d tokens, %d steps (%d idle)",
            rank,
            getattr(runner, "num_requests", 0),
            getattr(runner, "num_sampled", 0),
            last_step,
            getattr(runner, "num_idle_steps", 0),
        )
        guided = getattr(runner, "guided", None)
        if guided is not None:  # tests read this line: a live request's matcher only is held
            log.info(
                "rank %d: guided decoding: %d constrained requests, %d still held",
                rank,
                guided.num_requests,
                guided.num_held,
            )
            guided.close()
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
        heartbeat.stop()
        transport.close()


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
