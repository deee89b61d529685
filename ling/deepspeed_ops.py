"""DeepSpeed's JIT-built C++ op that training does not use, kept from being built (checked on DeepSpeed 0.19.8,
`TESTED_DEEPSPEED`; tests/runtime/test_deepspeed_ops.py fails when DeepSpeed's behaviour here changes).

On a CPU machine `deepspeed.init_distributed` constructs `deepspeed.comm.torch.TorchBackend`, which calls
`build_shm_op()`: it JIT-compiles DeepSpeed's `deepspeed_shm_comm` op with `torch.utils.cpp_extension.load` (88 s
the first time on 2 cores; a ninja no-op later) inside torch's extension cache,
`~/.cache/torch_extensions/<python>_cpu/deepspeed_shm_comm/`, guarded by the empty lock file `lock` there
(`torch.utils.file_baton.FileBaton`: created on entry, removed on exit, waited on forever and silently while it
exists). A run killed while it held the lock left the file behind, and every later run on the machine waited on
it. The op serves only `deepspeed.comm.inference_all_reduce` (DeepSpeed-Inference's tensor-parallel layers);
training's collectives (ZeRO's reduce-scatters and all-gathers, our all-to-alls and all-reduces) are
torch.distributed's, through gloo on CPU. So nothing is built and no lock is taken.

How: `build_shm_op` builds only when `deepspeed.ops.__compatible_ops__[name]` is true, DeepSpeed's probe of every
op, computed once on first access and cached in that dict ("edits to it persist", DeepSpeed's comment says).
`skip_unused_op_builds` sets the shared-memory op's entry to False before `init_distributed`. On a GPU machine the
CUDA accelerator has no such builder and nothing changes.
"""

from __future__ import annotations

import glob
import logging
import os

import deepspeed.ops
from torch.utils.cpp_extension import get_default_build_root

log = logging.getLogger(__name__)

# The DeepSpeed releases this module was checked on.
TESTED_DEEPSPEED = ("0.19.8",)
SHM_COMM_OP = "deepspeed_shm_comm"  # deepspeed.ops.op_builder.cpu.comm.ShareMemCommBuilder.NAME
LOCK_FILE = "lock"  # torch.utils.cpp_extension's FileBaton in an extension's build folder


def skip_unused_op_builds(report: bool) -> None:
    """Mark DeepSpeed's CPU shared-memory comm op as not buildable, so that `deepspeed.init_distributed` neither
    builds nor loads it (call before it); with `report` (rank 0), say so if a build's lock file exists (a killed
    build's)."""
    compatible = deepspeed.ops.__compatible_ops__  # probes every op once (0.15 s here), as build_shm_op would
    if compatible.get(SHM_COMM_OP):
        compatible[SHM_COMM_OP] = False
    for lock in build_locks(SHM_COMM_OP) if report else ():
        log.warning("found %s: the lock of a build of DeepSpeed's %s op that did not finish (a run killed at "
                    "start-up leaves it; the file names no owner). Training neither builds nor uses that op, so this "
                    "run does not wait on it; remove the file unless a build is running now (ps: ninja, c++)",
                    lock, SHM_COMM_OP)


def extension_roots() -> list[str]:
    """The folders torch builds JIT extensions in: $TORCH_EXTENSIONS_DIR, else one per Python and accelerator
    under torch's default build root (~/.cache/torch_extensions/py311_cpu, ...)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return [os.environ["TORCH_EXTENSIONS_DIR"]]
    return sorted(glob.glob(os.path.join(get_default_build_root(), "*")))


def build_locks(op: str) -> list[str]:
    """The lock files in `op`'s build folders that exist now (a build running, or one that was killed)."""
    return [path for root in extension_roots() if os.path.exists(path := os.path.join(root, op, LOCK_FILE))]
