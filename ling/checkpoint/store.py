"""Checkpoints that can be trusted: DeepSpeed's model/optimizer shards plus each rank's trainer state (step,
data position, RNG), a manifest of every file, verification before loading, rotation that keeps good ones.

Layout: <dir>/step00000123/ holds the DeepSpeed files, `trainer_state_rank{r}.pt` and `manifest.json` (each
file's size and sha256, the step, the world size, moe.ep_size); <dir>/latest names the newest tag (for
DeepSpeed's tools). With expert parallelism (ep_size P > 1) DeepSpeed's `mp_rank_00_model_states.pt` holds the
dense weights and only expert-parallel rank 0's share of each expert stack, so every expert-parallel rank k also
writes `experts_ep{k}_of{P}.pt` (its expert stacks in the training dtype, written by the first rank that holds
them); `read_expert_shards` joins them into whole stacks. A checkpoint resumes with the moe.ep_size that wrote
it (DeepSpeed's loader, then each rank's experts) or with another one at the same world size
(ling/checkpoint/reshard.py).
A save writes into <tag>.partial/, hashes what landed on disk (the ranks share the files), writes the manifest
last and renames the folder into place, so a checkpoint either has a manifest that matches its files or is
not a candidate. `newest_verified` walks the checkpoints newest first and returns the first whose files all
match their manifest (every rank checks its share), with the reasons it skipped the others.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ling.checkpoint.layout import (
    EXPERT_SHARD,
    MANIFEST,
    MANIFEST_FORMAT,
    PARTIAL,
    TRAINER_STATE,
    expert_shard_names,
    step_of,
    tag_for,
)
from ling.checkpoint.reshard import load_resharded
from ling.checkpoint.safe_load import check_folder, load_pt
from ling.files import atomic_write, sha256_file
from ling.ranks import all_gather, barrier, broadcast, rank_world


# ---------------------------------------------------------------------------------------------------- helpers
def _rng_state() -> dict[str, Any]:
    """Every RNG's state in plain types (tuples, ints, floats, str, tensors), so the trainer state loads with
    weights_only=True: numpy's (kind, uint32 keys [624], pos, has_gauss, cached_gaussian) with the keys as an
    int64 tensor."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    numpy_state = {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                   "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    saved = state["numpy"]
    if isinstance(saved, dict):
        saved = (saved["kind"], saved["keys"].numpy().astype(np.uint32), saved["pos"], saved["has_gauss"],
                 saved["cached_gaussian"])
    np.random.set_state(saved)  # a tuple with an ndarray: a trainer state from before 2026-12
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------------------------- experts
def expert_layout(engine) -> dict[str, int]:
    """This rank's place in the expert-parallel layout: ep_size, ep_rank (which experts it holds) and edp_rank
    (its place among the ranks holding the same experts, by global rank: the order of DeepSpeed's
    expert-data-parallel group). Collective when ep_size > 1."""
    model = getattr(engine, "module", None)
    ep_size = model.config.ep_size if hasattr(model, "config") else 1
    if ep_size == 1:
        return {"ep_size": 1, "ep_rank": 0, "edp_rank": rank_world()[0]}
    ep_ranks = all_gather(model.ep_rank)
    rank = rank_world()[0]
    return {"ep_size": ep_size, "ep_rank": model.ep_rank, "edp_rank": ep_ranks[:rank].count(model.ep_rank)}


def read_expert_shards(folder: Path) -> dict[str, torch.Tensor]:
    """The whole expert stacks [num_experts, ...] of an expert-parallel checkpoint, joined from its
    `experts_ep{k}_of{P}.pt` files in k order ({} for a checkpoint without expert parallelism)."""
    found = sorted(folder.glob(EXPERT_SHARD.format(ep_rank="*", ep_size="*")))
    if not found:
        return {}
    ep_size = int(found[0].stem.rpartition("_of")[2])
    shards = []
    for name in expert_shard_names(ep_size):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"checkpoint {folder}: {name} is missing (moe.ep_size={ep_size} writes "
                                    f"{', '.join(expert_shard_names(ep_size))})")
        shards.append(load_pt(folder / name))
    return {key: torch.cat([s[key] for s in shards]) for key in shards[0]}


def _save_expert_shard(engine, folder: Path, layout: dict[str, int]) -> None:
    if layout["ep_size"] > 1 and layout["edp_rank"] == 0:
        tensors = {n: p.detach().cpu() for n, p in engine.module.expert_parameters()}
        name = EXPERT_SHARD.format(ep_rank=layout["ep_rank"], ep_size=layout["ep_size"])
        atomic_write(folder / name, lambda tmp: torch.save(tensors, tmp))


