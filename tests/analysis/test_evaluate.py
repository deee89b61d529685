"""Held-out evaluation: `evaluate` against a hand computation, across ranks, and eval.py end to end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ling.analysis.evaluate import (
    SYNTHETIC_BATCHES,
    evaluate,
    requested_batches,
    run_eval,
    split_batches,
    split_steps,
)
from ling.analysis.step_error import format_step_errors
from model.config import ModelConfig
from model.ling import LingForCausalLM, shift_left
from tests.fork_server import CLIENT, python_command, run_script
from tests.helpers import ROOT

SMALL = ModelConfig.preset("tiny", vocab_size=200, num_layers=2, num_experts=8, num_expert_groups=4,
                           topk_groups=2, num_experts_per_tok=2, num_mtp_layers=2)


def make_batches(n: int, seed: int, B: int = 3, T: int = 16) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, SMALL.vocab_size, (B, T + 1), generator=g)
        labels = ids[:, 1:].clone()
        labels[:, : 2 * i] = -100  # a different number of ignored targets per batch: token weighting matters
        out.append({"input_ids": ids[:, :-1], "labels": labels})
    return out


def reference(model: LingForCausalLM, batches, **kwargs) -> dict[str, float]:
    """Concatenate every batch's logits and targets, then one CE / accuracy over all counted targets."""
    with torch.no_grad():
        outs = [model(b["input_ids"], labels=b["labels"], **{"return_logits": True, **kwargs}) for b in batches]
    res = {}
    heads = [("lm", [o.logits for o in outs], [b["labels"] for b in batches])]
    for d in range(1, SMALL.num_mtp_layers + 1):
        heads.append((f"mtp_{d}", [o.mtp_logits[d - 1] for o in outs],
                      [shift_left(b["labels"], d, -100) for b in batches]))
    for name, logits, targets in heads:
        lg = torch.cat([x.reshape(-1, x.shape[-1]) for x in logits]).double()
        tg = torch.cat([t.reshape(-1) for t in targets])
        keep = tg != -100
        res[f"{name}_loss"] = F.cross_entropy(lg[keep], tg[keep]).item()
        res[f"{name}_acc"] = (lg[keep].argmax(-1) == tg[keep]).double().mean().item()
    res["tokens"] = sum(int((b["labels"] != -100).sum()) for b in batches)
    return res


def test_evaluate_matches_a_token_weighted_hand_computation():
    torch.manual_seed(0)
    model = LingForCausalLM(SMALL)
    model.train()
    batches = make_batches(4, seed=1)
    got = evaluate(model, batches, "cpu")
    assert model.training  # mode restored
    model.eval()
    want = reference(model, batches)
    # fp32 logits, CE summed in fp32 per chunk vs one fp64 CE: ~1e-6 relative
    assert got["lm_loss"] == pytest.approx(want["lm_loss"], rel=1e-5)
    assert got["acc"] == pytest.approx(want["lm_acc"], abs=1e-12)
    for d in (1, 2):
        assert got[f"mtp_loss_{d}"] == pytest.approx(want[f"mtp_{d}_loss"], rel=1e-5)
        assert got[f"mtp_acc_{d}"] == pytest.approx(want[f"mtp_{d}_acc"], abs=1e-12)
    assert got["mtp_loss"] == pytest.approx((got["mtp_loss_1"] + got["mtp_loss_2"]) / 2)
    assert got["ppl"] == pytest.approx(torch.tensor(got["lm_loss"]).exp().item())
    assert got["tokens"] == want["tokens"] and got["batches"] == 4
    assert got["loss"] == pytest.approx(got["lm_loss"] + 0.1 * got["mtp_loss"] + got["z_loss"] + got["aux_loss"])
    assert got["z_loss"] > 0
    # max_batches stops early; a fresh figure on fewer batches
    first = evaluate(model, batches, "cpu", max_batches=1)
    assert first["batches"] == 1 and first["lm_loss"] == pytest.approx(reference(model, batches[:1])["lm_loss"],
                                                                        rel=1e-5)
    assert not model.training
    with pytest.raises(ValueError, match="no batches"):
        evaluate(model, [], "cpu")


