"""The two row ops of MoE dispatch and combine, in the rows' own dtype (BF16 in training): the permutation
gather `gather_rows` and the ordered gather-sum `sum_rows`, Triton kernels with their PyTorch references
(`gather_rows_ref`, `sum_rows_ref`). Used by the bf16 experts' path (model/dispatch.py) and by the FP8 experts
(fp8/grouped.py). Deterministic: every output element is written by one program, no atomics.
"""

from __future__ import annotations

import torch

from kernels.backend import HAS_TRITON, cdiv, tl, triton, use_triton

__all__ = ["gather_rows", "gather_rows_ref", "sum_rows", "sum_rows_ref"]


# ----------------------------------------------------------------------------------------------------------
# References (CPU path and tests)
# ----------------------------------------------------------------------------------------------------------
def gather_rows_ref(x: torch.Tensor, row_idx: torch.Tensor | None) -> torch.Tensor:
    """x[row_idx] with zero rows where row_idx < 0 (or x itself when row_idx is None)."""
    if row_idx is None:
        return x
    idx = row_idx.long()
    if x.shape[0] == 0:  # no source rows (an expert-parallel rank that received none): every row reads zeros
        return x.new_zeros(idx.numel(), *x.shape[1:])
    out = x[idx.clamp(min=0)]
    return out.masked_fill((idx < 0)[:, None], 0)


def sum_rows_ref(y: torch.Tensor, pos: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Reference of `sum_rows`: Σ_j y[pos[:, j]] in fp32, in slot order as the kernel sums."""
    idx = pos.long()
    acc = y[idx[:, 0]].float()
    for j in range(1, idx.shape[1]):
        acc += y[idx[:, j]].float()
    return acc.to(out_dtype or y.dtype)


# ----------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _gather_rows_kernel(
        x_ptr, idx_ptr, out_ptr, R, H, stride_xm, stride_xh, stride_om, stride_oh,
        BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        r_ok = rows < R
        h_ok = (cols < H)[None, :]
        src = tl.load(idx_ptr + rows, mask=r_ok, other=-1)
        v = tl.load(x_ptr + src[:, None] * stride_xm + cols[None, :] * stride_xh, mask=(src >= 0)[:, None] & h_ok,
                    other=0.0)  # fmt: skip
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_oh, v, mask=r_ok[:, None] & h_ok)

    @triton.jit
    def _sum_rows_kernel(
        y_ptr, pos_ptr, out_ptr, T, H, stride_ym, stride_yh, stride_ot, stride_oh,
        TOPK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    ):  # fmt: skip
        """out[t] = Σ_j y[pos[t, j]] summed in fp32 in slot order (deterministic)."""
        toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = (toks < T)[:, None] & (cols < H)[None, :]
        acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
        for j in tl.static_range(TOPK):
            r = tl.load(pos_ptr + toks * TOPK + j, mask=toks < T, other=0)
            acc += tl.load(y_ptr + r[:, None].to(tl.int64) * stride_ym + cols[None, :] * stride_yh, mask=mask,
                           other=0.0).to(tl.float32)  # fmt: skip
        tl.store(out_ptr + toks[:, None] * stride_ot + cols[None, :] * stride_oh, acc.to(out_ptr.dtype.element_ty),
                 mask=mask)  # fmt: skip


# ----------------------------------------------------------------------------------------------------------
# Public ops (Triton on CUDA tensors, reference otherwise)
# ----------------------------------------------------------------------------------------------------------
def gather_rows(x: torch.Tensor, row_idx: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """out [M, H] = x[row_idx] with zero rows where row_idx < 0 (the dispatch permutation)."""
    if not use_triton(x, backend):
        return gather_rows_ref(x, row_idx)
    r, h = row_idx.shape[0], x.shape[1]
    out = torch.empty(r, h, device=x.device, dtype=x.dtype)
    if r and h:
        _gather_rows_kernel[(cdiv(r, 32), cdiv(h, 256))](
            x, row_idx, out, r, h, x.stride(0), x.stride(1), out.stride(0), out.stride(1), BLOCK_R=32, BLOCK_H=256,
        )  # fmt: skip
    return out


def sum_rows(y: torch.Tensor, pos: torch.Tensor, out_dtype: torch.dtype | None = None, *,
             backend: str | None = None) -> torch.Tensor:  # fmt: skip
    """out [T, H] = Σ_j y[pos[t, j]] (pos int32 [T, k]), summed in fp32 in slot order, cast to out_dtype (the
    combine; also the adjoint of `gather_rows`). Deterministic: no atomics."""
    out_dtype = out_dtype or y.dtype
    if not use_triton(y, backend):
        return sum_rows_ref(y, pos, out_dtype)
    t, k = pos.shape
    h = y.shape[1]
    out = torch.empty(t, h, device=y.device, dtype=out_dtype)
    if t and h:
        pos = pos.contiguous()
        _sum_rows_kernel[(cdiv(t, 16), cdiv(h, 256))](
            y, pos, out, t, h, y.stride(0), y.stride(1), out.stride(0), out.stride(1), TOPK=k, BLOCK_T=16,
            BLOCK_H=256,
        )  # fmt: skip
    return out
