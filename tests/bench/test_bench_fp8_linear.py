"""bench/bench_fp8_linear.py on CPU: the scale layouts it offers cuBLAS's blockwise `scaled_mm` (the comparison
itself needs a GPU). cuBLAS takes a 128x128 operand's scales K-block-major, [KB, NB] with strides (1, KB) (its
refusal of the QKV dgrad's asked for strides (1, 24)). On the GPU the dgrad's Wᵀ scales come from
`fp8_transpose_128x128` as a transposed view, for which the bench once offered no candidate in that layout, so its
dgrad column read n/a. Where KB is not a multiple of 4 (no Ling shape) the bench pads the leading dimension to one
with zero scales, the 16-byte alignment cuBLAS asks of a scale tensor's rows; whether cuBLAS takes that layout is
for a GPU to say."""

from __future__ import annotations

import pytest
import torch

from fp8.quant import quantize_128x128
from tests.helpers import load_bench


@pytest.mark.parametrize("n, k", [(3072, 2048), (2048, 3072), (512, 2048), (2048, 5120)])
@pytest.mark.parametrize("transposed", [False, True])
def test_the_first_cublas_candidate_is_k_block_major_for_fprop_and_dgrad_scales(n, k, transposed):
    bench = load_bench("bench_fp8_linear")
    _, ws = quantize_128x128(torch.randn(n, k, dtype=torch.bfloat16))
    if transposed:  # the dgrad operand Wᵀ [k, n]: on the GPU its scales are this view of W's (the CPU path copies)
        ws = ws.transpose(-2, -1)
    nb, kb = ws.shape
    first = bench._cublas_candidates(ws, True)[0]
    assert first.shape == (kb, nb) and first.stride() == (1, kb)
    assert torch.equal(first, ws.t())


@pytest.mark.parametrize("k", [384, 640, 896])  # KB = 3, 5, 7
def test_a_k_block_count_off_a_multiple_of_4_is_padded_with_zero_scales(k):
    bench = load_bench("bench_fp8_linear")
    _, ws = quantize_128x128(torch.randn(256, k, dtype=torch.bfloat16))
    nb, kb = ws.shape
    padded_kb = -(-kb // 4) * 4
    first = bench._cublas_candidates(ws, True)[0]
    assert first.shape == (padded_kb, nb) and first.stride() == (1, padded_kb)
    assert torch.equal(first[:kb], ws.t()) and not first[kb:].any()
