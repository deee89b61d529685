"""FP8 health: underflow / distortion against hand-computed values, no host sync while a layer collects them,
the monitor's alarms (an underflowing layer alarms, a healthy one does not), the fp32 dW recompute check
against a hand computation, the per-layer fallback (plain linear afterwards, checkpoint state), and the
fallback through the real trainer on the tiny model: it trains in high precision and survives a resume."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn.functional as F

from fp8.health import distortion, relative_error, underflow
from fp8.linear import FP8Linear
from fp8.monitor import FP8Monitor, MonitorConfig
from fp8.quant import dequantize_1x128, quantize_1x128, quantize_1x128_ref
from tests.helpers import compose_cfg, run


# ---------------------------------------------------------------------------------------------------
# statistics
# ---------------------------------------------------------------------------------------------------
def test_underflow_and_distortion_match_hand_computed_values():
    x = torch.zeros(3, 130)
    x[0, 0] = 448.0  # scale 1: codes are the values themselves
    x[0, 1:5] = 2.0**-11  # below half the smallest subnormal (2^-9): these 4 flush to zero
    x[0, 5:9] = 2.0**-9  # the smallest subnormal: kept
    x[1, 0], x[1, 1], x[1, 2] = 448.0, 97.0, 99.0  # 97 and 99 both round to 96: one distinct value fewer
    x[2, 0] = 1.0
    x[2, 128], x[2, 129] = 5.0, 6.0  # a 2-wide tail block, representable after scaling: no loss
    q, _ = quantize_1x128(x)
    # non-zeros: 9 + 3 + 3 = 15, of which 4 became zero
    assert underflow(x, q).item() == pytest.approx(4 / 15, rel=1e-6)
    # blocks (row, first 128 | tail): distinct before -> after, ratio
    #   row 0: {0, 448, 2^-11, 2^-9} 4 -> {0, 448, 2^-9} 3: 3/4; tail {0} -> {0}: 1
    #   row 1: {0, 448, 97, 99} 4 -> {0, 448, 96} 3: 3/4;     tail {0}: 1
    #   row 2: {0, 1} 2 -> 2: 1;                              tail {5, 6} 2 -> 2: 1
    assert distortion(x, q).item() == pytest.approx(1 - (0.75 + 1 + 0.75 + 1 + 1 + 1) / 6, rel=1e-6)
    assert underflow(torch.zeros(2, 128), quantize_1x128(torch.zeros(2, 128))[0]).item() == 0.0
    a, ref = torch.tensor([3.0, 4.0]), torch.tensor([0.0, 0.0])
    assert relative_error(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 0.0])).item() == pytest.approx(2.0)
    assert relative_error(ref, ref).item() == 0.0 and relative_error(a, ref).item() == float("inf")


def test_collecting_health_reads_nothing_back_to_the_host(monkeypatch):
    """A sampled forward+backward of an FP8Linear (check_dw included) never converts a tensor to a Python
    number; the monitor reads every layer's statistics with one `tolist()`."""
    layers = [FP8Linear(256, 128) for _ in range(3)]
    monitor = FP8Monitor([(f"l{i}", m) for i, m in enumerate(layers)],
                         MonitorConfig(every=1, recompute_dw=True))
    monitor.begin_step(1)
    reads = []
    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=original, _n=name, **k: reads.append(_n)
                            or _o(self, *a, **k))
    for m in layers:
        x = torch.randn(64, 256, requires_grad=True)
        m(x).backward(torch.randn(64, 128))
    assert reads == []
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for m in layers for v in m.health.values())
    metrics = monitor.end_step(1)
    assert reads == ["tolist"]
    assert len([k for k in metrics if k.startswith("fp8/l0/")]) == 9  # 4 kinds x 2 statistics + dw_rel_err


# ---------------------------------------------------------------------------------------------------
# alarms, recompute check, fallback
# ---------------------------------------------------------------------------------------------------
def underflowing_input(m: int, k: int) -> torch.Tensor:
    """One large element per 128-block, the rest 1e-8 of it: 127 of every 128 quantize to zero."""
    x = torch.full((m, k), 1e-4)
    x[:, ::128] = 1e4
    return x


def step(monitor: FP8Monitor, layers: dict[str, FP8Linear], inputs: dict[str, torch.Tensor], n: int = 1):
    monitor.begin_step(n)
    for name, layer in layers.items():
        layer(inputs[name].requires_grad_()).sum().backward()
    return monitor.end_step(n)


