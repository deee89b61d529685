"""Checkpoint bytes off the training thread: a checkpoint's state dicts copied to host memory at save time (the
only wait training sees), then written, and hashed as they are written, by a background thread.

DeepSpeed's `engine.save_checkpoint` hands every file it writes to its checkpoint engine; for the call,
`ling.train.deepspeed_compat.captured_save` puts one in its place that passes each (state dict, path) on
instead of writing it, and ling/checkpoint/store.py keeps a `snapshot` of each: DeepSpeed's file names and layout
stay as they are (resume, reshard and zero_to_fp32 read them). `write_entries` then writes the kept (path, state)
pairs with torch.save through `HashingFile`, so each file's size and sha256 are known when its last byte is on
disk, without a second read.

Host copies are taken into `HostBuffers`, kept from one save to the next: for tensors on a GPU the buffers are
page-locked once (cudaHostRegister, exact sizes), so that from the second save on the copies run at full PCIe
bandwidth; the first save copies into pageable memory and pins its buffers in the background afterwards.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ling.files import HashingFile

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveFaults:
    """Faults a test injects into the background write (`train.inject_save_*`): a pause after each file
    (`delay_s`, to kill a run mid-save) and a full disk once `enospc_after_bytes` bytes were written by this
    rank in one save."""

    delay_s: float = 0.0
    enospc_after_bytes: int | None = None


# ------------------------------------------------------------------------------------------------ host copies
def _pin(buffer: torch.Tensor) -> bool:
    """Page-lock a host tensor's memory in place (cudaHostRegister: the exact size, unlike pin_memory=True's
    power-of-two blocks); False when CUDA refuses."""
    try:
        result = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel() * buffer.element_size(), 0)
    except (RuntimeError, AttributeError):
        return False
    return int(getattr(result, "value", result)) == 0


def _unpin(buffer: torch.Tensor) -> None:
    with contextlib.suppress(RuntimeError, AttributeError):
        torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())


class HostBuffers:
    """The host tensors snapshots copy into. `keep` (asynchronous saves): buffer i of one snapshot is buffer i of
    the next when shape and dtype match (the same state dicts come back with the same tensors), and the buffers
    of GPU tensors get pinned (`pin_pending`, run after a write); otherwise every snapshot allocates afresh and
    nothing is kept. Not thread-safe: one snapshot at a time, and none while a write reads the buffers."""

    def __init__(self, keep: bool) -> None:
        self.keep = keep
        self._buffers: list[torch.Tensor] = []
        self._pinned: list[bool] = []
        self._from_gpu: list[bool] = []
        self._next = 0
        self.pin_failed = False

    def begin(self) -> None:
        self._next = 0

    def copy(self, t: torch.Tensor, allocate_only: bool = False) -> torch.Tensor:
        """A contiguous host copy of `t` (enqueued on the current stream when `t` is on a GPU and its buffer is
        pinned: `synchronize` before reading it). `allocate_only`: the buffer, nothing copied (`preallocate`)."""
        t = t.detach()
        if not self.keep:
            return torch.empty(t.shape, dtype=t.dtype, device="cpu").copy_(t)
        i, self._next = self._next, self._next + 1
        if i < len(self._buffers) and self._buffers[i].shape == t.shape and self._buffers[i].dtype == t.dtype:
            buffer = self._buffers[i]
        else:
            buffer = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            if i < len(self._buffers):
                self._release(i)
                self._buffers[i], self._from_gpu[i] = buffer, t.is_cuda
            else:
                self._buffers.append(buffer)
                self._pinned.append(False)
                self._from_gpu.append(t.is_cuda)
        return buffer if allocate_only else buffer.copy_(t, non_blocking=self._pinned[i])

    def preallocate(self, states: list[Any]) -> None:
        """Allocate (and pin, for GPU tensors) the buffers a snapshot of `states` will take, ahead of it; from a
        background thread, reading only the tensors' shapes and dtypes."""
        self.begin()
        for state in states:
            snapshot(state, self, allocate_only=True)
        self.pin_pending()

    def pin_pending(self) -> None:
        """Pin the kept buffers of GPU tensors not pinned yet (the first save's); run from the background thread
        after a write, so that the next snapshot copies at full bandwidth."""
        for i, buffer in enumerate(self._buffers):
            if self.pin_failed:
                return
            if self._from_gpu[i] and not self._pinned[i] and buffer.numel():
                self._pinned[i] = _pin(buffer)
                if not self._pinned[i]:
                    self.pin_failed = True
                    log.info("checkpoint snapshots: CUDA would not page-lock host memory; the copies stay pageable "
                             "(slower snapshots)")

    def _release(self, i: int) -> None:
        if self._pinned[i]:
            _unpin(self._buffers[i])
            self._pinned[i] = False

    def release(self) -> None:
        """Unpin and drop every kept buffer (call when no write is running)."""
        for i in range(len(self._buffers)):
            self._release(i)
        self._buffers, self._pinned, self._from_gpu = [], [], []

    @property
    def pinned_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b, p in zip(self._buffers, self._pinned) if p)


