"""The FP8 ablation instrument (`fp8.ablate`): each switch keeps exactly its component in high precision, the
rest of the recipe bit for bit as without it; the config reaches the layers, the experts and FP8AdamW."""

from __future__ import annotations

import pytest
import torch

from fp8.linear import ABLATION_COMPONENTS, EMULATED, FP8Linear
from fp8.quant import dequantize_1x128, dequantize_128x128, fp8_transpose_128x128, quantize_1x128
from ling.analysis.tables import ablation_table, step_error_table
from tests.helpers import baseline_loss, compose_cfg, run, run_config, write_run


def r1(t: torch.Tensor) -> torch.Tensor:
    """The values an FP8 GEMM sees for a 1x128-quantized operand."""
    return dequantize_1x128(*quantize_1x128(t))


def expected(component: str, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, layer: FP8Linear):
    """(y, dx, dW) with `component` exact and everything else rounded like the recipe, composed by hand."""
    wq, ws = layer.quantized_weight()
    w_r = dequantize_128x128(wq, ws)
    wt_r = dequantize_128x128(*fp8_transpose_128x128(wq, ws))  # dgrad's on-demand transpose
    xs = x if component == "fwd_x" else r1(x)
    y = xs @ (w if component == "fwd_w" else w_r).t()
    dys = dy if component == "dgrad_dy" else r1(dy)
    dx = dys @ w if component == "dgrad_w" else dys @ wt_r.t()
    dyt = dy.t() if component == "wgrad_dy" else r1(dy.t())
    xt = x.t() if component == "wgrad_x" else r1(x.t())
    return y, dx, dyt @ xt.t()


CHANGES = {"fwd_x": 0, "fwd_w": 0, "dgrad_dy": 1, "dgrad_w": 1, "wgrad_dy": 2, "wgrad_x": 2}


@pytest.mark.parametrize("component", list(CHANGES))
def test_each_switch_changes_exactly_its_component(component):
    torch.manual_seed(0)
    layer = FP8Linear(384, 256)
    x, dy = torch.randn(160, 384) * 3, torch.randn(160, 256)
    recipe = run(layer, x, dy)
    layer.set_ablation({component})
    ablated = run(layer, x, dy)
    want = expected(component, x, layer.weight.detach(), dy, layer)
    for i, (a, r, e) in enumerate(zip(ablated, recipe, want)):
        assert torch.equal(a, e), (component, i)  # the hand composition, op for op
        if i == CHANGES[component]:
            assert not torch.equal(a, r)  # that output moved...
        else:
            assert torch.equal(a, r), (component, i)  # ...and nothing else did
    layer.set_ablation(())
    assert all(torch.equal(a, b) for a, b in zip(run(layer, x, dy), recipe))  # switched back: the recipe


def test_no_switch_is_the_recipe_and_wgrad_rounding_is_autograds():
    """With no component ablated the ablation path computes what the FP8 path computes; `wgrad_bf16` hands out
    the fp32 dW, which autograd rounds to a bf16 weight's dtype at once (round to nearest even, as the
    epilogue does): bit-identical gradients, so that suspect is ruled out by construction."""
    torch.manual_seed(1)
    x, dy = torch.randn(96, 256), torch.randn(96, 128)
    for dtype in (torch.float32, torch.bfloat16):
        layer = FP8Linear(256, 128, dtype=dtype)
        recipe = run(layer, x.to(dtype), dy.to(dtype))
        layer.set_ablation({"wgrad_bf16"})
        ablated = run(layer, x.to(dtype), dy.to(dtype))
        assert ablated[2].dtype == dtype
        assert all(torch.equal(a, b) for a, b in zip(ablated, recipe)), dtype
        layer.set_ablation({EMULATED})  # the ablation path, nothing in high precision: on CPU the recipe exactly
        assert layer.ablate and all(torch.equal(a, b) for a, b in zip(run(layer, x.to(dtype), dy.to(dtype)), recipe))