def test_evaluate_asks_for_logits_when_the_model_can_skip_them():
    torch.manual_seed(0)
    model = LingForCausalLM(SMALL)  # with labels, its forward returns logits only when asked
    batches = make_batches(2, seed=2)
    got = evaluate(model, batches, "cpu")
    model.eval()
    want = reference(model, batches, return_logits=True)
    assert got["lm_loss"] == pytest.approx(want["lm_loss"], rel=1e-5)
    assert got["mtp_acc_2"] == pytest.approx(want["mtp_2_acc"], abs=1e-12)


def _rank_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = LingForCausalLM(SMALL)
    batches = make_batches(4, seed=1)[rank::world]  # each rank its own (unequally masked) batches
    res = evaluate(model, batches, "cpu")
    if rank == 0:
        Path(out).write_text(json.dumps(res))
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_give_the_one_process_figures(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_worker, args=(2, port, str(tmp_path / "r.json")), nprocs=2)
    two = json.loads((tmp_path / "r.json").read_text())
    torch.manual_seed(0)
    one = evaluate(LingForCausalLM(SMALL), make_batches(4, seed=1), "cpu")
    for k in ("lm_loss", "acc", "mtp_loss_1", "mtp_acc_2", "loss", "tokens"):
        assert two[k] == pytest.approx(one[k], rel=1e-6), k  # fp64 sums in another order


def test_split_steps_cover_the_split_once():
    class Packed:
        num_rows, micro_batch_size, world_size = 103, 4, 2

    assert split_steps(Packed(), None) == 12 and split_steps(Packed(), 5) == 5
    Packed.num_rows = 3
    assert split_steps(Packed(), None) == 1
    with pytest.raises(ValueError, match="data=synthetic"):
        split_steps(object(), None)


# ------------------------------------------------------------------------------------------------ eval.py
TRAIN = ["+exp=tiny_cpu", "train.steps=3", "train.seq_len=64", "train.micro_batch_size=2", "model.num_layers=2",
         "logging.wandb.mode=disabled", "logging.progress_bar=false"]


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    return run_script(cmd, ROOT, env, timeout=600)  # a child of the fork server: `python *cmd` without the imports


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    """A 3-step BF16 run and its FP8 twin on the bundled corpus (FP8 health every step)."""
    root = tmp_path_factory.mktemp("runs")
    for name, extra in (("bf16", []), ("fp8", ["precision=fp8", "optim=fp8_adamw", "fp8.health_every=1"])):
        proc = _run(["train.py", *TRAIN, *extra, f"hydra.run.dir={root / name}"])
        assert proc.returncode == 0, proc.stderr[-4000:]
    return root


def eval_cfg(**values):
    from hydra import compose, initialize_config_dir

    overrides = [f"{k}={v}" for k, v in values.items()]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="eval", overrides=overrides)


