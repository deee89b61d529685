"""The run config checked whole before anything is built (ling/config_check.py): every shipped config passes;
typos (also added with `+`), bad types, bad ranges, missing paths and what must divide what fail naming the key
(the nearest valid key for a typo), all in one message; train.py prints it without a traceback and exits 2 in
seconds, before the data is prepared; the key table follows the yaml defaults; `+exp=NAME` lists experiments
only."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from hydra.errors import MissingConfigException
from omegaconf import OmegaConf

from ling.config_check import (
    MODEL_SPEC,
    SET_ELSEWHERE,
    SPEC,
    SYNTHETIC_DATA_SPEC,
    TEXT_DATA_SPEC,
    ConfigError,
    check_run_config,
    config_problems,
)
from ling.train.engine import FP8_OPTIM_KEYS, OPTIM_KEYS
from model.config import ModelConfig
from tests.helpers import COMMON, CONF, ROOT, compose_cfg

EXPERIMENTS = sorted(p.stem for p in (CONF / "exp").glob("*.yaml"))


def problems(*overrides: str, world: int = 1) -> list[str]:
    return config_problems(compose_cfg(list(overrides)), world)


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("exp", EXPERIMENTS)
def test_every_experiment_passes(exp):
    # the GPU experiments set train.device=cuda: on a CPU machine that alone is a problem, and named as one
    cpu = ["train.device=cpu"] if compose_cfg([f"+exp={exp}"]).train.device == "cuda" else []
    assert problems(f"+exp={exp}", *cpu) == []


@pytest.mark.parametrize("override", [f"{g}={o}" for g in ("model", "data", "optim", "precision", "deepspeed")
                                      for o in group_options(g)])
def test_every_group_option_passes(override, tmp_path):
    extra = {"data=files": [f"data.sources=[{tmp_path}]"], "deepspeed=zero0": ["deepspeed.bf16=true"]}.get(override, [])
    assert problems(override, *extra) == [], override


@pytest.mark.slow
def test_the_tests_run_configs_pass():
    """The overrides the runtime tests train with (tests/helpers.py COMMON), across their variants."""
    for extra in ([], ["precision=fp8", "optim=fp8_adamw", "optim.min_fp8_numel=0"], ["deepspeed=zero1"],
                  ["deepspeed=zero3"], ["train.inject_nan_steps=[3,4]", "train.max_bad_steps=2"],
                  ["fp8.ablate=[adam_m]", "optim=fp8_adamw"], ["train.profile_step=2", "train.profile_python_step=3"]):
        assert problems(*COMMON, "train.steps=4", *extra) == [], extra
    assert problems(*COMMON, "moe.ep_size=2", world=2) == []


@pytest.mark.parametrize("overrides,message", [
    # the cases (#28 item 3)
    (["+train.stepz=5"], "train.stepz: unknown key; did you mean train.steps?"),
    (["train.steps=abc"], "train.steps: expected an integer, got 'abc'"),
    (["optim.lr=-0.001"], "optim.lr: must be >= 0, got -0.001"),
    (["train.init_from=/missing"], "train.init_from=/missing: no such file or directory"),
    (["model.num_experts=10"], "model.num_expert_groups: num_expert_groups=4 must divide num_experts=10"),
    # nested, other groups, other kinds of problem
    (["+trian.steps=3"], "trian: unknown key; did you mean train?"),
    (["+model.num_headz=3"], "model.num_headz: unknown key; did you mean model.num_heads?"),
    (["+fp8.monitor.thresholds.act.underflw=1"],
     "fp8.monitor.thresholds.act.underflw: unknown key; did you mean fp8.monitor.thresholds.act.underflow?"),
    (["data=bundled", "+data.tokenizer.vocab_sz=3"],
     "data.tokenizer.vocab_sz: unknown key; did you mean data.tokenizer.vocab_size?"),
    (["+optim.block_size=64"], "optim.block_size: not a key here; set optim=fp8_adamw (its FP8AdamW key) instead"),
    (["+model.precision=fp8"], "model.precision: not a key here; set precision=bf16|fp8 instead"),
    (["+model.ep_size=2"], "model.ep_size: not a key here; set moe.ep_size instead"),
    (["optim=fp8_adamw", "optim.block_size=100"], "optim.block_size: must be a power of two in [16, 4096], got 100"),
    (["optim.betas=[0.9,1.0]"], "optim.betas: item 1: must be >= 0 and < 1, got 1.0"),
    (["train.seq_len=0"], "train.seq_len: must be >= 1, got 0"),
    (["train.deterministic=yes"], "train.deterministic: expected true or false, got 'yes'"),
    (["logging.level=verbose"], "logging.level: must be one of debug, info, warning, error; got 'verbose'"),
    (["train.stop_at=300"], "train.stop_at=300: expected a step in 1 … train.steps (200)"),
    (["train.profile_step=300"], "train.profile_step=300: want null or an integer step in 2..train.steps (200)"),
    (["optim.schedule=linear"], "optim.schedule: must be one of cosine, wsd, constant; got 'linear'"),
    (["train.resume=/no/such/checkpoint"], "train.resume=/no/such/checkpoint: no such file or directory"),
    (["data=files"], "data.sources[0].path: required, no value given"),
    (["data=files", "data.sources=[/no/such/*.jsonl]"], "data.sources[0].path=/no/such/*.jsonl: the pattern matches"),
    (["data=bundled", "data.tokenizer.model=/no/such.model"], "data.tokenizer.model=/no/such.model: no such file"),
    (["deepspeed=zero0"], "deepspeed.zero_stage=0 with fp32 weights"),
    (["deepspeed.grad_accum_dtype=fp16"], "deepspeed.grad_accum_dtype: must be one of fp32, bf16, null; got 'fp16'"),
    (["precision=fp8", "model.hidden_size=192"],
     "model.hidden_size: must be a multiple of 128 for the blockwise FP8 experts, got 192"),
    (["fp8.ablate=[fwd_q]"], "fp8.ablate: unknown component(s) ['fwd_q']"),
    (["precision=fp8", "fp8.gemm_kernel=cublas"],
     "fp8.gemm_kernel: must be one of auto, triton, gluon_ws; got 'cublas'"),
    (["model.num_heads=3", "model.num_kv_heads=1"], "model.num_heads: num_heads=3 does not divide hidden_size=128"),
    (["data=synthetic", "data.vocab_size=2000", "model.vocab_size=1024"],
     "model.vocab_size=1024 is smaller than the tokenizer's vocab"),
    (["moe.ep_size=4", "model.num_experts=8"], "moe.ep_size=4 does not divide the world size (2 ranks)"),
    (["moe.ep_size=2", "deepspeed=zero3"], "moe.ep_size=2 needs deepspeed.zero_stage 1 or 2 (got 3)"),
    (["model.cuda_graphs=true"], "model.cuda_graphs=true needs train.device cuda (resolved to cpu)"),
    (["model.cuda_graphs=true", "model.recompute=full"], "model.cuda_graphs: true needs model.recompute none or"),
    (["model.cuda_graphs=true", "moe.ep_size=2"], "model.cuda_graphs: true needs moe.ep_size=1 (got 2)"),
    (["model.cuda_graphs=true", "deepspeed=zero3"], "model.cuda_graphs=true needs deepspeed.zero_stage 0, 1 or 2"),
    (["model.cuda_graphs=true", "data=bundled", "data.document_mask=true"],
     "model.cuda_graphs=true with data.document_mask=true needs model.document_attention=dense"),
])
def test_a_bad_config_is_refused_naming_the_key(overrides, message):
    found = problems("+exp=tiny_cpu", *overrides, world=2)
    assert any(p.startswith(message) for p in found), found


def test_every_problem_comes_in_one_error():
    cfg = compose_cfg(["+exp=tiny_cpu", "+train.stepz=5", "train.steps=abc", "optim.lr=-0.001",
                       "train.init_from=/missing", "model.num_experts=10"])
    with pytest.raises(ConfigError) as caught:
        check_run_config(cfg, world_size=1)
    assert caught.value.exit_code == 2
    lines = str(caught.value).splitlines()
    assert lines[0] == "the run config has 5 problems (nothing was started):"
    assert {line.split(":")[0].strip() for line in lines[1:]} == {
        "train.stepz", "train.steps", "optim.lr", "train.init_from=/missing", "model.num_expert_groups"}


def test_checking_takes_milliseconds():
    cfg = compose_cfg(["+exp=tiny_cpu"])
    t0 = time.perf_counter()
    assert config_problems(cfg, 2) == []
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.slow
def test_train_py_refuses_a_bad_config_before_preparing_data_without_a_traceback(tmp_path):
    """The issue's typos at once: exit code 2, every problem on stderr, no traceback, no data prepared (the
    bundled corpus was prepared first, for minutes on a fresh machine, before optim.lr=-0.001 failed)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LING_CACHE": str(tmp_path / "cache")}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "train.py", "+exp=tiny_cpu", "+train.stepz=5", "train.steps=abc",
                           "optim.lr=-0.001", "train.init_from=/missing", "model.num_experts=10",
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    seconds = time.monotonic() - t0
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "train.py: the run config has 5 problems (nothing was started):" in proc.stderr
    assert "train.stepz: unknown key; did you mean train.steps?" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()
    assert seconds < 120, seconds  # Python, torch and DeepSpeed imports; about 6 s on an idle 2-core machine


