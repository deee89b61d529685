"""The LM-head loss's chunk epilogue: one chunk's per-row cross-entropy and logit gradient from its logits,
`cross_entropy_grad` (two Triton kernels) with its PyTorch reference `cross_entropy_grad_ref`.

    nll[r]     = logsumexp(z[r]) − z[r, target[r]]                       fp32
    grad[r, v] = w[r] · (softmax(z[r])[v] − [v == target[r]])            in the logits' dtype

z = the logits in fp32, w = the row's weight in the loss (1/count, or 0 for an ignored row). The logits are read
twice and the gradient written once, in column splits that fill the GPU whatever the chunk's row count:
  1. `_row_split_stats_kernel`: each (row, split) program's max and Σ exp(z − max) over its columns;
  2. `_row_split_grad_kernel`: each program combines its row's split statistics (a few floats) into the row's
     max and sum, then writes its columns' gradient; the row's first split also writes nll.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.backend import HAS_TRITON, cdiv, tl, triton, use_triton
from kernels.tuning import Tuning

__all__ = ["CROSS_ENTROPY_TUNING", "CrossEntropyConfig", "cross_entropy_grad", "cross_entropy_grad_ref"]

LOGIT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def cross_entropy_grad_ref(logits: torch.Tensor, target: torch.Tensor,
                           row_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of `cross_entropy_grad`: logits [c, V], target int64 [c] (a valid class for every row),
    row_weight fp32 [c] → (nll fp32 [c], grad [c, V] in the logits' dtype), fp32 throughout, in place on one fp32
    copy of the logits."""
    z = logits.to(torch.float32, copy=True)
    z.sub_(z.amax(dim=-1, keepdim=True))
    z_target = z.gather(1, target[:, None])
    z.exp_()
    sum_exp = z.sum(dim=-1, keepdim=True)
    nll = (sum_exp.log() - z_target).squeeze(1)
    z.mul_(row_weight[:, None] / sum_exp)
    z.scatter_add_(1, target[:, None], -row_weight[:, None])
    return nll, z.to(logits.dtype)


if HAS_TRITON:

    @triton.jit
    def _row_split_stats_kernel(z_ptr, max_ptr, sum_ptr, V, stride_zr, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
        """(row, split) program: max and Σ exp(z − max) of the row's columns [split·SPLIT, (split+1)·SPLIT) ∩ [0, V),
        online over BLOCK-wide steps (one exp per logit: each step's own max first). Stored at [row, split] of
        [rows, splits]."""
        row = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1)
        splits = tl.num_programs(1)
        start = split * SPLIT
        z_row = z_ptr + row * stride_zr
        m = float("-inf")
        s = 0.0
        for off in tl.range(start, tl.minimum(start + SPLIT, V), BLOCK):
            cols = off + tl.arange(0, BLOCK)
            z = tl.load(z_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(z, axis=0))
            # while every logit so far is −inf, s stays 0 (exp(−inf − −inf) would be NaN)
            s = tl.where(m_new == float("-inf"), 0.0, s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0))
            m = m_new
        tl.store(max_ptr + row * splits + split, m)
        tl.store(sum_ptr + row * splits + split, s)

    @triton.jit
    def _row_split_grad_kernel(
        z_ptr, g_ptr, target_ptr, w_ptr, max_ptr, sum_ptr, nll_ptr, V, stride_zr, stride_gr,
        SPLIT: tl.constexpr, BLOCK: tl.constexpr, SPLITS_P2: tl.constexpr,
    ):  # fmt: skip
        """(row, split) program: the row's max and sum from its splits' statistics, then grad = w·(exp(z − max)/sum
        − [col == target]) over the split's columns; split 0 stores nll = log(sum) + max − z[target]."""
        row = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1)
        splits = tl.num_programs(1)
        parts = tl.arange(0, SPLITS_P2)
        part_ok = parts < splits
        m_parts = tl.load(max_ptr + row * splits + parts, mask=part_ok, other=float("-inf"))
        s_parts = tl.load(sum_ptr + row * splits + parts, mask=part_ok, other=0.0)
        m = tl.max(m_parts, axis=0)
        total = tl.sum(tl.where(m_parts == float("-inf"), 0.0, s_parts * tl.exp(m_parts - m)), axis=0)
        target = tl.load(target_ptr + row)
        w = tl.load(w_ptr + row)
        z_row = z_ptr + row * stride_zr
        if split == 0:
            z_target = tl.load(z_row + target).to(tl.float32)
            tl.store(nll_ptr + row, tl.log(total) + m - z_target)
        scale = w / total
        start = split * SPLIT
        for off in tl.range(start, tl.minimum(start + SPLIT, V), BLOCK):
            cols = off + tl.arange(0, BLOCK)
            ok = cols < V
            z = tl.load(z_row + cols, mask=ok, other=0.0).to(tl.float32)
            grad = tl.exp(z - m) * scale - tl.where(cols == target, w, 0.0)
            tl.store(g_ptr + row * stride_gr + cols, grad.to(g_ptr.dtype.element_ty), mask=ok)


