"""The non-finite guard on a real DeepSpeed engine (one process, CPU): a non-finite step changes no state, and
the FP8 weight caches follow the optimizer through its step hook."""

from __future__ import annotations

import pytest
import torch

from fp8.linear import FP8Linear
from fp8.quant import quantize_128x128
from ling.config import model_config_from
from ling.ranks import init_distributed
from ling.train.engine import build_engine
from ling.train.guard import NonFiniteGuard, check_engine_can_skip
from ling.train.preemption import StopSignals
from ling.train.trainer import Trainer
from model.moe import ROUTER_FP32_BUFFERS, Router, update_expert_biases
from tests.helpers import compose_cfg

TINY = ["+exp=tiny_cpu", "data=synthetic", "data.kind=markov", "data.vocab_size=256", "train.seq_len=32",
        "model.num_layers=2", "train.micro_batch_size=2", "logging.wandb.mode=disabled",
        "logging.progress_bar=false", "train.resume=none", "optim.warmup_steps=1", "optim.lr=1e-2"]


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]  # cuda: bf16 weights, DeepSpeed's bf16 path


def engine_for(overrides: list[str], device: str = "cpu"):
    init_distributed()
    cfg = compose_cfg([*TINY, f"train.device={device}", *overrides])
    return build_engine(cfg, model_config_from(cfg, 256), torch.device(device, 0) if device == "cuda" else
                        torch.device(device))[0]


def step(engine, seed: int, grad_hook=None) -> None:
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(seed)).to(engine.device)
    handle = next(engine.module.parameters()).register_hook(grad_hook) if grad_hook else None
    out = engine(ids, labels=ids)
    engine.backward(out.loss)
    engine.step()
    if handle:
        handle.remove()


def full_params(engine) -> dict[str, torch.Tensor]:
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}