@pytest.mark.slow
def test_eval_py_end_to_end(tiny_runs):
    run = tiny_runs / "bf16"
    proc = _run(["eval.py", f"checkpoint={run}", "batches=3", "progress_bar=false"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = run / "eval" / "step00000003-val.json"
    rec = json.loads(out.read_text())
    m = rec["metrics"]
    assert rec["step"] == 3 and rec["split"] == "val" and rec["precision"] == "bf16" and m["batches"] == 3
    assert set(m) >= {"loss", "lm_loss", "ppl", "acc", "mtp_loss_1", "mtp_acc_1", "tokens"}
    assert m["tokens"] == 3 * 2 * 64 and 0 < m["lm_loss"] < 10 and 0 <= m["mtp_acc_1"] <= 1
    assert f"lm_loss      {m['lm_loss']:.6g}" in proc.stdout and str(out) in proc.stdout
    # the same weights give the same figure on the same batches (here found from the checkpoints folder)
    again = run_eval(eval_cfg(checkpoint=run / "checkpoints", batches=3, output=run / "again.json"))
    assert again["metrics"]["lm_loss"] == m["lm_loss"]


@pytest.mark.slow
def test_eval_py_takes_a_sample_by_default_and_the_whole_split_with_batches_all(tiny_runs):
    """The default is 20 micro-batches spread over the split (the tiny_cpu demo's whole validation split: 123 of
    them, a half-hour on a busy 2-core CPU); `batches=all` (or null, as before) is the whole split once."""
    from omegaconf import OmegaConf

    assert OmegaConf.load(ROOT / "conf" / "eval.yaml").batches == 20
    rec = run_eval(eval_cfg(checkpoint=tiny_runs / "bf16", output=tiny_runs / "default.json"))
    assert rec["metrics"]["batches"] == 20 and rec["split_batches"] > 20
    assert requested_batches("all", synthetic=False) is None and requested_batches(None, synthetic=False) is None
    assert requested_batches("all", synthetic=True) == SYNTHETIC_BATCHES and requested_batches(7, synthetic=True) == 7
    for bad in (0, -3, "some", 2.5, True):
        with pytest.raises(ValueError, match="want a positive number of micro-batches, or all"):
            requested_batches(bad, synthetic=False)


def test_a_sample_is_spread_over_the_split():
    class Counting:  # micro-batch i of the split is {"i": i}
        def __init__(self):
            self.i = -1

        def next_batch(self):
            self.i += 1
            return {"i": self.i}

    assert [b["i"] for b in split_batches(Counting(), 4, whole=10)] == [0, 2, 5, 7]
    assert [b["i"] for b in split_batches(Counting(), 3, whole=None)] == [0, 1, 2]  # no size: the first ones
    assert [b["i"] for b in split_batches(Counting(), 5, whole=5)] == [0, 1, 2, 3, 4]


@pytest.mark.slow
def test_ctrl_c_stops_eval_py_with_a_line_not_a_traceback(tiny_runs):
    """SIGINT (Ctrl-C) while eval.py evaluates the whole train split: exit code 130, one line, no result file."""
    out = tiny_runs / "interrupted.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # eval.py as a child of the fork server (the other eval.py runs' server) through its client, which passes
    # SIGINT on (tests/fork_server.py): the child has a fresh interpreter's SIGINT handler, and what is tested is
    # eval.py's handling of it, not its start-up. SIGINT as a terminal's Ctrl-C finds it: a shell's background job
    # (pytest run with &) ignores SIGINT, and a child inherits that
    env = {**env, **python_command(env)}
    proc = subprocess.Popen([*CLIENT, "eval.py", f"checkpoint={tiny_runs / 'bf16'}", "split=train",
                             "batches=all", "progress_bar=true", f"output={out}"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(iter(lambda: proc.stderr.read(1), "")), daemon=True)
    reader.start()
    try:
        t0 = time.monotonic()
        while "eval:" not in "".join(err):  # tqdm's bar: the evaluation has started
            assert proc.poll() is None, "".join(err)[-3000:]
            assert time.monotonic() - t0 < 900, "eval.py did not start evaluating: " + "".join(err)[-3000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=600)  # generous deadlines: on a loaded 2-core machine a start takes minutes
    finally:
        proc.kill()
    reader.join(timeout=10)
    said = "".join(err)
    assert proc.returncode == 130, said[-3000:]
    assert "eval.py: interrupted; no result written" in said and "Traceback" not in said
    assert not out.exists()


@pytest.mark.slow
def test_eval_in_another_precision_and_from_an_hf_export(tiny_runs):
    fp8_run = tiny_runs / "fp8"
    native = run_eval(eval_cfg(checkpoint=fp8_run, batches=2))
    as_bf16 = run_eval(eval_cfg(checkpoint=fp8_run, batches=2, precision="bf16"))
    assert native["precision"] == "fp8" and as_bf16["precision"] == "bf16"
    assert Path(as_bf16["output"]).name == "step00000003-val-bf16.json"
    # FP8 linears (E4M3, 3 mantissa bits) vs exact linears on the same weights: close, not equal
    a, b = native["metrics"]["lm_loss"], as_bf16["metrics"]["lm_loss"]
    assert a != b and a == pytest.approx(b, rel=2e-2)

    from ling.checkpoint.hf import save_hf
    from ling.checkpoint.weights import find_checkpoint, read_model_state

    ref = find_checkpoint(tiny_runs / "bf16")
    state = read_model_state(ref.folder)
    hf_dir = save_hf(state, ref.model_config(state), tiny_runs / "bf16_hf", dtype=torch.float32)
    from_hf = run_eval(eval_cfg(checkpoint=hf_dir, batches=2, data="bundled", seq_len=64, micro_batch_size=2))
    from_run = run_eval(eval_cfg(checkpoint=tiny_runs / "bf16", batches=2, output=tiny_runs / "x.json"))
    assert from_hf["metrics"]["lm_loss"] == from_run["metrics"]["lm_loss"]


@pytest.mark.slow
def test_eval_bad_input(tiny_runs, tmp_path):
    with pytest.raises(ValueError, match="another model config") as e:
        run_eval(eval_cfg(checkpoint=tiny_runs / "bf16", batches=1, model="tiny", **{"model.hidden_size": 256}))
    msg = str(e.value)
    assert "model.hidden_size: 128 in the checkpoint's run, 256 asked" in msg
    assert "model.num_layers: 2 in the checkpoint's run, 3 asked" in msg
    assert "other shapes: word_embeddings.weight: checkpoint [8192, 128], model [8192, 256]" in msg
    assert "missing tensors: layers.2.attention.dense.weight" in msg
    with pytest.raises(FileNotFoundError, match="no such folder"):
        run_eval(eval_cfg(checkpoint=tmp_path / "nope"))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "resolved_config.yaml").write_text("train: {seed: 1}\n")
    with pytest.raises(FileNotFoundError, match="no verified checkpoint"):
        run_eval(eval_cfg(checkpoint=tmp_path / "run"))


@pytest.mark.slow
def test_compare_real_runs_with_held_out_losses(tiny_runs):
    for name in ("bf16", "fp8"):  # held-out figures for both (the fp8 one in its own precision)
        run_eval(eval_cfg(checkpoint=tiny_runs / name, batches=2))
    proc = _run(["eval.py", "compare", str(tiny_runs / "fp8"), str(tiny_runs / "bf16"), "--out",
                 str(tiny_runs / "cmp")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tiny_runs / "cmp" / "summary.json").read_text())
    pair = summary["pairs"][0]
    assert pair["steps"] == 3 and pair["held_out_a"] is not None and pair["held_out_b"] is not None
    assert (tiny_runs / "cmp" / "fp8_health.png").is_file()  # the FP8 run logged health every step
    assert "WARNING" not in proc.stdout  # the twins differ only in precision / optimizer / run name


class _Toy(torch.nn.Module):
    """loss = scale · Σ_layers ⟨w, x⟩ with x the batch's float input ids: gradient scale · Σx per weight."""

    def __init__(self, scale: float, w: torch.Tensor) -> None:
        super().__init__()
        self.scale = scale
        self.layers = torch.nn.ModuleList([torch.nn.Module()])
        self.layers[0].attention = torch.nn.Linear(4, 1, bias=False, dtype=torch.float64)
        self.lm_head = torch.nn.Linear(4, 1, bias=False, dtype=torch.float64)
        with torch.no_grad():
            self.layers[0].attention.weight.copy_(w)
            self.lm_head.weight.copy_(w)

    def forward(self, input_ids, labels=None, doc_ids=None):
        from types import SimpleNamespace

        x = input_ids.double()  # float64: the expected figures hold to ~1e-15
        return SimpleNamespace(loss=self.scale * (self.layers[0].attention(x).sum() + 2 * self.lm_head(x).sum()))


def test_step_errors_against_hand_computed_values():
    """A candidate whose loss is the reference's times (1 + δ) on every batch: relative loss difference δ (its
    interval collapses to δ), gradient relative error δ, cosine 1; a copy of the reference: 0 and 1. Parameter
    groups follow the names."""
    from ling.analysis.step_error import step_errors

    w = torch.tensor([[0.5, -1.0, 2.0, 0.25]])
    models = {"fp32": _Toy(1.0, w), "bf16": _Toy(1.0, w), "fp8": _Toy(1.0 + 1e-3, w)}
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(1, 9, (3, 4), generator=g), "labels": torch.zeros(3, 4)} for _ in range(4)]
    rec = step_errors(models, batches, "cpu", max_batches=3)
    assert rec["batches"] == 3 and len(rec["loss"]["fp32"]) == 3
    assert rec["loss_rel"]["bf16"]["mean"] == 0 and rec["loss_rel"]["fp8"]["mean"] == pytest.approx(1e-3, rel=1e-9)
    assert rec["loss_rel"]["fp8"]["ci_high"] - rec["loss_rel"]["fp8"]["ci_low"] < 1e-12
    assert rec["loss_rel"]["fp8_vs_bf16"]["mean"] == pytest.approx(1e-3, rel=1e-9)
    assert set(rec["grad_rel_err"]["fp8"]) == {"all", "attention", "LM head"}
    assert rec["routing_changed"] == {"bf16": None, "fp8": None}  # no router in the toy
    for group in ("all", "attention", "LM head"):
        assert rec["grad_rel_err"]["bf16"][group] == 0 and rec["grad_cosine"]["bf16"][group] == pytest.approx(1.0)
        assert rec["grad_rel_err"]["fp8"][group] == pytest.approx(1e-3, rel=1e-6)
        assert rec["grad_cosine"]["fp8"][group] == pytest.approx(1.0, abs=1e-12)


