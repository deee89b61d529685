"""Shared test setup: `gpu` tests skip without CUDA; Triton kernels run in the interpreter on CPU."""

from __future__ import annotations

import contextlib
import os

# Triton reads TRITON_INTERPRET when a kernel is first decorated/launched; set it before any kernel module
# is imported so that kernels run on CPU tensors in CI. GPU runs set TRITON_INTERPRET=0 explicitly.
os.environ.setdefault("TRITON_INTERPRET", "0" if os.environ.get("LING_TEST_GPU") == "1" else "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels.interpreter import fixed_fp8_cast, interpreter_available, lean_interpreter  # noqa: E402


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
