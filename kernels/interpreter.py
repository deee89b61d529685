"""Running the Triton kernels on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1) with the casts
the GPU makes: a patch of the interpreter, applied only inside `with fixed_fp8_cast():`.

Why: the interpreter's float32 -> float8_e4m3fn conversion does not carry a rounded-up mantissa into the
exponent (125.9 becomes 64 instead of 128; upstream triton issue #8322), and its float32 -> bfloat16 conversion
truncates instead of rounding to nearest even. The compiled casts on the GPU round to nearest even exactly like
torch's `.to(...)` (checked bit for bit on the H200 for e4m3), so the patch replaces the interpreter's
conversions *to* e4m3 and to bf16 with torch's casts and leaves everything else in the interpreter alone.

Checked on triton 3.9.0 (the CPU test environment), which has both defects and keeps its conversions in
`triton.runtime.interpreter._convert_float(input, input_dtype, output_dtype, rounding_mode)`; another version
may have fixed them or moved that function (then `fixed_fp8_cast` raises AttributeError, and the bit-exact
tests say whether a patch is still needed). Used by the test suite (tests/conftest.py, the expert-parallel
worker) and by bench/bench_fp8_adam.py's CPU dry run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

try:  # Triton is optional: without it there is no interpreter to patch
    import triton.language as tl
    from triton.runtime import interpreter
except Exception:  # pragma: no cover - depends on the environment
    tl = interpreter = None  # type: ignore[assignment]

__all__ = ["CHECKED_TRITON_VERSIONS", "fixed_fp8_cast", "interpreter_available"]

CHECKED_TRITON_VERSIONS = ("3.9.0",)


def interpreter_available() -> bool:
    """Whether Triton and its interpreter import here."""
    return interpreter is not None


@contextlib.contextmanager
def fixed_fp8_cast() -> Iterator[None]:
    """Within the block, the interpreter's float -> e4m3 and float32 -> bf16 conversions are torch's
    round-to-nearest-even casts; the interpreter's own come back on exit."""
    if interpreter is None:
        raise RuntimeError("fixed_fp8_cast: triton is not installed")
    original = interpreter._convert_float
    np_float = {32: np.float32, 16: np.float16}

    def convert(input, input_dtype, output_dtype, rounding_mode):  # noqa: A002 (interpreter's name)
        if output_dtype == tl.float8e4nv and input_dtype in (tl.float32, tl.float16, tl.bfloat16):
            if input_dtype == tl.bfloat16:
                src = torch.from_numpy(np.ascontiguousarray(input).view(np.int16)).view(torch.bfloat16)
            else:
                src = torch.from_numpy(np.ascontiguousarray(input).view(np_float[input_dtype.primitive_bitwidth]))
            out = src.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
            return out.reshape(input.shape)
        if output_dtype == tl.bfloat16 and input_dtype == tl.float32:
            src = torch.from_numpy(np.ascontiguousarray(input).view(np.float32))
            return src.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).reshape(input.shape)
        return original(input, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = convert
    try:
        yield
    finally:
        interpreter._convert_float = original
