"""`Tuning`: the launch configuration of one kernel family, a frozen default beside its kernels, replaced only
inside a `with` block.

    QUANT_TUNING = Tuning("fp8.quant", QuantConfig())            # beside the kernels
    cfg = QUANT_TUNING.current()                                  # at launch
    with QUANT_TUNING.override(col_block_f=64, col_warps=8):      # a benchmark's sweep, a test
        ...

The override is undone when the block exits (also on an exception) and nested blocks restore the outer choice.
While the block runs it holds in every thread of the process: PyTorch's autograd engine runs a CUDA backward on
its own device threads, and an override that stayed in the calling thread (a `contextvars.ContextVar`, as
before) silently missed every backward kernel of the block. Under Triton's CPU interpreter
(TRITON_INTERPRET=1) the default is the `interpreter` config when one is given (small tiles keep it fast); an
override applies there too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from typing import Generic, TypeVar

from kernels.backend import interpreting

C = TypeVar("C")

__all__ = ["Tuning"]


class Tuning(Generic[C]):
    """A frozen-dataclass launch config with a default, an optional interpreter default, and scoped overrides."""

    def __init__(self, name: str, default: C, interpreter: C | None = None) -> None:
        self.name = name
        self.default = default
        self.interpreter = default if interpreter is None else interpreter
        self._overrides: list[tuple[object, C]] = []  # the open `override` blocks: (token, config), innermost last
        self._lock = threading.Lock()

    def current(self) -> C:
        """The config in force: the innermost open override, else the default (the interpreter's under it)."""
        with self._lock:
            if self._overrides:
                return self._overrides[-1][1]
        return self.interpreter if interpreting() else self.default

    @contextlib.contextmanager
    def override(self, config: C | None = None, **changes) -> Iterator[C]:
        """Within the block, `current()` is `config` (default: the current config) with `changes` applied
        (`dataclasses.replace`); the previous choice comes back on exit."""
        cfg = dataclasses.replace(self.current() if config is None else config, **changes)
        token = object()  # this block's entry, removed by identity whatever closed in between
        with self._lock:
            self._overrides.append((token, cfg))
        try:
            yield cfg
        finally:
            with self._lock:
                self._overrides = [entry for entry in self._overrides if entry[0] is not token]

    def __repr__(self) -> str:
        return f"Tuning({self.name!r}, default={self.default!r})"
