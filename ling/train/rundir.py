"""One run per directory: a lock that rank 0 holds for the run's lifetime, and what may already be there.

The lock is `fcntl.flock` on `<run dir>/.lock` (released by the kernel when the process dies, even by
SIGKILL, so a crashed run never leaves a stale lock); the file names the holder for the refusal message.
A run writes into its directory only once it holds the lock: Hydra is told not to write its `.hydra/` files
(ling/train/launch.py), and `write_hydra_files` writes them after locking, so a run refused on a busy
directory leaves the running one's files alone.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from ling.checkpoint.layout import METRICS, SUMMARY, step_of
from ling.files import atomic_write
from ling.ranks import broadcast, rank_world
from ling.train.launch import StopRun

log = logging.getLogger(__name__)


class RunDirBusy(StopRun):
    exit_code = 2


class RunDirNotEmpty(StopRun):
    exit_code = 2


class RunDirLock:
    """An exclusive, non-blocking lock on `<run_dir>/.lock`."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / ".lock"
        self.file: IO[str] | None = None

    def try_acquire(self) -> str | None:
        """None when this process now holds the lock; otherwise who holds it (pid, host, since when)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+")  # noqa: SIM115 (kept open while the lock is held)
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            return holder
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        f.flush()
        self.file = f
        return None

    def release(self) -> None:
        if self.file is not None:
            fcntl.flock(self.file, fcntl.LOCK_UN)
            self.file.close()
            self.file = None


@contextmanager
def locked_run_dir(run_dir: Path, wait: bool = False, poll_s: float = 5.0) -> Iterator[None]:
    """Hold the run dir's lock for the block (collective: rank 0 locks, all ranks learn the outcome).

    Held by another process: raise RunDirBusy, or with `wait` poll every `poll_s` seconds until it is free
    (one small broadcast per poll, so no collective times out while waiting).
    """
    rank, _ = rank_world()
    lock = RunDirLock(run_dir) if rank == 0 else None
    waiting = False
    while (holder := broadcast(lock.try_acquire() if lock else None)) is not None:
        if not wait:
            raise RunDirBusy(f"run dir {run_dir} is in use by {holder} (it holds {run_dir / '.lock'}); "
                             "pick another run_name, wait for that run to end, or set train.on_locked=wait")
        if not waiting:
            log.warning("run dir %s is in use by %s; waiting for it (train.on_locked=wait)", run_dir, holder)
            waiting = True
        time.sleep(poll_s)
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def previous_run(run_dir: Path, ckpt_dir: Path) -> list[str]:
    """What an earlier run left in the run dir: its metrics and checkpoints, described for a message."""
    found = []
    metrics = run_dir / METRICS
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append(f"metrics.jsonl ({len(metrics.read_text().splitlines())} lines)")
    if ckpt_dir.is_dir():
        tags = sorted(p.name for p in ckpt_dir.iterdir() if step_of(p.name.split(".")[0]) is not None)
        if tags:
            found.append(f"{ckpt_dir.name}/ ({', '.join(tags)})")
    return found


def clear_previous_run(run_dir: Path, ckpt_dir: Path) -> None:
    """Delete an earlier run's metrics, summary and checkpoints (train.overwrite=true); rank 0 only."""
    for name in (METRICS, SUMMARY):
        (run_dir / name).unlink(missing_ok=True)
    shutil.rmtree(ckpt_dir, ignore_errors=True)


HYDRA_FILES = ".hydra"  # Hydra's own folder name for them


def write_hydra_files(run_dir: Path, cfg: DictConfig) -> None:
    """Hydra's record of the run, `.hydra/{config,hydra,overrides}.yaml`, as Hydra would write it; rank 0, under
    the lock. A no-op outside a Hydra app (a test calling train() itself)."""
    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.get()
    folder = Path(run_dir) / HYDRA_FILES
    folder.mkdir(exist_ok=True)
    for name, node in (("config.yaml", cfg), ("hydra.yaml", OmegaConf.create({"hydra": hydra_cfg})),
                       ("overrides.yaml", hydra_cfg.overrides.task)):
        text = OmegaConf.to_yaml(node)
        atomic_write(folder / name, lambda tmp, text=text: tmp.write_text(text))
