"""FP8 inside the DeepSpeed train loop: the cached FP8 weights follow every optimizer step."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir

from fp8.linear import FP8Linear
from fp8.quant import quantize_128x128
from ling.trainer import train
from tests.test_config import CONF


@pytest.mark.parametrize("stage", [1, 2])
def test_fp8_weight_cache_is_refreshed_after_each_deepspeed_step(stage, tmp_path, monkeypatch):
    """ZeRO-1/2 copy the updated weights in through `.data` (no autograd version bump): a stale cache would
    silently freeze every FP8 linear. After training, each cache must equal a fresh quantization."""
    import ling.trainer as trainer

    engines = []
    real_build = trainer.build_engine
    monkeypatch.setattr(trainer, "build_engine", lambda *a, **k: engines.append(real_build(*a, **k)) or engines[-1])
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "+exp=tiny_cpu", "data=synthetic", "precision=fp8", f"deepspeed=zero{stage}", "train.steps=3",
            "train.seq_len=32", "model.num_layers=2", "logging.wandb.mode=disabled", "logging.progress_bar=false",
            "train.save_final=false", "optim.warmup_steps=1", "optim.lr=1e-2", "train.resume=none"])
    train(cfg, run_dir=tmp_path)
    model = engines[0][0].module
    layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
    assert layers
    for lin in layers:
        cached_q, cached_s = lin.quantized_weight()  # what the next forward would use
        fresh_q, fresh_s = quantize_128x128(lin.weight.detach())
        assert torch.equal(cached_q.view(torch.uint8), fresh_q.view(torch.uint8))
        assert torch.equal(cached_s, fresh_s)
