"""Process-launch glue: the `deepspeed` launcher's `--local_rank`, one shared Hydra run dir for all ranks with a
unique name, and how a run ends (StopRun: a message and an exit code, no traceback)."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import secrets
import sys
import time

log = logging.getLogger(__name__)


class StopRun(Exception):
    """A run that ends with a clear message and a non-zero exit code (train.py prints it, no traceback)."""

    exit_code = 1


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
    printed = io.StringIO()  # DeepSpeed prints "... built successfully" for its CPU comm op on every rank
    with contextlib.redirect_stdout(printed):
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    if printed.getvalue().strip():
        log.debug("deepspeed.init_distributed: %s", printed.getvalue().strip())


def unique_run_name() -> str:
    """Start time plus 24 random bits: two runs started in the same second still get their own directory."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def add_shared_run_overrides(argv: list[str] | None = None) -> None:
    """Give the run a name (the `run_name=` given, else `unique_run_name()`), the same on every rank (rank 0's,
    hence one Hydra run dir), and keep ranks > 0 from writing Hydra's config/log files. Needs
    torch.distributed when WORLD_SIZE > 1 (initialised here)."""
    argv = sys.argv if argv is None else argv
    given = next((a.split("=", 1)[1] for a in argv[1:] if a.startswith("run_name=")), None)
    name = [given or unique_run_name()]
    if world_size() > 1:
        import torch.distributed as dist

        init_distributed()
        dist.broadcast_object_list(name, src=0)
    argv[:] = [a for a in argv if not a.startswith("run_name=")] + [f"run_name={name[0]}"]
    if global_rank() != 0:
        argv += ["hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