def clone_tree(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: clone_tree(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(clone_tree(v) for v in x)
    return x


def assert_same_tree(a, b, path="") -> None:
    """Exact equality of nested dicts/lists of tensors (fp8 tensors compared bit for bit)."""
    if isinstance(a, torch.Tensor):
        if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same_tree(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_skips_a_step_whose_gradient_is_not_finite(stage, device):
    """What the guard relies on: an inf in one gradient (finite loss) leaves every parameter untouched and
    `was_step_applied()` False, under each ZeRO stage, fp32 (CPU) and bf16 (GPU)."""
    engine = engine_for([f"deepspeed=zero{stage}"], device)
    step(engine, 0)
    before = full_params(engine)
    step(engine, 1, grad_hook=lambda g: g.index_fill(0, torch.tensor([0], device=g.device), float("inf")))
    assert not engine.was_step_applied()
    after = full_params(engine)
    assert all(torch.equal(before[n], after[n]) for n in before)
    step(engine, 2)
    assert engine.was_step_applied()
    assert not torch.equal(before["lm_head.weight"], full_params(engine)["lm_head.weight"])


def test_zero0_in_fp32_is_refused_because_deepspeed_would_apply_the_nan():
    with pytest.raises(ValueError, match="deepspeed=zero1"):
        check_engine_can_skip(engine_for(["deepspeed=zero0"]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stage", [1, 2])
def test_fp8_weight_caches_follow_every_deepspeed_step_through_the_optimizer_hook(stage, device):
    """No trainer here: ZeRO writes the new weights through `.data` (no autograd version bump), so without the
    optimizer's step hook the next forward would reuse the old FP8 weights."""
    engine = engine_for(["precision=fp8", f"deepspeed=zero{stage}"], device)
    layers = [m for m in engine.module.modules() if isinstance(m, FP8Linear)]
    for seed in range(2):
        step(engine, seed)
        assert engine.was_step_applied()
        for lin in layers:
            cached_q, cached_s = lin.quantized_weight()
            fresh_q, fresh_s = quantize_128x128(lin.weight.detach())
            assert torch.equal(cached_q.view(torch.uint8), fresh_q.view(torch.uint8)) and torch.equal(cached_s, fresh_s)


@pytest.mark.parametrize("device", DEVICES)
def test_a_nan_step_changes_no_state_incl_fp8_adam_scales_and_expert_biases(tmp_path, device):
    """Through the trainer's own step: FP8 linears, FP8AdamW (E4M3 moments + scales on ZeRO-2 partitions),
    aux-loss-free expert biases. Step 2's loss is NaN (the fault-injection knob): after it, parameters,
    buffers, optimizer state and lr schedule are bit-identical to after step 1; only the data moved on."""
    cfg = compose_cfg([*TINY, "precision=fp8", "optim=fp8_adamw", "optim.min_fp8_numel=0", "deepspeed=zero2",
                       "train.steps=4", "train.inject_nan_steps=[2]", "train.max_bad_steps=2",
                       f"train.device={device}"])
    trainer = Trainer(cfg, tmp_path, StopSignals())
    engine = trainer.engine

    def snapshot():
        opt = engine.optimizer.state_dict()
        return clone_tree({"module": engine.module.state_dict(), "fp32": opt["single_partition_of_fp32_groups"],
                              "optimizer": opt["base_optimizer_state"], "scheduler": trainer.scheduler.state_dict()})

    first = trainer.train_step(1)
    assert not first["skipped"] and first["nonfinite_steps"] == 0
    state, consumed = snapshot(), trainer.loader.state_dict()["step"]
    assert any(k.endswith("expert_bias") and v.abs().sum() > 0 for k, v in state["module"].items())
    bad = trainer.train_step(2)
    assert bad["skipped"] and bad["nonfinite_steps"] == 1 and bad["loss"] != bad["loss"]  # NaN, counted
    assert_same_tree(state, snapshot())
    assert trainer.loader.state_dict()["step"] == consumed + 1  # that batch is consumed, not retried
    assert trainer.guard.streak == 1 and not trainer.guard.exhausted
    good = trainer.train_step(3)
    assert not good["skipped"] and good["nonfinite_steps"] == 1 and trainer.guard.streak == 0
    after = snapshot()
    assert not torch.equal(after["module"]["lm_head.weight"], state["module"]["lm_head.weight"])
    trainer.close()


def test_guard_poisons_a_nonfinite_loss_so_every_gradient_is_nan():
    guard = NonFiniteGuard(max_bad_steps=3, inject_nan_steps=frozenset({5}))
    w = torch.randn(4, requires_grad=True)
    guard.loss_for_backward((w * 2).sum(), step=1).backward()
    assert torch.equal(w.grad, torch.full((4,), 2.0))  # finite: the loss is multiplied by exactly 1.0
    w.grad = None
    guard.loss_for_backward(torch.log(-w.abs()).sum() * 0 + w.sum() * float("inf"), step=1).backward()
    assert torch.isnan(w.grad).all()
    w.grad = None
    guard.loss_for_backward(w.sum(), step=5).backward()  # injected
    assert torch.isnan(w.grad).all()
    for s in (1, 2, 3):
        assert guard.record(s, applied=False, loss=float("nan"), grad_norm=float("inf"))
    assert guard.exhausted and guard.total == 3 and guard.streak_start == 1
    with pytest.raises(RuntimeError, match="applied an update"):
        guard.record(4, applied=True, loss=float("nan"), grad_norm=1.0)


def test_zero3_in_bf16_keeps_the_routers_bias_and_counts_in_fp32():
    """zero.Init builds every floating tensor in the training dtype, the router's fp32 buffers too (bf16 counts stop
    being exact above 256, bf16 biases swallow the 1e-3 updates); the engine upcasts the ones deepspeed_config
    names. After one step the counts are the exact number of routed slots and the bias update lands in fp32."""
    engine = engine_for(["deepspeed=zero3", "deepspeed.bf16=true"])
    routers = [m for m in engine.module.modules() if isinstance(m, Router)]
    assert routers and all(getattr(r, n).dtype == torch.float32 for r in routers for n in ROUTER_FP32_BUFFERS)
    step(engine, 0)
    for r in routers:
        assert r.tokens_per_expert.sum().item() == 2 * 32 * r.top_k  # one micro-batch of 2 x 32 tokens, top-k each
    update_expert_biases(routers, 1e-3)
    assert all(r.expert_bias.dtype == torch.float32 and r.expert_bias.abs().max() <= 2e-3 for r in routers)
