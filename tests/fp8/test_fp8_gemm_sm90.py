"""The Hopper Gluon GEMM (fp8/gemm_sm90.py) against the Triton GEMM it replaces on sm_90 (the same bits: the same
block products promoted by the same fp32 expressions in the same K order) and against a float64 product of the
dequantized operands. GPU only: Gluon kernels do not run in Triton's CPU interpreter."""

from __future__ import annotations

import pytest
import torch

from fp8.gemm import GEMM_TUNING, fp8_gemm, fp8_gemm_ref, fp8_gemm_wgrad, fp8_gemm_wgrad_ref
from fp8.gemm_sm90 import (
    SM90_CONFIG,
    Sm90GemmConfig,
    fp8_gemm_sm90,
    grouped_gemm_sm90,
    grouped_gemm_wgrad_sm90,
    sm90_available,
)
from fp8.grouped import (
    GROUPED_TUNING,
    grouped_gemm,
    grouped_gemm_wgrad,
    quantize_expert_weights,
    quantize_tokens_grouped,
)
from fp8.quant import fp8_transpose_128x128, quantize_1x128, quantize_128x128
from tests.helpers import data_rows, layout, rel

pytestmark = pytest.mark.gpu

# (M, N, K): aligned; an odd number of K blocks (the kernel's unpaired last step); M, N and K tails (K = 208: TMA
# needs 16-byte rows); one tile; fewer tiles than SMs and more; a shared expert's K = 512
SHAPES = [(1024, 768, 1024), (1000, 384, 640), (333, 256, 208), (128, 128, 128), (257, 640, 1152), (64, 128, 384),
          (4096, 2048, 512)]  # fmt: skip
CONFIGS = [Sm90GemmConfig(), Sm90GemmConfig(stages=3), Sm90GemmConfig(group_m=1, stages=5),
           Sm90GemmConfig(warp_specialized=True), Sm90GemmConfig(warp_specialized=True, carry=True, stages=5),
           Sm90GemmConfig(warp_specialized=True, group_m=1, stages=3)]  # fmt: skip


def _needs_sm90():
    if not torch.cuda.is_available() or not sm90_available(torch.empty(0, device="cuda")):
        pytest.skip("needs an sm_90 GPU and Triton's Gluon")


def _operands(m, n, k, b_blockwise):
    a, a_s = quantize_1x128(torch.randn(m, k, device="cuda") * 2)
    w = torch.randn(n, k, device="cuda") * 0.02
    b, b_s = quantize_128x128(w) if b_blockwise else quantize_1x128(w)
    return a, a_s, b, b_s


def _triton(a, a_s, b, b_s, b_blockwise, out_dtype):
    """The Triton kernel (fp8_gemm's default; explicit here in case the default changes)."""
    with GEMM_TUNING.override(sm90=None):
        if b_blockwise:
            return fp8_gemm(a, a_s, b, b_s, out_dtype=out_dtype)
        return fp8_gemm_wgrad(a, a_s, b, b_s, out_dtype=out_dtype)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("b_blockwise,out_dtype", [(True, torch.bfloat16), (False, torch.float32),
                                                   (False, torch.bfloat16)])  # fmt: skip
@pytest.mark.parametrize("cfg", CONFIGS, ids=["default", "3-stages", "5-stages-ungrouped", "warp-specialized",
                                         "warp-specialized-carry-5-stages", "warp-specialized-3-stages-ungrouped"])
def test_sm90_gemm_gives_the_triton_kernels_bits(shape, b_blockwise, out_dtype, cfg):
    _needs_sm90()
    torch.manual_seed(hash((shape, b_blockwise)) % 2**31)
    m, n, k = shape
    a, a_s, b, b_s = _operands(m, n, k, b_blockwise)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=out_dtype)  # every element must be written
    fp8_gemm_sm90(a, a_s, b, b_s, out_dtype, b_blockwise=b_blockwise, config=cfg, out=out)
    assert not out.isnan().any()
    assert torch.equal(out, _triton(a, a_s, b, b_s, b_blockwise, out_dtype))
    ref = (fp8_gemm_ref if b_blockwise else fp8_gemm_wgrad_ref)(a.cpu(), a_s.cpu(), b.cpu(), b_s.cpu(),
                                                                torch.float64)  # fmt: skip
    # Hopper's FP8 tensor cores accumulate a 128-deep block with ~14 significant bits (tests/fp8/test_fp8_gemm.py)
    assert rel(out, ref) < (4e-3 if out_dtype == torch.bfloat16 else 5e-4)