def test_changed_routing_assignments_by_hand():
    from ling.analysis.step_error import _changed_assignments

    ref = [torch.tensor([[0, 1], [2, 3]]), torch.tensor([[5, 4]])]
    same_sets = [torch.tensor([[1, 0], [2, 3]]), torch.tensor([[4, 5]])]  # order within a token does not count
    moved = [torch.tensor([[0, 7], [6, 7]]), torch.tensor([[5, 4]])]  # 1 + 2 picks absent from the reference's
    assert _changed_assignments(same_sets, ref) == (0, 6)
    assert _changed_assignments(moved, ref) == (3, 6)


# The step-error tests' micro-batches: one sequence of 32 tokens instead of the run's 2 x 64. Each copy's forward
# and backward (seven copies in the ablation test; the bf16 ones' GEMMs are slow on CPU, the LM head's [8192, tokens]
# ones most) costs in proportion to the tokens. What they check does not depend on the count: the copies see the
# same batches and weights whatever their size; a backward-only switch leaves every loss bit and routing decision
# as they were and a forward one changes the loss, on any batch; the bounds below (loss within 5 %, cosine over 0.5,
# under half the assignments changed) are about E4M3's and bf16's rounding of each value, not an average over many
# tokens; and both kinds of layer (dense and MoE, with MTP) still run on every token.
STEP_ERROR_BATCH = {"seq_len": 32, "micro_batch_size": 1}


