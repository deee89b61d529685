"""The quantizers' division by a scale (`fp8.triton_blocks.divide_by_scale`: one reciprocal per scale and Markstein's
correction per value) gives IEEE division's bits, fp32 to fp32, on the quantizers' whole domain: every bf16 value
and random fp32 values up to 448 times the scale, over scales of every exponent the quantizers make, the
significands that strain a reciprocal (all ones, one less, powers of two) included, and the special cases (a zero
residual with -0, Inf and NaN scales). The reference is PyTorch's fp32 division of two tensors on the CPU (IEEE,
correctly rounded). On CPU the kernel runs in Triton's interpreter (its fma rounds once, as the GPU's does); the GPU
variant sweeps all bf16 values against 2,048 scales. The scale itself (`scale_from_amax_tl`: amax / 448 by the same
correction with a constant reciprocal) is checked against `fp8.quant.scale_from_amax` on every fp32 significand."""

from __future__ import annotations

import pytest
import torch

from fp8.quant import scale_from_amax
from kernels.backend import HAS_TRITON, tl, triton
from tests.helpers import DEVICES, setup_device

if HAS_TRITON:
    from fp8.triton_blocks import divide_by_scale, scale_from_amax_tl

    @triton.jit
    def _divide_kernel(v_ptr, s_ptr, out_ptr, N, S, BLOCK: tl.constexpr):
        """out[s, n] = divide_by_scale(v[n], scale[s]) for v [N], scale [S]; one program per (scale, BLOCK values)."""
        row = tl.program_id(1)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < N
        v = tl.load(v_ptr + offs, mask=ok, other=0.0)
        s = tl.load(s_ptr + row)
        q = divide_by_scale(v, s, tl.math.div_rn(1.0, s))
        tl.store(out_ptr + row.to(tl.int64) * N + offs, q, mask=ok)


    @triton.jit
    def _scale_kernel(a_ptr, out_ptr, N, BLOCK: tl.constexpr):
        """out[n] = scale_from_amax_tl(a[n]) (no power-of-two rounding)."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < N
        tl.store(out_ptr + offs, scale_from_amax_tl(tl.load(a_ptr + offs, mask=ok, other=0.0), False), mask=ok)


def _divide(v: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[S, N] fp32 quotients of every value by every scale, through the kernel."""
    out = torch.empty(scales.numel(), v.numel(), device=v.device, dtype=torch.float32)
    _divide_kernel[(triton.cdiv(v.numel(), 1024), scales.numel())](v, scales, out, v.numel(), scales.numel(),
                                                                   BLOCK=1024)  # fmt: skip
    return out