def test_fp8_gemm_runs_the_gluon_kernel_on_sm90_only_when_told():
    """The default is the Triton kernel (the Gluon one measured slower); GemmChoice.sm90 selects the Gluon kernel
    for TMA-readable operands past SMALL_M_ROWS rows, never for a small M or a column-major operand."""
    _needs_sm90()
    from fp8.gemm import _config

    a, a_s, b, b_s = _operands(1024, 256, 512, True)
    assert not isinstance(_config(a, b, "fprop", None, torch.bfloat16), Sm90GemmConfig)
    with GEMM_TUNING.override(sm90=SM90_CONFIG):
        assert isinstance(_config(a, b, "fprop", None, torch.bfloat16), Sm90GemmConfig)
        assert torch.equal(fp8_gemm(a, a_s, b, b_s), _triton(a, a_s, b, b_s, True, torch.bfloat16))
        assert not isinstance(_config(a[:16], b, "fprop", None, torch.bfloat16), Sm90GemmConfig)
        strided = a.t().contiguous().t()  # column-major: TMA cannot read it
        assert not isinstance(_config(strided, b, "fprop", None, torch.bfloat16), Sm90GemmConfig)


def test_sm90_gemm_refuses_wide_tiles_for_128x128_scales_and_rows_tma_cannot_read():
    _needs_sm90()
    a, a_s, b, b_s = _operands(128, 256, 128, True)
    with pytest.raises(ValueError, match="block_n = 128"):
        fp8_gemm_sm90(a, a_s, b, b_s, config=Sm90GemmConfig(block_n=256))
    a, a_s, b, b_s = _operands(333, 256, 200, True)  # 200-byte rows (the H200 run of 2026-12-05 gave garbage)
    with pytest.raises(ValueError, match="16-byte aligned rows"):
        fp8_gemm_sm90(a, a_s, b, b_s)


def test_the_warp_specialized_kernel_refuses_what_it_does_not_run():
    """128-row tiles only (two 64-row consumers), TMA-readable operands only, not the k-grouped wgrad."""
    _needs_sm90()
    a, a_s, b, b_s = _operands(256, 256, 256, True)
    with pytest.raises(ValueError, match="128-row tiles"):
        fp8_gemm_sm90(a, a_s, b, b_s, config=Sm90GemmConfig(warp_specialized=True, block_m=64))
    a2, a2_s, b2, b2_s = _operands(333, 256, 200, True)
    with pytest.raises(ValueError, match="16-byte aligned rows"):
        fp8_gemm_sm90(a2, a2_s, b2, b2_s, config=Sm90GemmConfig(warp_specialized=True))
    blocks = torch.tensor([0, 2], device="cuda", dtype=torch.int32)
    out = torch.empty(1, 256, 256, device="cuda")
    with pytest.raises(ValueError, match="not the k-grouped wgrad"):
        grouped_gemm_wgrad_sm90(a.t().contiguous(), a_s, b, b_s, blocks, out,
                                config=Sm90GemmConfig(warp_specialized=True))  # fmt: skip


# segment lengths: empty experts, ones shorter than a tile, one over two 128-row tiles (tests/fp8/test_fp8_grouped.py)
LENGTHS = [0, 37, 5, 0, 130, 1, 64, 16, 0, 261]


@pytest.mark.parametrize("alignment", [1, 16])
@pytest.mark.parametrize("n,k", [(256, 384), (128, 1024)])
@pytest.mark.parametrize("cfg", [Sm90GemmConfig(), Sm90GemmConfig(warp_specialized=True),
                                 Sm90GemmConfig(warp_specialized=True, carry=True, stages=3)],
                         ids=["default", "warp-specialized", "warp-specialized-carry-3-stages"])  # fmt: skip
