"""The blockwise E4M3 format of the GEMM operands: the dtype, its largest value, the 128 block, the amax floor
of a block's scale, and the layout of 1x128 scales. (FP8 Adam's moment blocks have their own floor and block
size: fp8/adam.py.)"""

from __future__ import annotations

import torch

__all__ = ["BLOCK", "E4M3", "E4M3_MAX", "OPERAND_AMAX_FLOOR", "col_major"]

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
BLOCK = 128  # the scale block: 1x128 tiles of activations and gradients, 128x128 blocks of weights
# A GEMM operand's block amax is clamped to at least this before scale = amax / 448, so an all-zero block gets the
# finite scale 1e-12 (its values quantize to exact zeros) instead of 0 (which would give 0/0 = NaN).
OPERAND_AMAX_FLOOR = 1e-12 * E4M3_MAX


def col_major(t: torch.Tensor) -> torch.Tensor:
    """Same values, stored with the row index fastest (stride (1, rows)): the layout of our 1x128 scales."""
    return t.t().contiguous().t()
