"""Deterministic mode (`train.deterministic=true`): the same config, seed and hardware give bit-identical runs,
so that an FP8-vs-BF16 difference is FP8's own and not GPU kernel nondeterminism.

What it sets, for the duration of a run (restored afterwards):
- `CUBLAS_WORKSPACE_CONFIG=:4096:8` (cuBLAS picks its reduction order per workspace; must be set before the
  first cuBLAS call, so `ling.train.trainer.train` enters this before building anything; an explicit value other
  than the two deterministic ones is refused);
- `torch.use_deterministic_algorithms(True)` (strict: an op without a deterministic implementation raises and
  names itself). It also makes SDPA's flash and memory-efficient backward use their deterministic
  algorithms (dQ accumulated in a fixed order instead of with atomics) and leaves out cuDNN attention; it
  turns on Inductor's deterministic mode (no autotuning) for the compiled FlexAttention and loss epilogue;
  the FlexAttention Triton backward writes dQ and dK/dV from separate programs without atomics;
- cuDNN deterministic, no cuDNN benchmark autotuning.

Already deterministic without it: our FP8 kernels (no atomics: every output element is written by one
program), the MoE dispatch and combine (ordered gather-sums, model/dispatch.py, fp8/grouped.py), the router's
int64 `scatter_add_` counts (integer sums are exact in any order), seeds (python, numpy, torch, CUDA) and the
data order (seeded loader). The cost is the slower deterministic attention backward (README).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import torch

log = logging.getLogger(__name__)

CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")


@contextlib.contextmanager
def deterministic_mode(enabled: bool) -> Iterator[None]:
    """Within the block, PyTorch, cuBLAS and cuDNN use deterministic algorithms only (see the module doc)."""
    if not enabled:
        yield
        return
    given = os.environ.get(CUBLAS_ENV)
    if given is not None and given not in CUBLAS_DETERMINISTIC:
        raise ValueError(f"train.deterministic=true needs {CUBLAS_ENV} unset or one of {CUBLAS_DETERMINISTIC}, "
                         f"got {given!r}")
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    os.environ[CUBLAS_ENV] = given or CUBLAS_DETERMINISTIC[0]
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    log.info("deterministic mode: torch.use_deterministic_algorithms(True), %s=%s, cuDNN deterministic",
             CUBLAS_ENV, os.environ[CUBLAS_ENV])
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2], saved[3]
        if given is None:
            os.environ.pop(CUBLAS_ENV, None)
