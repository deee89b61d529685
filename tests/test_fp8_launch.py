"""`fp8._triton_utils.CachedLaunch`: launches that skip Triton's per-call specialisation once a signature has been
compiled. On CPU against a fake JIT kernel (what reaches the compiled kernel's launcher, and when Triton is asked
instead); on the GPU every FP8 op, bit for bit against Triton's own launch path."""

from __future__ import annotations

import pytest
import torch

import fp8._triton_utils as tu


def kernel_fn(x_ptr, n, stride, BLOCK, FLAG=7):  # the signature a @triton.jit kernel would have
    pass


class FakeCompiled:
    def __init__(self, log: list) -> None:
        self.log, self.function, self.packed_metadata = log, "function", "packed"

    def launch_metadata(self, grid, stream, *values):
        return ("metadata", grid, stream)

    def run(self, *args):
        self.log.append(("fast", args))


class FakeJIT:
    """What CachedLaunch uses of a JITFunction: `fn` and `kernel[grid](*args, **kwargs)` returning the compiled kernel
    (or None, as the interpreter does)."""

    def __init__(self, returns_compiled: bool = True) -> None:
        self.fn, self.log, self.returns_compiled = kernel_fn, [], returns_compiled
        self.compiled = FakeCompiled(self.log)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append(("triton", grid, args, kwargs))
            return self.compiled if self.returns_compiled else None
        return launch


def cached(kernel: FakeJIT) -> tu.CachedLaunch:
    return tu.CachedLaunch(kernel, current_device=lambda: 0, current_stream=lambda device: f"stream{device}",
                           hooks=lambda: ("enter", "exit"))


@pytest.fixture
def cache_on(monkeypatch):
    monkeypatch.setitem(tu.LAUNCH_OPTIONS, "cached_specialization", True)


def test_a_seen_signature_goes_straight_to_the_compiled_kernel(cache_on):
    fake = FakeJIT()
    k = cached(fake)
    x = torch.zeros(64)
    k[(4,)](x, 64, 1, BLOCK=32, num_warps=4)
    assert [e[0] for e in fake.log] == ["triton"]
    y = torch.ones(64)  # another tensor of the same dtype and alignment: the same signature
    k[(5, 2)](y, 64, 1, BLOCK=32, num_warps=4)
    kind, args = fake.log[-1]
    assert kind == "fast"
    # grid padded to 3-D, the current stream, the compiled kernel's handles and metadata, the launch hooks, then every
    # parameter in signature order: positional, keyword constexpr, default (num_warps is an option, not a parameter)
    assert args[:9] == (5, 2, 1, "stream0", "function", "packed", ("metadata", (5, 2, 1), "stream0"), "enter", "exit")
    assert args[9] is y and args[10:] == (64, 1, 32, 7)


@pytest.mark.parametrize("change", ["alignment", "int value", "bool for int", "dtype", "constexpr", "option"])
def test_any_change_of_signature_asks_triton_again(cache_on, change):
    fake = FakeJIT()
    k = cached(fake)
    base = torch.zeros(64)
    k[(1,)](base, 64, 1, BLOCK=32, num_warps=4)
    call = {"alignment": lambda: k[(1,)](base[1:], 64, 1, BLOCK=32, num_warps=4),  # 4 bytes off: not 16-aligned
            "int value": lambda: k[(1,)](base, 48, 1, BLOCK=32, num_warps=4),
            "bool for int": lambda: k[(1,)](base, 64, True, BLOCK=32, num_warps=4),  # True == 1, another type
            "dtype": lambda: k[(1,)](base.double(), 64, 1, BLOCK=32, num_warps=4),
            "constexpr": lambda: k[(1,)](base, 64, 1, BLOCK=64, num_warps=4),
            "option": lambda: k[(1,)](base, 64, 1, BLOCK=32, num_warps=8)}[change]
    call()
    assert [e[0] for e in fake.log] == ["triton", "triton"]
    call()  # the new signature is now known too
    assert [e[0] for e in fake.log] == ["triton", "triton", "fast"]


def test_off_or_without_a_compiled_kernel_every_launch_is_tritons(monkeypatch):
    x = torch.zeros(64)
    fake = FakeJIT()
    k = cached(fake)
    for _ in range(3):  # the default: off
        k[(1,)](x, 64, 1, BLOCK=32)
    assert [e[0] for e in fake.log] == ["triton"] * 3 and not k.compiled
    monkeypatch.setitem(tu.LAUNCH_OPTIONS, "cached_specialization", True)
    interp = FakeJIT(returns_compiled=False)  # the interpreter returns no compiled kernel
    k = cached(interp)
    for _ in range(3):
        k[(1,)](x, 64, 1, BLOCK=32)
    assert [e[0] for e in interp.log] == ["triton"] * 3