def test_alarm_fires_on_the_underflowing_layer_only(caplog):
    torch.manual_seed(0)
    layers = {"bad": FP8Linear(256, 128), "good": FP8Linear(256, 128)}
    monitor = FP8Monitor(layers.items(), MonitorConfig.from_dict(1, {"thresholds": {"act": {"underflow": 0.01}}}))
    with caplog.at_level(logging.WARNING, logger="fp8.monitor"):
        metrics = step(monitor, layers, {"bad": underflowing_input(32, 256), "good": torch.randn(32, 256)})
    assert metrics["fp8/bad/act_underflow"] == pytest.approx(127 / 128)
    assert metrics["fp8/good/act_underflow"] == 0.0
    assert metrics["fp8/alarms"] == 1.0
    assert [(a.layer, a.key) for a in monitor.alarms] == [("bad", "act_underflow")]
    msg = caplog.records[-1].getMessage()
    assert "bad act_underflow = 0.9922 > 0.01" in msg and "fp8.monitor.thresholds.act.underflow" in msg
    assert all(layer.use_fp8 for layer in layers.values())  # no fallback unless asked


def test_recompute_error_equals_the_hand_computed_one():
    """health["dw_rel_err"] = ||dW_fp8 − dyᵀx|| / ||dyᵀx||, with dW_fp8 composed by hand from the reference
    quantizers (dyᵀ and xᵀ 1x128 along tokens) and the reference in float64."""
    torch.manual_seed(1)
    layer = FP8Linear(384, 256)
    layer.collect_health, layer.check_dw = True, True
    x, dy = torch.randn(96, 384), torch.randn(96, 256)
    _, _, dw = run(layer, x, dy)
    dyt = dequantize_1x128(*quantize_1x128_ref(dy.t()))
    xt = dequantize_1x128(*quantize_1x128_ref(x.t()))
    dw_hand = dyt @ xt.t()
    assert torch.equal(dw, dw_hand)  # the CPU path is this composition, op for op
    ref = dy.double().t() @ x.double()
    want = ((dw_hand.double() - ref).norm() / ref.norm()).item()
    # the check computes its reference GEMM and the norms in fp32: agrees with float64 to ~1e-6 relative
    assert layer.health["dw_rel_err"].item() == pytest.approx(want, rel=1e-5)
    assert 0.01 < want < 0.1  # E4M3's 3 mantissa bits on both operands
    layer.collect_health = layer.check_dw = False
    layer.health = {}
    run(layer, x, dy)
    assert "dw_rel_err" not in layer.health  # only sampled passes keep x and pay for the recompute


def test_fallback_switches_the_layer_to_a_plain_linear_and_is_checkpointed():
    torch.manual_seed(2)
    layers = {"bad": FP8Linear(256, 128), "good": FP8Linear(256, 128)}
    config = MonitorConfig.from_dict(1, {"thresholds": {"act": {"underflow": 0.01}}, "fallback": True})
    monitor = FP8Monitor(layers.items(), config)
    metrics = step(monitor, layers, {"bad": underflowing_input(32, 256), "good": torch.randn(32, 256)})
    assert metrics["fp8/bf16_layers"] == 1.0
    assert not layers["bad"].use_fp8 and layers["good"].use_fp8
    x = underflowing_input(16, 256)
    assert torch.equal(layers["bad"](x), F.linear(x, layers["bad"].weight))  # high precision from now on
    assert monitor.state_dict() == {"bf16_layers": ["bad"]}
    # the next sampled step no longer watches it (nothing to alarm on) and keeps watching the healthy one
    metrics = step(monitor, layers, {"bad": x, "good": torch.randn(32, 256)}, n=2)
    assert "fp8/bad/act_underflow" not in metrics and "fp8/good/act_underflow" in metrics
    fresh = {"bad": FP8Linear(256, 128), "good": FP8Linear(256, 128)}
    FP8Monitor(fresh.items(), config).load_state_dict(monitor.state_dict())
    assert not fresh["bad"].use_fp8 and fresh["good"].use_fp8
    with pytest.raises(ValueError, match="'nope'.*not an FP8 layer"):
        FP8Monitor(fresh.items(), config).load_state_dict({"bf16_layers": ["nope"]})


@pytest.mark.parametrize("monitor, match", [
    ({"thresholds": {"acts": {"underflow": 0.1}}}, "fp8.monitor.thresholds.acts: unknown tensor kind"),
    ({"thresholds": {"act": {"overflow": 0.1}}}, "fp8.monitor.thresholds.act.overflow: unknown statistic"),
    ({"thresholds": {"act": {"underflow": -1}}}, "must be a number >= 0"),
    ({"fallbak": True}, "fp8.monitor.fallbak: unknown key"),
])  # fmt: skip
def test_bad_monitor_config_is_named(monitor, match):
    with pytest.raises(ValueError, match=match):
        MonitorConfig.from_dict(10, monitor)


# ---------------------------------------------------------------------------------------------------
# through the trainer (tiny model, CPU): alarm -> BF16 -> checkpoint -> resume keeps it
# ---------------------------------------------------------------------------------------------------
WATCHED = "layers.0.attention.dense"


