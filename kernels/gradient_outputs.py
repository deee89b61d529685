"""`GRADIENT_OUTPUTS`: preallocated tensors that weight-gradient kernels write into, inside a `with` block.

    with GRADIENT_OUTPUTS.into({weight.data_ptr(): out}):   # model/graphs.py, capturing a layer's backward
        grads = torch.autograd.grad(...)                    # the wgrad GEMMs of `weight` write into `out`

Why: a layer's backward replayed from a CUDA graph must hand its parameter gradients over in memory outside the
graph's pool (`model.graphs`: one shared slab). Copying each gradient there costs a read and a write of every
parameter per micro-batch (about 1 ms for one 256-expert MoE layer on an H200); a kernel that writes the slab
directly costs nothing more.

A kernel's caller asks `GRADIENT_OUTPUTS.get(key, shape, dtype, device)` with the weight's `data_ptr()` (noted in
the forward: `torch.func.functional_call`'s detached alias shares the parameter's storage) and gets the registered
tensor, or None (allocate as usual) when no block is open, the weight is not registered, or the registered tensor
does not match: contiguous, the shape, dtype and device asked (pass a tensor's `.device`: cuda:0, not cuda). Each
registration is handed out once: a weight used twice in one backward gets its second gradient in a new tensor,
which autograd then adds to the first, instead of two GEMMs writing one output. The blocks hold in every thread of
the process, as `kernels.tuning.Tuning`'s overrides do: autograd runs a CUDA backward on its own device thread.
Nested blocks see the innermost registration of a key first.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping

import torch

__all__ = ["GRADIENT_OUTPUTS", "GradientOutputs", "check_output"]


class GradientOutputs:
    """The open `into` blocks' registrations: weight data pointer → the tensor its gradient is written into."""

    def __init__(self) -> None:
        self._blocks: list[tuple[object, Mapping[int, torch.Tensor]]] = []  # (token, outputs), innermost last
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def into(self, outputs: Mapping[int, torch.Tensor]) -> Iterator[None]:
        """Within the block, the gradient of the weight whose storage starts at key is written into outputs[key]
        by the kernels that look it up (the FP8 wgrad GEMMs)."""
        token = object()
        with self._lock:
            self._blocks.append((token, dict(outputs)))
        try:
            yield
        finally:
            with self._lock:
                self._blocks = [block for block in self._blocks if block[0] is not token]

    def get(self, key: int | None, shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor | None:  # fmt: skip
        """The registered output for `key` if it is a contiguous tensor of this shape, dtype and device, else
        None (the caller allocates). A registration that matches is handed out once."""
        if key is None:
            return None
        with self._lock:
            outputs = next((outputs for _, outputs in reversed(self._blocks) if key in outputs), None)
            if outputs is None:
                return None
            out = outputs[key]
            if (tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device
                    or not out.is_contiguous()):
                return None
            del outputs[key]
        return out


GRADIENT_OUTPUTS = GradientOutputs()


def check_output(out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    """A kernel's `out=` argument: contiguous, of the result's shape, dtype and device, or a ValueError naming it."""
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {tuple(shape)} {dtype} tensor on {device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}"
                         f"{'' if out.is_contiguous() else ' (not contiguous)'}")