def _scales(count: int, generator: torch.Generator) -> torch.Tensor:
    """Positive fp32 scales with exponents from the floor's (1e-12) up to 2^20: a quarter with an all-ones
    significand, a quarter with all ones but the last bit, a few powers of two and 1e-12, the rest random."""
    exps = torch.randint(127 - 40, 127 + 20, (count,), generator=generator)
    mant = torch.randint(0, 1 << 23, (count,), generator=generator)
    mant[: count // 4] = (1 << 23) - 1
    mant[count // 4 : count // 2] = (1 << 23) - 2
    mant[count // 2 : count // 2 + 4] = 0
    bits = (exps << 23) | mant
    scales = bits.to(torch.int32).view(torch.float32)
    scales[-1] = 1e-12
    return scales


def _bf16_values() -> torch.Tensor:
    """Every finite bf16 value (both zeros and the subnormals included) as fp32."""
    v = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    return v[torch.isfinite(v)]


def _same_quotients(got: torch.Tensor, want: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Where got and want (quotients of v) agree: the same fp32 bits, or, for |v| < 2^-100, the same E4M3 code. The
    residual v - q·scale is about 2^-24·|v|: for |v| < 2^-101 it falls below fp32's normal range and rounds, and the
    corrected quotient may miss by an ulp. In a quantizer such a v gives a quotient below 2^-100 / 1e-12 < 2^-60 (the
    scales are >= 1e-12), which E4M3 rounds to a signed zero either way (its smallest value is 2^-9)."""
    same = got.view(torch.int32) == want.view(torch.int32)
    tiny = v.abs() < 2.0**-100
    codes = got.to(torch.float8_e4m3fn).view(torch.uint8) == want.to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(tiny, codes, same)


def _assert_ieee(v: torch.Tensor, scales: torch.Tensor, got: torch.Tensor) -> None:
    """got [S, N] equals fp32 v / scale wherever |v| <= 448·scale·(1 + 2^-22) (the quantizers' domain: scale =
    RN(amax / 448) and |v| <= amax)."""
    v, scales, got = v.cpu(), scales.cpu(), got.cpu()
    for i in range(0, scales.numel(), 64):  # chunks of scales keep the CPU reference's memory small
        s = scales[i : i + 64, None]
        want = v[None, :] / s
        inside = v.abs()[None, :] <= s * (448 * (1 + 2**-22))
        differ = ~_same_quotients(got[i : i + 64], want, v[None, :].expand_as(want)) & inside
        if differ.any():
            r, c = differ.nonzero()[0].tolist()
            pytest.fail(f"{int(differ.sum())} quotients differ; first: {v[c].item()!r} / {s[r, 0].item()!r} = "
                        f"{want[r, c].item()!r}, kernel {got[i + r, c].item()!r}")  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
def test_every_bf16_value_divides_as_ieee(device, request):
    setup_device(device, request)
    generator = torch.Generator().manual_seed(0)
    scales = _scales(2048 if device == "cuda" else 12, generator)
    v = _bf16_values()
    _assert_ieee(v, scales, _divide(v.to(device), scales.to(device)))


@pytest.mark.parametrize("device", DEVICES)
def test_random_fp32_values_divide_as_ieee(device, request):
    setup_device(device, request)
    generator = torch.Generator().manual_seed(1)
    scales = _scales(512 if device == "cuda" else 8, generator)
    count = 1 << (18 if device == "cuda" else 14)
    # |v| / scale spread over [0, 448]: uniform fp32 fractions of 448·scale, per scale, with random signs
    frac = torch.rand(count, generator=generator) * torch.where(torch.rand(count, generator=generator) < 0.5, -1, 1)
    got = torch.cat([_divide((frac * 448 * s).to(device), scales[i : i + 1].to(device))
                     for i, s in enumerate(scales.tolist())])  # fmt: skip
    for i, s in enumerate(scales.tolist()):
        _assert_ieee(frac * 448 * s, scales[i : i + 1], got[i : i + 1])


@pytest.mark.parametrize("device", DEVICES)
def test_special_cases_divide_as_ieee(device, request):
    """A zero residual keeps -0; an Inf scale (an Inf in the block) gives ±0 for finite values and NaN for Inf
    ones, a NaN scale NaN. An infinite value meets only infinite or NaN scales (its block's amax is Inf), the
    quantizers' domain: with a finite scale the kernel gives NaN where IEEE gives ±Inf, so those pairs are left out."""
    setup_device(device, request)
    v = torch.tensor([0.0, -0.0, 1.0, -3.5, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-40])
    scales = torch.tensor([1.0, 0.75, 1e-12, float("inf"), float("nan")])
    got = _divide(v.to(device), scales.to(device)).cpu()
    want = v[None, :] / scales[:, None]
    domain = ~(torch.isinf(v)[None, :] & torch.isfinite(scales)[:, None])
    got, want = torch.where(domain, got, 0.0), torch.where(domain, want, 0.0)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    finite = ~torch.isnan(want)
    assert _same_quotients(got[finite], want[finite], v[None, :].expand_as(want)[finite]).all()


@pytest.mark.parametrize("device", DEVICES)
def test_scale_is_amax_over_448_as_ieee(device, request):
    """scale_from_amax_tl gives `fp8.quant.scale_from_amax`'s bits (IEEE amax / 448 after the floor) for every fp32
    significand in two binades (the division's steps are exact under scaling by 2^k, so every binade behaves
    alike; on the GPU all 2^23 significands, on CPU a random eighth of them for the interpreter's time), for random
    amax over every exponent from the floor to the largest, and for the floor, 0, subnormals, the largest float,
    Inf and NaN."""
    setup_device(device, request)
    generator = torch.Generator().manual_seed(2)
    significands = torch.arange(1 << 23, dtype=torch.int32)
    if device == "cpu":
        significands = significands[torch.randperm(1 << 23, generator=generator)[: 1 << 20]]
    binades = torch.cat([(significands | ((127 + e) << 23)).view(torch.float32) for e in (0, 1)])
    exps = torch.randint(1, 255, (1 << 16,), generator=generator, dtype=torch.int32)
    random = ((exps << 23) | torch.randint(0, 1 << 23, (1 << 16,), generator=generator, dtype=torch.int32))
    special = torch.tensor([4.48e-10, 4.47e-10, 0.0, 1e-40, 3.4028234663852886e38, float("inf"), float("nan")])
    amax = torch.cat([binades, random.view(torch.float32), special])
    got = torch.empty_like(amax, device=device)
    _scale_kernel[(triton.cdiv(amax.numel(), 4096),)](amax.to(device), got, amax.numel(), BLOCK=4096)
    want = scale_from_amax(amax)
    got = got.cpu()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    differ = (got.view(torch.int32) != want.view(torch.int32)) & ~torch.isnan(want)
    assert not differ.any(), f"{int(differ.sum())} scales differ; first amax {amax[differ][0].item()!r}"
