"""Branches of a run (scripts/parity_branch.sh): `train.resume=<another run's checkpoint>` in a fresh run dir
continues that run's trajectory (weights, fp32 masters, moments, data position, RNG, lr schedule) in another recipe,
and `train.stop_at` ends it early while the lr schedule still spans `train.steps`. Across optimizers (AdamW ↔
FP8AdamW) the state goes through ling/checkpoint/reshard.py's per-parameter path: the fp32 master weights exactly, the
moments in the new optimizer's format."""

from __future__ import annotations

import json

import pytest

from tests.helpers import COMMON, compose_cfg, metrics_of, same_losses

BASE = ["train.steps=8", "train.eval_every=0"]
FP8_ADAM = ["optim=fp8_adamw", "optim.min_fp8_numel=0"]


# DeepSpeed's default ZeRO buckets hold 5e8 elements, and deterministic mode (the trunk's and the FP8 branches')
# fills every torch.empty with NaN: on CPU that writes a 2 GB bucket every step (about 2.5 s). Buckets of the
# tiny model's size give the same sums.
SMALL_BUCKETS = ["+deepspeed.zero_extra.reduce_bucket_size=1000000",
                 "+deepspeed.zero_extra.allgather_bucket_size=1000000"]


def train_here(run_dir, overrides: list[str]):
    """One in-process run of the trainer (the torchrun launch has its own tests; a process start costs ~5 s here);
    returns its metrics lines and its train.log."""
    import ling.train.trainer as trainer

    trainer.train(compose_cfg([*COMMON, *BASE, *overrides]), run_dir=run_dir)
    return metrics_of(run_dir), (run_dir / "train.log").read_text()


@pytest.fixture(scope="module")
def trunk(tmp_path_factory):
    root = tmp_path_factory.mktemp("branch")
    metrics, _ = train_here(root / "trunk", ["train.save_every=3", "train.keep_last=0"])
    return root, metrics


def branch(root, name: str, source: str, stop_at: int, extra: list[str]):
    return train_here(root / name, [f"train.stop_at={stop_at}", f"train.resume={source}", *extra])


def close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * abs(b)


@pytest.mark.slow
def test_a_branch_in_the_same_recipe_is_the_trunk_bit_for_bit_and_stops_at_stop_at(trunk):
    root, full = trunk
    metrics, log = branch(root, "same", str(root / "trunk" / "checkpoints" / "step00000003"), 6, [])
    same_losses(metrics, full[3:6])  # steps 4-6: losses, grad norms and the lr of the 8-step schedule
    assert "stopped at train.stop_at at step 6/8" in log
    assert json.loads((root / "same" / "summary.json").read_text())["outcome"] == "stopped at train.stop_at"
    assert sorted(p.name for p in (root / "same" / "checkpoints").glob("step*")) == ["step00000006"]


@pytest.mark.slow
def test_a_branch_into_fp8_adam_converts_the_moments(trunk):
    """AdamW → FP8AdamW: step 4's forward uses step 3's weights, so its loss and gradient are the trunk's exactly;
    from step 5 on the update differs by the E4M3 rounding of the moments (measured 1e-5 relative on the losses;
    bound 1e-3)."""
    root, full = trunk
    metrics, log = branch(root, "adam8_from3", str(root / "trunk" / "checkpoints" / "step00000003"), 6, FP8_ADAM)
    assert "(its AdamW state converted for FP8AdamW)" in log
    assert (metrics[0]["loss"], metrics[0]["grad_norm"]) == (full[3]["loss"], full[3]["grad_norm"])
    for got, want in zip(metrics[1:], full[4:6], strict=True):
        assert got["lr"] == want["lr"] and got["loss"] != want["loss"]
        assert close(got["loss"], want["loss"], 1e-3) and close(got["grad_norm"], want["grad_norm"], 1e-2), (got, want)
    manifest = json.loads((root / "adam8_from3" / "checkpoints" / "step00000006" / "manifest.json").read_text())
    assert manifest["optimizer"] == "FP8AdamW"
    # ... and back: the FP8AdamW checkpoint branches into AdamW (moments dequantized) and into the FP8 linears
    back, log = branch(root, "back", str(root / "adam8_from3" / "checkpoints" / "step00000006"), 7, [])
    assert [m["step"] for m in back] == [7] and "(its FP8AdamW state converted for AdamW)" in log
    fp8, log = branch(root, "fp8", str(root / "trunk" / "checkpoints" / "step00000003"), 4,
                      ["precision=fp8", *FP8_ADAM])
    assert close(fp8[0]["loss"], full[3]["loss"], 1e-2) and fp8[0]["loss"] != full[3]["loss"]  # FP8's forward


