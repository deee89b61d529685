"""`kernels.gradient_outputs`: weight gradients written into registered tensors (what `model.graphs` uses to
leave the FP8 wgrads in its gradient slab without a copy). The registry's rules (matching, handed out once,
nested blocks, other threads, cleanup on an exception); the FP8 wgrad GEMMs' `out=` (the same bits as a new
tensor, the Triton kernels in the interpreter and on the GPU); and through autograd, the FP8Linear and grouped
experts' weight gradients land in the registered tensors with the bits they have without one, a weight used twice
included."""

from __future__ import annotations

import threading

import pytest
import torch

from fp8.gemm import fp8_gemm_wgrad
from fp8.grouped import fp8_grouped_experts, grouped_gemm_wgrad, quantize_expert_weights, quantize_tokens_grouped
from fp8.linear import FP8Linear
from fp8.quant import quantize_1x128_transposed
from kernels.gradient_outputs import GRADIENT_OUTPUTS
from model.dispatch import plan_dispatch
from tests.helpers import DEVICES, data_rows, layout, setup_device

CPU = torch.device("cpu")


def test_a_registered_output_is_handed_out_once_and_only_when_it_matches():
    out, other = torch.empty(4, 8), torch.empty(4, 8)
    assert GRADIENT_OUTPUTS.get(1, (4, 8), torch.float32, CPU) is None  # no block open
    with GRADIENT_OUTPUTS.into({1: out, 2: other.t()}):
        assert GRADIENT_OUTPUTS.get(3, (4, 8), torch.float32, CPU) is None  # not registered
        assert GRADIENT_OUTPUTS.get(1, (8, 4), torch.float32, CPU) is None  # another shape
        assert GRADIENT_OUTPUTS.get(1, (4, 8), torch.bfloat16, CPU) is None  # another dtype
        assert GRADIENT_OUTPUTS.get(2, (8, 4), torch.float32, CPU) is None  # not contiguous
        assert GRADIENT_OUTPUTS.get(1, (4, 8), torch.float32, CPU) is out
        assert GRADIENT_OUTPUTS.get(1, (4, 8), torch.float32, CPU) is None  # handed out once
    with GRADIENT_OUTPUTS.into({1: out}):
        with GRADIENT_OUTPUTS.into({1: other}):
            assert GRADIENT_OUTPUTS.get(1, (4, 8), torch.float32, CPU) is other  # the innermost first
        assert GRADIENT_OUTPUTS.get(1, (4, 8), torch.float32, CPU) is out  # the outer block again
    assert GRADIENT_OUTPUTS.get(1, (4, 8), torch.float32, CPU) is None


def test_a_block_holds_in_other_threads_and_closes_on_an_exception():
    out, seen = torch.empty(2, 2), []
    with pytest.raises(RuntimeError, match="boom"):
        with GRADIENT_OUTPUTS.into({7: out}):
            # autograd runs a CUDA backward on its own device thread: the block must hold there
            worker = threading.Thread(target=lambda: seen.append(GRADIENT_OUTPUTS.get(7, (2, 2), out.dtype, CPU)))
            worker.start()
            worker.join()
            raise RuntimeError("boom")
    assert seen == [out]
    with GRADIENT_OUTPUTS.into({}):
        pass
    assert GRADIENT_OUTPUTS.get(7, (2, 2), out.dtype, CPU) is None


@pytest.mark.parametrize("device", DEVICES)
def test_wgrad_gemms_write_into_out_with_the_bits_of_a_new_tensor(device, request):
    """The Triton kernels (the interpreter on CPU); the reference path's `out=` is the autograd tests' below."""
    setup_device(device, request)
    torch.manual_seed(2)
    dy, x = torch.randn(256, 384, device=device), torch.randn(256, 256, device=device)
    dyt = quantize_1x128_transposed(dy)
    xt = quantize_1x128_transposed(x)
    want = fp8_gemm_wgrad(*dyt, *xt, out_dtype=torch.bfloat16, backend="triton")
    out = torch.full_like(want, float("nan"))
    assert fp8_gemm_wgrad(*dyt, *xt, out_dtype=torch.bfloat16, out=out, backend="triton") is out
    assert torch.equal(out, want)

    rows, segs = layout([0, 37, 130, 5, 0, 200], 16, device)
    a = quantize_tokens_grouped(data_rows(segs, rows.num_rows, 256, device), rows)
    b = quantize_tokens_grouped(data_rows(segs, rows.num_rows, 128, device, 3.0), rows)
    want = grouped_gemm_wgrad(*a, *b, rows, out_dtype=torch.bfloat16, backend="triton")
    out = torch.full_like(want, float("nan"))  # every element written, the empty experts' zeros included
    assert grouped_gemm_wgrad(*a, *b, rows, out_dtype=torch.bfloat16, out=out, backend="triton") is out
    assert torch.equal(out, want)


