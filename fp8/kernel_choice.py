"""`fp8.gemm_kernel`: which GEMM kernels a run's FP8 layers launch (the same bits whichever runs).

- "auto" (the default): each kernel family's own default (fp8/gemm.py, fp8/grouped.py): the Triton kernels, and on
  sm_90 GPUs the Gluon kernel for the experts' weight gradient where their token segments are short.
- "triton": the Triton kernels everywhere, no Gluon kernel at all (e.g. to rule the Gluon kernels out).
- "gluon_ws": on sm_90 GPUs, the warp-specialised Gluon kernel of fp8/gemm_sm90.py (`SM90_WARP_SPECIALIZED`: a TMA
  loader warp and two consumer warpgroups) for the dense forward and dgrad GEMMs, where it ran 1.11-1.36x the
  Triton kernel's rate; the dense wgrad and the experts' grouped GEMMs stay on their defaults, where it measured
  slower (docs/kernel_tuning.md, 2026-12-07).

Where a Gluon kernel cannot run (another GPU, CPU, operands TMA cannot read, at most `fp8.gemm.SMALL_M_ROWS` rows)
the Triton kernels do.
`gemm_kernels(name)` holds the choice for a block: the kernels' `Tuning` overrides are process-wide, so the
autograd engine's backward threads see it too (kernels/tuning.py). `train()` holds it for the whole run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from fp8.gemm import GEMM_TUNING
from fp8.gemm_sm90 import SM90_WARP_SPECIALIZED
from fp8.grouped import GROUPED_TUNING

__all__ = ["GEMM_KERNELS", "gemm_kernels"]

GEMM_KERNELS = ("auto", "triton", "gluon_ws")


@contextlib.contextmanager
def gemm_kernels(name: str) -> Iterator[None]:
    """Inside the block, the FP8 GEMMs launch the kernels `name` picks (one of GEMM_KERNELS)."""
    if name not in GEMM_KERNELS:
        raise ValueError(f"fp8.gemm_kernel={name!r} is unknown (known: {', '.join(GEMM_KERNELS)})")
    if name == "auto":
        yield
        return
    if name == "gluon_ws":
        with GEMM_TUNING.override(sm90_fprop=SM90_WARP_SPECIALIZED):
            yield
        return
    with GEMM_TUNING.override(sm90=None, sm90_fprop=None), GROUPED_TUNING.override(sm90=None, sm90_wgrad=None):
        yield
