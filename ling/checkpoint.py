"""Checkpoints: DeepSpeed's model/optimizer shards plus per-rank trainer state (step, data position, RNG).

Layout: <dir>/<tag>/ (DeepSpeed files + trainer_state_rank{r}.pt) and <dir>/latest naming the last
complete tag. `latest` is replaced atomically only after every rank finished writing, so a crash during
a save leaves the previous checkpoint as the one that resumes.
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _atomic_write(path: Path, write: Callable[[Path], Any]) -> None:
    """write(tmp) into a sibling temporary file, then rename it over `path`: readers see old or new, never half."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def save(engine, ckpt_dir: Path, step: int, trainer_state: dict[str, Any], rank: int, keep_last: int) -> Path:
    """Save step `step`; every rank calls this. Returns the checkpoint folder."""
    tag = f"step{step:08d}"
    engine.save_checkpoint(str(ckpt_dir), tag=tag, save_latest=False)
    state = {"step": step, "rng": _rng_state(), **trainer_state}
    _atomic_write(ckpt_dir / tag / f"trainer_state_rank{rank}.pt", lambda tmp: torch.save(state, tmp))
    _barrier()
    if rank == 0:
        _atomic_write(ckpt_dir / "latest", lambda tmp: tmp.write_text(tag))
        if keep_last > 0:
            tags = sorted(p.name for p in ckpt_dir.glob("step*") if p.is_dir())
            for old in tags[:-keep_last]:
                shutil.rmtree(ckpt_dir / old, ignore_errors=True)
    _barrier()
    return ckpt_dir / tag


def latest_tag(ckpt_dir: Path) -> str | None:
    marker = ckpt_dir / "latest"
    if not marker.is_file():
        return None
    tag = marker.read_text().strip()
    if not (ckpt_dir / tag).is_dir():
        raise FileNotFoundError(f"{marker} names checkpoint {tag!r}, but {ckpt_dir / tag} does not exist")
    return tag


def load(engine, ckpt_dir: Path, tag: str, rank: int) -> dict[str, Any]:
    """Load model/optimizer/scheduler through DeepSpeed and return this rank's trainer state."""
    load_path, _ = engine.load_checkpoint(str(ckpt_dir), tag=tag)
    if load_path is None:
        raise FileNotFoundError(f"DeepSpeed could not load checkpoint {ckpt_dir / tag}")
    path = ckpt_dir / tag / f"trainer_state_rank{rank}.pt"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: was the checkpoint written by a run with fewer ranks?")
    state = torch.load(path, weights_only=False)
    _set_rng_state(state["rng"])
    return state
