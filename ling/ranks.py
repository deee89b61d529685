"""This process's place among the ranks, and the few collectives of Python objects the runtime needs (no-ops
without torch.distributed). Imports nothing of the project at the top (init_distributed:
ling.train.deepspeed_compat)."""

from __future__ import annotations

import os
import socket
from typing import Any

import torch
import torch.distributed as dist


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_world() -> tuple[int, int]:
    """(rank, world size) of the initialised process group, else (0, 1)."""
    if distributed():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def env_world_size() -> int:
    """WORLD_SIZE as the launcher set it (1 without a launcher); readable before torch.distributed starts."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def env_rank() -> int:
    """RANK as the launcher set it (0 without a launcher)."""
    return int(os.environ.get("RANK", "0"))


def barrier() -> None:
    if distributed():
        dist.barrier()


def all_gather(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order."""
    if not distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast(obj: Any) -> Any:
    """Rank 0's `obj` on every rank."""
    if not distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> None:
    """Initialise torch.distributed once from the launcher's environment (NCCL on GPU, gloo on CPU);
    without a launcher, a one-process group (DeepSpeed needs one)."""
    if distributed():
        return
    # imported here, not at the top: importing DeepSpeed takes seconds and prints a banner, and the entry points
    # import this module before they quieten library output (ling.train.logger.quiet_library_noise)
    import deepspeed

    from ling.train.deepspeed_compat import skip_unused_op_builds

    skip_unused_op_builds(report=env_rank() == 0)  # no JIT build of DeepSpeed's CPU shared-memory op, no lock wait
    if "RANK" not in os.environ:  # plain `python train.py`: a one-process group on a free local port
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