def test_an_unhashable_argument_is_left_to_triton(cache_on):
    fake = FakeJIT()
    k = cached(fake)
    for _ in range(2):
        k[(1,)](torch.zeros(4), [1, 2], 1, BLOCK=32)
    assert [e[0] for e in fake.log] == ["triton", "triton"] and not k.compiled


def test_the_cache_restarts_past_its_limit_and_attributes_pass_through(cache_on, monkeypatch):
    monkeypatch.setattr(tu, "_CACHE_LIMIT", 3)
    fake = FakeJIT()
    k = cached(fake)
    x = torch.zeros(64)
    for n in range(5):
        k[(1,)](x, n, 1, BLOCK=32)
    assert len(k.compiled) == 2  # cleared at the 4th signature, then the 4th and 5th
    assert k.fn is kernel_fn  # the JITFunction's own attributes


def test_interpreted_kernels_are_left_alone():
    pytest.importorskip("triton")
    import fp8.quant as q

    if isinstance(q._quant_rows_kernel, tu.CachedLaunch):  # GPU runs (TRITON_INTERPRET=0): wrapped
        assert q._quant_rows_kernel.fn.__name__ == "_quant_rows_kernel"
    else:
        assert type(q._quant_rows_kernel).__name__ == "InterpretedFunction"


# ---------------------------------------------------------------------------------------------------------- GPU
def _fp8_ops_outputs(seed: int) -> list[torch.Tensor]:
    """Every FP8 op on fresh inputs (aligned and misaligned, bf16 and fp32), and an FP8 MoE + FP8Linear
    forward and backward: their outputs and gradients."""
    from fp8.gemm import fp8_gemm, fp8_gemm_wgrad
    from fp8.linear import FP8Linear
    from fp8.quant import (
        fp8_transpose_128x128,
        quantize_1x128,
        quantize_1x128_dual,
        quantize_1x128_transposed,
        quantize_128x128,
    )
    from model.config import ModelConfig
    from model.moe import MoE

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(512, 1024 + 8, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(768, 1024, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    out = [*quantize_1x128(x[:, :1024]), *quantize_1x128(x[:, 1:1025]),  # the second: a view 2 bytes off alignment
           *quantize_1x128_dual(x[:, :1024].float()), *quantize_1x128_transposed(x[:, :1024])]
    wq, ws = quantize_128x128(w)
    out += [wq, ws, *fp8_transpose_128x128(wq, ws)]
    xq, xs = quantize_1x128(x[:, :1024].contiguous())
    out.append(fp8_gemm(xq, xs, wq, ws))
    at, ats = quantize_1x128_transposed(torch.randn(512, 768, device="cuda", dtype=torch.bfloat16, generator=g))
    bt, bts = quantize_1x128_transposed(x[:, :1024].contiguous())
    out.append(fp8_gemm_wgrad(at, ats, bt, bts))

    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=256, hidden_size=256, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=128,
                      num_experts=8, num_experts_per_tok=2, num_expert_groups=2, topk_groups=1,
                      expert_intermediate_size=128, precision="fp8")
    moe = MoE(cfg).cuda().to(torch.bfloat16)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.05)
    lin = FP8Linear(256, 384).cuda().to(torch.bfloat16)
    h = torch.randn(2, 64, 256, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    y, _ = moe(h)
    (lin(y).float().square().mean()).backward()
    out += [y, h.grad, *(p.grad for p in moe.parameters() if p.grad is not None), lin.weight.grad]
    return out


@pytest.mark.gpu
def test_gpu_cached_launch_is_bit_identical(monkeypatch):
    """Triton's own launches, then the cached ones (each op three times: the first call of a signature still goes
    through Triton, the later ones do not): every output bit-identical."""
    import fp8.quant as q

    assert isinstance(q._quant_rows_kernel, tu.CachedLaunch)
    monkeypatch.setitem(tu.LAUNCH_OPTIONS, "cached_specialization", False)
    reference = _fp8_ops_outputs(seed=0)
    monkeypatch.setitem(tu.LAUNCH_OPTIONS, "cached_specialization", True)
    for _ in range(3):
        got = _fp8_ops_outputs(seed=0)
        assert len(got) == len(reference)
        for i, (a, b) in enumerate(zip(got, reference)):
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a, b.view(
                torch.uint8) if b.dtype.itemsize == 1 else b), i
    assert q._quant_rows_kernel.compiled and all(c is not False for c in q._quant_rows_kernel.compiled.values())
