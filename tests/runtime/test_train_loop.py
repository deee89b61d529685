"""End-to-end train loop through `train.py` (as fork-server children, tests/fork_server.py; under torchrun where
the launcher's behaviour is tested): data-parallel equivalence, exact resume after torn
or corrupted checkpoints, SIGTERM, non-finite steps, the run-dir rules, validation and logs."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ling.checkpoint.store import verify
from ling.ranks import free_port
from ling.train.rundir import RunDirLock
from tests.fork_server import run_script
from tests.helpers import COMMON, ROOT, metrics_of, overwrite_4k, same_losses

STEPS = 12


def torchrun(run_dir: Path, nproc: int, overrides: list[str], common: list[str] = COMMON) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
            "train.py", *common, f"hydra.run.dir={run_dir}", *overrides]


def train_env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("RANK", None)
    return env


def python_train(run_dir: Path, overrides: list[str], common: list[str] = COMMON) -> list[str]:
    """`python train.py` without a launcher: one process, its own one-process group (ling.ranks.init_distributed)."""
    return [sys.executable, "train.py", *common, f"hydra.run.dir={run_dir}", *overrides]


def run_train(run_dir: Path, nproc: int, overrides: list[str], expect_rc: int | None = 0, common: list[str] = COMMON,
              launcher: bool = False):
    """Run train.py; returns (metrics lines, the completed process). `expect_rc`: the exit code the run must end
    with (None: any).

    Under torchrun when `launcher` is true: the tests of behaviour under the launcher (its logs; torchrun exits 1
    when a worker fails and reports the worker's exit code, which `expect_rc` is matched against). Otherwise the
    run's processes are children of the worker's fork server (tests/fork_server.py): `python train.py` for one
    process, torchrun's workers with torchrun's environment for several; they skip the ~15 s of CPU that every
    fresh interpreter spends importing torch, DeepSpeed and Hydra, and run the same code."""
    if launcher:
        cmd = torchrun(run_dir, nproc, overrides, common)
        proc = subprocess.run(cmd, cwd=ROOT, env=train_env(), capture_output=True, text=True, timeout=600)
    else:
        argv = ["train.py", *common, f"hydra.run.dir={run_dir}", *overrides]
        proc = run_script(argv, ROOT, train_env(), timeout=600, nproc=nproc if nproc > 1 else None)
    if expect_rc == 0:  # a failed worker's traceback sits before torchrun's summary: keep enough of stderr
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-20000:]
    elif expect_rc is not None and launcher:
        assert proc.returncode != 0 and re.search(rf"exitcode\s*:\s*{expect_rc}\b", proc.stderr), proc.stderr[-5000:]
    elif expect_rc is not None:
        assert proc.returncode == expect_rc, f"exit code {proc.returncode}: " + proc.stderr[-5000:]
    return metrics_of(run_dir), proc


def wait_for_steps(run_dir: Path, proc: subprocess.Popen, n: int, timeout: float = 300) -> None:
    t0 = time.monotonic()
    while len(metrics_of(run_dir)) < n:
        assert proc.poll() is None, "the run ended before it could be signalled"
        assert time.monotonic() - t0 < timeout
        time.sleep(0.02)


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    """12 steps, one process, a verified checkpoint after every step (the newest 5 kept)."""
    run_dir = tmp_path_factory.mktemp("one")
    metrics, _ = run_train(run_dir, 1, [f"train.steps={STEPS}", "train.micro_batch_size=4", "train.save_every=1",
                                        "train.keep_last=5"])
    return run_dir, metrics


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("two")
    metrics, _ = run_train(run_dir, 2, [f"train.steps={STEPS}", "train.micro_batch_size=2", "deepspeed=zero2"])
    return run_dir, metrics


def check_data_parallel_equivalence(one: list[dict], two: list[dict]) -> None:
    assert [m["step"] for m in one] == [m["step"] for m in two] == list(range(1, STEPS + 1))
    # fp32 on CPU; the two runs differ only in how gradients are summed (per-rank partial sums then an
    # all-reduce vs one sum), ~1e-7 relative per step, growing slowly over the Adam steps.
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=5e-4), (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=5e-3), (a, b)
    assert one[-1]["loss"] < one[0]["loss"]


@pytest.mark.slow
def test_zero2_two_processes_match_one_process_on_the_same_global_batch(one_process_run, two_process_run):
    check_data_parallel_equivalence(one_process_run[1], two_process_run[1])
    # one run directory shared by both ranks: one metrics file, written by rank 0 only
    assert len((two_process_run[0] / "metrics.jsonl").read_text().splitlines()) == STEPS


@pytest.mark.slow
def test_zero3_two_processes_match_one_process_on_the_same_global_batch(one_process_run, tmp_path):
    two, _ = run_train(tmp_path, 2, [f"train.steps={STEPS}", "train.micro_batch_size=2", "deepspeed=zero3"])
    check_data_parallel_equivalence(one_process_run[1], two)


@pytest.mark.slow
def test_torn_and_corrupted_checkpoints_are_skipped_and_the_resume_reproduces_the_run(one_process_run, tmp_path):
    """The newest four checkpoints are each damaged in one way; resume=auto says why it skips each, resumes
    from the one before, and steps 9-12 come out exactly as in the uninterrupted run. metrics.jsonl (copied
    from the crashed run, so it already holds steps 9-12) ends with each step once."""
    src, full = one_process_run
    ckpts = tmp_path / "checkpoints"
    shutil.copytree(src / "checkpoints", ckpts)
    shutil.copy(src / "metrics.jsonl", tmp_path / "metrics.jsonl")
    assert sorted(p.name for p in ckpts.glob("step*")) == [f"step{s:08d}" for s in range(8, 13)]
    overwrite_4k(ckpts / "step00000012" / "mp_rank_00_model_states.pt")
    os.truncate(ckpts / "step00000011" / "mp_rank_00_model_states.pt", 4096)
    (ckpts / "step00000010" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    os.truncate(ckpts / "step00000009" / "trainer_state_rank0.pt", 100)
    resumed, proc = run_train(tmp_path, 1, [f"train.steps={STEPS}", "train.micro_batch_size=4", "train.save_every=1",
                                            "train.keep_last=5"], launcher=True)
    same_losses(full, resumed)  # steps 1-8 kept from before, 9-12 trained again: identical
    log = (tmp_path / "train.log").read_text()  # under torchrun, rank 0's warnings reach train.log
    for tag, why in [("step00000012", "mp_rank_00_model_states.pt does not match its sha256"),
                     ("step00000011", "mp_rank_00_model_states.pt has 4096 bytes"),
                     ("step00000010", "zero_pp_rank_0_mp_rank_00_optim_states.pt is missing"),
                     ("step00000009", "trainer_state_rank0.pt has 100 bytes")]:
        assert f"skipping checkpoint {tag}: {why}" in log
        assert f"skipping checkpoint {tag}" in proc.stderr  # and the console
    assert "resumed from" in log and "step00000008 at step 8" in log
    assert "metrics.jsonl: dropped 4 lines after step 8" in log
    assert all(verify(ckpts / f"step{s:08d}") == [] for s in range(8, 13))  # rewritten, good again


@pytest.mark.slow
def test_sigterm_to_torchrun_saves_and_the_resumed_run_reproduces_the_losses(two_process_run, tmp_path):
    _, full = two_process_run
    overrides = [f"train.steps={STEPS}", "train.micro_batch_size=2", "deepspeed=zero2"]
    proc = subprocess.Popen(torchrun(tmp_path, 2, overrides), cwd=ROOT, env=train_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    wait_for_steps(tmp_path, proc, 2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0, out[-3000:]
    stopped = metrics_of(tmp_path)
    k = stopped[-1]["step"]
    assert 2 <= k < STEPS, out[-3000:]
    tags = sorted(p.name for p in (tmp_path / "checkpoints").glob("step*"))
    assert tags == [f"step{k:08d}"] and verify(tmp_path / "checkpoints" / tags[0], world_size=2) == []
    log = (tmp_path / "train.log").read_text()
    assert f"received SIGTERM: stopped after step {k}/{STEPS}" in log
    assert json.loads((tmp_path / "summary.json").read_text())["outcome"] == "stopped by SIGTERM"
    resumed, _ = run_train(tmp_path, 2, overrides)
    same_losses(full, resumed)  # each step once, the resumed ones identical to the uninterrupted run


@pytest.mark.slow
def test_nonfinite_steps_are_skipped_and_too_many_in_a_row_stop_the_run(tmp_path):
    metrics, proc = run_train(tmp_path, 1, ["train.steps=8", "train.save_every=2", "train.inject_nan_steps=[3,4,5]",
                                            "train.max_bad_steps=3"], expect_rc=3)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
    assert [m["skipped"] for m in metrics] == [False, False, True, True, True]
    assert [m["nonfinite_steps"] for m in metrics] == [0, 0, 1, 2, 3]
    assert all(m["loss"] is None for m in metrics[2:])  # NaN is written as null: strict JSON
    assert len({m["lr"] for m in metrics[1:]}) == 1  # skipped steps do not advance the lr schedule either
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step*")) == ["step00000002"]  # no checkpoint after a NaN step
    assert verify(ckpts / "step00000002") == [] and (ckpts / "latest").read_text() == "step00000002"
    message = "3 non-finite steps in a row (steps 3-5"
    assert message in proc.stderr and "the last good checkpoint is" in proc.stderr
    assert message in (tmp_path / "train.log").read_text()


@pytest.mark.slow
def test_a_diverging_run_stops_instead_of_skipping_forever(tmp_path):
    """optim.lr=1e10: step 1 applies, then every gradient norm is inf. The run used to skip silently to the end,
    exit 0 and keep writing checkpoints; now it stops after train.max_bad_steps and keeps step 1's."""
    metrics, proc = run_train(tmp_path, 1, ["train.steps=8", "train.save_every=1", "train.max_bad_steps=3",
                                            "optim.lr=1e10"], expect_rc=3)
    assert [(m["step"], m["skipped"]) for m in metrics] == [(1, False), (2, True), (3, True), (4, True)]
    assert all(m["grad_norm"] is None for m in metrics[1:])  # inf, written as null
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step*")) == ["step00000001"]
    assert verify(tmp_path / "checkpoints" / "step00000001") == []
    assert "grad norm inf" in proc.stderr and "the last good checkpoint is" in proc.stderr


@pytest.mark.slow
def test_a_locked_run_dir_and_a_fresh_start_over_an_old_run_are_refused(one_process_run, tmp_path):
    lock = RunDirLock(tmp_path)
    assert lock.try_acquire() is None  # as a running train.py holds it
    _, proc = run_train(tmp_path, 1, ["train.steps=2"], expect_rc=2)
    assert "is in use by pid" in proc.stderr and "train.on_locked=wait" in proc.stderr
    lock.release()
    src, full = one_process_run
    _, proc = run_train(src, 1, ["train.steps=2", "train.resume=none"], expect_rc=2)
    assert "already holds a run" in proc.stderr and "train.overwrite=true" in proc.stderr
    assert metrics_of(src) == full  # untouched


def write_corpus(path: Path, n_docs: int = 300) -> Path:
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(2, 7))) for _ in range(300)]
    with open(path, "w") as f:
        for _ in range(n_docs):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(20, 60)))}) + "\n")
    return path


