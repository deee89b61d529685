"""FP8 health statistics (DESIGN.md "FP8 numerics"): underflow and distortion of a tensor and its E4M3 form,
and the relative error of an FP8 weight gradient against its high-precision recomputation.

- underflow  = (# elements that are non-zero before quantization and exactly zero after) / (# non-zero).
- distortion = 1 - (# distinct values after quantization) / (# distinct values before), per 1x128 block
  along the last dim (the quantization block of activations and gradients), averaged over the blocks.
- relative error = ||a - ref||_F / ||ref||_F.

Every statistic is a 0-dim fp32 tensor on the input's device, computed without reading anything back to the
host (no `.item()`, no data-dependent Python branch), so a layer can collect them during its forward and
backward and the caller reads all layers' values at once (`fp8.monitor.FP8Monitor`: one host sync per sampled
step). Underflow and distortion look at most `max_rows` evenly spaced rows (sampling keeps them cheap on
[16384, 5120] tensors) and never touch the training numerics: they only read tensors the layer already has.
"""

from __future__ import annotations

import torch

__all__ = ["underflow", "distortion", "health_stats", "relative_error"]


def _sample_rows(t: torch.Tensor, max_rows: int) -> torch.Tensor:
    t = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    if t.shape[0] <= max_rows:
        return t
    idx = torch.linspace(0, t.shape[0] - 1, max_rows, device=t.device).round().long()
    return t.index_select(0, idx)


def underflow(x: torch.Tensor, x_fp8: torch.Tensor, max_rows: int = 1024) -> torch.Tensor:
    """Fraction of the non-zero elements of x [..., K] whose E4M3 value x_fp8 (same shape) is zero (0 when x
    has no non-zero element); a 0-dim fp32 tensor on x's device."""
    xs, qs = _sample_rows(x, max_rows), _sample_rows(x_fp8, max_rows)
    nz = xs != 0
    return (nz & (qs.float() == 0)).sum().float() / nz.sum().clamp(min=1).float()


def _distinct_per_row(v: torch.Tensor) -> torch.Tensor:
    s, _ = torch.sort(v, dim=-1)
    return (s[:, 1:] != s[:, :-1]).sum(dim=-1) + 1


def distortion(x: torch.Tensor, x_fp8: torch.Tensor, block: int = 128, max_rows: int = 1024) -> torch.Tensor:
    """Mean over 1x`block` blocks (along the last dim) of 1 - distinct(x_fp8 block) / distinct(x block); a 0-dim
    fp32 tensor on x's device (0 for an empty x).

    Distinct values are compared as fp32 (so +0 and -0 are one value). A tail shorter than `block` is its
    own block.
    """
    xs, qs = _sample_rows(x, max_rows).float(), _sample_rows(x_fp8, max_rows).float()
    k = xs.shape[-1]
    if k == 0 or xs.shape[0] == 0:
        return torch.zeros((), device=x.device)
    ratios = []
    for start in range(0, k, block * 64):  # chunks of 64 blocks bound the sort's temporary memory
        stop = min(k, start + block * 64)
        full = (stop - start) // block * block
        parts = []
        if full:
            parts.append(
                (xs[:, start : start + full].reshape(-1, block), qs[:, start : start + full].reshape(-1, block))
            )
        if stop - start > full:
            parts.append((xs[:, start + full : stop], qs[:, start + full : stop]))
        for xb, qb in parts:
            ratios.append(_distinct_per_row(qb).float() / _distinct_per_row(xb).float())
    return 1.0 - torch.cat(ratios).mean()


def health_stats(prefix: str, x: torch.Tensor, x_fp8: torch.Tensor, max_rows: int = 1024) -> dict[str, torch.Tensor]:
    """{f"{prefix}_underflow", f"{prefix}_distortion"} (0-dim device tensors) for x [..., K] quantized along its
    last dim."""
    with torch.no_grad():
        return {
            f"{prefix}_underflow": underflow(x, x_fp8, max_rows=max_rows),
            f"{prefix}_distortion": distortion(x, x_fp8, max_rows=max_rows),
        }


def relative_error(a: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """||a - ref||_F / ||ref||_F in fp32 (0-dim tensor on ref's device; 0 if both are zero, inf if only ref is)."""
    with torch.no_grad():
        a32, r32 = a.float(), ref.float()
        return (a32 - r32).norm() / r32.norm().clamp(min=torch.finfo(torch.float32).tiny)
