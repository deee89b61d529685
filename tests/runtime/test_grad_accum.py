"""Gradient accumulation across micro-batches under DeepSpeed bf16 (`deepspeed.grad_accum_dtype`): with fp32 (the
default of deepspeed=zero2/zero3) ZeRO hands the optimizer the fp32 sum of the micro-batch gradients; with
DeepSpeed's own default (the model's dtype, bf16) the running sum is rounded to bf16 at every micro-batch.

DeepSpeed runs bf16 on CPU too, so the worker (tests/runtime/grad_accum_worker.py, gloo, one process or two) exercises
the same ZeRO code as a GPU run: 8 micro-batches of inputs of different scale through a bf16 linear layer, the
gradient the optimizer sees against the float64 (data-parallel mean of the) sum of the same 8 bf16 gradients by
plain autograd.
"""

from __future__ import annotations

import json
import os

import pytest
from omegaconf import OmegaConf

from ling.ranks import free_port
from ling.train.engine import deepspeed_config
from model.moe import ROUTER_FP32_BUFFERS
from tests.fork_server import run_script
from tests.helpers import ROOT

pytest.importorskip("deepspeed")

WORKER = ROOT / "tests" / "runtime" / "grad_accum_worker.py"


@pytest.mark.slow
def test_fp32_accumulation_is_exact_and_bf16_is_not():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()))
    # `python WORKER ...`, a child of the fork server (tests/fork_server.py)
    proc = run_script([str(WORKER.relative_to(ROOT)), "2:fp32", "3:fp32", "2:null", "1:fp32", "1:null",
                       "1:fp32:stock"], ROOT, env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = {r["case"]: r for r in (json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"case"'))}
    # fp32: 8 fp32 additions of bf16 values, ~1e-8 relative; bf16: each addition rounds to 8 bits, ~1e-3
    for case in ("1:fp32", "2:fp32", "3:fp32"):
        assert got[case]["rel_err"] < 1e-6, got
    assert got["2:null"]["rel_err"] > 1e-4 and got["1:null"]["rel_err"] > 1e-4, got  # what the fp32 default fixes
    assert got["3:fp32"]["optimizer"] == "DeepSpeedZeroOptimizer_Stage3"
    # ZeRO-1 + fp32 is DeepSpeed's BF16_Optimizer; exact only because ling/train/engine.py makes it communicate in fp32
    assert got["1:fp32"]["optimizer"] == "LeanBF16Optimizer" and got["1:null"]["optimizer"] == "DeepSpeedZeroOptimizer"
    # the lean hook (ling/train/deepspeed_compat.py: a mixed-dtype in-place add) sums the same bits as DeepSpeed's own
    assert got["1:fp32:stock"]["optimizer"] == "BF16_Optimizer"
    assert got["1:fp32"]["digest"] == got["1:fp32:stock"]["digest"], got


@pytest.mark.slow
def test_across_two_ranks_zero1_fp32_is_exact_and_zero2_rounds_each_micro_batch_mean_to_bf16():
    """Data parallel over 2 ranks, each its own micro-batches: ZeRO-1 + fp32 (DeepSpeed's BF16_Optimizer) sums
    in fp32 and all-reduces the sums once in fp32 (ling/train/engine.py sets communication_data_type); ZeRO-2 + fp32
    reduce-scatters every micro-batch's bf16 gradient in bf16 and only then sums in fp32, so each micro-batch's
    mean over ranks is rounded to bf16 once (one bf16 rounding, like a bf16 gradient's own; it does not compound
    like a bf16 running sum). `deepspeed.extra.communication_data_type=fp32` makes ZeRO-2 exact too."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    # torchrun's 2 workers as children of the fork server (tests/fork_server.py): the launcher is not what is tested
    proc = run_script([str(WORKER.relative_to(ROOT)), "1:fp32", "2:fp32", "2:fp32:fp32_comm"], ROOT, env,
                      timeout=600, nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = {r["case"]: r for r in (json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"case"'))}
    assert got["1:fp32"]["optimizer"] == "LeanBF16Optimizer" and got["1:fp32"]["rel_err"] < 1e-6, got
    assert got["2:fp32:fp32_comm"]["rel_err"] < 1e-6, got
    assert 1e-4 < got["2:fp32"]["rel_err"] < 1e-2, got  # bf16 rounding (2^-9 relative) of each micro-batch's mean


def _cfg(stage: int, accum) -> OmegaConf:
    return OmegaConf.create({"train": {"micro_batch_size": 1, "grad_accum": 8}, "optim": {"grad_clip": 1.0},
                             "deepspeed": {"zero_stage": stage, "grad_accum_dtype": accum}})


def test_config_defaults_and_refusals():
    for stage, want in ((0, None), (1, "fp32"), (2, "fp32"), (3, "fp32")):
        assert OmegaConf.load(ROOT / "conf" / "deepspeed" / f"zero{stage}.yaml").grad_accum_dtype == want
    keep = {"keep_in_fp32_modules": list(ROUTER_FP32_BUFFERS)}  # bf16 runs: the routers' fp32 buffers (ZeRO-3)
    assert deepspeed_config(_cfg(2, "fp32"), use_bf16=True)["data_types"] == {"grad_accum_dtype": "fp32", **keep}
    assert deepspeed_config(_cfg(2, None), use_bf16=True)["data_types"] == keep
    assert "data_types" not in deepspeed_config(_cfg(2, "fp32"), use_bf16=False)  # fp32 runs: fp32 anyway
    with pytest.raises(ValueError, match="deepspeed.grad_accum_dtype='fp16' is unknown"):
        deepspeed_config(_cfg(2, "fp16"), use_bf16=True)
    with pytest.raises(ValueError, match="grad_accum_dtype=fp32 needs deepspeed.zero_stage 1, 2 or 3 \\(got 0\\)"):
        deepspeed_config(_cfg(0, "fp32"), use_bf16=True)
    zero1 = deepspeed_config(_cfg(1, "fp32"), use_bf16=True)  # BF16_Optimizer: fp32 sums, fp32 all-reduce
    assert zero1["data_types"]["grad_accum_dtype"] == "fp32" and zero1["communication_data_type"] == "fp32"
    assert zero1["bf16"]["immediate_grad_update"] is True
    for stage in (2, 3):  # ZeRO-2/3 reduce bf16 gradients into fp32 partitions: no change there
        conf = deepspeed_config(_cfg(stage, "fp32"), use_bf16=True)
        assert "communication_data_type" not in conf and "immediate_grad_update" not in conf["bf16"]
    assert "communication_data_type" not in deepspeed_config(_cfg(1, None), use_bf16=True)


def test_deepspeed_bf16_auto_true_false():
    import torch

    from ling.train.engine import bf16_enabled

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    cfg = OmegaConf.load(ROOT / "conf" / "deepspeed" / "zero2.yaml")
    assert cfg.bf16 == "auto"
    wrap = OmegaConf.create({"deepspeed": cfg})
    assert (bf16_enabled(wrap, cpu), bf16_enabled(wrap, cuda)) == (False, True)
    wrap.deepspeed.bf16 = True
    assert (bf16_enabled(wrap, cpu), bf16_enabled(wrap, cuda)) == (True, True)
    wrap.deepspeed.bf16 = False
    assert (bf16_enabled(wrap, cpu), bf16_enabled(wrap, cuda)) == (False, False)
    wrap.deepspeed.bf16 = "yes"
    with pytest.raises(ValueError, match="deepspeed.bf16='yes': expected auto, true or false"):
        bf16_enabled(wrap, cpu)