@pytest.mark.slow
def test_text_run_validates_summarises_and_logs_the_data_warnings(tmp_path):
    """A real-text run (data=files) with FP8 linears and FP8AdamW: validation every 2 steps in the metrics, the
    closing summary, and under torchrun the data package's warning (a damaged cache being rebuilt) and
    DeepSpeed's warning (untested optimizer) in train.log."""
    from data.text_loader import prepare

    data = ["data=files", f"data.sources=[{{path: {write_corpus(tmp_path / 'corpus.jsonl')}}}]",
            "data.tokenizer.vocab_size=320", "data.tokenizer.train_chars=200000",
            f"data.cache_dir={tmp_path / 'cache'}", "data.num_proc=1", "data.val_fraction=0.1"]
    common = [a for a in COMMON if not a.startswith("data")]
    cfg = {"name": "files", "sources": [str(tmp_path / "corpus.jsonl")], "cache_dir": str(tmp_path / "cache"),
           "num_proc": 1, "val_fraction": 0.1, "tokenizer": {"vocab_size": 320, "train_chars": 200_000}}
    train_split = prepare(cfg, 32).splits["train"]
    shard = Path(train_split.folder) / train_split.index["shards"][0]["file"]
    del train_split
    assert shard.stat().st_size > 8192
    overwrite_4k(shard)
    run = tmp_path / "run"
    metrics, proc = run_train(run, 1, [*data, "precision=fp8", "optim=fp8_adamw", "train.steps=4", "train.eval_every=2",
                                       "train.eval_batches=2"], common=common, launcher=True)
    assert [("val_loss" in m) for m in metrics] == [False, True, False, True]
    assert all(m["val_loss"] > 0 and m["val_ppl"] > 1 for m in metrics if "val_loss" in m)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["outcome"] == "completed" and summary["step"] == 4
    assert summary["val_loss"] == metrics[-1]["val_loss"] and summary["train_loss"] == metrics[-1]["loss"]
    assert summary["checkpoint"].endswith("step00000004") and summary["tokens_per_s"] > 0
    log = (run / "train.log").read_text()
    assert "rebuilding it" in log and "rebuilding it" in proc.stderr  # the data package's own warning
    assert "untested optimizer" in log  # DeepSpeed's warning
    assert "completed at step 4/4" in log and "val loss" in log and "checkpoint " in log


