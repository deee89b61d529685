"""Running our Triton kernels on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1).

Why a patch: the interpreter's float32 -> float8_e4m3fn conversion (triton 3.9.0) does not carry a
rounded-up mantissa into the exponent (125.9 becomes 64 instead of 128; upstream triton issue #8322), and
its float32 -> bfloat16 conversion truncates instead of rounding to nearest even. The compiled casts on the
GPU round to nearest even exactly like torch's `.to(...)` (checked bit for bit on the H200 for e4m3), so in
tests we replace the interpreter's conversions *to* e4m3 and to bf16 with torch's casts. Everything else in
the interpreter is left alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch


def interpreter_available() -> bool:
    try:
        import triton  # noqa: F401
        from triton.runtime import interpreter  # noqa: F401
    except Exception:
        return False
    return True


@contextlib.contextmanager
def fixed_fp8_cast() -> Iterator[None]:
    """Patch the interpreter's float -> e4m3 and float32 -> bf16 conversions with torch's round-to-nearest-even
    casts."""
    import triton.language as tl
    from triton.runtime import interpreter

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
