"""Small shared helpers for the FP8 Triton kernels: optional Triton import and backend selection, and `Fusable`
(a function beside its torch.compile twin, also used by `model/` for its elementwise chains).

Everything in `fp8/` must import on a machine without CUDA (and even without Triton): kernels are
defined only when Triton imports, and every public op falls back to its PyTorch reference.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch

try:  # Triton is optional at import time (CPU-only installs run the PyTorch reference path).
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the environment
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    HAS_TRITON = False

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
BLOCK = 128
# amax is clamped to at least AMAX_FLOOR before scale = amax / 448, so an all-zero block gets the finite
# scale 1e-12 (its values quantize to exact zeros) instead of 0 (which would give 0/0 = NaN).
AMAX_FLOOR = 1e-12 * E4M3_MAX


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def use_triton(t: torch.Tensor, backend: str | None) -> bool:
    """Which implementation runs: "triton" / "torch" when given, else Triton on CUDA tensors.

    The environment variable LING_FP8_BACKEND=torch forces the reference path everywhere (debugging).
    Tests run the Triton kernels on CPU tensors through the interpreter by passing backend="triton".
    """
    if backend is None:
        backend = os.environ.get("LING_FP8_BACKEND") or ("triton" if t.is_cuda else "torch")
    if backend not in ("triton", "torch"):
        raise ValueError(f"backend must be 'triton' or 'torch', got {backend!r}")
    if backend == "triton" and not HAS_TRITON:
        raise RuntimeError("backend='triton' requested but triton is not installed")
    return backend == "triton"


def col_major(t: torch.Tensor) -> torch.Tensor:
    """Same values, stored with the row index fastest (stride (1, rows)): the layout of our 1x128 scales."""
    return t.t().contiguous().t()


class Fusable:
    """A pure function of tensors and Python constants and its `torch.compile` twin (Inductor fuses its
    elementwise chains into a few kernels), built on first use and shared by every caller: one compiled graph
    per input shape serves every layer. `emulate_precision_casts`: a cast to bf16 rounds as in eager (Inductor
    would otherwise keep such an intermediate in fp32); not `fullgraph=True`, which turns hitting dynamo's
    recompile limit (eval at many shapes) into an error rather than an eager fallback — the tests check that these
    functions compile without a graph break. `dynamic`: torch.compile's (False, the default: one static graph per
    shape; None: static until a shape changes, then one dynamic graph, for inputs whose row count changes every
    call). `f(*args, compiled=False)` runs the eager function. Used as `@Fusable` or `Fusable(fn, dynamic=None)`."""

    def __init__(self, fn: Callable, dynamic: bool | None = False) -> None:
        functools.update_wrapper(self, fn)
        self.eager = fn
        self.dynamic = dynamic
        self._compiled: Callable | None = None

    def __call__(self, *args, compiled: bool = False):
        if not compiled:
            return self.eager(*args)
        if self._compiled is None:
            self._compiled = torch.compile(self.eager, dynamic=self.dynamic, options={"emulate_precision_casts": True})
        return self._compiled(*args)
