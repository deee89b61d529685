"""Process-launch glue: the `deepspeed` launcher's `--local_rank`, one shared Hydra run dir for all ranks."""

from __future__ import annotations

import os
import sys
import time


def strip_local_rank_arg(argv: list[str] | None = None) -> None:
    """Remove `--local_rank=N` / `--local_rank N` (added by the deepspeed launcher) from argv, in place,
    and export it as LOCAL_RANK, so that Hydra only sees its own overrides."""
    argv = sys.argv if argv is None else argv
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--local_rank=") or arg.startswith("--local-rank="):
            os.environ.setdefault("LOCAL_RANK", arg.split("=", 1)[1])
            del argv[i]
        elif arg in ("--local_rank", "--local-rank") and i + 1 < len(argv):
            os.environ.setdefault("LOCAL_RANK", argv[i + 1])
            del argv[i:i + 2]
        else:
            i += 1


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def global_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> None:
    """Initialise torch.distributed once from the launcher's environment (NCCL on GPU, gloo on CPU);
    without a launcher, a one-process group (DeepSpeed needs one)."""
    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return
    import deepspeed

    if "RANK" not in os.environ:  # plain `python train.py`: a one-process group on a free local port
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")


def add_shared_run_overrides(argv: list[str] | None = None) -> None:
    """Make every rank use rank 0's run name (hence one Hydra run dir) and keep ranks > 0 from writing
    Hydra's config/log files. Needs torch.distributed when WORLD_SIZE > 1 (initialised here)."""
    argv = sys.argv if argv is None else argv
    if world_size() <= 1:
        return
    import torch.distributed as dist

    init_distributed()
    given = next((a.split("=", 1)[1] for a in argv[1:] if a.startswith("run_name=")), None)
    name = [given or time.strftime("%Y%m%d-%H%M%S")]
    dist.broadcast_object_list(name, src=0)
    argv[:] = [a for a in argv if not a.startswith("run_name=")] + [f"run_name={name[0]}"]
    if global_rank() != 0:
        argv += ["hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