def leaves(node: dict, prefix: str = "") -> set[str]:
    """The dotted keys of a nested mapping's leaves (a spec's checks, a yaml node's values; {} is a leaf)."""
    return set().union(*(leaves(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}"}
                         for k, v in node.items()))


def test_the_key_table_follows_the_yaml_defaults():
    root = OmegaConf.to_container(OmegaConf.load(CONF / "config.yaml"))
    for group in ("train", "moe", "logging"):
        assert leaves(SPEC[group]) == leaves(root[group]), group
    optim = [OmegaConf.to_container(OmegaConf.load(f)) for f in (CONF / "optim").glob("*.yaml")]
    assert set(SPEC["optim"]) == OPTIM_KEYS | FP8_OPTIM_KEYS == set().union(*optim)
    fp8 = OmegaConf.to_container(OmegaConf.load(CONF / "precision" / "fp8.yaml"))["fp8"]
    assert leaves(SPEC["fp8"]) == leaves(fp8)
    for option in group_options("deepspeed"):
        assert set(SPEC["deepspeed"]) == set(OmegaConf.load(CONF / "deepspeed" / f"{option}.yaml"))
    assert set(SYNTHETIC_DATA_SPEC) == set(OmegaConf.load(CONF / "data" / "synthetic.yaml"))
    for option in ("bundled", "files"):
        assert set(OmegaConf.load(CONF / "data" / f"{option}.yaml")) <= set(TEXT_DATA_SPEC), option
    fields = set(ModelConfig.__dataclass_fields__)
    assert set(MODEL_SPEC) | set(SET_ELSEWHERE) == fields | {"preset", "name"}
    for option in group_options("model"):
        assert set(OmegaConf.load(CONF / "model" / f"{option}.yaml")) <= set(MODEL_SPEC), option


def test_an_unknown_experiment_lists_the_experiments_and_nothing_else():
    with pytest.raises(MissingConfigException) as caught:
        compose_cfg(["+exp=nope"])
    options = str(caught.value).split("Available options in 'exp':")[1].split("Config search path")[0]
    assert set(options.split()) == set(EXPERIMENTS) and "parity_common" not in str(caught.value)
    # the parity twins still compose on their shared base (conf/exp/shared/parity.yaml)
    for exp, precision in (("parity_bf16", "bf16"), ("parity_fp8", "fp8")):
        cfg = compose_cfg([f"+exp={exp}"])
        assert cfg.precision.name == precision and cfg.model.hidden_size == 1024 and cfg.train.seq_len == 1024