@pytest.mark.slow
def test_bad_override_fails_with_the_key_in_the_message(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = run_script(["train.py", "+exp=tiny_cpu", "train.stepz=3", f"hydra.run.dir={tmp_path}"], ROOT, env,
                      timeout=300)  # `python train.py`, a child of the fork server
    assert proc.returncode != 0
    assert "stepz" in proc.stderr


@pytest.mark.slow
def test_deepspeed_launcher_runs_and_a_sigterm_to_its_process_group_saves(tmp_path):
    """`deepspeed` strips --local_rank; a SIGTERM to the launcher's process group (Ctrl-C, SLURM, kill -TERM
    -PGID) reaches every rank, which finish the step, save and exit."""
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), "train.py", *COMMON,
           f"train.steps={STEPS}", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=train_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    wait_for_steps(tmp_path, proc, 2)
    os.killpg(proc.pid, signal.SIGTERM)
    proc.communicate(timeout=300)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 120:  # the launcher exits at once; its workers save first
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    k = metrics_of(tmp_path)[-1]["step"]
    assert k < STEPS
    assert verify(tmp_path / "checkpoints" / f"step{k:08d}", world_size=2) == []
    assert f"received SIGTERM: stopped after step {k}/{STEPS}" in (tmp_path / "train.log").read_text()


