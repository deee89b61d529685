"""Blockwise E4M3 quantizers: Triton kernels bit-exact against the PyTorch reference, and the reference
against the scale definition of DESIGN.md. On CPU the kernels run in Triton's interpreter (with its e4m3
cast fixed by the `triton_interpreter` fixture); the `gpu` variants run the compiled kernels."""

from __future__ import annotations

import pytest
import torch

from fp8.grouped import GROUPED_TUNING
from fp8.quant import (
    MAX_TOKEN_CHUNK_VALUES_PER_THREAD,
    QUANT_TUNING,
    dequantize_1x128,
    e4m3_code_distance,
    fp8_transpose_128x128,
    fp8_transpose_128x128_ref,
    quantize_1x128,
    quantize_1x128_dual,
    quantize_1x128_ref,
    quantize_1x128_transposed,
    quantize_1x128_transposed_ref,
    quantize_128x128,
    quantize_128x128_ref,
    quantize_128x128_with_transpose,
)
from kernels.backend import GRID_Y_MAX, blocks_by_chunks_grid
from tests.helpers import DEVICES, bits_equal, setup_device

SHAPES = [(200, 300), (128, 256), (7, 129), (1, 1)]


def rand(m: int, k: int, device: str, dtype=torch.bfloat16) -> torch.Tensor:
    # rows of very different magnitudes so that scales differ by orders of magnitude
    return (torch.randn(m, k) * torch.logspace(-6, 3, m)[:, None]).to(device=device, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_1x128_bit_exact(device, shape, pow2, dtype, request):
    setup_device(device, request)
    x = rand(*shape, device, dtype)
    q, s = quantize_1x128(x, pow2, backend="triton")
    qr, sr = quantize_1x128_ref(x.cpu(), pow2)
    assert q.shape == x.shape and s.shape == (shape[0], -(-shape[1] // 128))
    assert s.stride() == (1, shape[0])  # row index fastest (the GEMM/cuBLAS layout)
    assert bits_equal(q, qr) and bits_equal(s, sr)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("pow2", [False, True])
def test_quantize_128x128_bit_exact(device, shape, pow2, request):
    setup_device(device, request)
    w = rand(*shape, device)
    q, s = quantize_128x128(w, pow2, backend="triton")
    qr, sr = quantize_128x128_ref(w.cpu(), pow2)
    assert s.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    assert bits_equal(q, qr) and bits_equal(s, sr)
    t, ts = fp8_transpose_128x128(q, s, backend="triton")
    tr, tsr = fp8_transpose_128x128_ref(qr, sr)
    assert bits_equal(t, tr) and bits_equal(ts, tsr)
    assert bits_equal(t, q.t().contiguous())  # exact transpose
    # the weight cache's one pass: the same codes and scales, and the transpose of both
    q2, s2, t2, ts2 = quantize_128x128_with_transpose(w, pow2, backend="triton")
    assert bits_equal(q2, qr) and bits_equal(s2, sr)
    assert t2.shape == (shape[1], shape[0]) and bits_equal(t2, tr) and bits_equal(ts2, tsr)
    qr2, sr2, tr2, tsr2 = quantize_128x128_with_transpose(w.cpu(), pow2, backend="torch")
    assert bits_equal(qr2, qr) and bits_equal(tr2, tr) and bits_equal(tsr2, tsr)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize(
    "opts",
    [
        {},
        {"col_block_f": 64, "col_warps": 8, "row_block_m": 32},
        # a whole 128-feature block per program needs warps: with one, 512 fp32 values a thread spill and the
        # compile takes a minute per kernel variant
        {"col_block_f": 128, "col_warps": 4, "trans32": False},
        {"col_block_f": 32, "col_warps": 4, "col_features_first": False, "row_features_first": False},  # grid orders
    ],
    ids=["default", "f64-w8", "f128", "f32-w4-blocks-first"],
)
def test_quantize_transposed_and_dual_bit_exact(device, shape, pow2, opts, request):
    setup_device(device, request)
    x = rand(*shape, device)
    with QUANT_TUNING.override(**opts):  # launch variants must not change a single bit
        qt, st = quantize_1x128_transposed(x, None, pow2, backend="triton")
        qtr, str_ = quantize_1x128_transposed_ref(x.cpu(), None, pow2)
        assert qt.shape == (shape[1], shape[0]) and st.shape == (shape[1], -(-shape[0] // 128))
        assert bits_equal(qt, qtr) and bits_equal(st, str_)
        # same thing as quantizing a materialised transpose
        q2, s2 = quantize_1x128_ref(x.cpu().t().contiguous(), pow2)
        assert bits_equal(qt, q2) and bits_equal(st, s2)
        # from the FP8 x (the wgrad path): dequantize in registers, re-quantize along tokens
        xq, xs = quantize_1x128(x, pow2, backend="triton")
        qt, st = quantize_1x128_transposed(xq, xs, pow2, backend="triton")
        qtr, str_ = quantize_1x128_transposed_ref(xq.cpu(), xs.cpu(), pow2)
        assert bits_equal(qt, qtr) and bits_equal(st, str_)
        outs = quantize_1x128_dual(x, pow2, backend="triton")
        refs = quantize_1x128_dual(x.cpu(), pow2, backend="torch")
        assert all(bits_equal(a, b) for a, b in zip(outs, refs))


def test_the_chunks_first_grid_falls_back_where_the_blocks_exceed_the_second_dimension():
    """The quantizers' (row block, feature chunk) grids: chunks first when asked and the blocks fit CUDA's 65,535
    limit on a grid's second dimension, else blocks first, and the flag the kernel gets says which."""
    assert blocks_by_chunks_grid(10, 3, True) == ((3, 10), True)
    assert blocks_by_chunks_grid(10, 3, False) == ((10, 3), False)
    assert blocks_by_chunks_grid(GRID_Y_MAX, 3, True) == ((3, GRID_Y_MAX), True)
    assert blocks_by_chunks_grid(GRID_Y_MAX + 1, 3, True) == ((GRID_Y_MAX + 1, 3), False)


def test_scale_definition():
    x = torch.randn(64, 384) * 3
    x[5, 128:256] = 0.0  # an all-zero block
    q, s = quantize_1x128_ref(x)
    amax = x.abs().reshape(64, 3, 128).amax(-1)
    assert torch.equal(s[amax > 0], (amax / 448.0)[amax > 0])
    assert s[5, 1] == pytest.approx(1e-12, rel=1e-6) and torch.all(q[5, 128:256].float() == 0)
    assert q.float().abs().max() <= 448.0
    # every block's largest element maps to +-448 exactly (scale = amax / 448, division correctly rounded)
    blk = q.float().abs().reshape(64, 3, 128).amax(-1)
    assert torch.all(blk[amax > 0] == 448.0)
    q2, s2 = quantize_1x128_ref(x, pow2_scales=True)
    assert torch.all(torch.log2(s2) == torch.round(torch.log2(s2)))  # powers of two
    assert torch.all(s2 >= s) and torch.all(s2 < 2 * s)  # rounded up, by less than a factor 2
    assert q2.float().abs().max() <= 448.0
    # dequantization error bounded by half an E4M3 ulp (2^-4 relative) plus the subnormal floor
    err = (dequantize_1x128(q, s) - x).abs()
    assert torch.all(err <= x.abs() * 2.0**-4 + s.repeat_interleave(128, 1) * 2.0**-10)


@pytest.mark.parametrize("device", DEVICES)
def test_nan_inf_are_not_clipped(device, request):
    setup_device(device, request)
    x = torch.randn(4, 256)
    x[0, 3] = float("nan")
    x[1, 200] = float("inf")
    x = x.to(device)
    for fn in (quantize_1x128, lambda t, *a, **k: quantize_1x128_transposed(t.t().contiguous(), None, *a, **k)):
        q, s = fn(x, backend="triton")
        d = dequantize_1x128(q.cpu(), s.cpu())
        if q.shape[0] == 4:  # row-wise: the blocks holding NaN/Inf dequantize to NaN, nothing finite
            assert torch.isnan(d[0, :128]).all() and torch.isnan(d[1, 128:]).all()
            assert torch.isfinite(d[2:]).all()
        assert not torch.isfinite(d).all()
        qr, sr = quantize_1x128_ref(x.cpu()) if q.shape[0] == 4 else quantize_1x128_ref(x.cpu().t())
        assert bits_equal(q, qr) and bits_equal(s, sr)


@pytest.mark.parametrize("device", DEVICES)
def test_nan_of_either_sign_and_inf_reach_every_kernel_s_scales(device, request):
    """A NaN (either sign bit) makes its block's scale NaN and an Inf makes it Inf, in the row, token-dim and
    128x128 kernels alike; the other blocks keep finite scales and the reference's bits."""
    setup_device(device, request)
    x = torch.randn(256, 384)
    x[5, 7] = float("nan")
    x[130, 300] = -float("nan")
    x[200, 140] = -float("inf")
    x = x.to(device)
    for q, s, (qr, sr) in (
        (*quantize_1x128(x, backend="triton"), quantize_1x128_ref(x.cpu())),
        (*quantize_1x128_transposed(x, backend="triton"), quantize_1x128_transposed_ref(x.cpu())),
        (*quantize_128x128(x, backend="triton"), quantize_128x128_ref(x.cpu())),
    ):
        assert bits_equal(q, qr) and bits_equal(s, sr)
        assert torch.isnan(s).sum() == 2 and torch.isinf(s).sum() == 1 and (s.cpu() > 0).sum() == s.numel() - 2
    s = quantize_128x128(x, backend="triton")[1].cpu()
    assert torch.isnan(s[0, 0]) and torch.isnan(s[1, 2]) and s[1, 1] == float("inf")


def test_bad_input_errors():
    with pytest.raises(ValueError, match="2-D"):
        quantize_1x128(torch.randn(2, 3, 4))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        quantize_1x128_transposed(torch.randn(4, 128), torch.ones(4, 1))
    with pytest.raises(ValueError, match="backend"):
        quantize_1x128(torch.randn(4, 128), backend="cuda")



@pytest.mark.parametrize("tuning, f_key, w_key", [(QUANT_TUNING, "col_block_f", "col_warps"),
                                                  (GROUPED_TUNING, "tokens_block_f", "tokens_warps")])
def test_token_dim_launches_that_cannot_run_well_are_refused_when_configured(tuning, f_key, w_key):
    """A chunk width that does not divide 128 is wrong; one that puts more than MAX_TOKEN_CHUNK_VALUES_PER_THREAD
    values in a thread spills and compiles for a minute: both fail at the override, naming the fields."""
    with pytest.raises(ValueError, match=f"{f_key}.*must divide 128, got 48"):
        with tuning.override(**{f_key: 48}):
            pass
    with pytest.raises(ValueError, match=f"{f_key} / {w_key}.*512 fp32 values.*at least 4 warps"):
        with tuning.override(**{f_key: 128, w_key: 1}):
            pass
    edge_warps = 128 * 128 // (32 * MAX_TOKEN_CHUNK_VALUES_PER_THREAD)
    with tuning.override(**{f_key: 128, w_key: edge_warps}) as cfg:  # exactly at the bound: allowed
        assert tuning.current() is cfg
    assert getattr(tuning.current(), f_key) != 128  # and the default came back


def test_e4m3_code_distance_counts_values_between_across_zero():
    """Every pair of E4M3 values (both zeros, subnormals, both signs; NaN codes left out): the distance is the
    number of steps between their ranks on the sorted line of distinct values, where +0 and -0 are one."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # 0x7F/0xFF are NaN
    values = codes.view(torch.float8_e4m3fn).float()
    distinct = torch.unique(values)  # sorted; -0.0 and +0.0 compare equal, so one zero
    rank = torch.searchsorted(distinct, values)
    want = (rank[:, None] - rank[None, :]).abs().to(torch.int32)
    got = e4m3_code_distance(codes[:, None].expand(-1, len(codes)), codes[None, :].expand(len(codes), -1))
    assert torch.equal(got, want)
    fp8 = values.to(torch.float8_e4m3fn)  # the float8 dtype gives the same answer as its codes
    assert torch.equal(e4m3_code_distance(fp8[:, None].expand(-1, len(codes)), fp8[None, :].expand(len(codes), -1)),
                       want)
    zero, neg_zero, tiny, neg_tiny = (torch.tensor([c], dtype=torch.uint8) for c in (0x00, 0x80, 0x01, 0x81))
    assert e4m3_code_distance(zero, neg_zero).item() == 0 and e4m3_code_distance(tiny, neg_tiny).item() == 2
