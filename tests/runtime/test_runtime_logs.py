"""Logs and run directories: what reaches train.log and the console, metrics.jsonl after a resume, the run-dir
lock, unique run names and the rules for a directory that already holds a run."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
import warnings

import pytest

from ling.train.launch import add_shared_run_overrides
from ling.train.logger import setup_logging, truncate_metrics
from ling.train.preemption import StopSignals
from ling.train.rundir import RunDirBusy, RunDirLock, clear_previous_run, locked_run_dir, previous_run


def test_rank0_logs_reach_train_log_and_the_console_without_library_noise(tmp_path, capsys):
    ds = logging.getLogger("DeepSpeed")
    before = (ds.handlers[:], ds.propagate, logging.getLogger().handlers[:])
    with setup_logging(tmp_path, rank=0):
        logging.getLogger("data.pack").warning("packed cache damaged; rebuilding it")
        logging.getLogger("DeepSpeed").warning("You are using ZeRO with an untested optimizer")
        logging.getLogger("DeepSpeed").info("DeepSpeed chatter below its level")
        logging.getLogger("ling.train.trainer").info("resumed from step 3")
        logging.getLogger("data.pack").warning("packed cache damaged; rebuilding it")  # a repeat
        warnings.warn("`all_gather_into_tensor` is deprecated", FutureWarning, stacklevel=1)
    log = (tmp_path / "train.log").read_text()
    console = capsys.readouterr().err
    for line in ("rebuilding it", "untested optimizer", "resumed from step 3", "all_gather_into_tensor"):
        assert line in log
    assert "DeepSpeed chatter" not in log + console
    assert "rebuilding it" in console and "untested optimizer" in console and "resumed from step 3" in console
    assert console.count("rebuilding it") == 1 and log.count("rebuilding it") == 2
    assert "all_gather_into_tensor" not in console  # deprecation noise: train.log only
    assert (ds.handlers, ds.propagate, logging.getLogger().handlers) == before  # restored afterwards


def test_other_ranks_print_errors_only(tmp_path, capsys):
    with setup_logging(tmp_path, rank=1):
        logging.getLogger("ling").warning("rank 1 warning")
        logging.getLogger("ling").error("rank 1 error")
    console = capsys.readouterr().err
    assert "rank 1 warning" not in console and "[rank 1]" in console and "rank 1 error" in console
    assert not (tmp_path / "train.log").exists()


def test_metrics_after_a_resume_hold_each_step_once(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 8)) + '{"step": 8, "lo')
    assert truncate_metrics(path, 5) == 3  # steps 6, 7 and the torn line
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4, 5]
    assert truncate_metrics(path, 5) == 0


def test_a_second_process_on_a_locked_run_dir_is_refused_or_waits(tmp_path):
    first = RunDirLock(tmp_path)
    assert first.try_acquire() is None
    holder = RunDirLock(tmp_path).try_acquire()
    assert holder and "pid" in holder
    with pytest.raises(RunDirBusy, match="in use by pid"):
        with locked_run_dir(tmp_path):
            pass
    threading.Timer(0.3, first.release).start()
    t0 = time.monotonic()
    with locked_run_dir(tmp_path, wait=True, poll_s=0.05):
        assert time.monotonic() - t0 >= 0.25
        assert RunDirLock(tmp_path).try_acquire() is not None  # now held by the waiter
    assert RunDirLock(tmp_path).try_acquire() is None  # released at the end of the block


def test_unnamed_runs_get_distinct_names_and_a_given_name_is_kept(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    names = set()
    for _ in range(3):
        argv = ["train.py", "+exp=tiny_cpu"]
        add_shared_run_overrides(argv)
        assert argv[:2] == ["train.py", "+exp=tiny_cpu"] and argv[2].startswith("run_name=")
        names.add(argv[2])
    assert len(names) == 3
    argv = ["train.py", "run_name=mine", "train.steps=3"]
    add_shared_run_overrides(argv)
    assert argv == ["train.py", "train.steps=3", "run_name=mine"]


def test_what_an_earlier_run_left_is_described_and_cleared(tmp_path):
    ckpt = tmp_path / "checkpoints"
    assert previous_run(tmp_path, ckpt) == []
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (ckpt / "step00000002").mkdir(parents=True)
    (tmp_path / "train.log").write_text("kept\n")
    assert previous_run(tmp_path, ckpt) == ["metrics.jsonl (2 lines)", "checkpoints/ (step00000002)"]
    clear_previous_run(tmp_path, ckpt)
    assert previous_run(tmp_path, ckpt) == [] and (tmp_path / "train.log").exists()


def test_sigterm_and_sigint_are_recorded_a_quick_repeat_is_ignored_a_late_one_aborts():
    before = signal.getsignal(signal.SIGINT)
    with StopSignals(repeat_window_s=0.2) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)  # the launcher forwarding the same stop: ignored
        assert stop.signum == signal.SIGTERM and stop.name == "SIGTERM"
        time.sleep(0.3)
        with pytest.raises(KeyboardInterrupt, match="second SIGINT"):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)  # the handler runs between bytecodes
    assert signal.getsignal(signal.SIGINT) is before


def test_wandb_logging_without_the_package_names_the_config_key(tmp_path, monkeypatch):
    import sys

    from omegaconf import OmegaConf

    from ling.train.logger import MetricsLogger

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    cfg = OmegaConf.create({"run_name": "r", "logging": {"jsonl": False, "progress_bar": False,
                                                          "wandb": {"mode": "offline", "project": "p"}}})
    with pytest.raises(RuntimeError, match=r"logging\.wandb\.mode=offline needs the wandb package"):
        MetricsLogger(cfg, tmp_path, total_steps=1, start_step=0, enabled=True)
    cfg.logging.wandb.mode = "disabled"
    MetricsLogger(cfg, tmp_path, total_steps=1, start_step=0, enabled=True).close()
