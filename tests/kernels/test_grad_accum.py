"""`kernels.grad_accum.accumulate_`: the fp32 gradient accumulation kernel gives PyTorch's in-place add's bits
(one rounding of acc + grad), on fresh random sums and gradients of every gradient dtype, at sizes that fill no
block and several blocks, with signed zeros, infinities and NaN; bad input names the problem."""

from __future__ import annotations

import pytest
import torch

from kernels.grad_accum import ACCUMULATE_TUNING, accumulate_, accumulate_ref_
from tests.helpers import DEVICES, setup_device


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """fp32 bit equality, except that any NaN equals any NaN (IEEE leaves the payload of a sum with NaN open)."""
    a, b = a.cpu().reshape(-1), b.cpu().reshape(-1)
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    return torch.equal(nan_a, nan_b) and torch.equal(a.view(torch.int32)[~nan_a], b.view(torch.int32)[~nan_b])


def random_pair(n: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # magnitudes over many binades, so that the sums round (the low bits of acc and grad do not line up)
    acc = torch.randn(n, generator=g) * torch.exp2(torch.randint(-20, 20, (n,), generator=g).float())
    grad = (torch.randn(n, generator=g) * torch.exp2(torch.randint(-20, 20, (n,), generator=g).float())).to(dtype)
    return acc, grad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n", [1, 511, 2048, 5000])
def test_kernel_adds_as_pytorch(device, dtype, n, request):
    setup_device(device, request)
    acc, grad = random_pair(n, dtype, seed=n)
    want = accumulate_ref_(acc.clone(), grad)
    got = acc.clone().to(device)
    with ACCUMULATE_TUNING.override(block=1024):  # several programs and a partial last one at n = 5000
        out = accumulate_(got, grad.to(device).view(-1, 1), backend="triton")  # any shape of the same values
    assert out is got
    assert n == 1 or not torch.equal(want, acc)  # the sums moved
    assert same_bits(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_signed_zeros_infinities_and_nan(device, request):
    setup_device(device, request)
    inf, nan = float("inf"), float("nan")
    acc = torch.tensor([0.0, -0.0, -0.0, 0.0, inf, inf, -inf, nan, 1.0, 3.4e38, 1.0, -0.0])
    grad = torch.tensor([-0.0, 0.0, -0.0, 0.0, -inf, 1.0, -inf, 1.0, nan, 3.4e38, -1.0, 5.0]).to(torch.bfloat16)
    want = accumulate_ref_(acc.clone(), grad)
    got = accumulate_(acc.to(device), grad.to(device), backend="triton")
    assert same_bits(got, want)
    # −0 + +0 = +0, −0 + −0 = −0, Inf − Inf = NaN, overflow to Inf, 1 − 1 = +0
    assert torch.ones(4).copysign(got.cpu()[[0, 1, 2, 10]]).tolist() == [1.0, 1.0, -1.0, 1.0]
    assert torch.isnan(got.cpu()[[4, 7, 8]]).all() and got.cpu()[9] == inf


def test_non_contiguous_operands_take_pytorch_add():
    acc, grad = random_pair(64, torch.bfloat16, seed=3)
    acc2 = torch.zeros(64, 2)[:, 0].copy_(acc)  # a strided view of the sum
    want = accumulate_ref_(acc.clone(), grad)
    assert same_bits(accumulate_(acc2, grad, backend="triton"), want)


def test_bad_input_names_the_problem():
    with pytest.raises(TypeError, match="sum must be float32, got torch.bfloat16"):
        accumulate_(torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4))
    with pytest.raises(TypeError, match="gradient must be one of"):
        accumulate_(torch.zeros(4), torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"gradient \(2, 3\) \(6 values\) does not fit the sum \(4,\)"):
        accumulate_(torch.zeros(4), torch.zeros(2, 3))


@pytest.mark.gpu
def test_compiled_kernel_on_a_large_gradient():
    acc, grad = random_pair((1 << 22) + 7, torch.bfloat16, seed=9)  # default launch, a partial last program
    acc, grad = acc.cuda(), grad.cuda()
    want = acc.clone().add_(grad)  # PyTorch's CUDA mixed-dtype add
    assert same_bits(accumulate_(acc, grad), want)
