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
A save (`Checkpointer`) snapshots the state into host memory, writes it into <tag>.partial/ in the background
(each file hashed as it is written), writes the manifest last, once every rank's files are complete, and
renames the folder into place, so a checkpoint either has a manifest that matches its files or is not a
candidate. The manifest also records the model config (`model`): a resume compares the keys a checkpoint
cannot change (`FIXED_MODEL_KEYS`, `model_mismatch`) before anything is built. `newest_verified` walks the
checkpoints newest first and returns the first whose files all match their manifest (every rank checks its
share), with the reasons it skipped the others.
"""

from __future__ import annotations

import copy
import errno
import json
import logging
import os
import random
import shutil
import threading
import time
from dataclasses import dataclass
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
from ling.checkpoint.snapshot import (
    BackgroundWrite,
    HostBuffers,
    SaveFaults,
    snapshot,
    synchronize,
    tensor_bytes,
    write_entries,
)
from ling.files import atomic_write, sha256_file
from ling.ranks import all_gather, barrier, broadcast, rank_world
from ling.train.deepspeed_compat import captured_save

log = logging.getLogger(__name__)
FILE_OVERHEAD = 1 << 20  # bytes per file beyond its tensors' (pickle, zip records, alignment): a generous bound


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
class CheckpointWriteError(RuntimeError):
    """A save that could not be written (a full disk, ...). Raised on every rank; its .partial folder is gone and
    the checkpoints before it are untouched."""


@dataclass
class PendingSave:
    """A save whose snapshot is taken and whose files are being written (by this rank: `write`)."""

    step: int
    tag: str
    partial: Path
    final: Path
    ep_size: int
    optimizer: str | None
    need_bytes: int  # all ranks' tensor bytes: about the size of the checkpoint
    stall_s: float  # how long training waited for the snapshot
    write: BackgroundWrite | None = None  # None: written in the training thread (synchronous saves)
    files: dict[str, dict[str, Any]] | None = None
    error: BaseException | None = None
    write_s: float = 0.0


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _describe_write_error(error: BaseException) -> str:
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        return f"no space left on device writing {error.filename}"
    if isinstance(error, OSError):
        return f"{error.strerror or error} writing {error.filename}"
    return f"{type(error).__name__}: {error}"


class Checkpointer:
    """Saves checkpoints, one in flight at a time. `start` (every rank, at a step boundary) takes the snapshot —
    DeepSpeed's state dicts, the expert shards and this rank's trainer state, copied to host memory: the only
    time training waits — and writes the files into <tag>.partial/ in a background thread (`async_save`), or
    at once. When every rank's write is done (`local_done` on all ranks, or `wait`), `finish` (every rank)
    gathers each file's size and sha256 (hashed as written), and rank 0 writes the manifest, renames the folder
    into place, points `latest` at it and rotates. A save interrupted at any point leaves a folder without a
    manifest: never a candidate for resume. A failed write (a full disk) removes the .partial folder and
    raises CheckpointWriteError on every rank. `manifest_extra` goes into each manifest (the model config)."""

    def __init__(self, ckpt_dir: Path, keep_last: int, async_save: bool = True, faults: SaveFaults | None = None,
                 manifest_extra: dict[str, Any] | None = None) -> None:
        self.ckpt_dir = Path(ckpt_dir)
        self.keep_last = keep_last
        self.async_save = async_save
        self.faults = faults or SaveFaults()
        self.manifest_extra = dict(manifest_extra or {})
        self.buffers = HostBuffers(keep=async_save)
        self.pending: PendingSave | None = None
        self.last: Path | None = None  # the newest checkpoint this Checkpointer committed
        self._preparing: threading.Thread | None = None

    def prepare(self, engine) -> None:
        """Asynchronous saves of GPU state: allocate and pin the host buffers of the first snapshot now, in a
        background thread (pinning tens of GB takes seconds), so that the first save's copies run at pinned
        speed too. Every rank calls it (DeepSpeed's save path has collectives), after the optimizer state exists
        (the first step); a no-op for synchronous saves and without CUDA."""
        if not (self.async_save and torch.cuda.is_available()) or self._preparing is not None:
            return
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        states: list[Any] = []
        with captured_save(engine, lambda state, path: states.append(state), make_dirs=False):
            engine.save_checkpoint(str(self.ckpt_dir), tag="probe" + PARTIAL, save_latest=False)
        layout = expert_layout(engine)
        if layout["ep_size"] > 1 and layout["edp_rank"] == 0:
            states.append(dict(engine.module.expert_parameters()))
        self._preparing = threading.Thread(target=self.buffers.preallocate, args=(states,), daemon=True,
                                           name="checkpoint-buffers")
        self._preparing.start()

    def start(self, engine, step: int, trainer_state: dict[str, Any]) -> PendingSave:
        """Snapshot step `step` and start writing it (every rank calls this). A save still in flight is waited
        for first. Raises CheckpointWriteError, before writing anything, when the checkpoint folder's disk has
        less free space than the snapshot's size."""
        if self.pending is not None:
            self.wait()
        if self._preparing is not None:
            self._preparing.join()  # the buffers are ready (it ran since the first step)
        rank, _ = rank_world()
        tag = tag_for(step)
        final, partial = self.ckpt_dir / tag, self.ckpt_dir / (tag + PARTIAL)
        if rank == 0:
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)  # left by a save that was interrupted
        barrier()
        t0 = time.perf_counter()
        self.buffers.begin()
        entries: list[tuple[Path, Any]] = []
        with captured_save(engine, lambda state, path: entries.append((path, snapshot(state, self.buffers)))):
            engine.save_checkpoint(str(self.ckpt_dir), tag=partial.name, save_latest=False)
        layout = expert_layout(engine)
        if layout["ep_size"] > 1 and layout["edp_rank"] == 0:  # the first rank holding these experts
            name = EXPERT_SHARD.format(ep_rank=layout["ep_rank"], ep_size=layout["ep_size"])
            entries.append((partial / name, snapshot(dict(engine.module.expert_parameters()), self.buffers)))
        state = {"step": step, "rng": _rng_state(), "expert_parallel": layout, **copy.deepcopy(trainer_state)}
        entries.append((partial / TRAINER_STATE.format(rank=rank), state))
        synchronize()
        stall = time.perf_counter() - t0
        need = sum(all_gather(sum(tensor_bytes(s) for _, s in entries) + len(entries) * FILE_OVERHEAD))
        free = broadcast(shutil.disk_usage(self.ckpt_dir).free if rank == 0 else None)
        pending = PendingSave(step, tag, partial, final, layout["ep_size"], optimizer_name(engine), need, stall)
        if need > free:
            self._discard(pending)
            raise CheckpointWriteError(self._failure(pending, f"not enough space: it needs ≈ {_gib(need)} (all "
                                                              f"ranks), {_gib(free)} are free"))
        self.pending = pending
        if self.async_save:
            pending.write = BackgroundWrite(entries, partial, self.faults, after=self.buffers.pin_pending)
        else:
            t1 = time.perf_counter()
            try:
                pending.files = write_entries(entries, partial, self.faults)
            except Exception as e:  # noqa: BLE001 (every rank learns of it in finish)
                pending.error = e
            pending.write_s = time.perf_counter() - t1
        return pending

    def local_done(self) -> bool:
        """Whether this rank has nothing left to write (True without a save in flight)."""
        return self.pending is None or self.pending.write is None or self.pending.write.done

    def wait(self) -> PendingSave | None:
        """Wait for the save in flight and finish it (every rank); returns it (committed), or None without one."""
        if self.pending is None:
            return None
        if self.pending.write is not None:
            self.pending.write.join()
        return self.finish()

    def finish(self) -> PendingSave:
        """Commit the save in flight once every rank's write is done (every rank calls this, after `wait` or
        when `local_done` holds on all ranks): manifest, rename, `latest`, rotation. A failed write on any rank
        removes the .partial folder and raises CheckpointWriteError everywhere."""
        pending, self.pending = self.pending, None
        if pending.write is not None:
            pending.write.join()
            pending.files, pending.error, pending.write_s = (pending.write.files, pending.write.error,
                                                            pending.write.seconds)
        rank, world = rank_world()
        if pending.error is not None:
            log.error("checkpoint %s: rank %d could not write its files", pending.tag, rank, exc_info=pending.error)
        reports = all_gather({"files": pending.files or {}, "seconds": pending.write_s,
                              "error": None if pending.error is None else _describe_write_error(pending.error)})
        errors = [f"rank {r}: {rep['error']}" for r, rep in enumerate(reports) if rep["error"]]
        if errors:
            self._discard(pending)
            free = broadcast(shutil.disk_usage(self.ckpt_dir).free if rank == 0 else None)
            raise CheckpointWriteError(self._failure(pending, f"{'; '.join(errors)}; it needs ≈ "
                                                              f"{_gib(pending.need_bytes)} (all ranks), "
                                                              f"{_gib(free)} are free now"))
        pending.write_s = max(rep["seconds"] for rep in reports)
        if rank == 0:
            files = {k: v for rep in reports for k, v in rep["files"].items()}
            on_disk = sorted(str(p.relative_to(pending.partial)) for p in pending.partial.rglob("*") if p.is_file())
            for name in on_disk:  # written by the engine itself, not through the snapshot (e.g. a test stand-in)
                if name not in files:
                    path = pending.partial / name
                    files[name] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
            manifest = {"format": MANIFEST_FORMAT, "tag": pending.tag, "step": pending.step, "world_size": world,
                        "ep_size": pending.ep_size, "optimizer": pending.optimizer,
                        "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **self.manifest_extra,
                        "files": dict(sorted(files.items()))}
            atomic_write(pending.partial / MANIFEST, lambda tmp: tmp.write_text(json.dumps(manifest, indent=1)))
            if pending.final.exists():  # an older save of this step, e.g. by a run that was resumed from before it
                shutil.rmtree(pending.final)
            os.replace(pending.partial, pending.final)
            atomic_write(self.ckpt_dir / "latest", lambda tmp: tmp.write_text(pending.tag))
            rotate(self.ckpt_dir, self.keep_last, pending.step)
        barrier()
        self.last = pending.final
        return pending

    def _discard(self, pending: PendingSave) -> None:
        barrier()  # every rank is done with the folder
        if rank_world()[0] == 0:
            shutil.rmtree(pending.partial, ignore_errors=True)
        barrier()

    def _failure(self, pending: PendingSave, why: str) -> str:
        previous = self.last or newest_complete(self.ckpt_dir)
        return (f"checkpoint {pending.tag} could not be written to {self.ckpt_dir}: {why}. Its incomplete "
                f"{pending.partial.name} is removed; the last checkpoint, "
                f"{previous or 'none (none was written yet)'}, is untouched. Free space there (or set "
                "train.checkpoint_dir to a larger disk, or lower train.keep_last) and resume with the same command.")

    def close(self) -> None:
        """Release the host buffers unless a thread still uses them (a run ending on an error)."""
        if self.local_done() and (self._preparing is None or not self._preparing.is_alive()):
            self.buffers.release()