def snapshot(obj: Any, buffers: HostBuffers, allocate_only: bool = False) -> Any:
    """A copy of a (nested) state dict whose tensors are host copies, each with a storage of its own (a view of
    a flat buffer would otherwise save the whole buffer), and whose other leaves are deep copies.
    `allocate_only`: only the buffers are taken (HostBuffers.preallocate); the result is not a copy."""
    if isinstance(obj, torch.Tensor):
        return buffers.copy(obj, allocate_only)
    if isinstance(obj, torch.Size):  # a shape is a leaf: its items are ints
        return obj
    if allocate_only and not isinstance(obj, (dict, list, tuple)):
        return None
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps OrderedDict / defaultdict types
        for k, v in obj.items():
            out[k] = snapshot(v, buffers, allocate_only)
        return out
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(snapshot(v, buffers, allocate_only) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(snapshot(v, buffers, allocate_only) for v in obj)
    return copy.deepcopy(obj)


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in a (nested) state."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


# ------------------------------------------------------------------------------------------------------ writing
def synchronize() -> None:
    """Wait for the device → host copies of a snapshot (a no-op without CUDA)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def write_entries(entries: list[tuple[Path, Any]], folder: Path, faults: SaveFaults = SaveFaults()
                  ) -> dict[str, dict[str, Any]]:
    """torch.save each (path, state) (paths inside `folder`) through a HashingFile; returns {name relative to
    folder: {"size", "sha256"}} of what was written. A failed write raises the OSError behind it (ENOSPC, ...)
    rather than torch's wrapper of it."""
    files: dict[str, dict[str, Any]] = {}
    written = 0
    for path, state in entries:
        budget = None if faults.enospc_after_bytes is None else max(0, faults.enospc_after_bytes - written)
        out = HashingFile(path, fail_after_bytes=budget)
        try:
            torch.save(state, out)
        except Exception as e:
            with contextlib.suppress(OSError):
                out.close()
            if out.error is not None:
                raise out.error from e
            raise
        out.close()
        if out.error is not None:
            raise out.error
        files[str(path.relative_to(folder))] = {"size": out.size, "sha256": out.sha256}
        written += out.size
        if faults.delay_s:
            time.sleep(faults.delay_s)
    return files


class BackgroundWrite:
    """`write_entries` in a daemon thread (a process that dies mid-write leaves a folder without a manifest,
    which is never taken for a checkpoint); then `after()` (e.g. pinning the buffers for the next save).
    `done` polls, `join` waits; the outcome is `files` or `error`."""

    def __init__(self, entries: list[tuple[Path, Any]], folder: Path, faults: SaveFaults, after=None) -> None:
        self.files: dict[str, dict[str, Any]] | None = None
        self.error: BaseException | None = None
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._run, args=(entries, folder, faults, after),
                                        name="checkpoint-writer", daemon=True)
        self._thread.start()

    def _run(self, entries, folder, faults, after) -> None:
        t0 = time.perf_counter()
        try:
            self.files = write_entries(entries, folder, faults)
        except BaseException as e:  # noqa: BLE001 (reported to every rank by the commit)
            self.error = e
        finally:
            entries.clear()  # the states (host copies) go now
            self.seconds = time.perf_counter() - t0
        if after is not None and self.error is None:
            try:
                after()
            except Exception:  # noqa: BLE001 (an optimisation for the next save; the checkpoint is written)
                log.exception("checkpoint writer: after-write step failed")

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self) -> None:
        self._thread.join()
