"""FP8Linear: forward, dgrad and wgrad against the PyTorch reference composition and against a
high-precision nn.Linear; weight caching, health statistics, saved activations, bad input."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fp8.gemm import fp8_gemm_ref, fp8_gemm_wgrad_ref
from fp8.linear import FP8Linear, invalidate_fp8_weight_caches
from fp8.quant import quantize_1x128_ref, quantize_128x128_ref
from tests.helpers import DEVICES, rel, run, setup_device

HEALTH_KEYS = {"act_underflow", "act_distortion", "grad_underflow", "grad_distortion", "gradT_underflow",
               "gradT_distortion", "weight_underflow", "weight_distortion"}  # fmt: skip


def reference(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor):
    """The blockwise recipe composed by hand from the reference ops (fp32 throughout)."""
    xq, xs = quantize_1x128_ref(x)
    wq, ws = quantize_128x128_ref(w)
    y = fp8_gemm_ref(xq, xs, wq, ws, torch.float32)
    dq, ds = quantize_1x128_ref(dy)
    dx = fp8_gemm_ref(dq, ds, wq.t().contiguous(), ws.t().contiguous(), torch.float32)
    dtq, dts = quantize_1x128_ref(dy.t())
    xtq, xts = quantize_1x128_ref(x.t())  # xᵀ quantized along tokens straight from x (one rounding)
    dw = fp8_gemm_wgrad_ref(dtq, dts, xtq, xts)
    return y, dx, dw


@pytest.mark.parametrize("shape", [(64, 256, 384), (37, 200, 300)])  # (M, N, K): aligned; odd M + K tail
def test_cpu_path_is_the_reference_recipe(shape):
    m, n, k = shape
    layer = FP8Linear(k, n)
    x, dy = torch.randn(m, k), torch.randn(m, n)
    y, dx, dw = run(layer, x, dy)
    yr, dxr, dwr = reference(x, layer.weight.detach(), dy)
    assert torch.equal(y, yr) and torch.equal(dx, dxr) and torch.equal(dw, dwr)  # same ops, same order


@pytest.mark.parametrize("recipe", ["blockwise", "tensorwise"])
def test_close_to_high_precision_linear(recipe):
    torch.manual_seed(0)
    m, n, k = 96, 256, 512
    layer = FP8Linear(k, n, recipe=recipe)
    ref = nn.Linear(k, n, bias=False)
    ref.load_state_dict(layer.state_dict())
    x, dy = torch.randn(3, m // 3, k), torch.randn(3, m // 3, n)
    y, dx, dw = run(layer, x, dy)
    yr, dxr, dwr = run(ref, x, dy)
    assert y.shape == yr.shape and dx.shape == x.shape
    # E4M3 has 3 mantissa bits: a rounding error of at most 2^-4 relative, ~2.5% rms per operand for
    # Gaussian data, so a product of two quantized operands lands near 3.6% (measured: y 3.6%, dx 3.7%,
    # dW 3.8-4.1% for both recipes); 6% bounds it.
    for a, b in ((y, yr), (dx, dxr), (dw, dwr)):
        assert rel(a, b) < 0.06


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(128, 256, 256), (37, 200, 300)])
def test_triton_path_matches_reference_path(device, shape, request, monkeypatch):
    setup_device(device, request)
    torch.manual_seed(1)
    m, n, k = shape
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x, dy = torch.randn(m, k), torch.randn(m, n)
    cpu_layer = FP8Linear(k, n)
    with torch.no_grad():  # weights representable in dtype, so both layers quantize the same values
        cpu_layer.weight.copy_(cpu_layer.weight.to(dtype).float())
    yr, dxr, dwr = run(cpu_layer, x.to(dtype).float(), dy.to(dtype).float())
    layer = FP8Linear(k, n, device=device, dtype=dtype)
    layer.load_state_dict(cpu_layer.state_dict())
    if device == "cpu":
        monkeypatch.setenv("LING_FP8_BACKEND", "triton")
    y, dx, dw = run(layer, x.to(device, dtype), dy.to(device, dtype))
    # identical quantization; GEMMs differ only in fp32 summation order, plus output rounding to dtype
    tol = 4e-3 if dtype == torch.bfloat16 else 1e-5
    assert rel(y, yr) < tol and rel(dx, dxr) < tol and rel(dw, dwr) < tol


@pytest.mark.parametrize("device", DEVICES)
def test_nan_input_gives_nan_output(device, request, monkeypatch):
    setup_device(device, request)
    if device == "cpu":
        monkeypatch.setenv("LING_FP8_BACKEND", "triton")
    layer = FP8Linear(256, 128, device=device)
    x = torch.randn(16, 256, device=device)
    x[2, 5] = float("nan")
    x[4, 100] = float("inf")
    x.requires_grad_()
    y = layer(x)
    assert torch.isnan(y[2]).all() and not torch.isfinite(y[4]).any()
    assert torch.isfinite(y[[0, 1, 3] + list(range(5, 16))]).all()
    y.backward(torch.ones_like(y))
    assert not torch.isfinite(layer.weight.grad).all()  # NaN reaches dW instead of being clipped away


def test_drop_in_linear():
    layer = FP8Linear(130, 70, bias=True)
    ref = nn.Linear(130, 70, bias=True)
    assert isinstance(layer, nn.Linear)
    assert set(layer.state_dict()) == set(ref.state_dict())
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(2, 5, 130)
    y = layer(x)
    assert y.shape == (2, 5, 70) and rel(y, ref(x)) < 0.06
    y.sum().backward()
    assert layer.bias.grad is not None and layer.weight.grad.dtype == layer.weight.dtype
    with pytest.raises(ValueError, match="recipe"):
        FP8Linear(8, 8, recipe="rowwise")
    with pytest.raises(ValueError, match="expects input"):
        layer(torch.randn(3, 129))


def test_weight_cache_once_per_step():
    layer = FP8Linear(256, 128)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    q1, _ = layer.quantized_weight()
    for _ in range(3):  # micro-batches: the same FP8 weight is reused
        layer(torch.randn(8, 256)).sum().backward()
        assert layer.quantized_weight()[0] is q1
    opt.step()  # in-place update bumps weight._version -> re-quantized once
    q2, _ = layer.quantized_weight()
    assert q2 is not q1 and layer.quantized_weight()[0] is q2
    invalidate_fp8_weight_caches(layer)
    assert layer.quantized_weight()[0] is not q2


def test_a_stable_weight_cache_requantizes_into_the_same_tensors():
    """What a CUDA graph reading the cache needs (model.cuda_graphs): same tensors, new values, equal to a fresh
    quantization; a layout change is refused."""
    layer = FP8Linear(256, 128)
    cache = layer._wcache
    cache.stable = True
    first = layer.fp8_weights()
    ptrs = [t.data_ptr() for t in first]
    with torch.no_grad():
        layer.weight.data.mul_(3.0).add_(0.5)  # behind autograd's back, as DeepSpeed writes
    invalidate_fp8_weight_caches(layer)
    layer.refresh_fp8_weights()
    again = layer.fp8_weights()
    assert [t.data_ptr() for t in again] == ptrs and all(a is b for a, b in zip(again, first))
    fresh = FP8Linear(256, 128)
    fresh.load_state_dict(layer.state_dict())
    for a, b in zip(again, fresh.fp8_weights()):
        assert torch.equal(a.float(), b.float())
    with torch.no_grad():
        layer.weight = nn.Parameter(torch.randn(128, 384))  # another shape: a graph would read stale memory
    with pytest.raises(RuntimeError, match="changed its layout"):
        layer.fp8_weights()


@pytest.mark.parametrize("recipe", ["blockwise", "tensorwise"])
def test_health_stats_do_not_change_numerics(recipe):
    torch.manual_seed(2)
    layer = FP8Linear(256, 128, recipe=recipe)
    x, dy = torch.randn(64, 256), torch.randn(64, 128)
    y0, dx0, dw0 = run(layer, x, dy)
    layer.collect_health = True
    y1, dx1, dw1 = run(layer, x, dy)
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1) and torch.equal(dw0, dw1)
    assert set(layer.health) == HEALTH_KEYS
    assert all(0.0 <= v <= 1.0 for v in layer.health.values())


def test_saves_fp8_activation_not_bf16():
    layer = FP8Linear(512, 256, dtype=torch.bfloat16)
    x = torch.randn(128, 512, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(x)
    cached = {t.data_ptr() for t in layer.fp8_weights()} | {layer.weight.data_ptr()}  # W, Wᵀ and their scales
    acts = [t for t in saved if t.data_ptr() not in cached]
    assert all(t.dtype in (torch.float8_e4m3fn, torch.float32) for t in acts)
    nbytes = sum(t.numel() * t.element_size() for t in acts)
    # FP8 xᵀ [512, 128] + fp32 scales [512, 1]: ~half of the bf16 x (131072 bytes)
    assert nbytes == 128 * 512 + 512 * 1 * 4
    saved.clear()
    with torch.no_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(x)
    assert saved == []  # no backward coming: nothing quantized for wgrad, nothing saved


def test_frozen_weight_saves_nothing_for_wgrad():
    """With a frozen weight only dx is computed: the forward quantizes x along K only, saves no xᵀ, and dx
    equals the trainable layer's dx bit for bit."""
    torch.manual_seed(3)
    layer = FP8Linear(256, 128)
    x, dy = torch.randn(64, 256), torch.randn(64, 128)
    _, dx_ref, _ = run(layer, x, dy)
    layer.weight.requires_grad_(False)
    layer.weight.grad = None
    xg = x.clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = layer(xg)
    y.backward(dy)
    cached = {t.data_ptr() for t in layer.fp8_weights()}  # W, Wᵀ and their scales, from the weight cache
    assert [t for t in saved if t.data_ptr() not in cached] == []
    assert layer.weight.grad is None and torch.equal(xg.grad, dx_ref)
