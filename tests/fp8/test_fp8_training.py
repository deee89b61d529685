"""FP8 inside the DeepSpeed train loop: the cached FP8 weights follow every optimizer step."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir

from fp8.linear import FP8Linear
from fp8.quant import quantize_128x128
from ling.train.engine import build_engine
from ling.train.trainer import train
from tests.helpers import CONF


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_fp8_weight_cache_is_refreshed_after_each_deepspeed_step(stage, tmp_path):
    """ZeRO-1/2 copy the updated weights in through `.data` (no autograd version bump): a stale cache would
    silently freeze every FP8 linear. After training, each cache must equal a fresh quantization."""
    engines = []
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "+exp=tiny_cpu", "data=synthetic", "precision=fp8", f"deepspeed=zero{stage}", "train.steps=3",
            "train.seq_len=32", "model.num_layers=2", "logging.wandb.mode=disabled", "logging.progress_bar=false",
            "train.save_final=false", "optim.warmup_steps=1", "optim.lr=1e-2", "train.resume=none",
            "fp8.health_every=2"])
    metrics = train(cfg, run_dir=tmp_path, build_engine=lambda *a: engines.append(build_engine(*a)) or engines[-1])
    # health is sampled on steps 0 and 2 (every 2): the last step's metrics carry it, per layer and averaged
    assert 0.0 <= metrics["fp8/mean/act_underflow"] <= 1.0
    assert 0.0 <= metrics["fp8/mean/gradT_distortion"] <= 1.0
    assert any(k.startswith("fp8/layers.0.attention.query_key_value/") for k in metrics)
    model = engines[0][0].module
    layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
    assert layers
    for lin in layers:
        cached_q, cached_s = lin.quantized_weight()  # what the next forward would use
        fresh_q, fresh_s = quantize_128x128(lin.weight.detach())
        assert torch.equal(cached_q.view(torch.uint8), fresh_q.view(torch.uint8))
        assert torch.equal(cached_s, fresh_s)


def test_precision_switch_puts_fp8_exactly_in_the_design_linears():
    from model.config import ModelConfig
    from model.ling import LingForCausalLM

    model = LingForCausalLM(ModelConfig.preset("tiny", vocab_size=256, precision="fp8"))
    fp8 = {n for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    high = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and not isinstance(m, FP8Linear)}
    expected_fp8 = set()
    for prefix in ["layers.0", "layers.1", "layers.2", "mtp_layers.0.transformer_layer"]:
        expected_fp8 |= {f"{prefix}.attention.query_key_value", f"{prefix}.attention.dense"}
        mlp = f"{prefix}.mlp" if prefix == "layers.0" else f"{prefix}.mlp.shared_experts"
        expected_fp8 |= {f"{mlp}.gate_up_proj", f"{mlp}.down_proj"}
    assert fp8 == expected_fp8
    assert high == {"lm_head", "mtp_layers.0.eh_proj"}  # stay high precision, like embeddings and routers
    bf16 = LingForCausalLM(ModelConfig.preset("tiny", vocab_size=256))
    assert not any(isinstance(m, FP8Linear) for m in bf16.modules())
    assert bf16.state_dict().keys() == model.state_dict().keys()  # drop-in: same checkpoint layout


def _losses(tmp_path, stage: int, cache: bool, monkeypatch) -> list[tuple[float, float]]:
    from fp8.linear import WeightCache

    if not cache:  # every lookup re-quantizes the weight as it is now: what a correct cache must reproduce
        real_get = WeightCache.get
        monkeypatch.setattr(WeightCache, "get", lambda self, w, *o: (self.clear(), real_get(self, w, *o))[1])
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "+exp=tiny_cpu", "data=synthetic", "precision=fp8", "optim=fp8_adamw", f"deepspeed=zero{stage}",
            "train.steps=3", "train.grad_accum=2", "train.micro_batch_size=2", "train.seq_len=32",
            "model.num_layers=2", "logging.wandb.mode=disabled", "logging.progress_bar=false",
            "train.save_final=false", "optim.warmup_steps=1", "optim.lr=1e-2", "train.resume=none",
            "train.eval_every=0"])
    train(cfg, run_dir=tmp_path / f"z{stage}_{cache}")
    import json

    recs = [json.loads(line) for line in (tmp_path / f"z{stage}_{cache}" / "metrics.jsonl").read_text().splitlines()]
    monkeypatch.undo()
    return [(r["loss"], r["grad_norm"]) for r in recs]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_weight_cache_changes_nothing_under_every_zero_stage_with_grad_accumulation(stage, tmp_path, monkeypatch):
    """grad_accum 2, FP8 linears and experts, FP8AdamW: the cached FP8 weights (reused by the second micro-batch,
    refreshed after each DeepSpeed step; under ZeRO-3 the gathered weight is a new tensor at every forward) give
    the same losses and gradient norms, bit for bit, as re-quantizing the weight at every use."""
    cached = _losses(tmp_path, stage, True, monkeypatch)
    fresh = _losses(tmp_path, stage, False, monkeypatch)
    assert len(cached) == 3 and cached == fresh
    assert cached[0] != cached[-1]  # the weights did change between steps
