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

from fp8.quant import quantize_1x128

__all__ = ["underflow", "distortion", "health_stats", "relative_error", "grouped_experts_health"]


def _sample_rows(t: torch.Tensor, max_rows: int) -> torch.Tensor:
    t = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    if t.shape[0] <= max_rows:
        return t
    idx = torch.linspace(0, t.shape[0] - 1, max_rows, device=t.device).round().long()
    return t.index_select(0, idx)


def _codes(q: torch.Tensor) -> torch.Tensor:
    """E4M3 bits as uint8 with -0 (0x80) folded into +0: equal codes <=> equal values (no NaN)."""
    c = q.view(torch.uint8)
    return torch.where((c & 0x7F) == 0, 0, c)


def underflow(x: torch.Tensor, x_fp8: torch.Tensor, max_rows: int = 1024) -> torch.Tensor:
    """Fraction of the non-zero elements of x [..., K] whose E4M3 value x_fp8 (same shape) is zero (0 when x
    has no non-zero element); a 0-dim fp32 tensor on x's device."""
    xs, qs = _sample_rows(x, max_rows), _codes(_sample_rows(x_fp8, max_rows))
    nz = xs != 0
    return (nz & (qs == 0)).sum().float() / nz.sum().clamp(min=1).float()


def _distinct_ratio(xb: torch.Tensor, qb: torch.Tensor) -> torch.Tensor:
    """Per row of xb fp32 [n, b] and its codes qb uint8 [n, b]: distinct(codes) / distinct(values). The values
    are counted on a sort, the codes (256 possible) on a presence table."""
    s, _ = torch.sort(xb, dim=-1)
    dx = (s[:, 1:] != s[:, :-1]).sum(dim=-1) + 1
    seen = torch.zeros(qb.shape[0], 256, dtype=torch.bool, device=qb.device).scatter_(1, qb.long(), True)
    return seen.sum(dim=-1).float() / dx.float()


def distortion(x: torch.Tensor, x_fp8: torch.Tensor, block: int = 128, max_rows: int = 1024) -> torch.Tensor:
    """Mean over 1x`block` blocks (along the last dim) of 1 - distinct(x_fp8 block) / distinct(x block); a 0-dim
    fp32 tensor on x's device (0 for an empty x).

    Distinct values are compared as fp32 (so +0 and -0 are one value). A tail shorter than `block` is its
    own block.
    """
    xs, qs = _sample_rows(x, max_rows).float(), _codes(_sample_rows(x_fp8, max_rows))
    k = xs.shape[-1]
    if k == 0 or xs.shape[0] == 0:
        return torch.zeros((), device=x.device)
    ratios = []
    for start in range(0, k, block * 64):  # chunks of 64 blocks bound the sort's temporary memory
        stop = min(k, start + block * 64)
        full = (stop - start) // block * block
        if full:
            ratios.append(_distinct_ratio(xs[:, start : start + full].reshape(-1, block),
                                          qs[:, start : start + full].reshape(-1, block)))
        if stop - start > full:
            ratios.append(_distinct_ratio(xs[:, start + full : stop], qs[:, start + full : stop]))
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


def grouped_experts_health(x: torch.Tensor, out: torch.Tensor, weights: tuple[torch.Tensor, ...],
                           quantized: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
    """Health of the FP8 routed experts (`fp8.grouped.fp8_grouped_experts`): act = the tokens x [T, H] along H,
    weight = gate_up [E, 2I, H] and down [E, H, I] along their K (mean of the two), and, filled in when backward
    reaches `out` [T, H], grad = d(out) along H. Each expert-sorted row is quantized 1x128 along H exactly like
    its token row (the kernels gather before they quantize), so these are the rows' statistics over tokens
    (a token routed k times counts once). The SwiGLU output and the token-dim (wgrad) operands are not covered.
    `quantized` = (gate_up codes, scales, down codes, scales) from the experts' weight caches."""
    with torch.no_grad():
        h = x.shape[-1]
        health = health_stats("act", x, quantize_1x128(x.detach().reshape(-1, h))[0])
        per_weight = [health_stats("weight", w.detach(), q) for w, q in zip(weights, quantized[::2])]
        health.update({k: (per_weight[0][k] + per_weight[1][k]) / 2 for k in per_weight[0]})
    if out.requires_grad:
        out.register_hook(lambda g: health.update(health_stats("grad", g, quantize_1x128(g.reshape(-1, h))[0])))
    return health