@pytest.mark.slow
def test_fp8_run_with_fp8_adam_resumes_exactly(tmp_path):
    fp8 = ["precision=fp8", "optim=fp8_adamw", "optim.min_fp8_numel=0", "train.steps=4", "train.micro_batch_size=2"]
    check_resume_from_step_2(tmp_path, 1, fp8)


def check_resume_from_step_2(tmp_path: Path, nproc: int, overrides: list[str]) -> list[dict]:
    """A 4-step run saving at step 2, then a fresh run dir holding only that checkpoint: the resumed steps 3-4
    reproduce the uninterrupted run's losses bit for bit. Returns the uninterrupted run's metrics."""
    full, _ = run_train(tmp_path / "full", nproc, [*overrides, "train.save_every=2"])
    tag = "step00000002"
    shutil.copytree(tmp_path / "full" / "checkpoints" / tag, tmp_path / "resumed" / "checkpoints" / tag)
    resumed, _ = run_train(tmp_path / "resumed", nproc, overrides)
    assert [m["step"] for m in resumed] == [3, 4]
    same_losses(full[2:], resumed)
    return full


@pytest.mark.slow
def test_bf16_zero1_with_fp32_accumulation_trains_on_two_processes_and_resumes_exactly(tmp_path):
    """deepspeed=zero1 in bf16 (deepspeed.bf16=true runs bf16 on CPU) is DeepSpeed's BF16_Optimizer with fp32
    gradient sums and an fp32 all-reduce (ling/train/engine.py): the FP8 model with FP8AdamW trains through it on 2
    ranks with gradient accumulation, and a resume from its checkpoint reproduces the losses bit for bit."""
    bf16 = ["deepspeed=zero1", "deepspeed.bf16=true", "precision=fp8", "optim=fp8_adamw", "optim.min_fp8_numel=0",
            "train.steps=4", "train.micro_batch_size=1", "train.grad_accum=2"]
    full = check_resume_from_step_2(tmp_path, 2, bf16)
    # not ZeRO's optimizer: DeepSpeed's BF16_Optimizer, through ling.engine's subclass
    assert "DeepSpeed's BF16_Optimizer via LeanBF16Optimizer)" in (tmp_path / "full" / "train.log").read_text()
    assert all(m["grad_norm"] > 0 for m in full) and full[-1]["loss"] < full[0]["loss"]


@pytest.mark.slow
def test_a_nonfinite_step_is_skipped_under_zero1s_bf16_optimizer_too(tmp_path):
    """The non-finite guard relies on DeepSpeed skipping the step; ZeRO-1 in bf16 with fp32 accumulation is
    DeepSpeed's BF16_Optimizer, which decides that itself (an invalid gradient norm): step 3's NaN is skipped
    there as under ZeRO-2, and training goes on after it."""
    metrics, _ = run_train(tmp_path, 1, ["train.steps=5", "train.inject_nan_steps=[3]", "deepspeed=zero1",
                                         "deepspeed.bf16=true"])
    assert [(m["step"], m["skipped"], m["nonfinite_steps"]) for m in metrics] == [
        (1, False, 0), (2, False, 0), (3, True, 1), (4, False, 1), (5, False, 1)]
    assert metrics[2]["loss"] is None and all(m["loss"] is not None for m in metrics[3:])
    assert "DeepSpeed's BF16_Optimizer via LeanBF16Optimizer)" in (tmp_path / "train.log").read_text()