def _load_expert_shard(model, folder: Path) -> None:
    """This rank's expert stacks from its shard file (DeepSpeed's loader put rank 0's share everywhere)."""
    name = EXPERT_SHARD.format(ep_rank=model.ep_rank, ep_size=model.config.ep_size)
    tensors = load_pt(folder / name)
    with torch.no_grad():
        for key, p in model.expert_parameters():
            p.copy_(tensors[key])


def optimizer_name(engine) -> str | None:
    """The class name of the optimizer the engine wraps (e.g. "AdamW", "FP8AdamW"), under DeepSpeed's ZeRO or
    bf16 wrappers (each keeps the one it wraps as `.optimizer`); None for an engine without one."""
    opt = getattr(engine, "optimizer", None)
    if opt is None:
        return None
    while type(opt).__module__.startswith(("deepspeed", "ling.train")) and hasattr(opt, "optimizer"):
        opt = opt.optimizer
    return type(opt).__name__


# ------------------------------------------------------------------------------------------------------- save
def save(engine, ckpt_dir: Path, step: int, trainer_state: dict[str, Any], keep_last: int) -> Path:
    """Save step `step` (every rank calls this); returns the checkpoint folder, verified on disk."""
    rank, world = rank_world()
    tag = tag_for(step)
    final, partial = ckpt_dir / tag, ckpt_dir / (tag + PARTIAL)
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # left by a save that was interrupted
    barrier()
    engine.save_checkpoint(str(ckpt_dir), tag=partial.name, save_latest=False)
    layout = expert_layout(engine)
    _save_expert_shard(engine, partial, layout)
    state = {"step": step, "rng": _rng_state(), "expert_parallel": layout, **trainer_state}
    atomic_write(partial / TRAINER_STATE.format(rank=rank), lambda tmp: torch.save(state, tmp))
    barrier()
    names = broadcast(sorted(str(p.relative_to(partial)) for p in partial.rglob("*") if p.is_file())
                      if rank == 0 else None)
    mine = {n: {"size": (partial / n).stat().st_size, "sha256": sha256_file(partial / n)} for n in names[rank::world]}
    files = {k: v for part in all_gather(mine) for k, v in part.items()}
    if rank == 0:
        manifest = {"format": MANIFEST_FORMAT, "tag": tag, "step": step, "world_size": world,
                    "ep_size": layout["ep_size"], "optimizer": optimizer_name(engine),
                    "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": files}
        atomic_write(partial / MANIFEST, lambda tmp: tmp.write_text(json.dumps(manifest, indent=1)))
        if final.exists():  # an older save of this step, e.g. by a run that was resumed from before it
            shutil.rmtree(final)
        os.replace(partial, final)
        atomic_write(ckpt_dir / "latest", lambda tmp: tmp.write_text(tag))
        rotate(ckpt_dir, keep_last, step)
    barrier()
    return final


def rotate(ckpt_dir: Path, keep_last: int, current_step: int) -> list[str]:
    """Delete what a resume must never pick: checkpoints newer than `current_step` (left by a run this one
    was resumed from before), folders without a manifest and interrupted saves; then all but the
    `keep_last` newest complete ones (0 = keep all). The newest complete one (just written and hashed from
    disk) is always kept. Returns the removed tags."""
    removed = []
    complete = []
    for p in sorted(ckpt_dir.iterdir()):
        step = step_of(p.name)
        if p.name.endswith(PARTIAL) or (step is not None and (step > current_step or not (p / MANIFEST).is_file())):
            removed.append(p.name)
        elif step is not None:
            complete.append((step, p.name))
    complete.sort()
    if keep_last > 0:
        removed += [name for _, name in complete[:-keep_last]]
    for name in removed:
        shutil.rmtree(ckpt_dir / name, ignore_errors=True)
    return removed


# ----------------------------------------------------------------------------------------------------- verify
def _read_manifest(folder: Path) -> dict[str, Any] | str:
    path = folder / MANIFEST
    if not path.is_file():
        return "no manifest.json (the save did not finish)"
    try:
        manifest = json.loads(path.read_text())
        if manifest.get("format") != MANIFEST_FORMAT or not isinstance(manifest.get("files"), dict):
            return f"manifest.json has an unknown format ({manifest.get('format')!r})"
        return manifest
    except (OSError, ValueError) as e:
        return f"manifest.json is unreadable ({e})"


