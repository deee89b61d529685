"""`Fusable`: a function of tensors beside its `torch.compile` twin (used by `model/` for its elementwise chains
and by `fp8/` for the experts' SwiGLU recompute)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

__all__ = ["Fusable"]


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