def save(engine, ckpt_dir: Path, step: int, trainer_state: dict[str, Any], keep_last: int) -> Path:
    """Save step `step` synchronously (every rank calls this); returns the checkpoint folder."""
    checkpointer = Checkpointer(ckpt_dir, keep_last, async_save=False)
    checkpointer.start(engine, step, trainer_state)
    return checkpointer.wait().final


def newest_complete(ckpt_dir: Path) -> Path | None:
    """The newest folder in `ckpt_dir` with a manifest (not verified), or None."""
    tags = sorted((p.name for p in ckpt_dir.iterdir() if step_of(p.name) is not None and (p / MANIFEST).is_file()),
                  key=step_of) if ckpt_dir.is_dir() else []
    return ckpt_dir / tags[-1] if tags else None


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


# the model config keys a checkpoint fixes: its tensors' shapes, and what the weights mean (routing, positions,
# normalisation). The rest may change on resume: precision and the FP8 recipe (a branch into the other recipe),
# recomputation, compilation, attention kernel, padding, moe.ep_size (resharded), loss weights, bias rate.
FIXED_MODEL_KEYS = ("vocab_size", "hidden_size", "num_layers", "num_dense_layers", "dense_intermediate_size",
                    "num_heads", "num_kv_heads", "head_dim", "rotary_fraction", "rope_base", "rms_eps",
                    "num_experts", "num_experts_per_tok", "num_shared_experts", "expert_intermediate_size",
                    "num_expert_groups", "topk_groups", "routed_scaling_factor", "num_mtp_layers")


def model_mismatch(folder: Path, model: dict[str, Any]) -> list[str]:
    """The FIXED_MODEL_KEYS whose value in checkpoint `folder`'s manifest differs from `model` (a ModelConfig as
    a dict), as "model.key: K in the checkpoint, M now"; [] when they agree or the manifest records no model
    (checkpoints written before it did)."""
    manifest = _read_manifest(folder)
    saved = manifest.get("model") if isinstance(manifest, dict) else None
    if not isinstance(saved, dict):
        return []
    return [f"model.{key}: {saved[key]!r} in the checkpoint, {model.get(key)!r} now" for key in FIXED_MODEL_KEYS
            if key in saved and saved[key] != model.get(key)]


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