def test_bad_components_are_named():
    with pytest.raises(ValueError, match=r"unknown FP8Linear ablation component\(s\) \['fwd_y'\]"):
        FP8Linear(128, 128).set_ablation({"fwd_y"})
    with pytest.raises(ValueError, match="recipe='blockwise'"):
        FP8Linear(128, 128, recipe="tensorwise").set_ablation({"fwd_x"})
    assert set(ABLATION_COMPONENTS) == {*CHANGES, "wgrad_bf16", EMULATED}


def test_config_reaches_layers_experts_and_optimizer():
    from fp8.adam import FP8AdamW
    from ling.config import model_config_from
    from ling.ranks import init_distributed
    from ling.train.engine import build_engine
    from model.moe import GroupedExperts

    init_distributed()  # a one-process group, as the trainer makes

    cfg = compose_cfg(["+exp=tiny_cpu", "data=synthetic", "precision=fp8", "optim=fp8_adamw", "model.num_layers=2",
                       "fp8.ablate=[fwd_x,wgrad_dy,experts,adam_v]"])
    engine, _ = build_engine(cfg, model_config_from(cfg, 256), torch.device("cpu"))
    linears = [m for m in engine.module.modules() if isinstance(m, FP8Linear)]
    assert linears and all(m.ablate == {"fwd_x", "wgrad_dy"} for m in linears)
    assert all(not m.fp8 for m in engine.module.modules() if isinstance(m, GroupedExperts))
    opt = engine.optimizer
    opt = opt if isinstance(opt, FP8AdamW) else opt.optimizer  # DeepSpeed's wrapper holds ours
    assert opt.fp32_moments == {"exp_avg_sq"}
    for bad, match in ((["fp8.ablate=[adam_q]"], "unknown component"),
                       (["optim=adamw", "fp8.ablate=[adam_m]"], "need optim=fp8_adamw"),
                       (["precision=bf16", "fp8.ablate=[fwd_x]"], "needs precision=fp8")):
        cfg = compose_cfg(["+exp=tiny_cpu", "data=synthetic", "precision=fp8", "optim=fp8_adamw", *bad])
        with pytest.raises(ValueError, match=match):
            build_engine(cfg, model_config_from(cfg, 256), torch.device("cpu"))


