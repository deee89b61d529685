"""Checkpoint manifests, verification, fallback and rotation (ling/checkpoint/store.py), on a stand-in engine that
writes random shards the way DeepSpeed lays them out; the real engine is exercised in test_train_loop.py."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from ling.checkpoint import store as checkpoint
from ling.checkpoint.layout import MANIFEST, tag_for
from ling.checkpoint.store import newest_verified, rotate, verify
from tests.helpers import overwrite_4k


class ShardWriter:
    """save_checkpoint/load_checkpoint like a one-rank DeepSpeed engine: a model file and an optimizer shard."""

    def __init__(self, seed: int = 0) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.loaded: list[str] = []

    def save_checkpoint(self, save_dir: str, tag: str, save_latest: bool = True) -> None:
        folder = Path(save_dir) / tag
        folder.mkdir(parents=True, exist_ok=True)
        for name, n in (("mp_rank_00_model_states.pt", 3000), ("zero_pp_rank_0_mp_rank_00_optim_states.pt", 5000)):
            torch.save(torch.randn(n, generator=self.gen), folder / name)

    def load_checkpoint(self, load_dir: str, tag: str):
        self.loaded.append(tag)
        return str(Path(load_dir) / tag), {}


def save_steps(ckpt_dir: Path, steps, keep_last: int = 0, engine: ShardWriter | None = None) -> ShardWriter:
    engine = engine or ShardWriter()
    for s in steps:
        checkpoint.save(engine, ckpt_dir, s, {"loader": {"consumed": 4 * s}}, keep_last)
    return engine


DAMAGE = {
    "deleted optimizer shard": (lambda d: (d / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink(),
                                "zero_pp_rank_0_mp_rank_00_optim_states.pt is missing"),
    "truncated model file": (lambda d: os.truncate(d / "mp_rank_00_model_states.pt", 1000),
                             "mp_rank_00_model_states.pt has 1000 bytes"),
    "truncated trainer state": (lambda d: os.truncate(d / "trainer_state_rank0.pt", 10),
                                "trainer_state_rank0.pt has 10 bytes"),
    "4 KiB overwritten in the model states": (lambda d: overwrite_4k(d / "mp_rank_00_model_states.pt"),
                                              "mp_rank_00_model_states.pt does not match its sha256"),
    "no manifest": (lambda d: (d / MANIFEST).unlink(), "no manifest.json"),
    "garbled manifest": (lambda d: (d / MANIFEST).write_text("{not json"), "manifest.json is unreadable"),
}


def test_save_writes_a_manifest_of_every_file_and_it_verifies(tmp_path):
    save_steps(tmp_path, [1, 2, 3], keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["step00000002", "step00000003"]
    assert (tmp_path / "latest").read_text() == "step00000003"
    manifest = json.loads((tmp_path / "step00000003" / MANIFEST).read_text())
    on_disk = {p.name for p in (tmp_path / "step00000003").iterdir()} - {MANIFEST}
    assert set(manifest["files"]) == on_disk == {"mp_rank_00_model_states.pt", "trainer_state_rank0.pt",
                                                 "zero_pp_rank_0_mp_rank_00_optim_states.pt"}
    for name, entry in manifest["files"].items():
        assert entry["size"] == (tmp_path / "step00000003" / name).stat().st_size
        assert entry["sha256"] == checkpoint.sha256_file(tmp_path / "step00000003" / name)
    assert manifest["step"] == 3 and manifest["world_size"] == 1
    assert verify(tmp_path / "step00000003") == []
    assert not list(tmp_path.glob("*.partial")) and not list(tmp_path.rglob("*.tmp"))


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_each_kind_of_damage_is_found_and_the_previous_checkpoint_is_taken(tmp_path, kind):
    save_steps(tmp_path, [1, 2])
    damage, message = DAMAGE[kind]
    damage(tmp_path / "step00000002")
    problems = verify(tmp_path / "step00000002")
    assert problems and message in problems[0], problems
    folder, skipped = newest_verified(tmp_path)
    assert folder == tmp_path / "step00000001"
    assert [name for name, _ in skipped] == ["step00000002"] and message in skipped[0][1]


def test_size_only_verification_misses_a_same_size_overwrite_but_not_a_truncation(tmp_path):
    save_steps(tmp_path, [1])
    folder = tmp_path / "step00000001"
    overwrite_4k(folder / "mp_rank_00_model_states.pt")
    assert verify(folder, checksums=False) == []  # what train.verify_checksums=false trades away
    assert verify(folder, checksums=True)
    os.truncate(folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt", 7)
    assert "has 7 bytes" in verify(folder, checksums=False)[0]


def test_an_interrupted_save_is_never_a_candidate_and_is_reported(tmp_path):
    save_steps(tmp_path, [1])
    shutil.copytree(tmp_path / "step00000001", tmp_path / "step00000002.partial")  # killed before the rename
    folder, skipped = newest_verified(tmp_path)
    assert folder == tmp_path / "step00000001"
    assert skipped == [("step00000002.partial", "an interrupted save")]


def test_a_checkpoint_from_another_world_size_does_not_verify(tmp_path):
    save_steps(tmp_path, [1])
    path = tmp_path / "step00000001" / MANIFEST
    manifest = json.loads(path.read_text())
    manifest["world_size"] = 2
    path.write_text(json.dumps(manifest))
    assert verify(tmp_path / "step00000001") == ["written by 2 ranks, this run has 1"]


def test_rotation_keeps_the_newest_and_drops_what_a_resume_must_not_pick(tmp_path):
    engine = save_steps(tmp_path, [1, 2, 3, 4, 5])  # keep all
    (tmp_path / "step00000004" / MANIFEST).unlink()  # torn
    # a run resumed from step 2 (4 is torn, say 5 was rejected) saves step 3 again: 4 and 5 belong to the
    # abandoned run and would shadow the new ones, so they go; keep_last=2 keeps 2 and the new 3
    save_steps(tmp_path, [3], keep_last=2, engine=engine)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["step00000002", "step00000003"]
    assert verify(tmp_path / "step00000003") == []
    assert rotate(tmp_path, keep_last=1, current_step=3) == ["step00000002"]
    assert (tmp_path / "step00000003").is_dir()  # the newest complete one is never removed


def test_load_restores_the_trainer_state_and_rng(tmp_path):
    engine = ShardWriter()
    torch.manual_seed(7)
    checkpoint.save(engine, tmp_path, 4, {"loader": {"consumed": 16}}, keep_last=0)
    expected = torch.rand(3)
    torch.manual_seed(99)
    state = checkpoint.load(engine, tmp_path / tag_for(4))
    assert engine.loaded == ["step00000004"]
    assert state["step"] == 4 and state["loader"] == {"consumed": 16}
    assert torch.equal(torch.rand(3), expected)  # the RNG continues where the saved run was
