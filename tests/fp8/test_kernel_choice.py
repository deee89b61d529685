"""`fp8.gemm_kernel` (fp8/kernel_choice.py): the choice holds for a block in every thread (the autograd engine's
backward threads included), is undone on exit, and a run holds it from start to end."""

from __future__ import annotations

import threading

import pytest
from hydra import compose, initialize_config_dir

from fp8.gemm import GEMM_TUNING
from fp8.gemm_sm90 import SM90_WARP_SPECIALIZED
from fp8.grouped import GROUPED_TUNING
from fp8.kernel_choice import GEMM_KERNELS, gemm_kernels
from ling.train.engine import build_engine
from ling.train.trainer import train
from tests.helpers import CONF


def _choices() -> tuple[object, object]:
    return GEMM_TUNING.current().sm90, GROUPED_TUNING.current().sm90


def test_gluon_ws_picks_the_warp_specialised_kernel_in_every_thread_and_is_undone():
    before = _choices()
    assert before == (None, None)  # the default: the Triton kernels
    seen = []
    with gemm_kernels("gluon_ws"):
        worker = threading.Thread(target=lambda: seen.append(_choices()))  # as a backward thread would see it
        worker.start()
        worker.join()
        assert _choices() == (SM90_WARP_SPECIALIZED, SM90_WARP_SPECIALIZED)
    assert seen == [(SM90_WARP_SPECIALIZED, SM90_WARP_SPECIALIZED)]
    assert _choices() == before


def test_triton_changes_nothing_and_an_unknown_name_is_refused_naming_the_key():
    with gemm_kernels("triton"):
        assert _choices() == (None, None)
    with pytest.raises(ValueError, match=r"fp8.gemm_kernel='cublas' is unknown \(known: triton, gluon_ws\)"):
        with gemm_kernels("cublas"):
            pass
    assert GEMM_KERNELS == ("triton", "gluon_ws")


def test_a_run_holds_the_choice_while_it_builds_and_trains(tmp_path):
    seen = []

    def build(*args):
        seen.append(_choices())
        return build_engine(*args)

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "+exp=tiny_cpu", "data=synthetic", "precision=fp8", "fp8.gemm_kernel=gluon_ws", "train.steps=1",
            "train.seq_len=32", "model.num_layers=1", "logging.wandb.mode=disabled", "logging.progress_bar=false",
            "train.save_final=false", "train.resume=none"])
    train(cfg, run_dir=tmp_path, build_engine=build)
    assert seen == [(SM90_WARP_SPECIALIZED, SM90_WARP_SPECIALIZED)]
    assert _choices() == (None, None)  # undone when the run ends
