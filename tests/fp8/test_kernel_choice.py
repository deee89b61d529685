"""`fp8.gemm_kernel` (fp8/kernel_choice.py): the choice holds for a block in every thread (the autograd engine's
backward threads included), is undone on exit, and a run holds it from start to end."""

from __future__ import annotations

import threading

import pytest
import torch
from hydra import compose, initialize_config_dir

from fp8.gemm import GEMM_TUNING, SMALL_M_ROWS, _config, default_gemm_config, fp8_gemm
from fp8.gemm_sm90 import SM90_SMALL_TILES, SM90_WARP_SPECIALIZED
from fp8.grouped import GROUPED_TUNING
from fp8.kernel_choice import GEMM_KERNELS, gemm_kernels
from fp8.quant import quantize_1x128, quantize_128x128
from ling.train.engine import build_engine
from ling.train.trainer import train
from tests.helpers import CONF


def _choices() -> tuple[object, ...]:
    """(dense forward/dgrad on sm_90, dense any kind on sm_90, grouped on sm_90, grouped wgrad of short segments)"""
    dense, grouped = GEMM_TUNING.current(), GROUPED_TUNING.current()
    return dense.sm90_fprop, dense.sm90, grouped.sm90, grouped.sm90_wgrad


@pytest.fixture(autouse=True)
def gpu_defaults():
    """The GPU defaults in force (under the CPU interpreter the grouped kernels' defaults turn the Gluon wgrad off)."""
    with GROUPED_TUNING.override(GROUPED_TUNING.default):
        yield


DEFAULTS = (None, None, None, SM90_SMALL_TILES)  # the Triton kernels; the Gluon wgrad of short segments on sm_90
GLUON_WS = (SM90_WARP_SPECIALIZED, None, None, SM90_SMALL_TILES)  # the dense forward and dgrad only


def test_gluon_ws_puts_the_dense_forward_and_dgrad_on_the_warp_specialised_kernel_in_every_thread_and_is_undone():
    assert _choices() == DEFAULTS
    seen = []
    with gemm_kernels("gluon_ws"):
        worker = threading.Thread(target=lambda: seen.append(_choices()))  # as a backward thread would see it
        worker.start()
        worker.join()
        assert _choices() == GLUON_WS
    assert seen == [GLUON_WS]
    assert _choices() == DEFAULTS


def test_auto_keeps_the_defaults_triton_turns_every_gluon_kernel_off_and_unknown_names_are_refused():
    with gemm_kernels("auto"):
        assert _choices() == DEFAULTS
    with gemm_kernels("triton"):
        assert _choices() == (None, None, None, None)
    with gemm_kernels("gluon_ws"), gemm_kernels("triton"):  # inside another choice too
        assert _choices() == (None, None, None, None)
    assert _choices() == DEFAULTS
    with pytest.raises(ValueError, match=r"fp8.gemm_kernel='cublas' is unknown \(known: auto, triton, gluon_ws\)"):
        with gemm_kernels("cublas"):
            pass
    assert GEMM_KERNELS == ("auto", "triton", "gluon_ws")


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
    assert seen == [GLUON_WS]
    assert _choices() == DEFAULTS  # undone when the run ends


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="sm_90 GPU")
def test_gluon_ws_runs_the_big_dense_forward_and_dgrad_only_with_the_triton_bits():
    """On an sm_90 GPU: forward/dgrad of more than SMALL_M_ROWS rows on the warp-specialised kernel, the wgrad and
    small GEMMs on the Triton defaults; the outputs bit-equal to the Triton kernel's."""
    a, a_s = quantize_1x128(torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16))
    b, b_s = quantize_128x128(torch.randn(384, 512, device="cuda", dtype=torch.bfloat16))
    small = a[:SMALL_M_ROWS]
    with gemm_kernels("gluon_ws"):
        assert _config(a, b, "fprop", None, torch.bfloat16) == SM90_WARP_SPECIALIZED
        assert _config(small, b, "fprop", None, torch.bfloat16) == default_gemm_config(SMALL_M_ROWS, "fprop",
                                                                                     torch.bfloat16)
        assert _config(a, b, "wgrad", None, torch.float32) == default_gemm_config(1024, "wgrad", torch.float32)
        got = fp8_gemm(a, a_s, b, b_s)
    assert torch.equal(got, fp8_gemm(a, a_s, b, b_s))
