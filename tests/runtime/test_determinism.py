"""Deterministic mode (`train.deterministic=true`): two runs of one config are bit-identical (CPU always; the
`gpu` test on CUDA, where it is the mode's point), the validation loss is measured on the same held-out
batches every time, and the process-wide switches are restored after the run."""

from __future__ import annotations

import json
import os

import pytest
import torch

from ling.train.determinism import deterministic_mode
from tests.helpers import compose_cfg

EVAL_BATCHES = 2
# Sequences of 64 tokens (the demo's 256 cost four times the compute on CPU): whether two runs agree bit for bit and
# validate on the same batches does not depend on their length; every op of a step (FP8 linears and experts,
# FP8AdamW's stochastic rounding, validation) still runs, on the bundled corpus's packed sequences.
COMMON = ["+exp=tiny_cpu", "train.deterministic=true", "train.micro_batch_size=1", "train.seq_len=64",
          "model.num_layers=2", "train.eval_every=2", f"train.eval_batches={EVAL_BATCHES}", "train.save_final=false",
          "logging.wandb.mode=disabled", "logging.progress_bar=false", "optim.warmup_steps=1", "train.resume=none"]


def compose_run(extra: list[str]):
    return compose_cfg([*COMMON, *extra])


def train_twice(tmp_path, extra: list[str]):
    """Two runs of one config; returns their metrics lines, final weights, the batches each validation read (the
    model's eval-mode forwards, `train.eval_batches` per validation) and (the ZeRO optimizer's reduce bucket size,
    None without one; the model's parameter count), and checks that deterministic mode was on inside the run."""
    import ling.train.trainer as trainer
    from ling.train.engine import build_engine

    engines, seen = [], []

    def record_validation_batch(module, args):
        if not module.training:  # validation (ling.analysis.evaluate); training forwards run in train mode
            seen.append(args[0].clone())

    def build(*a, **k):
        assert torch.are_deterministic_algorithms_enabled()  # entered before the model and engine are built
        engines.append(build_engine(*a, **k))
        engines[-1][0].module.register_forward_pre_hook(record_validation_batch)
        return engines[-1]

    runs = []
    for name in ("a", "b"):
        seen.clear()
        trainer.train(compose_run(extra), run_dir=tmp_path / name, build_engine=build)
        lines = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        weights = {k: v.detach().cpu().clone() for k, v in engines[-1][0].module.state_dict().items()}
        runs.append((lines, weights, [seen[i:i + EVAL_BATCHES] for i in range(0, len(seen), EVAL_BATCHES)],
                     (getattr(engines[-1][0].optimizer, "reduce_bucket_size", None),
                      sum(p.numel() for p in engines[-1][0].module.parameters()))))
    return runs


def check_bit_identical(runs) -> None:
    (la, wa, *_), (lb, wb, *_) = runs
    keys = ("loss", "lm_loss", "mtp_loss", "grad_norm", "val_loss")
    assert [{k: r.get(k) for k in keys} for r in la] == [{k: r.get(k) for k in keys} for r in lb]
    assert any("val_loss" in r for r in la)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_two_runs_are_bit_identical_and_validate_on_the_same_batches(tmp_path):
    """FP8 linears and FP8AdamW (its stochastic rounding included); on CPU."""
    runs = train_twice(tmp_path, ["train.steps=3", "precision=fp8", "optim=fp8_adamw"])
    check_bit_identical(runs)
    # ZeRO-2's gradient bucket, allocated anew every micro-batch and NaN-filled in deterministic mode, holds the
    # model's parameter count (ling.train.engine.cap_zero_buckets), not DeepSpeed's 500M elements (docs/runtime.md)
    bucket, count = runs[0][3]
    assert bucket == count + count % 2
    for _, _, seen, _ in runs:  # validations at steps 2 and 3 (the end): the same held-out batches, the same order
        assert len(seen) == 2 and all(torch.equal(a, b) for a, b in zip(seen[0], seen[1]))
    assert not torch.are_deterministic_algorithms_enabled()  # restored after the run
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ or os.environ["CUBLAS_WORKSPACE_CONFIG"] in (":4096:8", ":16:8")


def test_deterministic_mode_sets_and_restores_the_switches(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark)
    with deterministic_mode(True):
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()  # strict
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark) == before
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    with pytest.raises(ValueError, match="CUBLAS_WORKSPACE_CONFIG"):
        with deterministic_mode(True):
            pass


@pytest.mark.gpu
@pytest.mark.parametrize("extra", [[], ["data.document_mask=true"], ["precision=fp8", "optim=fp8_adamw"]],
                         ids=["bf16-sdpa", "bf16-flex", "fp8"])
def test_gpu_rerun_is_bit_identical(extra, tmp_path):
    """On CUDA: SDPA (flash) or FlexAttention backward, cuBLAS, DeepSpeed bf16, the MoE's grouped GEMMs and
    our FP8 kernels; two runs of 6 steps must agree bit for bit (losses, grad norms, weights)."""
    runs = train_twice(tmp_path, ["train.steps=6", "train.device=cuda", *extra])
    check_bit_identical(runs)