# ---------------------------------------------------------------------------------------------------
# scripts/ablate.sh (→ parity.sh) and scripts/ablation_table.py
# ---------------------------------------------------------------------------------------------------
def test_ablate_script_runs_each_variant_per_seed_and_compares_it(tmp_path):
    """A dry run (PYTHON=echo prints every command instead of running it)."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {"PATH": "/usr/bin:/bin", "PYTHON": "echo", "SEEDS": "1 2", "NOISE_SEEDS": "1", "STEPS": "7",
           "OUT": str(tmp_path), "ABLATIONS": "fwd_x adam_v,fwd_w optim.rounding=nearest"}
    out = subprocess.run(["bash", str(root / "scripts" / "ablate.sh"), "train.device=cuda"], env=env, cwd=root,
                         capture_output=True, text=True, check=True).stdout
    trains = [line for line in out.splitlines() if line.startswith("train.py")]
    assert len(trains) == 2 * 5 + 1  # per seed: bf16, fp8, 3 variants; one noise rerun
    assert ("train.py +exp=parity_fp8 train.seed=2 train.steps=7 run_name=parity-s2_fp8-no-adam_v+fwd_w "
            f"hydra.run.dir={tmp_path}/s2_fp8-no-adam_v+fwd_w train.deterministic=true fp8.ablate=[adam_v,fwd_w] "
            "train.device=cuda") in trains
    assert any("s1_fp8-no-optim.rounding-nearest" in t and t.endswith("optim.rounding=nearest train.device=cuda")
               for t in trains)
    assert any("s1_bf16_rerun" in t and "train.deterministic=false" in t for t in trains)
    compares = [line for line in out.splitlines() if line.startswith("eval.py compare")]
    assert (f"eval.py compare --pairs {tmp_path}/s1_fp8-no-fwd_x:{tmp_path}/s1_bf16 "
            f"{tmp_path}/s2_fp8-no-fwd_x:{tmp_path}/s2_bf16 --noise {tmp_path}/s1_bf16_rerun:{tmp_path}/s1_bf16 "
            f"--out {tmp_path}/report_no-fwd_x") in compares
    assert len(compares) == 5 and out.rstrip().endswith(f"scripts/ablation_table.py {tmp_path}")
    assert any(c.startswith("eval.py compare --key val_loss --window 0.3") and c.endswith(f"{tmp_path}/report_val")
               for c in compares)


def test_parity_script_concurrent_jobs_rerun_check_and_archive(tmp_path):
    """JOBS=2: every run's commands land in its own log; DET_RERUN_SEEDS adds the deterministic rerun and its
    --identical check; ARCHIVE packs the logs (dry run: PYTHON=echo)."""
    import subprocess
    import tarfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {"PATH": "/usr/bin:/bin", "PYTHON": "echo", "SEEDS": "1", "NOISE_SEEDS": "", "STEPS": "7",
           "OUT": str(tmp_path / "p"), "JOBS": "2", "DET_RERUN_SEEDS": "1", "ARCHIVE": str(tmp_path / "a.tgz")}
    out = subprocess.run(["bash", str(root / "scripts" / "parity.sh")], env=env, cwd=root, capture_output=True,
                         text=True, check=True).stdout
    logs = sorted(p.name for p in (tmp_path / "p").glob("*.log"))
    assert logs == ["s1_bf16.log", "s1_bf16_detrerun.log", "s1_fp8.log"]
    assert "train.deterministic=true" in (tmp_path / "p" / "s1_bf16_detrerun.log").read_text()
    assert f"eval.py compare --identical {tmp_path}/p/s1_bf16 {tmp_path}/p/s1_bf16_detrerun" in out
    with tarfile.open(tmp_path / "a.tgz") as tar:
        assert {Path(n).name for n in tar.getnames()} >= set(logs)


def test_ablation_table_from_reports_with_known_offsets(tmp_path):
    """Synthetic runs whose losses are the baseline's times 1.002 (fp8), 1.001 (fwd_x kept exact) and 1.0015 (adam_v
    kept in fp32); without an emulated run every Δ is against fp8; with one (1.0018), the FP8Linear component's Δ
    is against it and the optimizer's stays against fp8."""
    from ling.analysis.compare import compare

    factors = {"fp8": 1.002, "no-fwd_x": 1.001, "no-adam_v": 1.0015, "no-emulated": 1.0018}
    pairs = {name: [] for name in factors}
    for seed in (1, 2, 3):
        base = baseline_loss(seed)
        bf16 = write_run(tmp_path, f"s{seed}_bf16", base, run_config(**{"train.seed": seed}))
        for name, factor in factors.items():
            fp8 = write_run(tmp_path, f"s{seed}_{name}", base * (factor + 1e-4 * seed),
                            run_config(**{"train.seed": seed, "precision.name": "fp8", "fp8.ablate": [name]}))
            pairs[name].append((fp8, bf16))

    def rows() -> dict[str, list[str]]:
        lines = [line.split(" | ") for line in ablation_table(tmp_path).splitlines() if line[:2] == "| "]
        return {cells[0][2:]: cells for cells in lines}

    for name in ("fp8", "no-fwd_x", "no-adam_v"):
        compare(pairs[name], out_dir=tmp_path / ("report" if name == "fp8" else f"report_{name}"))
    got = rows()
    assert got["fp8"][1:3] == ["3", "+0.220 % ± 0.010"] and got["fp8"][4] == "—"
    assert got["no-fwd_x"][2] == "+0.120 % ± 0.010" and got["no-fwd_x"][4] == "-0.100 % (vs fp8)"
    # 95 % t-interval of a mean of 3 values with std 0.01 %: ± t(0.975, 2) · 0.01 / sqrt(3) = ± 0.0248 %
    assert got["fp8"][3] == "[+0.195, +0.245] %"
    compare(pairs["no-emulated"], out_dir=tmp_path / "report_no-emulated")
    got = rows()
    assert got["no-fwd_x"][4] == "-0.080 % (vs no-emulated)" and got["no-emulated"][4] == "-0.020 % (vs fp8)"
    assert got["no-adam_v"][4] == "-0.050 % (vs fp8)"


