"""Grouped blockwise FP8 GEMMs and their quantizers (fp8/grouped.py) against float64 products of the
dequantized operands and bit-exact against the PyTorch references. Segments of random sizes, empty ones and
ones shorter than the alignment included, with and without 16-alignment. On CPU the Triton kernels run in
the interpreter; the `gpu` variants run the compiled kernels."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fp8.gemm_sm90 import Sm90GemmConfig
from fp8.grouped import (
    GROUPED_TUNING,
    GroupedConfig,
    GroupedGemmConfig,
    GroupedRows,
    grouped_gemm,
    grouped_gemm_wgrad,
    quantize_expert_weights,
    quantize_rows_gathered,
    quantize_tokens_grouped,
    quantize_tokens_grouped_ref,
    swiglu_backward,
    swiglu_backward_ref,
    swiglu_quantize,
    swiglu_quantize_ref,
    swiglu_quantize_tokens,
    token_columns,
    wgrad_sm90_config,
)
from fp8.quant import QUANT_TUNING, dequantize_1x128, dequantize_128x128, fp8_transpose_128x128, quantize_1x128
from kernels.rows import gather_rows, sum_rows
from model.dispatch import plan_dispatch
from tests.helpers import DEVICES, bits_equal, data_rows, layout, rel, setup_device

# segment lengths: empty experts, segments shorter than 16 and than a tile, one longer than two 128-row tiles
LENGTHS = [0, 37, 5, 0, 130, 1, 64, 16, 0, 261]
# Tolerances, ‖out − ref‖ / ‖ref‖ against float64 of the dequantized operands: exact up to fp32 accumulation
# and the output rounding (bf16: 8 significant bits → ~1.1e-3 rms → 4e-3 bound; fp32: 1e-5). On the GPU the
# FP8 tensor cores accumulate each 128-deep block with ~14 significant bits: 5e-4 for fp32 outputs.
TOL = {torch.bfloat16: 4e-3, torch.float32: 1e-5}
TOL_GPU = {torch.bfloat16: 4e-3, torch.float32: 5e-4}


def used(t: torch.Tensor, rows: GroupedRows, dim: int = 0) -> torch.Tensor:
    return t.narrow(dim, 0, int(rows.offsets[-1])).cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("alignment", [1, 16])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_grouped_forward_and_dgrad_match_float64(device, alignment, out_dtype, request):
    setup_device(device, request)
    torch.manual_seed(0)
    rows, segs = layout(LENGTHS, alignment, device)
    g, n, k = len(LENGTHS), 256, 384
    x_q, x_s = quantize_1x128(data_rows(segs, rows.num_rows, k, device, 2.0), backend="triton")
    w_q, w_s = quantize_expert_weights((torch.randn(g, n, k) * 0.02).to(device))
    out = grouped_gemm(x_q, x_s, w_q, w_s, rows, out_dtype=out_dtype, backend="triton")
    xd = dequantize_1x128(x_q.cpu(), x_s.cpu(), torch.float64)
    ref = torch.zeros(rows.num_rows, n, dtype=torch.float64)
    for e, (lo, hi) in enumerate(segs):
        ref[lo:hi] = xd[lo:hi] @ dequantize_128x128(w_q[e].cpu(), w_s[e].cpu(), torch.float64).t()
    tol = (TOL_GPU if device == "cuda" else TOL)[out_dtype]
    assert out.dtype == out_dtype
    for lo, hi in segs:  # every segment by itself (an unwritten one would hold garbage)
        if hi > lo:
            assert rel(out[lo:hi], ref[lo:hi]) < tol
    padded = used(out, rows).float()[used(ref, rows).abs().sum(1) == 0]
    assert torch.equal(padded, torch.zeros_like(padded))  # pad rows come out exactly 0
    ref_path = grouped_gemm(x_q.cpu(), x_s.cpu(), w_q.cpu(), w_s.cpu(), _cpu(rows), out_dtype, backend="torch")
    assert rel(used(ref_path, rows), used(ref, rows)) < TOL[out_dtype]
    # dgrad: the on-demand transposed weights, whose scales are a strided view
    dy_q, dy_s = quantize_1x128(data_rows(segs, rows.num_rows, n, device), backend="triton")
    wt_q, wt_s = fp8_transpose_128x128(w_q, w_s)
    dx = grouped_gemm(dy_q, dy_s, wt_q, wt_s, rows, out_dtype=torch.float32, backend="triton")
    dyd = dequantize_1x128(dy_q.cpu(), dy_s.cpu(), torch.float64)
    ref_dx = torch.zeros(rows.num_rows, k, dtype=torch.float64)
    for e, (lo, hi) in enumerate(segs):
        ref_dx[lo:hi] = dyd[lo:hi] @ dequantize_128x128(w_q[e].cpu(), w_s[e].cpu(), torch.float64)
    assert rel(used(dx, rows), used(ref_dx, rows)) < (TOL_GPU if device == "cuda" else TOL)[torch.float32]


def _cpu(rows: GroupedRows) -> GroupedRows:
    return GroupedRows(rows.offsets.cpu(), rows.num_rows, rows.alignment, rows.data_lengths.cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("alignment", [1, 16])
def test_grouped_wgrad_matches_float64_with_blocks_restarting_per_segment(device, alignment, request):
    setup_device(device, request)
    torch.manual_seed(1)
    rows, segs = layout(LENGTHS, alignment, device)
    n, k = 256, 128
    dy = data_rows(segs, rows.num_rows, n, device)
    x = data_rows(segs, rows.num_rows, k, device, 3.0)
    dyt_q, dyt_s = quantize_tokens_grouped(dy, rows, backend="triton")
    xt_q, xt_s = quantize_tokens_grouped(x, rows, backend="triton")
    dw = grouped_gemm_wgrad(dyt_q, dyt_s, xt_q, xt_s, rows, out_dtype=torch.float32, backend="triton")
    blocks = rows.block_offsets().tolist()
    for e, (lo, hi) in enumerate(segs):
        if hi == lo:
            assert torch.equal(dw[e].cpu(), torch.zeros(n, k))  # an empty expert gets an exact zero gradient
            continue
        nb = -(-(hi - lo) // 128)
        sa, sb = dyt_s[:, blocks[e]:blocks[e] + nb].cpu(), xt_s[:, blocks[e]:blocks[e] + nb].cpu()
        cols = token_columns(rows, e, hi - lo)  # the segment's tokens in the block-aligned layout
        a = dequantize_1x128(dyt_q[:, cols].cpu(), sa, torch.float64)
        b = dequantize_1x128(xt_q[:, cols].cpu(), sb, torch.float64)
        assert rel(dw[e], a @ b.t()) < (TOL_GPU if device == "cuda" else TOL)[torch.float32]
        # the scale blocks restart at the segment start: they equal a fresh quantization of the segment alone
        q_ref, s_ref = quantize_1x128(dy[lo:hi].t().cpu().contiguous(), backend="torch")
        assert bits_equal(dyt_q[:, cols], q_ref) and torch.equal(sa, s_ref.cpu())
        # the rest of the segment's last block is zeros (the kernel reads whole blocks)
        tail = dyt_q[:, cols.stop:(blocks[e] + nb) * 128].cpu()
        assert torch.equal(tail.view(torch.uint8), torch.zeros_like(tail.view(torch.uint8)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("alignment", [1, 16])
def test_gathered_and_per_segment_quantizers_are_bit_exact(device, alignment, request):
    setup_device(device, request)
    torch.manual_seed(2)
    rows, segs = layout(LENGTHS, alignment, device)
    tokens = torch.randn(300, 256, device=device).to(torch.bfloat16)
    row_src = torch.full((rows.num_rows,), -1, dtype=torch.int32)
    for lo, hi in segs:
        row_src[lo:hi] = torch.randint(0, 300, (hi - lo,), dtype=torch.int32)
    row_src = row_src.to(device)
    q_ref, s_ref = quantize_rows_gathered(tokens.cpu(), row_src.cpu(), backend="torch")
    for order in (False, True):  # the grid's order changes no bit
        with QUANT_TUNING.override(gathered_row_features_first=order):
            q, s = quantize_rows_gathered(tokens, row_src, rows, backend="triton")
        assert bits_equal(used(q, rows), used(q_ref, rows)) and torch.equal(used(s, rows), used(s_ref, rows))
    qt_ref, st_ref = quantize_tokens_grouped_ref(tokens.cpu(), _cpu(rows), row_src.cpu())
    nb = int(rows.block_offsets()[-1])
    for chunk in ({}, {"tokens_block_f": 128, "tokens_warps": 8}, {"tokens_block_f": 16, "tokens_warps": 2},
                  {"gathered_features_first": True, "tokens_features_first": False}):  # the other grid orders
        with GROUPED_TUNING.override(**chunk):  # launch shapes must not change a single bit
            qt, st = quantize_tokens_grouped(tokens, rows, row_src, backend="triton")
        assert bits_equal(qt[:, :nb * 128], qt_ref[:, :nb * 128]), chunk  # every used block, zero tails included
        assert torch.equal(st[:, :nb].cpu(), st_ref[:, :nb]), chunk
    # the gather itself, and its adjoint the ordered sum, exactly
    gathered = gather_rows(tokens, row_src, backend="triton")
    assert torch.equal(gathered.cpu(), gather_rows(tokens.cpu(), row_src.cpu(), backend="torch"))
    pos = torch.randint(0, int(rows.offsets[-1]), (50, 4), dtype=torch.int32, device=device)
    summed = sum_rows(gathered, pos, out_dtype=torch.float32, backend="triton")
    expected = sum(gathered.cpu().float()[pos.cpu().long()[:, j]] for j in range(4))
    assert torch.equal(summed.cpu(), expected)


def test_block_groups_name_the_owner_of_every_block():
    """Each 128-row block's segment (empty segments own none), and G past the used blocks."""
    for alignment in (1, 16):
        rows, segs = layout(LENGTHS, alignment, "cpu")
        want = [g for g, (lo, hi) in enumerate(zip(rows.offsets[:-1].tolist(), rows.offsets[1:].tolist()))
                for _ in range(-(-(hi - lo) // 128))]  # fmt: skip
        got = rows.block_groups()
        assert got.dtype == torch.int32 and got.shape == (rows.max_blocks(),)
        assert got[:len(want)].tolist() == want
        assert set(got[len(want):].tolist()) <= {len(LENGTHS)}


@pytest.mark.parametrize("device", DEVICES)
def test_fused_swiglu_quantize_and_backward_match_the_reference(device, request):
    setup_device(device, request)
    torch.manual_seed(3)
    rows, segs = layout(LENGTHS, 16, device)
    inter = 256
    h = data_rows(segs, rows.num_rows, 2 * inter, device, 2.0).to(torch.bfloat16)
    gate = data_rows(segs, rows.num_rows, 1, device)[:, 0].abs()
    got = swiglu_quantize(h, gate, rows, backend="triton")
    ref = swiglu_quantize_ref(h.cpu(), gate.cpu())
    # h_q is a plain 1x128 quantization of h: bit-exact. a = silu·up·gate differs from torch's only through
    # exp (ULPs), so an E4M3 code may sit on the other side of a rounding boundary: allow 1 in 1000 codes
    assert bits_equal(used(got[2], rows), used(ref[2], rows)) and torch.equal(used(got[3], rows), used(ref[3], rows))
    codes_differ = (used(got[0], rows).view(torch.uint8) != used(ref[0], rows).view(torch.uint8)).float().mean()
    assert codes_differ < 1e-3
    # the scales are amax(a)/448: exp's ULPs reach them directly (1.3e-6 seen when other tests ran first)
    assert rel(used(got[1], rows), used(ref[1], rows)) < 1e-5
    da = data_rows(segs, rows.num_rows, inter, device).to(torch.bfloat16)
    dh, dh_q, dh_s, d_gate = swiglu_backward(got[2], got[3], da, gate, rows, backend="triton")
    r_dh, r_dh_q, r_dh_s, r_gate = swiglu_backward_ref(got[2].cpu(), got[3].cpu(), da.cpu(), gate.cpu())
    # dh is rounded to bf16: exp's ULPs flip a rare rounding; dh_q is quantized from that bf16 dh (as any bf16
    # gradient is), so it equals the reference quantization of the kernel's own dh bit for bit
    assert rel(used(dh, rows), used(r_dh, rows)) < 1e-3
    q_own, s_own = quantize_1x128(used(dh, rows), backend="torch")
    assert bits_equal(used(dh_q, rows), q_own) and torch.equal(used(dh_s, rows), s_own)
    assert rel(used(d_gate, rows), used(r_gate, rows)) < 1e-5
    # aᵀ recomputed from the FP8 h for the down projection's wgrad
    at_q, at_s = swiglu_quantize_tokens(got[2], got[3], gate, rows, backend="triton")
    rt_q, rt_s = swiglu_quantize_tokens(got[2].cpu(), got[3].cpu(), gate.cpu(), _cpu(rows), backend="torch")
    assert (used(at_q, rows, 1).view(torch.uint8) != used(rt_q, rows, 1).view(torch.uint8)).float().mean() < 1e-3
    # the grid order changes no bit of the kernel's own result
    with GROUPED_TUNING.override(tokens_block_f=32, tokens_warps=2, tokens_features_first=False):
        at_q2, at_s2 = swiglu_quantize_tokens(got[2], got[3], gate, rows, backend="triton")
    nb = int(rows.block_offsets()[-1])
    assert bits_equal(at_q2[:, :nb * 128], at_q[:, :nb * 128]) and torch.equal(at_s2[:, :nb], at_s[:, :nb])


def test_bad_operands_name_the_problem():
    rows = GroupedRows(torch.tensor([0, 3, 5], dtype=torch.int32), 8)
    a = torch.zeros(8, 128, dtype=torch.float8_e4m3fn)
    w = torch.zeros(3, 128, 128, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="do not fit 2 segments"):
        grouped_gemm(a, torch.ones(8, 1), w, torch.ones(3, 1, 1), rows)
    with pytest.raises(ValueError, match="num_rows=8"):
        grouped_gemm(a[:6], torch.ones(6, 1), w[:2], torch.ones(2, 1, 1), rows)
    with pytest.raises(ValueError, match="multiples of 128"):
        quantize_expert_weights(torch.zeros(2, 100, 128))


def test_a_flattened_wgrad_is_refused_naming_the_field():
    """`GroupedGemmConfig.flatten` is a forward/dgrad option: on the wgrad, whose token loop varies by expert, it
    would be ignored, so it is refused, directly and through the tuning override, while the fprop takes it."""
    flat = GroupedGemmConfig(flatten=True)
    with pytest.raises(ValueError, match=r"GroupedConfig\.wgrad\.flatten"):
        GroupedConfig(wgrad=flat)
    with pytest.raises(ValueError, match=r"GroupedConfig\.wgrad\.flatten"):
        with GROUPED_TUNING.override(wgrad=flat):
            pass
    assert GroupedConfig(fprop=flat).fprop.flatten
    assert not GROUPED_TUNING.current().wgrad.flatten  # the refused override left the tuning as it was


def test_the_wgrad_asks_for_the_gluon_tiles_only_where_expert_segments_are_short():
    """GroupedConfig.sm90_wgrad (the Gluon wgrad on sm_90, where it measured faster): the dispatch's rows of Ling's
    top-8 routing over 256 experts at 4,096 and 16,384 tokens (about 2 and 5 token blocks per expert) and 64 experts
    at 4,096 tokens (5) take it, 64 experts at 16,384 tokens (17 blocks) keep the Triton wgrad; a set
    GroupedConfig.sm90 wins unless it is the warp-specialised kernel; None turns it off; the interpreter never asks
    for it (Gluon does not run there)."""
    cfg = GroupedConfig()
    assert cfg.sm90_wgrad is not None

    def rows(tokens: int, experts: int) -> GroupedRows:
        topk = torch.rand(tokens, experts, generator=torch.Generator().manual_seed(tokens + experts)).topk(8).indices
        return plan_dispatch(topk, experts, 16).rows

    for tokens, experts in [(4096, 256), (16384, 256), (4096, 64)]:
        assert wgrad_sm90_config(cfg, rows(tokens, experts)) is cfg.sm90_wgrad
    long_segments = rows(16384, 64)
    assert wgrad_sm90_config(cfg, long_segments) is None
    forced = Sm90GemmConfig(stages=3)
    assert wgrad_sm90_config(dataclasses.replace(cfg, sm90=forced), long_segments) is forced
    # the warp-specialised kernel runs forward/dgrad only: the wgrad then follows the default's rule
    ws = Sm90GemmConfig(warp_specialized=True)
    assert wgrad_sm90_config(dataclasses.replace(cfg, sm90=ws), long_segments) is None
    assert wgrad_sm90_config(dataclasses.replace(cfg, sm90=ws), rows(4096, 256)) is cfg.sm90_wgrad
    assert wgrad_sm90_config(dataclasses.replace(cfg, sm90_wgrad=None), rows(4096, 256)) is None
    assert GROUPED_TUNING.interpreter.sm90_wgrad is None
