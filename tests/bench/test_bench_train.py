"""bench/bench_train.py on CPU: variant specs, the headline table's baselines and OOM rows, medians without
the profiled step, and one real run of the tiny model with its profile table printed after the main table."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ling.config_check import config_problems
from tests.helpers import ROOT, compose_cfg, load_bench


def test_variant_specs():
    bench = load_bench("bench_train")
    assert bench.parse_variant("fp8", 1) == ("fp8", False, 1, "none")
    assert bench.parse_variant("bf16_nomtp@4", 1, "full") == ("bf16", True, 4, "full")
    assert bench.parse_variant("fp8_nomtp+selective@max", 1) == ("fp8", True, None, "selective")
    assert bench.family("fp8_nomtp+full@4") == "fp8_nomtp" and bench.family("bf16") == "bf16"
    args = type("Args", (), {"micro": 2, "recompute": "full", "deepspeed": "zero1", "extra": ""})()
    assert bench.variant_overrides("fp8_nomtp", args) == (
        2, ["deepspeed=zero1", "precision=fp8", "optim=fp8_adamw", "train.micro_batch_size=2", "model.recompute=full",
            "model.num_mtp_layers=0"])
    assert bench.variant_overrides("bf16+none@4", args)[1][3:5] == ["train.micro_batch_size=4", "model.recompute=none"]
    # a row (or --extra) that names the deepspeed group replaces --deepspeed's: Hydra refuses two values of a group
    micro, overrides = bench.variant_overrides("fp8_bf16wgrad_zero2@12", args)  # the ZeRO-2 grad path's rows
    assert micro == 12 and "fp8.expert_wgrad=bf16" in overrides
    assert [o for o in overrides if o.startswith("deepspeed=")] == ["deepspeed=zero2"]
    args.extra = "deepspeed=zero3 train.seed=2"
    assert not any(o.startswith("deepspeed=") for o in bench.variant_overrides("bf16", args)[1])
    for bad in ("fp9", "fp8@", "fp8@0", "fp8@x", "fp8@maximum", "bf16_nomtp_nomtp", "fp8+half", "fp8+"):
        with pytest.raises(SystemExit, match="--variants"):
            bench.parse_variant(bad, 1)


def test_every_variant_is_a_valid_run_config():
    """A variant's overrides pass the run-config check (a typo in a row would otherwise fail minutes into a GPU
    call)."""
    bench = load_bench("bench_train")
    args = type("Args", (), {"micro": 1, "recompute": "none", "deepspeed": "zero1", "extra": ""})()
    for name in bench.VARIANTS:
        problems = config_problems(compose_cfg(bench.variant_overrides(name, args)[1]), 1)
        # on this CPU machine: the CUDA-graph rows need a GPU (said as a problem of model.cuda_graphs)
        assert [p for p in problems if not p.startswith("model.cuda_graphs")] == [], name


def test_largest_micro_batch_search_doubles_until_oom_then_bisects():
    """fp8@max with --micro 1 where 5 is the largest that fits: trials at 1, 2, 4 fit, 8 runs out of memory, then
    6 (out) and 5 (fits) → 5; `--max-search double` stops at 4; the cap bounds both phases; a trial that fails
    otherwise stops the bench naming it; nothing fitting → None."""
    import argparse

    bench = load_bench("bench_train")
    assert bench.parse_variant("fp8_nomtp@max", 1) == ("fp8", True, None, "none")
    args = argparse.Namespace(micro=1, max_micro=64, max_search="bisect", steps=12, warmup=4)
    tried = []

    def fake(spec, trial, limit=5):
        tried.append((spec, trial.steps, trial.warmup))
        micro = int(spec.partition("@")[2])
        return {"variant": spec, "micro": micro} if micro <= limit else {"variant": spec, "error": "OOM"}

    fits, log = bench.largest_micro("fp8_nomtp@max", args, run=fake)
    assert fits == 5 and [t[0] for t in tried] == [f"fp8_nomtp@{m}" for m in (1, 2, 4, 8, 6, 5)]
    assert all(t[1:] == (2, 0) for t in tried) and args.steps == 12  # short trials; the caller's args untouched
    assert log[3:] == ["fp8_nomtp@8: OOM", "fp8_nomtp@6: OOM", "fp8_nomtp@5: fits"]
    tried.clear()
    doubling = argparse.Namespace(**{**vars(args), "max_search": "double"})
    assert bench.largest_micro("fp8@max", doubling, run=fake)[0] == 4 and len(tried) == 4
    for limit in range(1, 40):  # bisection finds every limit exactly, from any start
        for start in (1, 3):
            got = bench.largest_micro("fp8@max", argparse.Namespace(**{**vars(args), "micro": start}),
                                      run=lambda s, t, limit=limit: fake(s, t, limit))[0]  # fmt: skip
            assert got == (limit if limit >= start else None), (limit, start)
    tried.clear()
    capped = argparse.Namespace(**{**vars(args), "max_micro": 6})  # 1, 2, 4 fit; 8 is past the cap: 5, then 6
    assert bench.largest_micro("fp8@max", capped, run=lambda s, t: fake(s, t, limit=64))[0] == 6
    assert max(int(t[0].partition("@")[2]) for t in tried) == 6
    with pytest.raises(SystemExit, match="fp8@max: the trial at micro-batch 1 failed: failed: boom"):
        bench.largest_micro("fp8@max", args, run=lambda s, t: {"variant": s, "error": "failed: boom"})


def test_largest_against_largest_line():
    """Each family's fastest @max row, over the recompute modes searched."""
    bench = load_bench("bench_train")
    rows = [{**result("bf16@2", 2, 1000.0, 120.0), "largest_of": "bf16@max"},
            {**result("bf16+full@8", 8, 1100.0, 110.0), "largest_of": "bf16+full@max"},
            {**result("fp8@8", 8, 1700.0, 96.0), "largest_of": "fp8@max"}, result("fp8", 1, 900.0, 70.0)]
    assert bench.largest_vs_largest(rows) == [
        "fp8 at its largest micro-batch (fp8@8) vs bf16 at its largest (bf16+full@8): 1.55x tokens/s, "
        "0.87x peak memory"]