def test_sm90_grouped_gemm_gives_the_triton_kernels_bits(alignment, n, k, cfg):
    """Forward and dgrad; the warp-specialised kernel's consumers store their 64-row halves masked at the segment
    end (LENGTHS has segments shorter than a half, and one across two tiles)."""
    _needs_sm90()
    torch.manual_seed(alignment + n)
    rows, segs = layout(LENGTHS, alignment, "cuda")
    g = len(LENGTHS)
    x_q, x_s = quantize_1x128(data_rows(segs, rows.num_rows, k, "cuda", 2.0))
    w_q, w_s = quantize_expert_weights(torch.randn(g, n, k, device="cuda") * 0.02)
    out = grouped_gemm_sm90(x_q, x_s, w_q, w_s, rows.offsets, rows.block_offsets(cfg.block_m),
                            rows.max_blocks(cfg.block_m) * (n // cfg.block_n), config=cfg)  # fmt: skip
    ref = grouped_gemm(x_q, x_s, w_q, w_s, rows)
    for lo, hi in segs:  # every data row of every segment
        assert torch.equal(out[lo:hi], ref[lo:hi])
    # dgrad: the on-demand transposed weights, made contiguous as the caller does
    dy_q, dy_s = quantize_1x128(data_rows(segs, rows.num_rows, n, "cuda"))
    wt_q, wt_s = fp8_transpose_128x128(w_q, w_s)
    dx = grouped_gemm_sm90(dy_q, dy_s, wt_q.contiguous(), wt_s, rows.offsets, rows.block_offsets(cfg.block_m),
                           rows.max_blocks(cfg.block_m) * (k // cfg.block_n), torch.float32, config=cfg)  # fmt: skip
    ref_dx = grouped_gemm(dy_q, dy_s, wt_q, wt_s, rows, out_dtype=torch.float32)
    for lo, hi in segs:
        assert torch.equal(dx[lo:hi], ref_dx[lo:hi])


@pytest.mark.parametrize("alignment", [1, 16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(256, 128), (128, 384)])
def test_sm90_grouped_wgrad_gives_the_triton_kernels_bits(alignment, out_dtype, n, k):
    """Every expert's gradient, the empty experts' exact zeros included (the output starts as NaN)."""
    _needs_sm90()
    torch.manual_seed(alignment + k)
    rows, segs = layout(LENGTHS, alignment, "cuda")
    dyt = quantize_tokens_grouped(data_rows(segs, rows.num_rows, n, "cuda"), rows)
    xt = quantize_tokens_grouped(data_rows(segs, rows.num_rows, k, "cuda", 3.0), rows)
    out = torch.full((len(LENGTHS), n, k), float("nan"), device="cuda", dtype=out_dtype)
    grouped_gemm_wgrad_sm90(*dyt, *xt, rows.block_offsets(), out)
    with GROUPED_TUNING.override(sm90_wgrad=None):  # the Triton kernel (by default these short segments take Gluon)
        assert torch.equal(out, grouped_gemm_wgrad(*dyt, *xt, rows, out_dtype=out_dtype))
    for e, (lo, hi) in enumerate(segs):
        if hi == lo:
            assert torch.equal(out[e], torch.zeros_like(out[e]))


def _kernels_run(fn) -> set[str]:
    """The names of the CUDA kernels fn launches."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if e.device_type == torch.profiler.DeviceType.CUDA}


@pytest.mark.parametrize("lengths,gluon", [(LENGTHS, True), ([4096, 0, 3000], False)], ids=["short", "long"])
def test_grouped_wgrad_takes_the_gluon_kernel_by_default_only_for_short_segments(lengths, gluon):
    """GroupedConfig.sm90_wgrad: LENGTHS' experts average under 8 token blocks and get the Gluon wgrad; 3 experts
    over 7,096 rows (19 blocks each) keep the Triton kernel. Either way the Triton kernel's bits."""
    _needs_sm90()
    torch.manual_seed(len(lengths))
    rows, segs = layout(lengths, 16, "cuda")
    dyt = quantize_tokens_grouped(data_rows(segs, rows.num_rows, 256, "cuda"), rows)
    xt = quantize_tokens_grouped(data_rows(segs, rows.num_rows, 384, "cuda", 3.0), rows)
    out = grouped_gemm_wgrad(*dyt, *xt, rows, out_dtype=torch.bfloat16)
    names = _kernels_run(lambda: grouped_gemm_wgrad(*dyt, *xt, rows, out_dtype=torch.bfloat16))
    assert any("sm90" in n for n in names) == gluon, names
    with GROUPED_TUNING.override(sm90_wgrad=None):
        assert not any("sm90" in n for n in _kernels_run(lambda: grouped_gemm_wgrad(*dyt, *xt, rows)))
        assert torch.equal(out, grouped_gemm_wgrad(*dyt, *xt, rows, out_dtype=torch.bfloat16))
