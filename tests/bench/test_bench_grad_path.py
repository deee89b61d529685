"""Smoke test of bench/bench_grad_path.py on CPU (DeepSpeed bf16 + gloo, one process, in a subprocess so that
its process group does not outlive the test): every variant's row prints, with numbers; a bad name is refused."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytest.importorskip("deepspeed")

# one variant per code path: plain autograd, the hand-written hook (PyTorch's add, the kernel), ling.engine's
# engine (ZeRO-1: the lean BF16_Optimizer hook), DeepSpeed's own engine; ZeRO-2's rows differ from zero1
# only in the config
VARIANTS = ["autograd", "fp32_by_hand", "fp32_kernel", "zero1", "zero1_stock_hook"]

# The bench runs each row in a fresh process (run_in_subprocess: `--json`, one variant, its row as the last line),
# ~5-9 s of start-up each on CPU. Here the first row goes that way and the others run in the bench's own process,
# through the same `--json` entry (main), so one start-up serves three rows: what is checked is every row's code
# path and the table, not the isolation of the rows' memory (the peak column is nan on CPU anyway). The stock row
# after zero1 is still DeepSpeed's own: ling.train.deepspeed_compat swaps its classes in only while it builds an
# engine (project_classes restores them).
ROWS_IN_ONE_PROCESS = """
import contextlib, importlib.util, io, json, sys
spec = importlib.util.spec_from_file_location("bench_grad_path", sys.argv[1])
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
in_subprocess = bench.run_in_subprocess

def row(name, args):
    if name == sys.argv[2]:
        return in_subprocess(name, args)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        bench.main(["--json", "--variants", name, "--model", args.model, "--grad-accum", str(args.grad_accum),
                    "--steps", str(args.steps), "--device", args.device])
    return json.loads(out.getvalue().strip().splitlines()[-1])

bench.run_in_subprocess = row
bench.main(sys.argv[3:])
"""


def bench(*args: str, rows_in_one_process: bool = False) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    script = str(ROOT / "bench" / "bench_grad_path.py")
    cmd = ["-c", ROWS_IN_ONE_PROCESS, script, VARIANTS[0]] if rows_in_one_process else [script]
    return subprocess.run([sys.executable, *cmd, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_bench_grad_path_runs_on_cpu():
    proc = bench("--model", "tiny", "--device", "cpu", "--steps", "1", "--grad-accum", "2",
                 "--variants", ",".join(VARIANTS), rows_in_one_process=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [line.split(" | ") for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert [r[0].lstrip("| ") for r in rows[1:]] == VARIANTS
    for r in rows[1:]:
        assert float(r[1]) > 0 and float(r[3]) >= 0  # backward ms, step ms
    assert rows[1][2] == "0.0"  # autograd is its own floor


def test_unknown_variant_is_named():
    proc = bench("--model", "tiny", "--device", "cpu", "--variants", "zero2,zero9")
    assert proc.returncode != 0 and "unknown variant(s) ['zero9']" in proc.stderr