def test_fastest_against_fastest_line_without_a_search():
    """Rows at given micro-batches (the headline run's largest known to fit): each family's fastest row against
    bf16's fastest of the same MTP setting, said to be unsearched; a searched family keeps its @max row."""
    bench = load_bench("bench_train")
    rows = [result("bf16@5", 5, 39379.0, 137.1), result("fp8@4", 4, 34739.0, 87.0),
            result("fp8@12", 12, 40221.0, 130.7), result("bf16_nomtp@5", 5, 48161.0, 129.9),
            result("fp8_nomtp@12", 12, 49063.0, 123.2),
            {"variant": "fp8_bf16wgrad@16", "micro": 16, "error": "OOM"}]
    assert bench.largest_vs_largest(rows) == [
        "fp8's fastest row (fp8@12) vs bf16's fastest (bf16@5): 1.02x tokens/s, 0.95x peak memory "
        "(micro-batches as given, not searched with @max)",
        "fp8_nomtp's fastest row (fp8_nomtp@12) vs bf16_nomtp's fastest (bf16_nomtp@5): 1.02x tokens/s, "
        "0.95x peak memory (micro-batches as given, not searched with @max)"]
    searched = [*rows, {**result("fp8@8", 8, 30000.0, 96.0), "largest_of": "fp8@max"}]  # slower, but searched
    assert bench.largest_vs_largest(searched)[0] == (
        "fp8's fastest row (fp8@8) vs bf16's fastest (bf16@5): 0.76x tokens/s, 0.70x peak memory "
        "(only one of them searched with @max)")