@dataclass(frozen=True)
class CrossEntropyConfig:
    """Columns per (row, split) program (`split`, a multiple of `block`), columns per step of its loop (`block`)
    and warps, for both kernels. The default: within 1.5 % of the fastest of eight launches at the e64 LM head's
    chunk on an H100 (docs/kernel_tuning.md, 2026-12-06)."""

    split: int = 16384
    block: int = 2048
    num_warps: int = 4

    def __post_init__(self) -> None:
        if self.block < 1 or self.split % self.block:
            raise ValueError(f"CrossEntropyConfig: split={self.split} must be a multiple of block={self.block}")


CROSS_ENTROPY_TUNING: Tuning[CrossEntropyConfig] = Tuning(
    "kernels.cross_entropy",
    CrossEntropyConfig(),
    interpreter=CrossEntropyConfig(split=256, block=64, num_warps=1),  # several splits on the tests' small rows
)


def cross_entropy_grad(logits: torch.Tensor, target: torch.Tensor, row_weight: torch.Tensor, *,
                       backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's loss and logit gradient: logits [c, V] (bf16, fp16 or fp32, unit column stride), target int64
    [c] (a valid class for every row), row_weight fp32 [c] (the row's factor in the loss: 1/count, or 0 for an
    ignored row) → (nll fp32 [c] = logsumexp − target logit, grad [c, V] in the logits' dtype = row_weight ·
    (softmax − onehot)). fp32 maths; the Triton kernels on CUDA, the reference elsewhere."""
    if logits.dim() != 2 or logits.dtype not in LOGIT_DTYPES:
        raise ValueError(f"cross_entropy_grad: logits must be [c, V] in one of {LOGIT_DTYPES}, got "
                         f"{tuple(logits.shape)} {logits.dtype}")
    c, vocab = logits.shape
    if target.shape != (c,) or target.dtype != torch.int64:
        raise ValueError(f"cross_entropy_grad: target must be int64 [{c}], got {target.dtype} {tuple(target.shape)}")
    if row_weight.shape != (c,) or row_weight.dtype != torch.float32:
        raise ValueError(f"cross_entropy_grad: row_weight must be float32 [{c}], got {row_weight.dtype} "
                         f"{tuple(row_weight.shape)}")
    if vocab == 0:
        raise ValueError("cross_entropy_grad: logits have no columns")
    if not use_triton(logits, backend):
        return cross_entropy_grad_ref(logits, target, row_weight)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    nll = torch.empty(c, device=logits.device, dtype=torch.float32)
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    if c == 0:
        return nll, grad
    cfg = CROSS_ENTROPY_TUNING.current()  # split a multiple of block: checked by CrossEntropyConfig
    splits = cdiv(vocab, cfg.split)
    row_max = torch.empty(c, splits, device=logits.device, dtype=torch.float32)
    row_sum = torch.empty_like(row_max)
    target, row_weight = target.contiguous(), row_weight.contiguous()
    grid = (c, splits)
    _row_split_stats_kernel[grid](logits, row_max, row_sum, vocab, logits.stride(0), SPLIT=cfg.split,
                                  BLOCK=cfg.block, num_warps=cfg.num_warps)  # fmt: skip
    _row_split_grad_kernel[grid](
        logits, grad, target, row_weight, row_max, row_sum, nll, vocab, logits.stride(0), grad.stride(0),
        SPLIT=cfg.split, BLOCK=cfg.block, SPLITS_P2=triton.next_power_of_2(splits), num_warps=cfg.num_warps,
    )  # fmt: skip
    return nll, grad
