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


@pytest.mark.parametrize("fp8", [False, True])
def test_a_layers_rows_are_its_eager_step_and_for_fp8linear_its_graph_replay(monkeypatch, fp8):
    """`time_layer` on CPU with the GPU timers stood in for (each step counted): the eager row times the layer's own
    step and carries its forward error and saved bytes; only an FP8Linear gets the CUDA-graph row."""
    bench = load_bench("bench_fp8_linear")
    steps = []
    monkeypatch.setattr(bench, "bench_ms", lambda fn: steps.append(fn) or 2.0)
    monkeypatch.setattr(bench, "gpu_busy_ms", lambda fn: steps.append(fn) or 1.5)
    monkeypatch.setattr(bench, "cuda_graph_step", lambda fn: fn)
    torch.manual_seed(0)
    x = torch.randn(256, 256, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(128, 256, dtype=torch.bfloat16).t().contiguous()
    base = torch.nn.Linear(256, 128, bias=False, dtype=torch.bfloat16)
    layer = base
    if fp8:
        layer = bench.FP8Linear(256, 128, dtype=torch.bfloat16)
        layer.load_state_dict(base.state_dict())
    ref_y = x.detach().double() @ base.weight.detach().double().t()
    rows = bench.time_layer("shape row", layer, x, g, ref_y, flops=6.0 * 256 * 128 * 256)
    err = float(bench.relative_error(layer(x), ref_y))
    assert set(rows) == ({"", ", CUDA graph"} if fp8 else {""})
    ms, row_err, saved, busy = rows[""]
    assert (ms, busy) == (2.0, 1.5) and row_err == err and saved == bench.saved_bytes(layer, x) > 0
    assert 0 < err < (0.1 if fp8 else 0.01)  # E4M3's 3 mantissa bits against bf16's 8
    if fp8:
        assert rows[", CUDA graph"] == (2.0, err, saved, 2.0)
    assert len(steps) == (3 if fp8 else 2) and len({id(s) for s in steps}) == 1  # the one step, timed each way
    steps[0]()  # and it runs a backward: the input's gradient is the layer's
    assert x.grad is not None and x.grad.shape == x.shape
