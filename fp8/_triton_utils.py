"""Small shared helpers for the FP8 Triton kernels: optional Triton import and backend selection.

Everything in `fp8/` must import on a machine without CUDA (and even without Triton): kernels are
defined only when Triton imports, and every public op falls back to its PyTorch reference.
"""

from __future__ import annotations

import os

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


# ----------------------------------------------------------------------------------------------------------
# Launching without Triton's per-call specialisation
# ----------------------------------------------------------------------------------------------------------
# `cached_specialization`: repeat launches of a kernel with an argument signature seen before (the same dtypes,
# 16-byte alignments, integer values, constexprs and options) call the compiled kernel straight away instead of
# going through `JITFunction.run` (argument binding, one specialisation call per argument, the cache key; its host
# cost is in the README's "Launch overhead"). Off until the GPU test
# (tests/test_fp8_launch.py::test_gpu_cached_launch_is_bit_identical) and `bench/bench_fp8_linear.py --host` have
# run on this Triton version; LING_FP8_CACHED_LAUNCH=1 in the environment turns it on for a process (e.g. a
# train.py run to compare).
LAUNCH_OPTIONS: dict = {"cached_specialization": os.environ.get("LING_FP8_CACHED_LAUNCH", "0") == "1"}
_CACHE_LIMIT = 256  # signatures per kernel before the cache restarts (shapes keep changing: eval, odd batches)


def _signature_key(args: tuple, kwargs: dict) -> tuple:
    """What Triton's specialisation of these arguments can depend on, and more: for a tensor its dtype and
    whether its address is 16-byte aligned, for a tensor descriptor its base's dtype and its shape, strides, block
    shape and padding, for anything else its type and value (so 1 and True, or 16 and 16.0, do not collide)."""
    key = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((a.dtype, a.data_ptr() % 16 == 0))
        elif hasattr(a, "block_shape") and hasattr(a, "base"):  # triton.tools.tensor_descriptor.TensorDescriptor
            key.append((a.base.dtype, tuple(a.shape), tuple(a.strides), tuple(a.block_shape),
                        getattr(a, "padding", None), getattr(a, "round_f32_to_tf32", None)))
        else:
            key.append((type(a), a))
    return tuple(key), tuple((k, type(v), v) for k, v in kwargs.items())


def _launchable(compiled) -> bool:
    return all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata", "launch_metadata"))


class CachedLaunch:
    """`kernel[grid](*args, **kwargs)` for a `@triton.jit` kernel, with the compiled kernel of each argument
    signature (`_signature_key`) kept here once Triton has launched it: later launches with that signature pass
    every parameter, in the kernel's signature order with its defaults, straight to the compiled kernel's
    launcher, on the current device's current stream, as `JITFunction.run` does (launch hooks included). Under
    `LAUNCH_OPTIONS["cached_specialization"] = False`, or where Triton returns no launchable compiled kernel
    (the interpreter, a Triton without this launch API), every launch goes through Triton as before.

    `current_device`, `current_stream` and `hooks` (the launch enter/exit hooks) are injectable for the CPU tests."""

    def __init__(self, kernel, current_device=None, current_stream=None, hooks=None) -> None:
        import inspect

        self.kernel = kernel
        params = inspect.signature(kernel.fn).parameters
        self.names = list(params)
        self.defaults = {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}
        self.compiled: dict[tuple, object] = {}
        self._device, self._stream, self._hooks = current_device, current_stream, hooks

    def __getattr__(self, name):  # the JITFunction's own attributes (fn, arg_names, ...) stay reachable
        if name == "kernel":  # not set yet (e.g. during copy): no recursion
            raise AttributeError(name)
        return getattr(self.kernel, name)

    def __getitem__(self, grid):
        if not LAUNCH_OPTIONS["cached_specialization"]:  # off: Triton's own launcher, nothing in between
            return self.kernel[grid]
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args: tuple, kwargs: dict):
        device = self._current_device()
        key = (device, _signature_key(args, kwargs))
        try:
            compiled = self.compiled.get(key)
        except TypeError:  # an unhashable argument (a list): no signature to cache
            return self.kernel[grid](*args, **kwargs)
        if compiled is None:
            compiled = self.kernel[grid](*args, **kwargs)
            if len(self.compiled) >= _CACHE_LIMIT:
                self.compiled.clear()
            self.compiled[key] = compiled if _launchable(compiled) else False
            return compiled
        if compiled is False:
            return self.kernel[grid](*args, **kwargs)
        values = list(args)
        for name in self.names[len(args):]:  # keyword constexprs, then defaults; num_warps etc. are not params
            values.append(kwargs[name] if name in kwargs else self.defaults[name])
        stream = self._current_stream(device)
        g = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        enter, exit_ = self._launch_hooks()
        compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata,
                     compiled.launch_metadata(g, stream, *values), enter, exit_, *values)
        return compiled

    def _current_device(self):
        if self._device is not None:
            return self._device()
        from triton.runtime import driver

        return driver.active.get_current_device()

    def _current_stream(self, device):
        if self._stream is not None:
            return self._stream(device)
        from triton.runtime import driver

        return driver.active.get_current_stream(device)

    def _launch_hooks(self):
        if self._hooks is not None:
            return self._hooks()
        from triton import knobs

        return knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook


def cached_launch(kernel):
    """Decorator over `@triton.jit` for the kernels the host launches: a `CachedLaunch` around a JIT kernel, the
    kernel itself otherwise (the interpreter's `InterpretedFunction`, TRITON_INTERPRET=1)."""
    from triton.runtime.jit import JITFunction

    return CachedLaunch(kernel) if isinstance(kernel, JITFunction) else kernel