def result(variant: str, micro: int, tokens: float, mem: float, recompute: str = "none") -> dict:
    return {"variant": variant, "micro": micro, "recompute": recompute, "tokens_per_s": tokens, "tflops": tokens / 100,
            "mfu": 0.25, "peak_mem_gib": mem, "optim_state_gib": 1.5, "loss_first": 10.0, "loss_last": 9.5}


def test_each_row_is_compared_with_the_bf16_row_of_its_micro_batch_and_mtp_setting():
    bench = load_bench("bench_train")
    results = [result("bf16", 1, 1000.0, 100.0),
               {**result("fp8", 1, 1300.0, 70.0), "tokens_per_s_range": (1200.0, 1400.0)},
               result("bf16_nomtp", 1, 1200.0, 80.0), result("fp8_nomtp@1", 1, 1800.0, 40.0),
               {"variant": "bf16@2", "micro": 2, "error": "OOM"}, result("fp8@2", 2, 2000.0, 90.0),
               result("fp8+full", 1, 800.0, 50.0, "full")]
    rows = {r[0]: r for r in bench.table_rows(results)}
    assert len(bench.HEADER) == len(rows["bf16"])
    assert rows["bf16"][1:5] == ["1", "none", "1,000", "1.00x"]
    assert rows["fp8"][4] == "1.30x" and rows["fp8"][8] == "0.70x"
    assert rows["fp8_nomtp@1"][4] == "1.50x" and rows["fp8_nomtp@1"][8] == "0.50x"  # against bf16_nomtp
    assert rows["bf16@2"][3] == "OOM" and len(rows["bf16@2"]) == len(bench.HEADER)
    assert rows["fp8@2"][4] == "" and rows["fp8@2"][8] == ""  # its bf16 row ran out of memory
    assert rows["fp8+full"][4] == "" and rows["fp8+full"][2] == "full"  # no bf16 row with full recompute
    assert rows["fp8"][5:8] == ["13", "25.0%", "70.0"] and rows["fp8"][9:12] == ["1.50", "10.000→9.500", "1,200–1,400"]
    assert rows["bf16"][11] == "" and rows["bf16@2"][11] == ""  # a row without the spread (or an OOM) leaves it blank
    assert rows["bf16"][12:] == ["n/a", "n/a", "n/a"]  # no clock samples (CPU, or NVML missing), no CUDA allocator