@pytest.mark.slow
def test_a_branch_into_fp8_adam_with_an_ablated_moment_keeps_it_in_fp32(trunk):
    """fp8.ablate=[adam_v] on a branch of an AdamW run: the converted state keeps v in fp32, so from step 5 on the
    branch differs from the recipe's branch (before the fix both were E4M3 and the runs bit-identical: the
    ablation did nothing, as the H200 branch ablation showed)."""
    root, full = trunk
    source = str(root / "trunk" / "checkpoints" / "step00000003")
    recipe, _ = branch(root, "adam8_recipe", source, 5, FP8_ADAM)
    ablated, log = branch(root, "adam8_no_v", source, 5, [*FP8_ADAM, "fp8.ablate=[adam_v]"])
    assert "(its AdamW state converted for FP8AdamW)" in log
    assert ablated[0]["loss"] == recipe[0]["loss"] == full[3]["loss"]  # step 4: step 3's weights
    assert ablated[1]["loss"] != recipe[1]["loss"] and close(ablated[1]["loss"], recipe[1]["loss"], 1e-3)


@pytest.mark.slow
def test_a_branch_from_past_stop_at_is_refused(trunk):
    root, _ = trunk
    with pytest.raises(ValueError, match="train.stop_at=5: the run resumes at step 8"):  # its newest checkpoint
        train_here(root / "late", ["train.stop_at=5", f"train.resume={root / 'trunk' / 'checkpoints'}"])


@pytest.mark.parametrize("stop_at", [0, 9])
def test_stop_at_outside_the_schedule_is_refused_naming_the_key(tmp_path, stop_at):
    with pytest.raises(ValueError, match=f"train.stop_at={stop_at}: expected a step in 1 … train.steps \\(8\\)"):
        train_here(tmp_path / "run", [f"train.stop_at={stop_at}"])


