"""Triton, if installed, and the choice between a Triton kernel and its PyTorch reference.

Every kernel module imports Triton through here: kernels are defined only when `HAS_TRITON`, and every public
op falls back to its PyTorch reference, so a CPU-only install without Triton imports and runs everything.
"""

from __future__ import annotations

import functools
import os

import torch

try:  # Triton is optional at import time (CPU-only installs run the PyTorch reference path).
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the environment
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    HAS_TRITON = False

__all__ = [
    "GRID_Y_MAX",
    "HAS_TRITON",
    "blocks_by_chunks_grid",
    "cdiv",
    "interpreting",
    "num_sms",
    "set_descriptor_allocator",
    "tl",
    "tma_compatible",
    "triton",
    "use_triton",
]


GRID_Y_MAX = 65535  # CUDA's limit on a launch grid's second (and third) dimension; the first takes 2**31 - 1


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def blocks_by_chunks_grid(blocks: int, chunks: int, features_first: bool) -> tuple[tuple[int, int], bool]:
    """The 2-D launch grid of a kernel with one program per (row block, feature chunk), and whether it walks the
    chunks first: (chunks, blocks) when `features_first` and the blocks fit the grid's second dimension
    (GRID_Y_MAX), else (blocks, chunks). The kernel maps its program ids back with
    `fp8.triton_blocks.block_and_chunk` and the returned flag."""
    features_first = features_first and blocks <= GRID_Y_MAX
    return ((chunks, blocks) if features_first else (blocks, chunks)), features_first


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


def interpreting() -> bool:
    """Whether Triton kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1), read at every call."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def tma_compatible(*tensors: torch.Tensor) -> bool:
    """Whether TMA tensor descriptors can read these 2-D or 3-D tensors: unit inner strides, 16-byte aligned row
    strides and base addresses."""
    return all(t.stride(-1) == 1 and (t.stride(-2) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
               for t in tensors)  # fmt: skip


def _descriptor_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global memory for the TMA descriptors a kernel builds on the device (`tl.make_tensor_descriptor`): a few
    hundred bytes per program, from PyTorch's caching allocator on the current device and stream (Triton launches
    there). The caching allocator's blocks are at least 256-byte aligned, more than the 128 bytes a descriptor
    needs; `stream` is the current stream, the one the allocator serves."""
    if alignment > 256:
        raise ValueError(f"Triton asked for {alignment}-byte aligned scratch; the caching allocator guarantees 256")
    return torch.empty(size, dtype=torch.int8, device="cuda")


def set_descriptor_allocator() -> None:
    """Give Triton the scratch allocator of kernels that build TMA descriptors on the device; call before each
    launch of one. Triton (3.6) keeps its allocator in a `contextvars.ContextVar`, which autograd's CUDA backward
    thread does not inherit from the thread that set it, so setting it once at import would leave every backward
    launch without one."""
    if HAS_TRITON:
        triton.set_allocator(_descriptor_scratch)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (the persistent kernels' grid size); 4 elsewhere (the
    interpreter)."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


# The SM count per CUDA device index: a driver query too slow to repeat at every launch, constant for the
# process; a host has a handful of devices.
@functools.lru_cache(maxsize=64)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
