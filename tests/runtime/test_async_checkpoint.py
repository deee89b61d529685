"""Asynchronous, verified checkpoints (ling/checkpoint/snapshot.py, store.Checkpointer): the snapshot is what
the files hold whatever training does afterwards, every file is hashed as it is written, a failed write
(a full disk) removes its folder and keeps the previous checkpoint, and the host buffers are reused and pinned
on a GPU. The end-to-end faults (kill -9 mid-save, ENOSPC in a real run, a tmpfs) are in test_run_faults.py."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from ling.checkpoint import store as checkpoint
from ling.checkpoint.layout import MANIFEST, tag_for
from ling.checkpoint.snapshot import HostBuffers, SaveFaults, snapshot, write_entries
from ling.checkpoint.store import Checkpointer, CheckpointWriteError, model_mismatch, newest_verified, verify
from ling.files import HashingFile, atomic_write, sha256_file
from tests.runtime.test_runtime_checkpoint import ShardWriter
from tests.runtime.test_runtime_guard import engine_for, full_params, step


def test_a_hashing_file_hashes_exactly_the_bytes_torch_save_writes(tmp_path):
    state = {"w": torch.randn(300, 70), "fp8": torch.randn(64).to(torch.float8_e4m3fn), "n": 3,
             "nested": [torch.arange(5), {"b": torch.ones(2, dtype=torch.bfloat16)}]}
    out = HashingFile(tmp_path / "x.pt")
    torch.save(state, out)
    out.close()
    data = (tmp_path / "x.pt").read_bytes()
    assert out.size == len(data) and out.sha256 == hashlib.sha256(data).hexdigest()
    loaded = torch.load(tmp_path / "x.pt", weights_only=True)
    assert torch.equal(loaded["w"], state["w"]) and loaded["n"] == 3
    assert torch.equal(loaded["fp8"].view(torch.uint8), state["fp8"].view(torch.uint8))


def test_a_failed_write_reports_the_full_disk_not_torchs_wrapper_of_it(tmp_path):
    entries = [(tmp_path / "a.pt", {"w": torch.randn(10_000)})]
    with pytest.raises(OSError) as caught:
        write_entries(entries, tmp_path, SaveFaults(enospc_after_bytes=5000))
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(tmp_path / "a.pt")


def test_atomic_write_removes_its_temporary_file_when_writing_fails(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("kept\n")

    def fail(tmp: Path) -> None:
        tmp.write_text("half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError):
        atomic_write(tmp_path / "metrics.jsonl", fail)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
    assert (tmp_path / "metrics.jsonl").read_text() == "kept\n"


def test_a_snapshot_is_a_copy_with_a_storage_per_tensor():
    flat = torch.arange(1000, dtype=torch.float32)
    state = {"view": flat[10:20], "t": (flat[:3], 7), "list": [flat.view(10, 100)[:, 0]]}
    copy = snapshot(state, HostBuffers(keep=False))
    flat.add_(1)  # training goes on
    assert torch.equal(copy["view"], torch.arange(10, 20, dtype=torch.float32)) and copy["t"][1] == 7
    assert copy["view"].untyped_storage().nbytes() == 40  # its own storage: torch.save writes 10 floats, not 1000
    assert torch.equal(copy["list"][0], torch.arange(0, 1000, 100, dtype=torch.float32))


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [True, False])
def test_the_checkpoint_holds_the_state_at_the_snapshot_while_training_goes_on(tmp_path, async_save):
    """A real DeepSpeed engine (ZeRO-2, CPU): the save starts at step 1, the writer is slowed down, training takes
    two more steps meanwhile; the committed checkpoint loads back the step-1 weights, and its manifest's sha256
    (computed while writing) match the files."""
    engine = engine_for(["deepspeed=zero2"])
    step(engine, 0)
    at_save = full_params(engine)
    saver = Checkpointer(tmp_path, keep_last=0, async_save=async_save, faults=SaveFaults(delay_s=0.3))
    pending = saver.start(engine, 1, {"loader": {"consumed": 4}})
    assert (pending.write is not None) == async_save and pending.stall_s >= 0
    step(engine, 1)
    step(engine, 2)
    assert not torch.equal(full_params(engine)["lm_head.weight"], at_save["lm_head.weight"])
    done = saver.wait()
    assert done.final == tmp_path / tag_for(1) and saver.pending is None and saver.wait() is None
    assert verify(done.final) == []
    manifest = json.loads((done.final / MANIFEST).read_text())
    for name, entry in manifest["files"].items():
        assert entry["sha256"] == sha256_file(done.final / name) and entry["size"] == (done.final / name).stat().st_size
    fresh = engine_for(["deepspeed=zero2"])
    state = checkpoint.load(fresh, done.final)
    assert state["step"] == 1 and state["loader"] == {"consumed": 4}
    loaded = full_params(fresh)
    assert all(torch.equal(loaded[n], at_save[n]) for n in at_save)
    saver.close()


@pytest.mark.slow
def test_one_save_in_flight_the_next_waits_for_it(tmp_path):
    engine = engine_for(["deepspeed=zero2"])
    saver = Checkpointer(tmp_path, keep_last=0, faults=SaveFaults(delay_s=0.2))
    saver.start(engine, 1, {})
    assert not saver.local_done()  # still writing
    saver.start(engine, 2, {})  # waits for step 1 and commits it first
    assert verify(tmp_path / tag_for(1)) == [] and saver.pending.step == 2
    saver.wait()
    assert [p.name for p in sorted(tmp_path.glob("step*"))] == [tag_for(1), tag_for(2)]
    assert (tmp_path / "latest").read_text() == tag_for(2)


@pytest.mark.slow
def test_a_write_that_runs_out_of_space_removes_its_folder_and_keeps_the_previous_checkpoint(tmp_path):
    engine = engine_for(["deepspeed=zero2"])
    Checkpointer(tmp_path, keep_last=2).start(engine, 1, {}).write.join()  # written, but never committed
    good = Checkpointer(tmp_path, keep_last=2)
    good.start(engine, 2, {})
    good.wait()
    full = Checkpointer(tmp_path, keep_last=2, faults=SaveFaults(enospc_after_bytes=100_000))
    full.start(engine, 3, {})
    with pytest.raises(CheckpointWriteError) as caught:
        full.wait()
    message = str(caught.value)
    assert f"checkpoint {tag_for(3)} could not be written to {tmp_path}" in message
    assert "no space left on device writing" in message and "it needs ≈" in message and "are free now" in message
    assert f"the last checkpoint, {tmp_path / tag_for(2)}, is untouched" in message
    assert not (tmp_path / (tag_for(3) + ".partial")).exists()
    folder, _ = newest_verified(tmp_path)
    assert folder == tmp_path / tag_for(2)


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str):
    """A tmpfs of `size` mounted at `path` for the block (skips the test where mounting is not allowed)."""
    path.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                                                        str(path)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_a_save_larger_than_the_free_space_is_refused_before_writing(tmp_path):
    with small_tmpfs(tmp_path / "disk", "2m") as disk:
        saver = Checkpointer(disk, keep_last=2)
        saver.start(ShardWriter(), 1, {"x": torch.zeros(10)})
        saver.wait()
        with pytest.raises(CheckpointWriteError, match=r"not enough space: it needs ≈ .* GiB \(all ranks\)"):
            saver.start(ShardWriter(), 2, {"x": torch.zeros(2**20)})  # 4 MiB of trainer state
        assert not (disk / (tag_for(2) + ".partial")).exists() and verify(disk / tag_for(1)) == []


def test_the_manifest_records_the_model_and_a_changed_fixed_key_is_named(tmp_path):
    saver = Checkpointer(tmp_path, keep_last=0, manifest_extra={"model": {"num_layers": 2, "num_experts_per_tok": 4,
                                                                           "precision": "bf16"}})
    saver.start(ShardWriter(), 1, {})
    folder = saver.wait().final
    assert json.loads((folder / MANIFEST).read_text())["model"]["num_layers"] == 2
    assert model_mismatch(folder, {"num_layers": 2, "num_experts_per_tok": 4, "precision": "fp8"}) == []
    assert model_mismatch(folder, {"num_layers": 4, "num_experts_per_tok": 2, "precision": "bf16"}) == [
        "model.num_layers: 2 in the checkpoint, 4 now", "model.num_experts_per_tok: 4 in the checkpoint, 2 now"]


@pytest.mark.gpu
def test_gpu_snapshots_reuse_pinned_buffers_and_copy_exactly():
    """On a GPU the kept buffers are pinned after the first save's write and reused: the second snapshot copies
    asynchronously into the same host memory; values are bit-exact (bf16 and fp8)."""
    from ling.checkpoint.snapshot import synchronize

    buffers = HostBuffers(keep=True)
    state = {"w": torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16),
             "q": torch.randn(4096, device="cuda").to(torch.float8_e4m3fn)}
    first = snapshot(state, buffers)
    synchronize()
    assert torch.equal(first["w"], state["w"].cpu()) and not first["w"].is_pinned()
    buffers.pin_pending()
    assert buffers.pinned_bytes == 1024 * 1024 * 2 + 4096
    state["w"].add_(1)
    buffers.begin()
    second = snapshot(state, buffers)
    synchronize()
    assert second["w"].data_ptr() == first["w"].data_ptr() and second["w"].is_pinned()
    assert torch.equal(second["w"], state["w"].cpu())
    assert torch.equal(second["q"].view(torch.uint8), state["q"].cpu().view(torch.uint8))
    buffers.release()
    assert buffers.pinned_bytes == 0


@pytest.mark.gpu
def test_gpu_buffers_are_pinned_ahead_so_the_first_save_copies_at_pinned_speed_too(tmp_path):
    """`prepare` (after the first step) captures DeepSpeed's state dicts without copying and allocates and pins
    their host buffers in the background; the first save then copies into those buffers, and resumes exactly."""
    engine = engine_for(["deepspeed=zero1"], "cuda")
    step(engine, 0)
    saver = Checkpointer(tmp_path, keep_last=0)
    saver.prepare(engine)
    saver._preparing.join()
    pinned = saver.buffers.pinned_bytes
    assert pinned > 0 and not list(tmp_path.glob("probe*"))  # the probe wrote no folder
    at_save = full_params(engine)
    pending = saver.start(engine, 1, {})
    assert saver.buffers.pinned_bytes == pinned  # the same buffers, none added
    step(engine, 1)
    folder = saver.wait().final
    fresh = engine_for(["deepspeed=zero1"], "cuda")
    checkpoint.load(fresh, folder)
    loaded = full_params(fresh)
    assert all(torch.equal(loaded[n], at_save[n]) for n in at_save)
    assert pending.stall_s < 5
    saver.close()


def test_preallocating_walks_states_holding_shapes_and_the_snapshot_copies_them():
    """DeepSpeed's optimizer state holds torch.Size leaves (its partition shapes): preallocation must take them as
    leaves (a Size of Nones cannot be built), and the snapshot copies them and every tensor exactly."""
    state = {"shapes": [torch.Size([3, 4]), (torch.Size([2]), 5)], "t": torch.randn(3, 4), "step": 7}
    buffers = HostBuffers(keep=True)
    buffers.preallocate([state])
    buffers.begin()
    copy = snapshot(state, buffers)
    assert copy["shapes"] == [torch.Size([3, 4]), (torch.Size([2]), 5)] and copy["step"] == 7
    assert torch.equal(copy["t"], state["t"]) and copy["t"].data_ptr() != state["t"].data_ptr()
