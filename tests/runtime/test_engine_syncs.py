"""The trainer's DeepSpeed engine never synchronizes the device for DeepSpeed's own throughput timer: that timer
(on by default in DeepSpeed) synchronizes at every micro-batch's forward and step(), and each sync empties the
GPU's queue (docs/benchmarks.md). Built from the trainer's config on CPU (one process, gloo)."""

from __future__ import annotations

import torch
from deepspeed.utils.timer import ThroughputTimer
from omegaconf import OmegaConf
from torch import nn

from ling.ranks import init_distributed
from ling.train.deepspeed_compat import initialize_engine
from ling.train.engine import deepspeed_config


def test_throughput_timer_never_runs_so_never_synchronizes():
    init_distributed()
    cfg = OmegaConf.create({"train": {"micro_batch_size": 1, "grad_accum": 2}, "optim": {"grad_clip": 1.0},
                            "deepspeed": {"zero_stage": 1, "grad_accum_dtype": "fp32"}})  # fmt: skip
    model = nn.Linear(64, 32, bias=False).to(torch.bfloat16)
    engine, *_ = initialize_engine(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                   deepspeed_config(cfg, use_bf16=True))  # fmt: skip
    timer = engine.tput_timer
    assert isinstance(timer, ThroughputTimer) and not timer.config.enabled
    for _ in range(6):  # past DeepSpeed's start_step (2), from where an enabled timer would synchronize
        engine.backward(engine(torch.randn(4, 64, dtype=torch.bfloat16)).float().pow(2).mean())
        engine.step()
    # an enabled timer counts micro-steps and records times at every stop (after a synchronize)
    assert timer.micro_step_count == 0 and timer.global_step_count == 0 and timer.start_time == 0
    assert engine.global_steps == 3  # the engine itself stepped