@pytest.mark.slow
def test_the_branch_protocol_script_on_the_tiny_model(tmp_path):
    """scripts/parity_branch.sh for real on CPU (tiny model, synthetic data): a trunk of 5 steps with a checkpoint
    at 3, an FP8 and a nondeterministic-BF16 branch of 2 steps from it (side by side), and the report of each
    branch against the trunk's same steps (several branch points: the dry run below). On CPU the BF16 branch is
    the trunk bit for bit (CPU kernels are deterministic), so the noise pair reads exactly 0; the FP8 branch
    differs, by FP8's rounding over 2 steps (well under 1 %). The trunk's checkpoints are deleted once its
    branches have run; a rerun trains nothing."""
    import os
    import subprocess
    from pathlib import Path

    from tests.fork_server import python_command

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    # the script's `$PYTHON train.py` / `$PYTHON eval.py` as children of the fork server (tests/fork_server.py):
    # the script's orchestration is what is tested, not a fresh interpreter's start-up
    env = {**env, **python_command(env), "TRUNK_STEPS": "5", "EVERY": "3", "LENGTH": "2", "OUT": str(tmp_path / "pb"),
           "JOBS": "2"}
    extra = ["model=tiny", "data=synthetic", "data.kind=markov", "data.vocab_size=512", "train.device=cpu",
             "train.seq_len=32", "train.micro_batch_size=2", "model.num_layers=2", "logging.wandb.mode=disabled",
             "logging.progress_bar=false", "optim.warmup_steps=2", *SMALL_BUCKETS]
    proc = subprocess.run(["bash", str(root / "scripts" / "parity_branch.sh"), *extra], cwd=root, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "pb"
    summary = json.loads((out / "report" / "summary.json").read_text())
    assert [p["candidate"] for p in summary["pairs"]] == ["s1_fp8_from3"]
    assert [p["window"] for p in summary["pairs"]] == [[5, 5]]  # the second of the branch's 2 steps
    assert all(0 < abs(p["mean_rel"]) < 1e-2 for p in summary["pairs"])
    assert [p["mean_rel"] for p in summary["noise"]] == [0.0]
    trunk = [m["loss"] for m in (json.loads(line) for line in (out / "s1_trunk" / "metrics.jsonl").open())]
    fp8 = [json.loads(line) for line in (out / "s1_fp8_from3" / "metrics.jsonl").open()]
    assert [m["step"] for m in fp8] == [4, 5] and fp8[0]["loss"] != trunk[3]
    assert not (out / "s1_trunk" / "checkpoints").exists()
    # the rerun as a dry run (PYTHON=echo prints the commands it would run): the skip check reads the real run
    # dirs, so every finished run is skipped and only the reports' commands are left
    again = subprocess.run(["bash", str(root / "scripts" / "parity_branch.sh"), *extra], cwd=root,
                           env={**env, "PYTHON": "echo"}, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0 and "===" not in again.stdout and "train.py" not in again.stdout
    assert again.stdout.count("eval.py compare") == 1  # the training-loss report (synthetic data: no held-out)


def test_the_branch_script_runs_each_ablation_beside_each_fp8_branch(tmp_path):
    """A dry run (PYTHON=echo prints every command instead of running it): per checkpoint of the trunk, the FP8
    branch, one branch per ABLATIONS entry and the noise branch, each into its own log; one report per entry."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {"PATH": "/usr/bin:/bin", "PYTHON": "echo", "SEEDS": "1 2", "TRUNK_STEPS": "10", "EVERY": "4",
           "LENGTH": "2", "OUT": str(tmp_path), "ABLATIONS": "fwd_x adam_v,fwd_w optim.rounding=nearest"}
    out = subprocess.run(["bash", str(root / "scripts" / "parity_branch.sh"), "train.device=cuda"], env=env,
                         cwd=root, capture_output=True, text=True, check=True).stdout
    logs = sorted(p.name for p in tmp_path.glob("*.log"))
    assert len(logs) == 2 * (1 + 2 * (1 + 3)) + 2  # per seed: trunk; per checkpoint (4, 8): fp8 + 3 ablations; noise
    assert "s1_bf16nd_from4.log" in logs and "s2_bf16nd_from4.log" not in logs  # noise: the first seed only
    ablated = (tmp_path / "s2_fp8-no-adam_v+fwd_w_from8.log").read_text()
    assert ablated.startswith("train.py +exp=parity_fp8 train.seed=2 train.steps=10 train.stop_at=10 "
                              f"train.resume={tmp_path}/s2_trunk/checkpoints/step00000008 train.eval_every=2 ")
    assert ablated.rstrip().endswith("train.deterministic=true fp8.ablate=[adam_v,fwd_w] train.device=cuda")
    trunk = (tmp_path / "s1_trunk.log").read_text()
    assert "train.save_every=4 train.keep_last=0 train.eval_every=2" in trunk
    compares = [line for line in out.splitlines() if line.startswith("eval.py compare")]
    assert len(compares) == 1 + 3  # the recipe, one per ablation (no held-out report: a dry run logs no val_loss)
    t = tmp_path
    assert (f"eval.py compare --window 0.5 --pairs {t}/s1_fp8-no-fwd_x_from4:{t}/s1_trunk "
            f"{t}/s1_fp8-no-fwd_x_from8:{t}/s1_trunk {t}/s2_fp8-no-fwd_x_from4:{t}/s2_trunk "
            f"{t}/s2_fp8-no-fwd_x_from8:{t}/s2_trunk --noise {t}/s1_bf16nd_from4:{t}/s1_trunk "
            f"{t}/s1_bf16nd_from8:{t}/s1_trunk --out {t}/report_no-fwd_x") in compares
    assert any("report_no-optim.rounding-nearest" in c for c in compares)
