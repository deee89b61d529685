"""Hydra configs: every experiment composes; bad keys fail naming the key; yaml presets match the code."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from ling.config import model_config_from
from ling.train.engine import build_optimizer, cap_zero_buckets
from ling.train.launch import strip_local_rank_arg
from ling.train.memory_plan import ZERO_BUCKET_ELEMENTS
from model.config import PRESETS, ModelConfig
from tests.helpers import CONF, compose_cfg

EXPERIMENTS = sorted(p.stem for p in (CONF / "exp").glob("*.yaml"))


@pytest.mark.parametrize("exp", EXPERIMENTS)
def test_every_experiment_composes_and_builds_a_model_config(exp):
    cfg = compose_cfg([f"+exp={exp}"])
    vocab = cfg.data.get("vocab_size") or 8192
    mc = model_config_from(cfg, vocab)
    assert mc.vocab_size >= vocab
    assert cfg.train.steps > 0


@pytest.mark.parametrize("exp", ["bf16", "bf16_mtp", "fp8", "fp8_mtp"])
def test_gpu_experiments_accumulate_in_fp32_through_zero1(exp):
    """The GPU experiments run ZeRO-1 with fp32 gradient accumulation: under bf16 that is DeepSpeed's BF16_Optimizer
    with its fp32 sums all-reduced in fp32 (README "Gradient accumulation in fp32"; the faster grad path measured by
    bench/bench_grad_path.py)."""
    from ling.train.engine import deepspeed_config

    cfg = compose_cfg([f"+exp={exp}"])
    ds = deepspeed_config(cfg, use_bf16=True)
    assert cfg.deepspeed.zero_stage == 1 and ds["zero_optimization"]["stage"] == 1
    assert ds["data_types"]["grad_accum_dtype"] == "fp32" and ds["communication_data_type"] == "fp32"
    assert ds["bf16"]["enabled"] and ds["bf16"]["immediate_grad_update"]


def test_required_experiments_exist():
    assert {"tiny_cpu", "bf16", "bf16_mtp"} <= set(EXPERIMENTS)


def test_unknown_override_key_fails_naming_it():
    with pytest.raises(ConfigCompositionException, match="stepz"):
        compose_cfg(["+exp=tiny_cpu", "train.stepz=3"])
    with pytest.raises(ConfigCompositionException, match="num_headz"):
        compose_cfg(["model.num_headz=3"])


def test_added_unknown_model_key_fails_naming_it():
    cfg = compose_cfg(["+model.num_headz=3"])
    with pytest.raises(ValueError, match="model.num_headz"):
        model_config_from(cfg, 1024)


def test_heads_not_dividing_hidden_size_fails_naming_the_key():
    cfg = compose_cfg(["model.num_heads=3", "model.num_kv_heads=1"])
    with pytest.raises(ValueError, match="model.num_heads"):
        model_config_from(cfg, 1024)


def test_unknown_optimizer_key_and_name_fail_naming_them():
    cfg = compose_cfg(["+optim.momentum=0.9"])
    with pytest.raises(ValueError, match="optim.momentum"):
        build_optimizer([], cfg.optim)
    cfg = compose_cfg(["optim.name=sgd"])
    with pytest.raises(ValueError, match="optim.name"):
        build_optimizer([{"params": []}], cfg.optim)


def test_model_yaml_files_match_code_presets():
    for name in PRESETS:
        yaml = OmegaConf.to_container(OmegaConf.load(CONF / "model" / f"{name}.yaml"))
        code = dataclasses.asdict(ModelConfig.preset(name))
        for key, value in yaml.items():
            if key == "vocab_size" and value is None:
                continue
            assert code[key] == value, (name, key)


def test_vocab_follows_data_unless_fixed():
    cfg = compose_cfg(["+exp=tiny_cpu"])
    assert model_config_from(cfg, 777).vocab_size == 777
    cfg = compose_cfg(["+exp=tiny_cpu", "model.vocab_size=512"])
    with pytest.raises(ValueError, match="model.vocab_size"):
        model_config_from(cfg, 777)


@pytest.mark.parametrize("argv", [["train.py", "--local_rank=1", "a=1"], ["train.py", "--local_rank", "1", "a=1"]])
def test_deepspeed_local_rank_argument_is_stripped(argv, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    strip_local_rank_arg(argv)
    assert argv == ["train.py", "a=1"]
    import os

    assert os.environ["LOCAL_RANK"] == "1"


def test_fp8_adamw_with_elastic_checkpoint_is_refused_up_front():
    from ling.train.engine import build_engine

    cfg = compose_cfg(["+exp=tiny_cpu", "optim=fp8_adamw", "+deepspeed.zero_extra.elastic_checkpoint=true"])
    with pytest.raises(ValueError, match="elastic_checkpoint"):
        build_engine(cfg, model_config_from(cfg, 256), torch.device("cpu"))


def test_zero_buckets_are_capped_at_the_model_size_unless_set():
    """ling.train.engine.cap_zero_buckets: ZeRO-1/2 reduce and allgather buckets, ZeRO-3's reduce bucket, at the
    parameter count rounded up to even when DeepSpeed's default would be larger; a size the user set, ZeRO-0 and a
    model larger than the default are left alone."""

    def capped(zero: dict, count: int) -> dict:
        conf = {"zero_optimization": dict(zero)}
        cap_zero_buckets(conf, count)
        return conf["zero_optimization"]

    assert capped({"stage": 2}, 4_988_673) == {"stage": 2, "reduce_bucket_size": 4_988_674,
                                               "allgather_bucket_size": 4_988_674}
    assert capped({"stage": 1}, 1000) == {"stage": 1, "reduce_bucket_size": 1000, "allgather_bucket_size": 1000}
    assert capped({"stage": 3}, 1000) == {"stage": 3, "reduce_bucket_size": 1000}
    assert capped({"stage": 2, "reduce_bucket_size": 64}, 1000) == {"stage": 2, "reduce_bucket_size": 64,
                                                                  "allgather_bucket_size": 1000}
    assert capped({"stage": 0}, 1000) == {"stage": 0}
    assert capped({"stage": 2}, ZERO_BUCKET_ELEMENTS) == {"stage": 2}  # the e64 proxy and up: DeepSpeed's sizes