def test_the_clock_and_allocator_columns_are_the_median_clock_the_mean_power_capped_share_and_the_retries(tmp_path):
    bench = load_bench("bench_train")
    lines = [{"step": s, "tokens_per_s": 1.0, "tflops_per_gpu": 1.0, "peak_mem_gib": 1.0, "loss": 1.0,
              "sm_clock_mhz": mhz, "power_capped_share": capped, "alloc_retries": retries}
             for s, (mhz, capped, retries) in enumerate([(1980.0, 0.0, 7), (1700.0, 1.0, 0), (1830.0, 0.5, 2),
                                                         (1600.0, 0.9, 1)], start=1)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    summary = bench.summarize_run(tmp_path, warmup=1)  # the first step is warm-up: left out
    assert summary["sm_clock_mhz"] == 1700.0 and summary["power_capped_share"] == pytest.approx(0.8)
    assert summary["alloc_retries"] == 3  # summed over the timed steps
    row = bench.table_rows([{**result("fp8", 1, 1300.0, 70.0), **summary}])[0]
    assert row[-3:] == ["1,700", "80%", "3"]


def test_medians_leave_out_the_warmup_and_the_profiled_step(tmp_path):
    bench = load_bench("bench_train")
    lines = [{"step": s, "tokens_per_s": float(t), "tflops_per_gpu": 1.0, "peak_mem_gib": float(s), "loss": 5.0 - s}
             for s, t in enumerate([1, 2, 100, 3, 4], start=1)]
    lines[0]["optim_state_gib"] = 0.5
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    summary = bench.summarize_run(tmp_path, warmup=1, skip_steps=(3,))
    assert summary["tokens_per_s"] == 3.0  # median of steps 2, 4, 5
    assert summary["tokens_per_s_range"] == (2.0, 4.0)  # their slowest and fastest
    assert summary["peak_mem_gib"] == 5.0 and summary["optim_state_gib"] == 0.5
    assert bench.summarize_run(tmp_path, warmup=1)["tokens_per_s"] == 3.5
    assert summary["step_ms"] is None  # no step_time_s logged


def test_the_host_stall_line_sets_the_profiled_gpu_time_against_the_unprofiled_steps(tmp_path):
    bench = load_bench("bench_train")
    lines = [{"step": s, "tokens_per_s": 1.0, "step_time_s": t, "tflops_per_gpu": 1.0, "peak_mem_gib": 1.0,
              "loss": 1.0} for s, t in enumerate([9.0, 3.2, 3.0, 7.5], start=1)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    summary = bench.summarize_run(tmp_path, warmup=1, skip_steps=(4,))
    assert summary["step_ms"] == pytest.approx(3100.0)  # median of steps 2 and 3: not the warm-up, not the profiled
    line = bench.host_stall_line({**summary, "profile_busy_ms": 2790.0})
    assert "2,790.0 ms" in line and "3,100.0 ms" in line and "90%" in line and "310.0 ms" in line
    assert bench.host_stall_line({**summary, "profile_busy_ms": None}) is None  # a CPU profile has no busy time
    assert bench.host_stall_line({"profile_busy_ms": 5.0}) is None  # no step times


@pytest.mark.slow
def test_bench_train_runs_on_cpu_with_an_oom_row_and_the_profile_last(monkeypatch, capsys):
    bench = load_bench("bench_train")
    real_run = subprocess.run

    def run(cmd, **kw):  # the micro-batch-2 variant "runs out of memory"
        if "train.micro_batch_size=2" in cmd:
            return subprocess.CompletedProcess(cmd, 1, "", "Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory.")
        return real_run(cmd, **kw)

    monkeypatch.setattr(bench.subprocess, "run", run)
    bench.main(["--device", "cpu", "--model", "tiny", "--variants", "fp8_nomtp,bf16@2", "--profile", "fp8_nomtp",
                "--steps", "3", "--warmup", "1", "--seq-len", "32", "--grad-accum", "1", "--vocab", "512",
                "--extra", "model.num_layers=2"])
    out = capsys.readouterr().out
    table = out[out.rindex("| variant | micro-batch"):out.index("#### Profile of `fp8_nomtp`")]
    rows = [line.split(" | ") for line in table.strip().splitlines()[2:]]
    assert [r[0].lstrip("| ") for r in rows] == ["fp8_nomtp", "bf16@2"]
    assert rows[1][1:4] == ["2", "none", "OOM"]
    assert float(rows[0][9]) > 0  # optimizer state, logged by the run
    lo, hi = (float(v.replace(",", "")) for v in rows[0][11].strip(" |").split("–"))  # the timed steps' spread
    assert lo <= float(rows[0][3].replace(",", "")) <= hi
    profile = out[out.index("#### Profile of `fp8_nomtp`"):]
    assert "Where optimizer step 3 spends its time" in profile and "| optimizer (DeepSpeed step) |" in profile
    assert "the GPU works" not in profile  # no GPU: no busy time to set against the steps


def test_profile_must_name_one_of_the_variants():
    with pytest.raises(SystemExit, match="--profile fp8"):
        load_bench("bench_train").main(["--variants", "bf16", "--profile", "fp8"])
    with pytest.raises(SystemExit, match="--profile-python fp8"):
        load_bench("bench_train").main(["--variants", "bf16", "--profile-python", "fp8"])


def test_both_profiles_of_one_variant_take_its_last_two_steps(monkeypatch):
    bench = load_bench("bench_train")
    calls = []
    monkeypatch.setattr(bench, "run_variant", lambda spec, args, p=None, q=None: calls.append((spec, p, q)) or
                        {"variant": spec, "micro": 1, "recompute": "none", "error": "OOM"})
    bench.main(["--variants", "bf16,fp8", "--profile", "fp8", "--profile-python", "fp8", "--steps", "6",
                "--warmup", "3"])
    assert calls == [("bf16", None, None), ("fp8", 6, 5)]
    calls.clear()
    bench.main(["--variants", "bf16,fp8", "--profile", "fp8", "--profile-python", "bf16", "--steps", "6"])
    assert calls == [("bf16", None, 6), ("fp8", 6, None)]
    with pytest.raises(SystemExit, match="need --steps >= 6"):
        bench.main(["--variants", "fp8", "--profile", "fp8", "--profile-python", "fp8", "--steps", "5",
                    "--warmup", "3"])


def test_the_table_says_which_allocator_settings_every_row_ran_with(monkeypatch, capsys):
    bench = load_bench("bench_train")
    monkeypatch.setattr(bench, "run_variant", lambda spec, args, p=None, q=None:
                        {"variant": spec, "micro": 1, "recompute": "none", "error": "OOM"})
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    bench.main(["--variants", "bf16"])
    assert "Every row ran with" not in capsys.readouterr().out
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    bench.main(["--variants", "bf16"])
    out = capsys.readouterr().out
    assert "Every row ran with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True." in out
    assert out.index("Every row ran with") < out.index("| variant | micro-batch")


def wait_until(condition, deadline_s: float, what: str) -> None:
    """Poll `condition()` until it is true; fail naming `what` after `deadline_s` seconds (a generous deadline: a
    process start takes seconds on a loaded machine, not a fixed share of one)."""
    t0 = time.monotonic()
    while not condition():
        if time.monotonic() - t0 > deadline_s:
            pytest.fail(f"{what}: not after {deadline_s:.0f} s")
        time.sleep(0.05)


def gone(pid: int) -> bool:
    """The process no longer runs (a zombie, reaped by init shortly, counts as gone)."""
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except (ProcessLookupError, FileNotFoundError):
        return True


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="PR_SET_PDEATHSIG is Linux only")
def test_a_row_process_that_ignores_sigterm_still_dies_with_the_bench(tmp_path):
    """train.py answers SIGTERM with a checkpoint (minutes of GPU memory held on e64): a row's process must be
    killed outright when the bench dies, even if it ignores SIGTERM."""
    pid_file = tmp_path / "child.pid"
    parent = f"""
import subprocess, sys, time
sys.path.insert(0, {str(ROOT / "bench")!r})
import importlib.util
spec = importlib.util.spec_from_file_location("bench_train", {str(ROOT / "bench" / "bench_train.py")!r})
bench = importlib.util.module_from_spec(spec); spec.loader.exec_module(bench)
child = "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " \\
        "open({str(pid_file)!r} + '.tmp', 'w').write(str(os.getpid())); " \\
        "os.replace({str(pid_file)!r} + '.tmp', {str(pid_file)!r}); time.sleep(3600)"
subprocess.Popen([sys.executable, "-c", child], preexec_fn=bench._die_with_parent)
time.sleep(3600)
"""
    proc = subprocess.Popen([sys.executable, "-c", parent], cwd=ROOT)
    try:  # the child writes its pid (whole, by a rename) once it ignores SIGTERM
        wait_until(pid_file.exists, 300, f"the row process to start and write {pid_file}")
    finally:
        proc.kill()
        proc.wait()
    child_pid = int(pid_file.read_text())
    try:
        wait_until(lambda: gone(child_pid), 120, "the row process to die with the bench")
    except BaseException:
        os.kill(child_pid, signal.SIGKILL)
        raise
