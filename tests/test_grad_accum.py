"""Gradient accumulation across micro-batches under DeepSpeed bf16 (`deepspeed.grad_accum_dtype`): with fp32 (the
default of deepspeed=zero2/zero3) ZeRO hands the optimizer the fp32 sum of the micro-batch gradients; with
DeepSpeed's own default (the model's dtype, bf16) the running sum is rounded to bf16 at every micro-batch.

DeepSpeed runs bf16 on CPU too, so the worker (tests/grad_accum_worker.py, one process, gloo) exercises the same
ZeRO code as a GPU run: 8 micro-batches of inputs of different scale through a bf16 linear layer, the gradient
the optimizer sees against the float64 sum of the same 8 bf16 gradients by plain autograd.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from ling.engine import deepspeed_config
from tests.test_fp8_adam_deepspeed import free_port

pytest.importorskip("deepspeed")

ROOT = Path(__file__).resolve().parents[1]


def test_fp32_accumulation_is_exact_and_bf16_is_not():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "grad_accum_worker.py"), "2:fp32", "3:fp32", "2:null"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = {r["case"]: r for r in (json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"case"'))}
    # fp32: 8 fp32 additions of bf16 values, ~1e-8 relative; bf16: each addition rounds to 8 bits, ~1e-3
    assert got["2:fp32"]["rel_err"] < 1e-6 and got["3:fp32"]["rel_err"] < 1e-6, got
    assert got["2:null"]["rel_err"] > 1e-4, got  # what the fp32 default fixes
    assert got["3:fp32"]["optimizer"] == "DeepSpeedZeroOptimizer_Stage3"


def _cfg(stage: int, accum) -> OmegaConf:
    return OmegaConf.create({"train": {"micro_batch_size": 1, "grad_accum": 8}, "optim": {"grad_clip": 1.0},
                             "deepspeed": {"zero_stage": stage, "grad_accum_dtype": accum}})


def test_config_defaults_and_refusals():
    for stage, want in ((0, None), (1, None), (2, "fp32"), (3, "fp32")):
        assert OmegaConf.load(ROOT / "conf" / "deepspeed" / f"zero{stage}.yaml").grad_accum_dtype == want
    assert deepspeed_config(_cfg(2, "fp32"), use_bf16=True)["data_types"] == {"grad_accum_dtype": "fp32"}
    assert "data_types" not in deepspeed_config(_cfg(2, None), use_bf16=True)
    assert "data_types" not in deepspeed_config(_cfg(2, "fp32"), use_bf16=False)  # fp32 runs: fp32 anyway
    with pytest.raises(ValueError, match="deepspeed.grad_accum_dtype='fp16' is unknown"):
        deepspeed_config(_cfg(2, "fp16"), use_bf16=True)
    for stage in (0, 1):
        want = f"grad_accum_dtype=fp32 needs deepspeed.zero_stage 2 or 3 \\(got {stage}\\)"
        with pytest.raises(ValueError, match=want):
            deepspeed_config(_cfg(stage, "fp32"), use_bf16=True)