def saved_step(folder: Path) -> int:
    """The optimizer step a verified checkpoint folder holds (its manifest's)."""
    manifest = _read_manifest(folder)
    if isinstance(manifest, str):
        raise ValueError(f"checkpoint {folder}: {manifest}")
    return int(manifest["step"])


def _check_file(folder: Path, name: str, want: dict[str, Any], checksums: bool) -> str | None:
    path = folder / name
    if not path.is_file():
        return f"{name} is missing"
    size = path.stat().st_size
    if size != want["size"]:
        return f"{name} has {size} bytes, the manifest says {want['size']} (truncated or rewritten)"
    if checksums and sha256_file(path) != want["sha256"]:
        return f"{name} does not match its sha256 checksum (corrupted)"
    return None


def verify(folder: Path, checksums: bool = True, world_size: int | None = None) -> list[str]:
    """Check a checkpoint against its manifest (collective: each rank checks a share of the files).

    Returns the problems found on any rank, the same list on every rank; empty = verified. `world_size`:
    the ranks that will load it (default: this run's); a checkpoint only resumes in the world that wrote it.
    world_size=0: any world (reading the weights only, e.g. eval.py and HF export).
    """
    rank, world = rank_world()
    manifest = _read_manifest(folder)
    nranks = world_size or world
    if world_size == 0 and isinstance(manifest, dict):
        nranks = manifest.get("world_size")
    problems: list[str] = []
    if isinstance(manifest, str):
        problems.append(manifest)
    elif manifest.get("world_size") != nranks:
        problems.append(f"written by {manifest.get('world_size')} ranks, this run has {nranks}")
    else:
        files = manifest["files"]
        needed = [TRAINER_STATE.format(rank=r) for r in range(nranks)] + expert_shard_names(manifest["ep_size"])
        problems += [f"{name} is not in the manifest" for name in needed if name not in files]
        names = sorted(files)
        problems += [p for n in names[rank::world] if (p := _check_file(folder, n, files[n], checksums))]
    merged: list[str] = []
    for part in all_gather(problems):
        merged += [p for p in part if p not in merged]
    return merged


def newest_verified(ckpt_dir: Path, checksums: bool = True,
                    world_size: int | None = None) -> tuple[Path | None, list[tuple[str, str]]]:
    """(the newest checkpoint folder in `ckpt_dir` that verifies or None, [(name, why it was skipped)]);
    `world_size` as in `verify`."""
    names = broadcast(sorted(p.name for p in ckpt_dir.iterdir()) if ckpt_dir.is_dir() else [])
    skipped = [(n, "an interrupted save") for n in names if n.endswith(PARTIAL)]
    for tag in sorted((n for n in names if step_of(n) is not None), key=step_of, reverse=True):
        problems = verify(ckpt_dir / tag, checksums, world_size)
        if not problems:
            return ckpt_dir / tag, skipped
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        skipped.append((tag, "; ".join(problems[:3]) + more))
    return None, skipped


# ------------------------------------------------------------------------------------------------------- load
def load(engine, folder: Path) -> dict[str, Any]:
    """Load a verified checkpoint into the engine (model, optimizer, lr scheduler) and restore this rank's
    RNG state; returns this rank's trainer state. A checkpoint of another moe.ep_size, or of another optimizer
    (AdamW ↔ FP8AdamW: a branch of a run in the other recipe, scripts/parity_branch.sh), is re-assembled per
    parameter for this engine (ling/checkpoint/reshard.py): the same fp32 master weights, the moments in this
    optimizer's format. The trainer state then says `converted_from` (the saved optimizer's name) for the log."""
    rank, _ = rank_world()
    manifest = _read_manifest(folder)
    if isinstance(manifest, str):
        raise ValueError(f"checkpoint {folder}: {manifest}")
    saved_ep, saved_opt = manifest["ep_size"], manifest["optimizer"]
    layout = expert_layout(engine)
    converted = saved_opt != optimizer_name(engine)
    check_folder(folder)  # DeepSpeed's loader unpickles with weights_only=False: nothing reaches it unchecked
    if saved_ep != layout["ep_size"] or converted:
        load_resharded(engine, folder, saved_ep)
    else:
        load_path, _ = engine.load_checkpoint(str(folder.parent), tag=folder.name)
        if load_path is None:
            raise FileNotFoundError(f"DeepSpeed could not load checkpoint {folder}")
        if saved_ep > 1:
            _load_expert_shard(engine.module, folder)
    state = load_pt(folder / TRAINER_STATE.format(rank=rank))
    _set_rng_state(state["rng"])
    if converted:
        state["converted_from"] = saved_opt
    return state
