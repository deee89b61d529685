"""Smoke test of bench/bench_grad_path.py on CPU (DeepSpeed bf16 + gloo, one process, in a subprocess so that
its process group does not outlive the test): every variant's row prints, with numbers; a bad name is refused."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytest.importorskip("deepspeed")

# one variant per code path (each row is a fresh process, ~5-9 s on CPU): plain autograd, the hand-written hook,
# ling.engine's engine (ZeRO-1: the lean BF16_Optimizer hook), DeepSpeed's own engine; ZeRO-2's rows differ
# from zero1 only in the config
VARIANTS = ["autograd", "fp32_by_hand", "zero1", "zero1_stock_hook"]


def bench(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return subprocess.run([sys.executable, str(ROOT / "bench" / "bench_grad_path.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_bench_grad_path_runs_on_cpu():
    proc = bench("--model", "tiny", "--device", "cpu", "--steps", "1", "--grad-accum", "2",
                 "--variants", ",".join(VARIANTS))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [line.split(" | ") for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert [r[0].lstrip("| ") for r in rows[1:]] == VARIANTS
    for r in rows[1:]:
        assert float(r[1]) > 0 and float(r[3]) >= 0  # backward ms, step ms
    assert rows[1][2] == "0.0"  # autograd is its own floor


def test_unknown_variant_is_named():
    proc = bench("--model", "tiny", "--device", "cpu", "--variants", "zero2,zero9")
    assert proc.returncode != 0 and "unknown variant(s) ['zero9']" in proc.stderr
