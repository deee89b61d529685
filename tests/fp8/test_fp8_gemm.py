"""Blockwise FP8 GEMMs against a float64 product of the dequantized operands (and, on the GPU, against
cuBLAS's blockwise `scaled_mm`, an independent implementation)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fp8.gemm import (
    FPROP_CONFIG,
    GEMM_TUNING,
    INTERPRETER_CONFIG,
    SMALL_M_CONFIG,
    WGRAD_CONFIG,
    WGRAD_FP32_CONFIG,
    GemmConfig,
    default_gemm_config,
    fp8_gemm,
    fp8_gemm_ref,
    fp8_gemm_wgrad,
)
from fp8.gemm_sm90 import SM90_CONFIG
from fp8.quant import dequantize_1x128, dequantize_128x128, fp8_transpose_128x128, quantize_1x128, quantize_128x128
from tests.helpers import DEVICES, rel, setup_device

# (M, N, K): aligned; K tail + odd M; tiny; N tail
SHAPES = [(256, 256, 512), (77, 200, 300), (1, 130, 129), (130, 64, 128)]
# Tolerances (‖out − ref‖ / ‖ref‖ against float64 of the dequantized operands): the GEMM is exact up to
# fp32 accumulation (~1e-7 for K <= 512) and the output rounding: bf16 has 8 significant bits, so its
# rounding gives about 2^-9 / sqrt(3) ~ 1.1e-3 rms relative -> 4e-3 bound; fp32 output -> 1e-5.
# On the GPU, Hopper's FP8 tensor cores accumulate a 128-deep block with ~14 significant bits (the reason
# for per-block promotion to fp32): measured 1.2-1.3e-4 for ours and for cuBLAS alike -> 5e-4 there.
TOL = {torch.bfloat16: 4e-3, torch.float32: 1e-5}
TOL_GPU = {torch.bfloat16: 4e-3, torch.float32: 5e-4}


def operands(m, n, k, device, b_blockwise=True):
    a = torch.randn(m, k, device=device) * 2
    b = torch.randn(n, k, device=device) * 0.02
    aq, as_ = quantize_1x128(a, backend="triton")
    bq, bs = quantize_128x128(b, backend="triton") if b_blockwise else quantize_1x128(b, backend="triton")
    return aq, as_, bq, bs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "cfg",
    [
        None,
        GemmConfig(64, 64, 4, tma=True),
        GemmConfig(64, 64, 4, tma=True, persistent=True, warp_specialize=True),
        GemmConfig(64, 128, 4),
        GemmConfig(64, 64, 4),
    ],
    ids=["default", "tma", "tma-persistent", "pointer-scalar-sb", "pointer-sb-per-128-cols"],
)
def test_fp8_gemm_matches_float64(device, shape, out_dtype, cfg, request):
    setup_device(device, request)
    m, n, k = shape
    aq, as_, bq, bs = operands(m, n, k, device)
    ref = (
        dequantize_1x128(aq.cpu(), as_.cpu(), torch.float64) @ dequantize_128x128(bq.cpu(), bs.cpu(), torch.float64).t()
    )
    with GEMM_TUNING.override(fprop=cfg):
        out = fp8_gemm(aq, as_, bq, bs, out_dtype=out_dtype, backend="triton")
    assert out.dtype == out_dtype and out.shape == (m, n)
    assert rel(out, ref) < (TOL_GPU if device == "cuda" else TOL)[out_dtype]
    assert rel(fp8_gemm_ref(aq.cpu(), as_.cpu(), bq.cpu(), bs.cpu(), out_dtype), ref) < TOL[out_dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_gemm_wgrad_matches_float64(device, shape, request):
    setup_device(device, request)
    m, n, k = shape
    aq, as_, bq, bs = operands(m, n, k, device, b_blockwise=False)
    ref = dequantize_1x128(aq.cpu(), as_.cpu(), torch.float64) @ dequantize_1x128(bq.cpu(), bs.cpu(), torch.float64).t()
    out = fp8_gemm_wgrad(aq, as_, bq, bs, backend="triton")
    assert out.dtype == torch.float32
    assert rel(out, ref) < (TOL_GPU if device == "cuda" else TOL)[torch.float32]


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_gemm_nan_propagates(device, request):
    setup_device(device, request)
    a = torch.randn(64, 256, device=device)
    a[3, 7] = float("nan")
    a[9, 140] = float("inf")
    aq, as_ = quantize_1x128(a, backend="triton")
    bq, bs = quantize_128x128(torch.randn(64, 256, device=device), backend="triton")
    out = fp8_gemm(aq, as_, bq, bs, out_dtype=torch.float32, backend="triton").cpu()
    assert torch.isnan(out[3]).all() and not torch.isfinite(out[9]).any()
    rows = [i for i in range(64) if i not in (3, 9)]
    assert torch.isfinite(out[rows]).all()


def test_fp8_gemm_bad_inputs():
    aq, as_, bq, bs = operands(8, 128, 256, "cpu")
    with pytest.raises(ValueError, match="reduction dims"):
        fp8_gemm(aq, as_, bq[:, :128], bs)
    with pytest.raises(ValueError, match="b_scale"):
        fp8_gemm(aq, as_, bq, bs[:, :1])
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        fp8_gemm(aq.float(), as_, bq, bs)


def _scaled_mm_blockwise(a, a_s, b, b_s, b_blockwise):
    """cuBLAS blockwise GEMM through F.scaled_mm; the rhs scale layout cuBLAS wants is tried in turn."""
    st = F.ScalingType
    rb = st.BlockWise128x128 if b_blockwise else st.BlockWise1x128
    cands = [b_s.t(), b_s.t().contiguous(), b_s]
    if b_blockwise and b_s.shape[1] % 4:
        cands.insert(0, F.pad(b_s, (0, (-b_s.shape[1]) % 4)).t())
    for c in cands:
        try:
            return F.scaled_mm(a, b.t(), a_s, st.BlockWise1x128, c, rb, output_dtype=torch.bfloat16)
        except Exception:  # noqa: BLE001, S112 - try the next layout
            continue
    pytest.skip("cuBLAS blockwise scaled_mm unavailable on this build")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fprop", "dgrad", "wgrad"])
def test_fp8_gemm_vs_cublas_blockwise(kind):
    m, n, k = 1024, 768, 1024
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    if kind == "fprop":
        a, a_s = quantize_1x128(x)
        b, b_s = quantize_128x128(w)
    elif kind == "dgrad":
        a, a_s = quantize_1x128(dy)
        b, b_s = fp8_transpose_128x128(*quantize_128x128(w))
    else:
        from fp8.quant import quantize_1x128_transposed

        a, a_s = quantize_1x128_transposed(dy)
        b, b_s = quantize_1x128_transposed(x)
    bw = kind != "wgrad"
    ours = fp8_gemm(a, a_s, b, b_s) if bw else fp8_gemm_wgrad(a, a_s, b, b_s, out_dtype=torch.bfloat16)
    cub = _scaled_mm_blockwise(a, a_s, b, b_s, bw)
    # both are the same product up to fp32 summation order and bf16 output rounding
    assert rel(ours, cub) < 4e-3


def test_default_tiles_follow_the_kind_the_rows_and_the_output_dtype(monkeypatch):
    """The compiled kernels' defaults (docs/kernel_tuning.md): an fp32 wgrad output gets tiles whose epilogue fits
    the shared memory; a tiny M its own tiles; the interpreter its small ones."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert default_gemm_config(16384, "wgrad", torch.float32) == WGRAD_FP32_CONFIG != WGRAD_CONFIG
    assert default_gemm_config(16384, "wgrad", torch.bfloat16) == WGRAD_CONFIG
    assert default_gemm_config(16384, "fprop", torch.float32) == default_gemm_config(16384, "fprop") == FPROP_CONFIG
    assert default_gemm_config(8, "wgrad", torch.float32) == SMALL_M_CONFIG
    with pytest.raises(ValueError, match="kind must be one of"):
        default_gemm_config(16384, "dgrad")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert default_gemm_config(16384, "wgrad", torch.float32) == INTERPRETER_CONFIG


def test_a_forced_hopper_config_falls_back_to_the_triton_kernel_off_sm90(request):
    """`config=Sm90GemmConfig()` (or GEMM_TUNING's sm90) where the Gluon kernel cannot run (here: the interpreter
    on CPU) runs the Triton kernel: the same bits as the default."""
    setup_device("cpu", request)
    a, a_s, b, b_s = operands(130, 256, 256, "cpu")
    want = fp8_gemm(a, a_s, b, b_s, backend="triton")
    assert torch.equal(fp8_gemm(a, a_s, b, b_s, backend="triton", config=SM90_CONFIG), want)
    with GEMM_TUNING.override(sm90=SM90_CONFIG):
        assert torch.equal(fp8_gemm(a, a_s, b, b_s, backend="triton"), want)