def test_parity_script_step_error_evaluations(tmp_path):
    """STEP_ERROR=1: each seed's final BF16 and FP8 checkpoint through eval.py mode=step_error, then the table
    (dry run: PYTHON=echo)."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {"PATH": "/usr/bin:/bin", "PYTHON": "echo", "SEEDS": "1 2", "NOISE_SEEDS": "", "STEPS": "7",
           "OUT": str(tmp_path), "STEP_ERROR": "1", "STEP_ERROR_ABLATE": "[fwd_x]"}
    out = subprocess.run(["bash", str(root / "scripts" / "parity.sh")], env=env, cwd=root, capture_output=True,
                         text=True, check=True).stdout.splitlines()
    evals = [line for line in out if "mode=step_error" in line]
    assert evals == [f"eval.py checkpoint={tmp_path}/s{s}_{p} mode=step_error batches=null progress_bar=false "
                     f"step_error_ablate=[fwd_x] output={tmp_path}/s{s}_{p}/eval/step_error.json"
                     for s in (1, 2) for p in ("bf16", "fp8")]
    assert out[-1] == f"scripts/step_error_table.py {tmp_path}"


def _step_error_record(step: int, fp8_bias: float, d_err: float) -> dict:
    one = lambda m: {"mean": m, "std": 0.0, "min": m, "max": m, "n": 15, "ci_low": m - 1e-5, "ci_high": m + 1e-5}  # noqa: E731
    return {"step": step, "batches": 15,
            "loss_rel": {"bf16": one(1e-5), "fp8": one(fp8_bias), "fp8_vs_bf16": one(fp8_bias - 1e-5)},
            "grad_rel_err": {"bf16": {"all": 0.02}, "fp8": {"all": 0.05}},
            "routing_changed": {"bf16": 0.006, "fp8": 0.022},
            "ablation_effect": {"fp8-no-fwd_x": {"baseline": "fp8-emulated", "loss_rel": one(-1e-4),
                                                 "grad_rel_err": one(d_err), "routing_changed": -0.005}}}


def test_step_error_table_over_runs(tmp_path):
    """Two runs with FP8 biases 0.01 % and 0.03 %: the mean 0.02 % with the t-interval over 2 runs
    (± t(0.975, 1) · std / sqrt(2) = ± 12.706 · 0.01414 / 1.414 = ± 0.127 %), the ablation averaged likewise."""
    import json

    for name, bias, d_err in (("s1_bf16", 1e-4, -6e-3), ("s1_fp8", 3e-4, -8e-3)):
        (tmp_path / name / "eval").mkdir(parents=True)
        (tmp_path / name / "eval" / "step_error.json").write_text(json.dumps(_step_error_record(1000, bias, d_err)))
    out = step_error_table(tmp_path)
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| s1_")]
    assert [r[0] for r in rows] == ["| s1_bf16", "| s1_fp8"]
    assert rows[0][3] == "+0.0100 % [+0.0090 %, +0.0110 %]" and rows[0][6] == "2.000e-02 / 5.000e-02"
    assert rows[1][7] == "0.60 % / 2.20 % |"
    assert "loss FP8 vs fp32 +0.0200 % [-0.1071 %, +0.1471 %]" in out
    assert "FP8's gradient error / bf16's 2.50× [2.50×, 2.50×]" in out
    assert "| fwd_x | fp8-emulated | 2 | -7.00e-03 [" in out
    with pytest.raises(SystemExit, match="no eval/step_error.json"):
        step_error_table(tmp_path / "nothing")