@pytest.mark.slow
def test_eval_step_error_mode_end_to_end(tiny_runs):
    """mode=step_error on a BF16 run's checkpoint: every parameter group, errors in (0, 1), the FP8 twin's loss
    within a few % of fp32's, the same figures when run twice (CPU: deterministic), and the JSON written."""
    run = tiny_runs / "bf16"
    # STEP_ERROR_BATCH: micro-batches of 32 tokens (the run's: 2 x 64), see there
    rec = run_eval(eval_cfg(checkpoint=run, batches=2, mode="step_error", **STEP_ERROR_BATCH))
    again = run_eval(eval_cfg(checkpoint=run, batches=2, mode="step_error", output=run / "se2.json",
                              **STEP_ERROR_BATCH))
    assert rec["loss"] == again["loss"] and rec["grad_rel_err"] == again["grad_rel_err"]
    assert set(rec["grad_rel_err"]["fp8"]) == {"all", "routed experts", "router", "attention", "norms", "embedding",
                                               "dense MLP + shared experts", "LM head", "MTP projection"}
    for c in ("bf16", "fp8"):
        assert 0 < rec["grad_rel_err"][c]["all"] < 1 and rec["grad_cosine"][c]["all"] > 0.5
        assert abs(rec["loss_rel"][c]["mean"]) < 0.05
        assert 0 <= rec["routing_changed"][c] < 0.5
    assert json.loads((run / "eval" / "step00000003-val-step_error.json").read_text())["mode"] == "step_error"
    with pytest.raises(ValueError, match="mode='grads' is unknown"):
        run_eval(eval_cfg(checkpoint=run, batches=1, mode="grads"))


