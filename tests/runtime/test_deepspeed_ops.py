"""Start-up builds nothing and waits on no lock (ling/train/deepspeed_compat.py): DeepSpeed's CPU shared-memory op
is not JIT-built, a run killed at start-up leaves nothing that holds up the next one, and a build lock left by a killed
build (the way torch's FileBaton leaves it: an empty file) neither hangs a run nor goes unmentioned.

Each test has its own torch extension cache (TORCH_EXTENSIONS_DIR), so a fresh machine's first run is what runs.
Before ling/train/deepspeed_compat.py, the first run built the op for 88 s holding `deepspeed_shm_comm/lock`, and a run
started while the lock file existed waited on it forever: the deadlines below are what such a run fails."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder

from ling.train.deepspeed_compat import LOCK_FILE, SHM_COMM_OP
from tests.helpers import COMMON, ROOT, metrics_of

RUN = [*COMMON, "train.steps=2", "train.save_every=0", "train.save_final=false"]
DEADLINE_S = 300  # a run of 2 tiny steps starts and ends in about 20 s here, a minute on a loaded machine


def env_with_cache(cache: Path) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TORCH_EXTENSIONS_DIR": str(cache)}
    env.pop("RANK", None)
    return env


def train_cmd(run_dir: Path) -> list[str]:
    """One process (train.py makes its own one-process group: DeepSpeed's start-up as under torchrun)."""
    return [sys.executable, "train.py", *RUN, f"hydra.run.dir={run_dir}"]


def read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def test_the_op_is_deepspeeds_shared_memory_op():
    assert ShareMemCommBuilder.NAME == SHM_COMM_OP


@pytest.mark.slow
def test_init_distributed_builds_and_loads_no_op(tmp_path):
    script = ("from ling.ranks import init_distributed\n"
              "init_distributed()\n"
              "import deepspeed.comm.comm as c\n"
              "assert c.cdb.shm_comm_op is None, c.cdb.shm_comm_op\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env_with_cache(tmp_path / "ext"),
                          capture_output=True, text=True, timeout=DEADLINE_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (tmp_path / "ext" / SHM_COMM_OP).exists()  # torch makes an op's build folder first thing


@pytest.mark.slow
def test_a_run_killed_at_start_up_leaves_nothing_that_holds_up_the_next(tmp_path):
    """SIGKILL while the first run starts: where it built the op, the moment its lock file appears; here, where
    it builds nothing, once DeepSpeed's start-up is behind it (train.log names the model, before step 1). The
    next run with the same extension cache then trains to its end."""
    cache, first = tmp_path / "ext", tmp_path / "first"
    lock = cache / SHM_COMM_OP / LOCK_FILE
    proc = subprocess.Popen(train_cmd(first), cwd=ROOT, env=env_with_cache(cache), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        t0 = time.monotonic()
        while not (lock.exists() or "model: " in read(first / "train.log")):
            assert proc.poll() is None, "the first run ended before it could be killed"
            assert time.monotonic() - t0 < DEADLINE_S, "the first run did not get through its start-up"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    second = tmp_path / "second"
    done = subprocess.run(train_cmd(second), cwd=ROOT, env=env_with_cache(cache), capture_output=True, text=True,
                          timeout=DEADLINE_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [m["step"] for m in metrics_of(second)] == [1, 2]


@pytest.mark.slow
def test_a_build_lock_left_behind_neither_hangs_the_run_nor_goes_unmentioned(tmp_path):
    lock = tmp_path / "ext" / SHM_COMM_OP / LOCK_FILE
    lock.parent.mkdir(parents=True)
    lock.touch()  # what a build killed mid-way leaves: FileBaton's empty file, no owner recorded
    run_dir = tmp_path / "run"
    done = subprocess.run(train_cmd(run_dir), cwd=ROOT, env=env_with_cache(tmp_path / "ext"), capture_output=True,
                          text=True, timeout=DEADLINE_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [m["step"] for m in metrics_of(run_dir)] == [1, 2]
    said = done.stdout + done.stderr
    assert f"found {lock}: the lock of a build of DeepSpeed's {SHM_COMM_OP} op that did not finish" in said
    assert "remove the file unless a build is running now" in said
    assert lock.exists()  # not ours to remove: another job may be building the op right now
