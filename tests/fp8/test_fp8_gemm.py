"""Blockwise FP8 GEMMs against a float64 product of the dequantized operands (and, on the GPU, against
cuBLAS's blockwise `scaled_mm`, an independent implementation)."""

from __future__ import annotations

import dataclasses

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
    fp8_gemm_wgrad_ref,
    wgrad_splits,
)
from fp8.gemm_sm90 import SM90_CONFIG
from fp8.quant import (
    dequantize_1x128,
    dequantize_128x128,
    fp8_transpose_128x128,
    quantize_1x128,
    quantize_1x128_transposed,
    quantize_128x128,
)
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


def test_wgrad_splits_fill_one_wave_and_never_leave_a_split_empty():
    # the shared expert's down projection at 16,384 tokens (128 K blocks): 64x128 tiles, two programs per SM (bf16
    # out), and 128x128 tiles, one per SM (fp32 out)
    assert wgrad_splits(tiles=128, k_blocks=128, programs_per_sm=2) == 2
    assert wgrad_splits(tiles=64, k_blocks=128) == 2
    assert wgrad_splits(tiles=128, k_blocks=128) == 1  # the shared gate_up's fp32 wgrad: one wave already
    assert wgrad_splits(tiles=8, k_blocks=1024) == 8  # at most SPLIT_K_MAX
    assert wgrad_splits(tiles=768, k_blocks=128, programs_per_sm=2) == 1  # QKV: enough tiles
    assert wgrad_splits(tiles=64, k_blocks=31) == 1  # splits of at least 16 K blocks (2,048 tokens)
    assert wgrad_splits(tiles=64, k_blocks=32) == 2
    assert wgrad_splits(tiles=4, k_blocks=500, requested=1) == 1
    assert wgrad_splits(tiles=4, k_blocks=3, requested=8) == 3  # no more splits than K blocks
    for k_blocks in range(1, 40):
        for requested in range(1, 12):
            splits = wgrad_splits(1, k_blocks, requested=requested)
            per_split = -(-k_blocks // splits)
            assert 1 <= splits <= requested and (splits - 1) * per_split < k_blocks  # the last split is not empty


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", [2, 3, 6])
def test_split_k_wgrad_is_the_in_order_sum_of_its_slices(device, splits, request):
    """A split wgrad's output is bit for bit the unsplit kernel's fp32 products of its K slices, added in split order
    and rounded once (to bf16 or fp32); and it matches float64 as the unsplit one does. K = 6 blocks (the last a
    48-wide tail), so 3 splits take 2 blocks each and 6 one each; M and N have tails (N = 200: rows of 16-byte
    multiples, which the TMA kernel, the only one that splits, needs); `out=` is written through the same path."""
    setup_device(device, request)
    m, n, k = 70, 200, 688
    aq, as_, bq, bs = operands(m, n, k, device, b_blockwise=False)
    cfg = GemmConfig(64, 64, 4, tma=True, persistent=True)
    per_split = 6 // splits
    want = torch.zeros(m, n, device=device)
    for s in range(splits):
        blocks = slice(s * per_split, (s + 1) * per_split)
        cols = slice(blocks.start * 128, min(blocks.stop * 128, k))
        want += fp8_gemm_wgrad(aq[:, cols], as_[:, blocks], bq[:, cols], bs[:, blocks], backend="triton",
                               config=dataclasses.replace(cfg, split_k=1))  # fmt: skip
    ref = dequantize_1x128(aq.cpu(), as_.cpu(), torch.float64) @ dequantize_1x128(bq.cpu(), bs.cpu(), torch.float64).t()
    for out_dtype in (torch.bfloat16, torch.float32):
        out = torch.full((m, n), float("nan"), device=device, dtype=out_dtype)  # every element must be written
        split = fp8_gemm_wgrad(aq, as_, bq, bs, out_dtype=out_dtype, backend="triton",
                               config=dataclasses.replace(cfg, split_k=splits), out=out)  # fmt: skip
        assert split is out and not out.isnan().any()
        assert torch.equal(split.cpu(), want.to(out_dtype).cpu()), out_dtype
        assert rel(split, ref) < (TOL_GPU if device == "cuda" else TOL)[out_dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_the_shared_experts_down_wgrad_splits_by_default_and_matches_float64(out_dtype):
    """[2048, 512] over 16,384 tokens: 128 (bf16) or 64 (fp32) output tiles, so the default splits K in two."""
    torch.manual_seed(0)
    dy = torch.randn(16384, 2048, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(16384, 512, device="cuda", dtype=torch.bfloat16)
    a, a_s = quantize_1x128_transposed(dy)
    b, b_s = quantize_1x128_transposed(x)
    split = fp8_gemm_wgrad(a, a_s, b, b_s, out_dtype=out_dtype)
    unsplit_config = dataclasses.replace(default_gemm_config(2048, "wgrad", out_dtype), split_k=1)
    unsplit = fp8_gemm_wgrad(a, a_s, b, b_s, out_dtype=out_dtype, config=unsplit_config)
    assert not torch.equal(split, unsplit)  # another summation order: the split path ran
    ref = fp8_gemm_wgrad_ref(a.cpu(), a_s.cpu(), b.cpu(), b_s.cpu(), torch.float64)
    assert rel(split, ref) < TOL_GPU[out_dtype] and rel(unsplit, ref) < TOL_GPU[out_dtype]


@pytest.mark.gpu
def test_a_split_wgrad_replays_from_a_cuda_graph_with_the_eager_bits():
    """The split path allocates its partials per call: under capture they come from the graph's pool, and a replay
    on new operands (copied into the captured inputs) gives the eager call's bits."""
    def operands(seed):
        torch.manual_seed(seed)
        a = quantize_1x128_transposed(torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16))
        b = quantize_1x128_transposed(torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16))
        return (*a, *b)

    static = operands(0)
    config = dataclasses.replace(default_gemm_config(2048, "wgrad", torch.bfloat16), split_k=2)
    fp8_gemm_wgrad(*static, out_dtype=torch.bfloat16, config=config)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_gemm_wgrad(*static, out_dtype=torch.bfloat16, config=config)
    fresh = operands(1)
    for dst, src in zip(static, fresh):
        dst.copy_(src)
    graph.replay()
    assert torch.equal(out, fp8_gemm_wgrad(*fresh, out_dtype=torch.bfloat16, config=config))


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
