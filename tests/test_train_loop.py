"""End-to-end train loop through `train.py` under torchrun: data-parallel equivalence and exact resume."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["+exp=tiny_cpu", "data=synthetic", "data.kind=markov", "logging.wandb.mode=disabled",
          "logging.progress_bar=false", "train.seq_len=32",
          "optim.warmup_steps=2", "model.num_layers=2", "data.vocab_size=512"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_train(run_dir: Path, nproc: int, overrides: list[str]) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("RANK", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
           "train.py", *COMMON, f"hydra.run.dir={run_dir}", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("one")
    metrics = run_train(run_dir, 1, ["train.steps=6", "train.micro_batch_size=4", "train.save_every=3",
                                     "train.keep_last=3"])
    return run_dir, metrics


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_two_processes_match_one_process_on_the_same_global_batch(one_process_run, tmp_path, stage):
    _, one = one_process_run
    two = run_train(tmp_path, 2, ["train.steps=6", "train.micro_batch_size=2", f"deepspeed=zero{stage}"])
    assert [m["step"] for m in one] == [m["step"] for m in two] == list(range(1, 7))
    # fp32 on CPU; the two runs differ only in how gradients are summed (per-rank partial sums then an
    # all-reduce vs one sum), ~1e-7 relative per step, growing slowly over 6 Adam steps.
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-4), (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=2e-3), (a, b)
    assert one[-1]["loss"] < one[0]["loss"]
    # one run directory shared by both ranks: one metrics file, written by rank 0 only
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 6


@pytest.mark.slow
def test_resume_from_checkpoint_reproduces_the_uninterrupted_run(one_process_run, tmp_path):
    run_dir, full = one_process_run
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text() == "step00000006"
    # pretend the run crashed right after the step-3 checkpoint
    shutil.copytree(ckpts / "step00000003", tmp_path / "checkpoints" / "step00000003")
    (tmp_path / "checkpoints" / "latest").write_text("step00000003")
    resumed = run_train(tmp_path, 1, ["train.steps=6", "train.micro_batch_size=4"])
    assert [m["step"] for m in resumed] == [4, 5, 6]
    for a, b in zip(full[3:], resumed):
        assert b["loss"] == a["loss"] and b["grad_norm"] == a["grad_norm"] and b["lr"] == a["lr"], (a, b)


def test_bad_override_fails_with_the_key_in_the_message(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "train.py", "+exp=tiny_cpu", "train.stepz=3", f"hydra.run.dir={tmp_path}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "stepz" in proc.stderr


@pytest.mark.slow
def test_deepspeed_launcher_local_rank_argument_does_not_break_hydra(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), "train.py", *COMMON,
           "train.steps=2", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.slow
def test_fp8_run_with_fp8_adam_resumes_exactly(tmp_path):
    fp8 = ["precision=fp8", "optim=fp8_adamw", "optim.min_fp8_numel=0", "train.steps=4", "train.micro_batch_size=2"]
    full = run_train(tmp_path / "full", 1, [*fp8, "train.save_every=2"])
    ckpts = tmp_path / "full" / "checkpoints"
    shutil.copytree(ckpts / "step00000002", tmp_path / "resumed" / "checkpoints" / "step00000002")
    (tmp_path / "resumed" / "checkpoints" / "latest").write_text("step00000002")
    resumed = run_train(tmp_path / "resumed", 1, fp8)
    assert [m["step"] for m in resumed] == [3, 4]
    for a, b in zip(full[2:], resumed):
        assert b["loss"] == a["loss"] and b["grad_norm"] == a["grad_norm"], (a, b)
