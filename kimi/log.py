"""Logging helpers: lines that only one rank of a multi-rank worker should write.

kimi's modules take their logger from `logging.getLogger(__name__)`; a worker rank's lines carry `rank<N>` (the
format kimi.worker.main sets). A line every rank would write with the same content goes through `rank0_info`.
"""

from __future__ import annotations

import logging

from kimi import envs


def is_rank0(rank: int | None = None) -> bool:
    """Whether this process is global rank 0: `rank` when given, else $RANK (torchrun's; 0 when unset)."""
    return (envs.RANK.get() if rank is None else rank) == 0


def rank0_info(logger: logging.Logger, msg: str, *args: object, rank: int | None = None) -> None:
    """`logger.info(msg, *args)` on rank 0 only (see `is_rank0`); the record names the caller's line."""
    if is_rank0(rank):
        logger.info(msg, *args, stacklevel=2)
