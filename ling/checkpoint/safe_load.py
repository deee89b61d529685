"""Loading `.pt` files without running code: every torch.load of the project goes through here.

A pickle can call any function while it loads, so a checkpoint that someone hands over could run a program.
`load_pt` loads with `weights_only=True` (tensors, plain containers and numbers) plus exactly the few classes
that DeepSpeed's checkpoint files pickle (`ALLOWED_GLOBALS`); anything else is refused with
`UnsafeCheckpointError` naming the object, before any of it is built.

DeepSpeed reads its own files with `weights_only=False` (engine.load_checkpoint, zero_to_fp32), so before a
folder is handed to DeepSpeed `check_folder` loads every `.pt` file in it the same safe way (memory-mapped:
the tensor bytes are not read), and refuses the folder if one does not pass.

The allow-list was taken from real checkpoints (`torch.serialization.get_unsafe_globals_in_checkpoint`) of the
tiny model trained 2 steps on CPU with torch 2.13.0 and DeepSpeed 0.19.8, under ZeRO 0 (bf16), 1 (fp32 and bf16:
BF16_Optimizer), 2 and 3 (fp32 and bf16), AdamW and FP8AdamW, moe.ep_size 1 and 2: the ZeRO-1/2/3 optimizer
files hold a LossScaler, a ZeroStageEnum and fragment_address entries; the model-states files and the expert
shards hold none. Trainer states written before December 2026 kept numpy's RNG state as an ndarray: the numpy
array rebuild functions read those (they build arrays only; their elements load under the same rules).
"""

from __future__ import annotations

import importlib
import os
import pickle
from pathlib import Path
from typing import Any

import torch

# "module.name" -> where it comes from (each is imported only when a file names it)
ALLOWED_GLOBALS = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": "ZeRO optimizer files: the (static, bf16/fp32) loss scaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum": "ZeRO optimizer files: the stage",
    "deepspeed.utils.tensor_fragment.fragment_address": "ZeRO-1/2 optimizer files: param_slice_mappings",
    "numpy._core.multiarray._reconstruct": "trainer states before 2026-12: numpy's RNG key array (numpy 2)",
    "numpy.core.multiarray._reconstruct": "trainer states before 2026-12: numpy's RNG key array (numpy 1)",
    "numpy.ndarray": "trainer states before 2026-12: numpy's RNG key array",
    "numpy.dtype": "trainer states before 2026-12: numpy's RNG key array's dtype",
}
# built while a named global loads, so absent from the file's names: allowed along with it
_BUILT_BY = {"numpy.dtype": ("numpy.dtypes.UInt32DType",)}


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A `.pt` file that holds objects other than tensors, plain containers and the allow-listed classes."""


def _resolve(name: str) -> Any:
    module, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def _named_globals(path: Path) -> list[str]:
    """The globals the file's pickle names that torch does not already allow (read statically: nothing runs)."""
    try:
        return torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except (ValueError, pickle.UnpicklingError, EOFError, RuntimeError):
        return []  # not a zip checkpoint, or opcodes the scanner does not know: the weights_only load decides


def _reason(e: pickle.UnpicklingError) -> str:
    """The line of torch's weights_only error that says what was refused (it opens with generic advice)."""
    text = str(e).partition("WeightsUnpickler error:")[2] or str(e)
    return next((line.strip() for line in text.splitlines() if line.strip()), "not a weights-only pickle")


def load_pt(path: str | os.PathLike, *, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """torch.load(path, weights_only=True) with the DeepSpeed classes of ALLOWED_GLOBALS allowed; raises
    UnsafeCheckpointError (naming the file and what it holds) for anything else, having built none of it."""
    path = Path(path)
    named = _named_globals(path)
    refused = sorted(n for n in named if n not in ALLOWED_GLOBALS)
    if refused:
        raise UnsafeCheckpointError(
            f"{path}: refused to load: it holds {', '.join(refused)}, which a checkpoint of this project never "
            "does (a pickle can run code while it loads; only tensors, plain containers and DeepSpeed's "
            "checkpoint classes are accepted)")
    allowed = [_resolve(m) for n in named for m in (n, *_BUILT_BY.get(n, ()))]
    with torch.serialization.safe_globals(allowed):
        try:
            return torch.load(path, map_location=map_location, mmap=mmap, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpointError(f"{path}: refused to load: {_reason(e)} (only tensors, plain containers "
                                        "and DeepSpeed's checkpoint classes are accepted)") from e


def check_folder(folder: str | os.PathLike) -> None:
    """Load every `.pt` file under `folder` as `load_pt` does (memory-mapped: no tensor data is read); raises
    UnsafeCheckpointError on the first that does not pass. Call before DeepSpeed loads the folder itself."""
    for path in sorted(Path(folder).rglob("*.pt")):
        load_pt(path, mmap=True)
