"""The TMA kernels' K loop (fp8/triton_blocks.py `tma_k_loop`) against the pointer-load kernels: the same tiles give
the same bits (the same per-block products, promoted in the same order), so the TMA path, the GPU default, is also
checked in the interpreter; so is its variant that loads the next block's scales ahead (`prefetch_scales`). On the
GPU also the flattened tile and K loops (`flatten`, with and without the prefetch), a compiler transformation that
the interpreter does not apply (so those cases run only where it can fail). Dense
shapes with one, an odd and an even number of K blocks and a zero-filled K tail; grouped segments of zero to three
token blocks. Both are also checked against float64 here and in
test_fp8_gemm.py / test_fp8_grouped.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fp8.gemm import GemmConfig, fp8_gemm, fp8_gemm_wgrad
from fp8.grouped import (
    GROUPED_TUNING,
    GroupedGemmConfig,
    grouped_gemm,
    grouped_gemm_wgrad,
    quantize_expert_weights,
    quantize_tokens_grouped,
)
from fp8.quant import dequantize_1x128, dequantize_128x128, quantize_1x128, quantize_128x128
from tests.helpers import DEVICES, data_rows, layout, rel, setup_device

# K = 128: one block; 384: odd; 512: even; 300: a zero-filled K tail in the third block
DENSE_SHAPES = [(192, 256, 128), (130, 256, 384), (256, 128, 512), (64, 256, 300)]
# token blocks per segment: 0, 1, 1, 0, 2, 1, 1, 1, 0, 3
LENGTHS = [0, 37, 5, 0, 130, 1, 64, 16, 0, 261]
TOL = 4e-3  # bf16 output rounding (8 significant bits: ~1.1e-3 rms), as in test_fp8_gemm.py


TMA_LOADS = ("tma", "tma_prefetch")  # "tma_prefetch": prefetch_scales=True; each compared with "pointer"
# flatten=True, without and with prefetch_scales: compiled kernels only (the interpreter ignores tl.range's flatten)
FLATTENED = ("tma_flatten", "tma_prefetch_flatten")


def _tma_loads(device: str) -> tuple[str, ...]:
    return TMA_LOADS if device == "cpu" else TMA_LOADS + FLATTENED


def _dense(device, m, n, k, loads, wgrad):
    torch.manual_seed(0)
    a = torch.randn(m, k, device=device) * 2
    b = torch.randn(n, k, device=device) * 0.02
    aq, as_ = quantize_1x128(a, backend="triton")
    bq, bs = quantize_1x128(b, backend="triton") if wgrad else quantize_128x128(b, backend="triton")
    tma = loads.startswith("tma")
    cfg = GemmConfig(64, 128, 4, num_warps=4, num_stages=2, tma=tma, persistent=tma,
                     prefetch_scales="prefetch" in loads, flatten=loads.endswith("flatten"))  # fmt: skip
    fn = fp8_gemm_wgrad if wgrad else fp8_gemm
    out = fn(aq, as_, bq, bs, out_dtype=torch.bfloat16, backend="triton", config=cfg)
    deq_b = dequantize_1x128 if wgrad else dequantize_128x128
    ref = dequantize_1x128(aq.cpu(), as_.cpu(), torch.float64) @ deq_b(bq.cpu(), bs.cpu(), torch.float64).t()
    return out.cpu(), ref


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", DENSE_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("wgrad", [False, True], ids=["fprop", "wgrad"])
def test_dense_tma_and_pointer_kernels_are_bit_identical(device, shape, wgrad, request):
    setup_device(device, request)
    outs = {}
    for loads in (*_tma_loads(device), "pointer"):
        outs[loads], ref = _dense(device, *shape, loads, wgrad)
    assert rel(outs["tma"], ref) < TOL
    for loads in _tma_loads(device):
        assert torch.equal(outs[loads].view(torch.int16), outs["pointer"].view(torch.int16)), loads


def _grouped_cfg(device: str, loads: str, wgrad: bool) -> GroupedGemmConfig:
    if device == "cpu":  # small tiles keep the interpreter fast
        return GroupedGemmConfig(block_m=32, block_n=32 if wgrad else 128, num_warps=4, num_stages=2,
                                 tma=loads.startswith("tma"), prefetch_scales="prefetch" in loads)  # fmt: skip
    tuned = GROUPED_TUNING.current()
    flatten = loads.endswith("flatten") and not wgrad  # a forward/dgrad option: GroupedConfig refuses it on the wgrad
    return dataclasses.replace(tuned.wgrad if wgrad else tuned.fprop, tma=loads.startswith("tma"),
                               prefetch_scales="prefetch" in loads, flatten=flatten)  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_tma_and_pointer_kernels_are_bit_identical(device, request):
    setup_device(device, request)
    torch.manual_seed(3)
    rows, segs = layout(LENGTHS, 16, device)
    g, n, k = len(LENGTHS), 128, 384  # three K blocks in the forward GEMM
    x_q, x_s = quantize_1x128(data_rows(segs, rows.num_rows, k, device, 2.0), backend="triton")
    w_q, w_s = quantize_expert_weights((torch.randn(g, n, k) * 0.02).to(device))
    dy = data_rows(segs, rows.num_rows, n, device)
    dyt = quantize_tokens_grouped(dy, rows, backend="triton")
    xt = quantize_tokens_grouped(data_rows(segs, rows.num_rows, 64, device, 3.0), rows, backend="triton")
    fwd, dw = {}, {}
    for loads in (*_tma_loads(device), "pointer"):
        fprop_cfg, wgrad_cfg = _grouped_cfg(device, loads, False), _grouped_cfg(device, loads, True)
        with GROUPED_TUNING.override(fprop=fprop_cfg, wgrad=wgrad_cfg, sm90_wgrad=None):  # the Triton kernels
            fwd[loads] = grouped_gemm(x_q, x_s, w_q, w_s, rows, out_dtype=torch.float32, backend="triton").cpu()
            dw[loads] = grouped_gemm_wgrad(*dyt, *xt, rows, out_dtype=torch.float32, backend="triton").cpu()
    xd = dequantize_1x128(x_q.cpu(), x_s.cpu(), torch.float64)
    for e, (lo, hi) in enumerate(segs):
        if hi > lo:
            ref = xd[lo:hi] @ dequantize_128x128(w_q[e].cpu(), w_s[e].cpu(), torch.float64).t()
            assert rel(fwd["tma"][lo:hi], ref) < 5e-4  # fp32 output; FP8 tensor-core accumulation on the GPU
        else:
            assert torch.equal(dw["tma"][e], torch.zeros(n, 64))  # an empty expert: exact zeros
    used = int(rows.offsets[-1])
    for loads in _tma_loads(device):
        assert torch.equal(fwd["pointer"][:used], fwd[loads][:used]), loads
        assert torch.equal(dw["pointer"], dw[loads]), loads
