"""Shared test setup: `gpu` tests skip without CUDA; Triton kernels run in the interpreter on CPU."""

from __future__ import annotations

import contextlib
import os
import sys

# Triton reads TRITON_INTERPRET when a kernel is first decorated/launched; set it before any kernel module
# is imported so that kernels run on CPU tensors in CI. GPU runs set TRITON_INTERPRET=0 explicitly.
os.environ.setdefault("TRITON_INTERPRET", "0" if os.environ.get("LING_TEST_GPU") == "1" else "1")


def _threads_per_worker() -> int | None:
    """Under pytest-xdist, the machine's cores shared out among the workers (None outside xdist)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    return max(1, len(os.sched_getaffinity(0)) // workers) if workers > 1 else None


# xdist workers (and what they start without an OMP_NUM_THREADS of their own: torch.multiprocessing spawns, the
# benchmarks' rows) each take their share of the cores for torch's intra-op threads instead of all of them. With
# one thread per core taken by every worker, the default (a thread per core in each worker) leaves OpenMP's
# threads spinning for cores another worker holds: on the 2-core machine, two workers running the in-process
# test files (test_fp8_adam, test_profiling, test_determinism, ...) spent 336 CPU-s with the default and 178 with
# this. The values tests compute do not depend on the thread count beyond summation order (every bound in the
# tests allows for that; the train.py runs they start already use OMP_NUM_THREADS=1). A run outside xdist, or an
# OMP_NUM_THREADS set by the caller, is left as it is.
_WORKER_THREADS = _threads_per_worker() if "OMP_NUM_THREADS" not in os.environ else None
if _WORKER_THREADS is not None:
    os.environ["OMP_NUM_THREADS"] = str(_WORKER_THREADS)

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels.interpreter import fixed_fp8_cast, interpreter_available, lean_interpreter  # noqa: E402

if _WORKER_THREADS is not None:  # torch reads OMP_NUM_THREADS at import, unless a plugin imported it before this file
    torch.set_num_threads(_WORKER_THREADS)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session", autouse=True)
def _lean_interpreter():
    """With TRITON_INTERPRET=1, the whole session runs the interpreter without the work it throws away
    (kernels/interpreter.py: `lean_interpreter`; the same kernel values, about half the interpreter's time)."""
    with lean_interpreter() if os.environ.get("TRITON_INTERPRET") == "1" else contextlib.nullcontext():
        yield


@pytest.fixture
def triton_interpreter():
    """Run Triton kernels on CPU tensors with the interpreter's e4m3 cast fixed (see kernels/interpreter.py)."""
    if not interpreter_available():
        pytest.skip("triton is not installed")
    with fixed_fp8_cast():
        yield


@pytest.fixture(scope="module", autouse=True)
def _fresh_compile_caches():
    """Every test file starts with dynamo's caches empty. The model's compiled functions (kernels/fusable.py) are
    shared by every caller in a process, one graph per shape and grad mode, and dynamo compiles at most 8 per
    function (its recompile limit) before running a new shape eagerly; an xdist worker that ran other files' models
    first could otherwise test the eager fallback in place of the compiled ops (docs/benchmarks.md, the GPU suite
    of 2026-12-05 night). Without torch._dynamo imported nothing was compiled and there is nothing to reset."""
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
    yield
