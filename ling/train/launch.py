"""Process-launch glue: the `deepspeed` launcher's `--local_rank`, one shared Hydra run dir for all ranks with a
unique name, and how a run ends (StopRun: a message and an exit code, no traceback)."""

from __future__ import annotations

import os
import secrets
import sys
import time

import torch.distributed as dist

from ling.ranks import env_rank, env_world_size, init_distributed


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


def unique_run_name() -> str:
    """Start time plus 24 random bits: two runs started in the same second still get their own directory."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def add_shared_run_overrides(argv: list[str] | None = None) -> None:
    """Give the run a name (the `run_name=` given, else `unique_run_name()`), the same on every rank (rank 0's,
    hence one Hydra run dir), and keep ranks > 0 from configuring Hydra's logging (conf/config.yaml already keeps
    Hydra from writing into the run dir: rank 0 writes `.hydra/` once it holds the lock, ling/train/rundir.py).
    Needs torch.distributed when WORLD_SIZE > 1 (initialised here)."""
    argv = sys.argv if argv is None else argv
    given = next((a.split("=", 1)[1] for a in argv[1:] if a.startswith("run_name=")), None)
    name = [given or unique_run_name()]
    if env_world_size() > 1:
        init_distributed()
        dist.broadcast_object_list(name, src=0)
    argv[:] = [a for a in argv if not a.startswith("run_name=")] + [f"run_name={name[0]}"]
    if env_rank() != 0:
        argv += ["hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]
