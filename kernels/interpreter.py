"""Running the Triton kernels on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1): the patches of the
interpreter, each applied only inside its `with` block.

- `fixed_fp8_cast()`: the casts the GPU makes (a correctness patch, below).
- `lean_interpreter()`: the interpreter without work whose result it throws away (a speed patch: no value a
  kernel computes changes; on a Triton version it was not checked on it patches nothing).

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

`lean_interpreter` removes two costs of the interpreter (triton 3.9.0), about half of its time in the FP8 kernel
tests, by patching `interpreter.interpreter_builder.options`, `interpreter._patch_lang` and
`interpreter.GridExecutor.__call__`:
- Every integer +, -, * of a kernel builds an int64 overflow check (`binary_op_sanitize_overflow_impl`: two casts,
  the op again, two compares, an and) and hands it to `device_assert`, which drops it unless the options' `debug`
  is on; the interpreter's options never turn `debug` on. With `debug` off, `sanitize_overflow` is turned off: the
  compiled kernels with debug off drop the same checks as dead code, so no check that could fire is lost.
- `triton.language` (every builtin of tl, tl.core, tl.tensor, tl.math) is patched when a kernel launches, and
  again on every call of a `@triton.jit` helper inside the kernel, per program. Inside a launch the language is
  already patched (a patched member is no longer a builtin, so a repeat finds only what is in place, and a
  helper's patch is never restored before the launch ends): a helper's call skips the repeat when the launch, or
  a helper earlier in it, already patched every language module the helper sees.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Iterator

import numpy as np
import torch

try:  # Triton is optional: without it there is no interpreter to patch
    import triton
    import triton.language as tl
    from triton.runtime import interpreter
except Exception:  # pragma: no cover - depends on the environment
    triton = tl = interpreter = None  # type: ignore[assignment]

__all__ = ["CHECKED_TRITON_VERSIONS", "fixed_fp8_cast", "interpreter_available", "lean_interpreter"]

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


@contextlib.contextmanager
def lean_interpreter() -> Iterator[bool]:
    """Within the block, the interpreter skips the overflow checks it would drop and re-patches the language once
    per launch (module docstring); the interpreter's own behaviour comes back on exit. Yields whether it patched:
    False without Triton or on a version not in CHECKED_TRITON_VERSIONS (a speed-up only, so nothing is lost)."""
    if interpreter is None or triton.__version__ not in CHECKED_TRITON_VERSIONS:
        yield False
        return
    builder = interpreter.interpreter_builder
    original_options = builder.options
    original_patch, original_call = interpreter._patch_lang, interpreter.GridExecutor.__call__
    launch: dict[str, object] = {"inside": False, "patched": frozenset()}  # the launch's patched language modules

    def seen_langs(fn) -> frozenset[int]:
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))

    def patch_lang(fn):
        seen = seen_langs(fn)
        if launch["inside"] and launch["patched"] and seen <= launch["patched"]:
            return interpreter._LangPatchScope()  # already in place for this launch: nothing to restore
        scope = original_patch(fn)
        if launch["inside"]:
            launch["patched"] = launch["patched"] | seen
        return scope

    def call(self, *args, **kwargs):
        outer = launch["inside"]
        launch["inside"] = True
        try:
            return original_call(self, *args, **kwargs)
        finally:
            if not outer:
                launch["inside"], launch["patched"] = False, frozenset()

    if not original_options.debug:
        builder.options = dataclasses.replace(original_options, sanitize_overflow=False)
    interpreter._patch_lang, interpreter.GridExecutor.__call__ = patch_lang, call
    try:
        yield True
    finally:
        builder.options = original_options
        interpreter._patch_lang, interpreter.GridExecutor.__call__ = original_patch, original_call