def test_a_wrong_out_is_refused_by_name():
    dyt, xt = quantize_1x128_transposed(torch.randn(128, 256)), quantize_1x128_transposed(torch.randn(128, 128))
    for bad, why in ((torch.empty(128, 256), r"\(256, 128\)"), (torch.empty(256, 128, dtype=torch.bfloat16), "float32"),
                     (torch.empty(128, 256).t(), "not contiguous")):  # fmt: skip
        with pytest.raises(ValueError, match=why):
            fp8_gemm_wgrad(*dyt, *xt, out=bad)
    rows, segs = layout([10, 0, 20], 16, "cpu")
    a = quantize_tokens_grouped(data_rows(segs, rows.num_rows, 128, "cpu"), rows)
    with pytest.raises(ValueError, match=r"\(3, 128, 128\)"):
        grouped_gemm_wgrad(*a, *a, rows, out=torch.empty(2, 128, 128))


def _experts_case(seed: int):
    g = torch.Generator().manual_seed(seed)
    t, e, h, inter = 64, 8, 256, 128
    x = torch.randn(t, h, generator=g, dtype=torch.float32)
    topk_idx = torch.randn(t, e, generator=g).topk(2, dim=-1).indices
    gates = torch.rand(t, 2, generator=g) + 0.1
    w_gu = (torch.randn(e, 2 * inter, h, generator=g) * 0.05).requires_grad_()
    w_d = (torch.randn(e, h, inter, generator=g) * 0.05).requires_grad_()
    dout = torch.randn(t, h, generator=g)
    return x, topk_idx, gates, w_gu, w_d, dout


def _experts_grads(case, outputs: dict | None):
    x, topk_idx, gates, w_gu, w_d, dout = case
    plan = plan_dispatch(topk_idx, w_gu.shape[0], 16)
    wq = (*quantize_expert_weights(w_gu.detach()), *quantize_expert_weights(w_d.detach()))
    out = fp8_grouped_experts(x, gates, w_gu, w_d, wq, plan.row_src, plan.pos, plan.rows)
    if outputs is None:
        return torch.autograd.grad(out, (w_gu, w_d), dout)
    with GRADIENT_OUTPUTS.into(outputs):
        return torch.autograd.grad(out, (w_gu, w_d), dout)


def test_expert_weight_gradients_land_in_the_registered_tensors_with_the_same_bits():
    case = _experts_case(3)
    w_gu, w_d = case[3], case[4]
    want = _experts_grads(case, None)
    slab = torch.full((w_gu.numel() + w_d.numel(),), float("nan"))
    views = slab[:w_gu.numel()].view_as(w_gu), slab[w_gu.numel():].view_as(w_d)
    got = _experts_grads(case, {w_gu.data_ptr(): views[0], w_d.data_ptr(): views[1]})
    for g, v, w in zip(got, views, want):
        assert g.data_ptr() == v.data_ptr()  # autograd hands back the kernel's output: no copy
        assert torch.equal(v, w)


def test_fp8_linear_weight_gradient_lands_in_the_registered_tensor_also_when_used_twice():
    torch.manual_seed(4)
    layer = FP8Linear(256, 128)
    x1, x2, dy = torch.randn(32, 256), torch.randn(16, 256), torch.randn(32, 128)
    (want,) = torch.autograd.grad(layer(x1), layer.weight, dy)
    out = torch.full_like(layer.weight, float("nan"))
    with GRADIENT_OUTPUTS.into({layer.weight.data_ptr(): out}):
        (got,) = torch.autograd.grad(layer(x1), layer.weight, dy)
    assert got.data_ptr() == out.data_ptr() and torch.equal(out, want)

    # twice in one backward: the second GEMM gets a new tensor and autograd sums the two
    y = torch.cat([layer(x1), layer(x2)])
    dy2 = torch.randn(48, 128)
    (want,) = torch.autograd.grad(y, layer.weight, dy2)
    out = torch.full_like(layer.weight, float("nan"))
    y = torch.cat([layer(x1), layer(x2)])
    with GRADIENT_OUTPUTS.into({layer.weight.data_ptr(): out}):
        (got,) = torch.autograd.grad(y, layer.weight, dy2)
    assert torch.equal(got, want)