def compose_run(steps: int, extra: list[str]):
    return compose_cfg([
        "+exp=tiny_cpu", "data=synthetic", "data.kind=markov", "data.vocab_size=256", "precision=fp8",
        f"train.steps={steps}", "train.seq_len=32", "model.num_layers=2", "train.save_every=2",
        "train.keep_last=0", "logging.wandb.mode=disabled", "logging.progress_bar=false",
        "optim.warmup_steps=1", "fp8.health_every=2", "fp8.monitor.fallback=true",
        "fp8.monitor.thresholds.act.underflow=0.5", "fp8.monitor.thresholds.weight.underflow=null",
        "fp8.monitor.thresholds.grad.underflow=null", "fp8.monitor.thresholds.gradT.underflow=null", *extra])


@pytest.mark.slow
def test_fallback_through_the_trainer_survives_a_checkpoint(tmp_path):
    """One linear is fed underflowing inputs (a forward pre-hook, in every run alike); its alarm at the first
    sampled step switches it to high precision; a run resumed from a later checkpoint keeps it there and
    reproduces the uninterrupted run's losses exactly."""
    import ling.train.trainer as trainer
    from ling.train.engine import build_engine

    models = []

    def build(*a, **k):
        engine, sched = build_engine(*a, **k)
        layer = engine.module.get_submodule(WATCHED)
        layer.register_forward_pre_hook(lambda m, args: (args[0] * underflowing_input(1, args[0].shape[-1]),))
        models.append(engine.module)
        return engine, sched

    trainer.train(compose_run(6, ["train.resume=none"]), run_dir=tmp_path / "straight", build_engine=build)
    straight = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    log_lines = (tmp_path / "straight" / "train.log").read_text().splitlines()
    alarms = [line for line in log_lines if "FP8 health alarm" in line]
    assert len(alarms) == 1 and f"step 1: {WATCHED} act_underflow" in alarms[0]
    assert any(f"{WATCHED} runs in high precision (BF16) from step 2 on" in line for line in log_lines)
    assert straight[0]["fp8/alarms"] == 1.0 and straight[0][f"fp8/{WATCHED}/act_underflow"] > 0.9
    assert f"fp8/{WATCHED}/act_underflow" not in straight[2] and "fp8/mean/act_underflow" in straight[2]
    layer = models[0].get_submodule(WATCHED)
    assert not layer.use_fp8 and sum(not m.use_fp8 for m in models[0].modules() if isinstance(m, FP8Linear)) == 1
    # the checkpoint of step 4 names it; a run resumed from there starts with it in high precision
    state = torch.load(tmp_path / "straight" / "checkpoints" / "step00000004" / "trainer_state_rank0.pt",
                       weights_only=True)
    assert state["fp8_monitor"] == {"bf16_layers": [WATCHED]}
    resumed_dir = tmp_path / "resumed"
    (resumed_dir / "checkpoints").mkdir(parents=True)
    import shutil

    shutil.copytree(tmp_path / "straight" / "checkpoints" / "step00000004",
                    resumed_dir / "checkpoints" / "step00000004")
    trainer.train(compose_run(6, ["train.resume=auto"]), run_dir=resumed_dir, build_engine=build)
    assert not models[1].get_submodule(WATCHED).use_fp8
    resumed = [json.loads(line) for line in (resumed_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == [5, 6]
    for a, b in zip(straight[4:], resumed):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"])


def test_fp8_experts_report_health():
    """The routed experts' hook: act (tokens along H) at forward, grad (d out along H) once backward reaches
    the experts, weight (mean over gate_up and down); read by the monitor like any FP8 layer."""
    from fp8.health import health_stats
    from model.config import ModelConfig
    from model.moe import MoE

    torch.manual_seed(3)
    moe = MoE(ModelConfig.preset("tiny", vocab_size=256, precision="fp8"))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    monitor = FP8Monitor([("moe.experts", moe.experts)], MonitorConfig(every=1))
    monitor.begin_step(1)
    x = torch.randn(2, 64, 128, requires_grad=True)
    out, _ = moe(x)
    assert set(moe.experts.health) == {"act_underflow", "act_distortion", "weight_underflow", "weight_distortion"}
    captured = []
    out.register_hook(lambda g: captured.append(g))  # the same gradient reaches the experts' output (a sum)
    out.backward(torch.randn_like(out) * torch.logspace(-3, 3, 128))
    want = health_stats("grad", captured[0].reshape(-1, 128), quantize_1x128(captured[0].reshape(-1, 128))[0])
    assert moe.experts.health["grad_distortion"].item() == pytest.approx(want["grad_distortion"].item())
    metrics = monitor.end_step(1)
    assert metrics["fp8/moe.experts/act_underflow"] == pytest.approx(
        underflow(x.detach().reshape(-1, 128), quantize_1x128(x.detach().reshape(-1, 128))[0]).item())
    assert "fp8/moe.experts/grad_underflow" in metrics and not moe.experts.collect_health