@pytest.mark.slow
def test_step_error_ablation_copies(tiny_runs):
    """step_error_ablate: a backward-only component (dgrad) leaves every loss exactly as the full FP8 copy's and
    changes the gradient; the forward's x quantization changes the loss; FP8Linear entries are measured against
    the emulated copy (on CPU the FP8 copy exactly), "experts" against fp8, paired per batch; an unknown component
    is refused."""
    run = tiny_runs / "bf16"
    rec = run_eval(eval_cfg(checkpoint=run, batches=3, mode="step_error", output=run / "se3.json",
                            step_error_ablate="[dgrad_dy,fwd_x,experts]", **STEP_ERROR_BATCH))
    assert rec["loss"]["fp8-no-dgrad_dy"] == rec["loss"]["fp8"] != rec["loss"]["fp8-no-fwd_x"]
    assert rec["grad_rel_err"]["fp8-no-dgrad_dy"]["all"] != rec["grad_rel_err"]["fp8"]["all"]
    assert rec["loss"]["fp8-emulated"] == rec["loss"]["fp8"]  # CPU: the emulated path is the recipe, bit for bit
    assert rec["grad_rel_err_batches"]["fp8-emulated"] == rec["grad_rel_err_batches"]["fp8"]
    effects = rec["ablation_effect"]
    assert {c: e["baseline"] for c, e in effects.items()} == {
        "fp8-no-dgrad_dy": "fp8-emulated", "fp8-no-fwd_x": "fp8-emulated", "fp8-no-experts": "fp8"}
    dgrad = effects["fp8-no-dgrad_dy"]
    assert dgrad["loss_rel"]["mean"] == dgrad["loss_rel"]["ci_low"] == dgrad["loss_rel"]["ci_high"] == 0.0
    assert dgrad["routing_changed"] == 0.0  # a backward-only switch moves no routing decision
    errs = rec["grad_rel_err_batches"]
    assert dgrad["grad_rel_err"]["n"] == 3 and dgrad["grad_rel_err"]["mean"] == pytest.approx(
        sum(a - b for a, b in zip(errs["fp8-no-dgrad_dy"], errs["fp8-emulated"])) / 3, rel=1e-12)
    assert effects["fp8-no-fwd_x"]["loss_rel"]["mean"] != 0
    assert "| fp8-no-experts | fp8 |" in format_step_errors(rec)
    with pytest.raises(ValueError, match=r"step_error_ablate: unknown component\(s\) \['adam_v'\]"):
        run_eval(eval_cfg(checkpoint=run, batches=1, mode="step_error", step_error_ablate="[adam_v]"))
