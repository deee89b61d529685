"""fp32 gradient accumulation: `accumulate_(acc, grad)` adds a micro-batch's gradient (bf16, fp16 or fp32) into
its fp32 sum in place, one vectorised pass over both (10 bytes a value for a bf16 gradient), with its PyTorch
reference `accumulate_ref_`.

Why a kernel: PyTorch's mixed-dtype in-place add (`acc.add_(bf16_grad)`) runs its unvectorised elementwise
kernel, one 2-byte and one 4-byte load per value, at about 2.7 TB/s on the H200 (docs/benchmarks.md, "DeepSpeed's
gradient path"); this one loads 16-byte vectors. The sum is the same bits: bf16/fp16 → fp32 is exact, and both
round acc + grad once to nearest (NaN and Inf as IEEE addition gives them, −0 + +0 = +0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.backend import HAS_TRITON, tl, triton, use_triton
from kernels.tuning import Tuning

__all__ = ["ACCUMULATE_TUNING", "AccumulateConfig", "accumulate_", "accumulate_ref_"]

GRADIENT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def accumulate_ref_(acc: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Reference of `accumulate_`: PyTorch's in-place add, the gradient converted inside the op."""
    return acc.add_(grad.reshape(acc.shape))


if HAS_TRITON:

    @triton.jit
    def _accumulate_kernel(acc_ptr, grad_ptr, n, BLOCK: tl.constexpr, EVEN: tl.constexpr):
        """acc[i] += float(grad[i]) for the BLOCK values of this program (flat, contiguous). EVEN: every program's
        block is whole (no mask), so the loads are 16-byte vectors wherever the pointers are 16-byte aligned; a mask
        that Triton cannot prove constant over 16 values (n not a multiple of 16) makes them scalar."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        if EVEN:
            tl.store(acc_ptr + offs, tl.load(acc_ptr + offs) + tl.load(grad_ptr + offs).to(tl.float32))
        else:
            mask = offs < n
            acc = tl.load(acc_ptr + offs, mask=mask)
            grad = tl.load(grad_ptr + offs, mask=mask).to(tl.float32)
            tl.store(acc_ptr + offs, acc + grad, mask=mask)


@dataclass(frozen=True)
class AccumulateConfig:
    """Values per program and warps of `accumulate_` (16 values a thread: two 16-byte loads of a bf16 gradient,
    four of the fp32 sum)."""

    block: int = 2048
    num_warps: int = 4


ACCUMULATE_TUNING: Tuning[AccumulateConfig] = Tuning("kernels.grad_accum", AccumulateConfig())


def accumulate_(acc: torch.Tensor, grad: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """acc += grad, in place; returns acc.

    acc: fp32, any shape; grad: bf16, fp16 or fp32 with acc's number of elements (any shape: a flat view of the
    same values, as DeepSpeed's flat fp32 gradient partitions hold them). The Triton kernel runs on CUDA when both
    are contiguous; otherwise, and on CPU, PyTorch's add (the same bits)."""
    if acc.dtype != torch.float32:
        raise TypeError(f"accumulate_: the sum must be float32, got {acc.dtype}")
    if grad.dtype not in GRADIENT_DTYPES:
        raise TypeError(f"accumulate_: the gradient must be one of {GRADIENT_DTYPES}, got {grad.dtype}")
    if grad.numel() != acc.numel():
        raise ValueError(f"accumulate_: gradient {tuple(grad.shape)} ({grad.numel()} values) does not fit the "
                         f"sum {tuple(acc.shape)} ({acc.numel()} values)")
    if grad.device != acc.device:
        raise ValueError(f"accumulate_: gradient on {grad.device}, sum on {acc.device}")
    if not (use_triton(acc, backend) and acc.is_contiguous() and grad.is_contiguous()):
        return accumulate_ref_(acc, grad)
    n = acc.numel()
    cfg = ACCUMULATE_TUNING.current()
    block, warps = cfg.block, cfg.num_warps
    whole = n // block * block
    if whole:  # the whole blocks, unmasked
        _accumulate_kernel[(whole // block,)](acc, grad, whole, BLOCK=block, EVEN=True, num_warps=warps)
    if n > whole:  # the last partial block, masked (a view from its first value on)
        acc_tail, grad_tail = acc.view(-1)[whole:], grad.reshape(-1)[whole:]
        _accumulate_kernel[(1,)](acc_tail, grad_tail, n - whole, BLOCK=block, EVEN=False, num_warps=warps)
    return acc
