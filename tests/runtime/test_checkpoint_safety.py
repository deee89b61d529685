"""Loading a checkpoint never runs code (ling/checkpoint/safe_load.py): a crafted pickle handed to every entry point
(resume, eval, HF export, reshard, train.init_from) is refused with a clear error, and its payload does not run.
Real checkpoints hold only tensors, plain containers and the allow-listed DeepSpeed classes."""

from __future__ import annotations

import builtins
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from ling.analysis.evaluate import run_eval
from ling.checkpoint import hf, reshard, store
from ling.checkpoint.safe_load import ALLOWED_GLOBALS, UnsafeCheckpointError, check_folder, load_pt
from ling.checkpoint.weights import read_model_state
from ling.files import sha256_file
from model.ling import LingForCausalLM
from tests.analysis.test_evaluate import eval_cfg
from tests.fork_server import run_script
from tests.runtime.test_hf import SMALL
from tests.runtime.test_train_loop import run_train, train_env

ROOT = Path(__file__).resolve().parents[2]
TAG = "step00000002"


class Payload:
    """Unpickling this creates `marker` (what a real attack would do with a shell command)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return builtins.exec, (f"open({str(self.marker)!r}, 'w').close()",)


def plant(path: Path, marker: Path, key: str | None = None) -> None:
    """Rewrite the .pt file `path` with a Payload: as the whole object (key None) or beside its entries."""
    if key is None:
        obj = {"module": Payload(marker)}
    else:
        obj = load_pt(path)
        obj[key] = Payload(marker)
    torch.save(obj, path)


def rewrite_manifest(folder: Path) -> None:
    """What an attacker can do too: make the manifest match the rewritten files."""
    manifest = json.loads((folder / "manifest.json").read_text())
    for name, entry in manifest["files"].items():
        entry.update(size=(folder / name).stat().st_size, sha256=sha256_file(folder / name))
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))


@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> Path:
    """A 2-step run (ZeRO-2, AdamW) with a checkpoint at step 2."""
    run = tmp_path_factory.mktemp("safety") / "run"
    run_train(run, 1, ["train.steps=2", "train.save_every=2"])
    return run


def copy_run(real_run: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(real_run, run, ignore=shutil.ignore_patterns("*.lock"))
    return run


# ------------------------------------------------------------------------------------------ what real files hold
def test_a_real_checkpoint_loads_through_the_allow_list(real_run):
    folder = real_run / "checkpoints" / TAG
    for path in sorted(folder.glob("*.pt")):
        named = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
        assert set(named) <= set(ALLOWED_GLOBALS), (path.name, named)
        if path.name.startswith("trainer_state"):
            assert named == [], named  # our own state needs no class at all
        assert isinstance(load_pt(path), dict)
    check_folder(folder)


def test_rng_state_round_trips_exactly_and_an_older_numpy_state_still_loads(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.standard_normal()  # a cached gaussian in numpy's state
    torch.save({"rng": store._rng_state()}, tmp_path / "new.pt")
    legacy = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    torch.save({"rng": legacy}, tmp_path / "old.pt")
    want = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist())
    for name in ("new.pt", "old.pt"):
        random.seed(9), np.random.seed(9), torch.manual_seed(9)
        store._set_rng_state(load_pt(tmp_path / name)["rng"])
        assert (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist()) == want, name


def test_load_pt_refuses_a_payload_naming_it(tmp_path):
    marker = tmp_path / "ran"
    plant(tmp_path / "x.pt", marker)
    with pytest.raises(UnsafeCheckpointError, match=r"x\.pt: refused to load: it holds builtins\.exec"):
        load_pt(tmp_path / "x.pt")
    with pytest.raises(UnsafeCheckpointError, match="builtins.exec"):
        check_folder(tmp_path)
    assert not marker.exists()


# ---------------------------------------------------------------------------------------------- entry points
def test_hf_export_of_a_crafted_model_states_file_is_refused(real_run, tmp_path):
    """Issue #26 point 1: a checkpoint folder handed directly to the export (no manifest check on this path)."""
    run = copy_run(real_run, tmp_path)
    folder = run / "checkpoints" / TAG
    marker = tmp_path / "ran"
    plant(folder / "mp_rank_00_model_states.pt", marker)
    # a child of the fork server (tests/fork_server.py): `python -m ling.checkpoint.hf export ...` less the imports
    proc = run_script(["-m", "ling.checkpoint.hf", "export", str(folder), str(tmp_path / "hf")], ROOT, train_env(),
                      timeout=300)
    assert proc.returncode != 0 and "refused to load: it holds builtins.exec" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not marker.exists() and not (tmp_path / "hf").exists()


def test_eval_of_a_crafted_checkpoint_is_refused(real_run, tmp_path):
    run = copy_run(real_run, tmp_path)
    folder = run / "checkpoints" / TAG
    marker = tmp_path / "ran"
    plant(folder / "mp_rank_00_model_states.pt", marker)
    with pytest.raises(UnsafeCheckpointError, match="builtins.exec"):
        run_eval(eval_cfg(checkpoint=folder, batches=1))
    with pytest.raises(UnsafeCheckpointError, match="builtins.exec"):
        read_model_state(folder)
    assert not marker.exists()


@pytest.mark.parametrize("victim", ["trainer_state_rank0.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"])
def test_resume_from_a_crafted_checkpoint_with_a_matching_manifest_is_refused(real_run, tmp_path, victim):
    """Our own trainer state, and a DeepSpeed file that DeepSpeed itself would unpickle with weights_only=False;
    the manifest rewritten to match, so the checkpoint verifies."""
    run = copy_run(real_run, tmp_path)
    folder = run / "checkpoints" / TAG
    marker = tmp_path / "ran"
    plant(folder / victim, marker, key="extra")
    rewrite_manifest(folder)
    assert store.verify(folder) == []
    _, proc = run_train(run, 1, ["train.steps=4", "train.save_every=2"], expect_rc=None, launcher=False)
    assert proc.returncode != 0
    assert f"{victim}: refused to load: it holds builtins.exec" in proc.stderr, proc.stderr[-5000:]
    assert not marker.exists()


def test_reshard_of_a_crafted_optimizer_file_is_refused(real_run, tmp_path):
    run = copy_run(real_run, tmp_path)
    folder = run / "checkpoints" / TAG
    marker = tmp_path / "ran"
    plant(folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt", marker, key="extra")
    with pytest.raises(UnsafeCheckpointError, match="builtins.exec"):
        reshard.SavedZeroState(folder, 1, set(), {})
    assert not marker.exists()


def test_init_from_a_pickled_bin_checkpoint_is_refused(tmp_path):
    """HF checkpoints load from safetensors only; a pytorch_model.bin (a pickle) is refused unread."""
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf.hf_config(SMALL)))
    marker = tmp_path / "ran"
    torch.save({"model.norm.weight": Payload(marker)}, folder / "pytorch_model.bin")
    with pytest.raises(hf.HFCheckpointError, match=r"pytorch_model\.bin.*unsupported"):
        hf.load_hf_checkpoint(LingForCausalLM(SMALL), folder)
    _, proc = run_train(tmp_path / "run", 1, ["train.steps=1", f"train.init_from={folder}"], expect_rc=None,
                        launcher=False)
    assert proc.returncode != 0 and "unsupported" in proc.stderr, proc.stderr[-3000:]
    assert not marker.exists()
