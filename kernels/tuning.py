"""`Tuning`: the launch configuration of one kernel family, a frozen default beside its kernels, replaced only
inside a `with` block.

    QUANT_TUNING = Tuning("fp8.quant", QuantConfig())            # beside the kernels
    cfg = QUANT_TUNING.current()                                  # at launch
    with QUANT_TUNING.override(col_block_f=64, col_warps=8):      # a benchmark's sweep, a test
        ...

The override lives in a `contextvars.ContextVar`: it is undone when the block exits (also on an exception),
nested blocks restore the outer choice, and other threads keep the default. Under Triton's CPU interpreter
(TRITON_INTERPRET=1) the default is the `interpreter` config when one is given (small tiles keep it fast); an
override applies there too.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from contextvars import ContextVar
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
        self._override: ContextVar[C | None] = ContextVar(f"{name}.tuning", default=None)

    def current(self) -> C:
        """The config in force: the innermost override, else the default (the interpreter's under it)."""
        cfg = self._override.get()
        if cfg is not None:
            return cfg
        return self.interpreter if interpreting() else self.default

    @contextlib.contextmanager
    def override(self, config: C | None = None, **changes) -> Iterator[C]:
        """Within the block, `current()` is `config` (default: the current config) with `changes` applied
        (`dataclasses.replace`); the previous choice comes back on exit."""
        cfg = dataclasses.replace(self.current() if config is None else config, **changes)
        token = self._override.set(cfg)
        try:
            yield cfg
        finally:
            self._override.reset(token)

    def __repr__(self) -> str:
        return f"Tuning({self.name!r}, default={self.default!r})"
