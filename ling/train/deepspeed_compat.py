"""Everything this project changes in DeepSpeed, in one place: the subclasses of DeepSpeed classes, the swap of
the two names `deepspeed.initialize` builds them under, the checkpoint engine a save is captured through
(`captured_save`), the calls of DeepSpeed's private groups API, and the start-up check that the installed
DeepSpeed is one these were checked on. Each override says what DeepSpeed
lacks; all were checked on DeepSpeed 0.19.8 (`TESTED_DEEPSPEED`; tests/runtime/test_deepspeed_compat.py fails
when DeepSpeed's behaviour under one of them changes).

How the classes get in. `deepspeed.initialize` takes no engine class: it builds `DeepSpeedEngine`, a name it
looks up in the `deepspeed` package's globals when called; the engine takes no optimizer-wrapper class either:
`DeepSpeedEngine._configure_bf16_optimizer` builds `BF16_Optimizer`, a name it looks up in
`deepspeed.runtime.engine`'s globals when called. `project_classes` swaps those two names for the duration of
`deepspeed.initialize` (`substituted`: a context manager that checks the name still holds DeepSpeed's class,
swaps it and puts it back in `finally`, so an exception, or a second engine built with DeepSpeed's own classes,
never sees ours). Considered and not chosen:
- constructing the engine subclass directly, the way `deepspeed.initialize` does: in 0.19.8 `initialize` does a
  dozen things around the constructor (deepspeed.comm start-up, shutting down and restoring zero.Init's context,
  DeepSpeedConfig and `set_optimizer_flags`, the tensor-parallel config merge, AutoTP mode, the mesh device, the
  hybrid and pipeline engines, the GC setting), through helpers of its own that change between versions; a copy
  of it would be a larger and more fragile override than swapping one name;
- overriding `_configure_bf16_optimizer` with a copy of its body that names our class: eleven of DeepSpeed's
  constructor arguments to keep in step by hand, where the swap keeps DeepSpeed's own call;
- the standard library's `mock.patch.object` (what the swap replaces): a test tool; it substitutes anything,
  even a name DeepSpeed no longer has, where `substituted` refuses one that is not DeepSpeed's class.
"""

from __future__ import annotations

import contextlib
import glob
import inspect
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import deepspeed
import deepspeed.ops
import torch
from deepspeed.runtime import engine as ds_engine_module
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.utils import groups as ds_groups
from torch import nn
from torch.utils.cpp_extension import get_default_build_root

from kernels.grad_accum import accumulate_

# The DeepSpeed releases every override below was checked on (their tests passed).
TESTED_DEEPSPEED = ("0.19.8",)
log = logging.getLogger(__name__)


class DeepSpeedIncompatible(RuntimeError):
    """The installed DeepSpeed lacks a member this module overrides or calls (or has another signature)."""


class UntestedDeepSpeedWarning(UserWarning):
    """The installed DeepSpeed is not one of TESTED_DEEPSPEED (its members still have the expected signatures)."""


# ------------------------------------------------------------------------------------- the substitution
@contextlib.contextmanager
def substituted(owner: Any, name: str, original: Any, replacement: Any) -> Iterator[None]:
    """`owner.name` is `replacement` inside the block and `original` again afterwards, however the block ends.
    Refuses when `owner.name` is not `original` on entry (DeepSpeed renamed or moved it, or someone else
    swapped it): substituting then would change something other than what this module was checked against."""
    current = getattr(owner, name, None)
    if current is not original:
        what = getattr(replacement, "__name__", replacement)
        raise DeepSpeedIncompatible(f"{getattr(owner, '__name__', owner)}.{name} is {current!r}, expected "
                                    f"{original!r}: the substitution of {what} does not apply")
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextlib.contextmanager
def project_classes(engine_class: type[DeepSpeedEngine] = DeepSpeedEngine) -> Iterator[None]:
    """Inside the block `deepspeed.initialize` builds `engine_class` (DeepSpeed's engine or a subclass of it),
    and an engine that wraps its optimizer in DeepSpeed's BF16_Optimizer builds LeanBF16Optimizer instead."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(substituted(ds_engine_module, "BF16_Optimizer", BF16_Optimizer, LeanBF16Optimizer))
        if engine_class is not DeepSpeedEngine:
            stack.enter_context(substituted(deepspeed, "DeepSpeedEngine", DeepSpeedEngine, engine_class))
        yield


# ------------------------------------------------------------------------------------------ the overrides
class LeanBF16Optimizer(BF16_Optimizer):
    """DeepSpeed's BF16_Optimizer (ZeRO-1 + bf16 + fp32 accumulation) with a leaner gradient hook.

    What DeepSpeed lacks (0.19.8): its `_update_hp_grad` adds each micro-batch's bf16 gradient into the fp32
    one as `hp.add_(lp.grad.to(fp32))`: the cast writes an fp32 temporary and the add reads it again (18 bytes
    moved per parameter). `kernels.grad_accum.accumulate_` reads the bf16 gradient and converts it inside one
    vectorised kernel (10 bytes; on CPU PyTorch's mixed-dtype in-place add, the same bits). Both add the same fp32
    value (bf16 → fp32 is exact), so the sums are bit-identical. AutoEP's folded tensor parallelism
    (`autoep_folding_tp_group`, unused here) keeps DeepSpeed's own hook."""

    @torch.no_grad()
    def _update_hp_grad(self, lp, group_idx, param_idx, clear_lp_grads):
        if lp.grad is None or self.autoep_folding_tp_group is not None:
            return super()._update_hp_grad(lp, group_idx, param_idx, clear_lp_grads)
        hp_grad = self.fp32_groups_gradients[group_idx][param_idx]
        accumulate_(hp_grad, lp.grad)
        lp._hp_grad = hp_grad
        self.fp32_groups_has_gradients[group_idx][param_idx] = True
        if clear_lp_grads:
            lp.grad.zero_()


class ExpertParallelEngine(DeepSpeedEngine):
    """DeepSpeed's engine for a model whose expert parameters are DeepSpeed MoE parameters (`allreduce=False`,
    a `group_name`, in `moe: True` parameter groups) without DeepSpeed's MoE modules.

    What DeepSpeed lacks (0.19.8): the engine sets `has_moe_layers`, and with it hands its optimizer wrapper the
    expert-data-parallel groups, only when the model contains `deepspeed.moe.layer.MoE` (or AutoEP) modules,
    which ours are not. This engine raises the flag while the ZeRO optimizer (or, for ZeRO-1 + bf16 + fp32
    accumulation, the BF16_Optimizer) is built and lowers it again, so that checkpoints keep DeepSpeed's plain
    layout (ling/checkpoint/store.py writes the experts beside it). The BF16_Optimizer leaves the boundary
    all-reduce to the engine, which reduces the expert gradients over their expert-data-parallel groups only
    under the flag: it is raised for that call too (ZeRO-1/2's own optimizer reduces in its own hooks)."""

    def _configure_zero_optimizer(self, optimizer):
        with self._moe_flag_raised():
            return super()._configure_zero_optimizer(optimizer)

    def _configure_bf16_optimizer(self, optimizer):
        with self._moe_flag_raised():
            return super()._configure_bf16_optimizer(optimizer)

    def allreduce_gradients(self, *args, **kwargs):
        if not isinstance(self.optimizer, BF16_Optimizer):
            return super().allreduce_gradients(*args, **kwargs)
        with self._moe_flag_raised():
            return super().allreduce_gradients(*args, **kwargs)

    @contextlib.contextmanager
    def _moe_flag_raised(self) -> Iterator[None]:
        self.has_moe_layers = True
        try:
            yield
        finally:
            self.has_moe_layers = False


class CapturingCheckpointEngine(CheckpointEngine):
    """A DeepSpeed checkpoint engine that writes nothing: `save(state_dict, path)` hands the state dict and its
    path to `keep` (which must copy what it keeps: the tensors are the live ones), and DeepSpeed need not clone
    the tensors first (`preserves_storage_sharing` False). `make_dirs` False (a probe): no directory either.

    What DeepSpeed lacks (0.19.8): a way to take a checkpoint's state dicts without writing them. Its engines
    (torch, fast, decoupled, DataStates) all write, the asynchronous ones in processes and layouts of their own,
    while `engine.save_checkpoint` hands every file's state dict to `engine.checkpoint_engine.save`: the module
    states, the ZeRO 1-3 optimizer shards and the BF16_Optimizer's."""

    def __init__(self, keep: Callable[[Any, Path], None], make_dirs: bool = True) -> None:
        super().__init__()
        self.name = "CapturingCheckpointEngine"
        self.keep, self.make_dirs = keep, make_dirs

    def create(self, info) -> None:
        pass

    def makedirs(self, path, exist_ok=False) -> None:
        if self.make_dirs:
            os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict, path: str) -> None:
        self.keep(state_dict, Path(path))

    def load(self, path: str, map_location=None):
        return torch.load(path, map_location=map_location, weights_only=False)

    def commit(self, info) -> bool:
        return True

    def preserves_storage_sharing(self) -> bool:
        return False


@contextlib.contextmanager
def captured_save(engine: Any, keep: Callable[[Any, Path], None], make_dirs: bool = True) -> Iterator[None]:
    """Inside the block `engine.save_checkpoint` hands each file's state dict to `keep(state_dict, path)` instead
    of writing it (CapturingCheckpointEngine in `engine.checkpoint_engine`, DeepSpeed's own put back after). An
    engine without a checkpoint engine (a test's stand-in that writes its own files) is left alone."""
    if not hasattr(engine, "checkpoint_engine"):
        yield
        return
    capture = CapturingCheckpointEngine(keep, make_dirs)
    with substituted(engine, "checkpoint_engine", engine.checkpoint_engine, capture):
        yield


# ----------------------------------------------------------------------------- the private groups API
def expert_group_name(ep_size: int) -> str:
    """DeepSpeed's name of the expert-(data-)parallel groups of size `ep_size` (also the MoE params' group_name)."""
    return f"ep_size_{ep_size}"


def create_expert_groups(ep_size: int):
    """This rank's expert-parallel process group of size `ep_size`, created (once: a no-op when they exist)
    together with the expert-data-parallel groups ZeRO reduces the experts over: P = ep_size consecutive
    ranks [0..P-1], [P..2P-1], … hold the experts between them; the ranks {r, r+P, r+2P, …} hold the same ones.

    What DeepSpeed lacks (0.19.8): a public way to create them. `deepspeed.utils.groups.initialize` is
    deprecated (it raises); DeepSpeed's MoE layer calls the private `_create_expert_and_data_parallel`, and the
    group is read back with the private `_get_expert_parallel_group`."""
    ds_groups._create_expert_and_data_parallel(ep_size)
    return ds_groups._get_expert_parallel_group(expert_group_name(ep_size))


# --------------------------------------------------------------------------------------- the check
# (owner, member, the parameters the override or call above relies on, in order)
OVERRIDDEN: tuple[tuple[Any, str, tuple[str, ...]], ...] = (
    (DeepSpeedEngine, "_configure_zero_optimizer", ("self", "optimizer")),
    (DeepSpeedEngine, "_configure_bf16_optimizer", ("self", "optimizer")),
    # its override passes every argument through (and DeepSpeed's nvtx decorator hides the signature): no parameters
    (DeepSpeedEngine, "allreduce_gradients", ()),
    (BF16_Optimizer, "_update_hp_grad", ("self", "lp", "group_idx", "param_idx", "clear_lp_grads")),
    (ds_groups, "_create_expert_and_data_parallel", ("expert_parallel_size_",)),
    (ds_groups, "_get_expert_parallel_group", ("group_name",)),
    # CapturingCheckpointEngine implements DeepSpeed's checkpoint-engine interface; save_checkpoint calls it
    (CheckpointEngine, "create", ("self", "info")),
    (CheckpointEngine, "save", ("self", "state_dict", "path")),
    (CheckpointEngine, "makedirs", ("self", "path", "exist_ok")),
    (CheckpointEngine, "load", ("self", "path", "map_location")),
    (CheckpointEngine, "commit", ("self", "info")),
    (CheckpointEngine, "preserves_storage_sharing", ("self",)),
    (DeepSpeedEngine, "save_checkpoint", ("self", "save_dir", "tag", "client_state", "save_latest")),
)
# (owner, name, the class it must hold): the names `project_classes` swaps
SWAPPED: tuple[tuple[Any, str, type], ...] = (
    (deepspeed, "DeepSpeedEngine", DeepSpeedEngine),
    (ds_engine_module, "BF16_Optimizer", BF16_Optimizer),
)


def _name(owner: Any) -> str:
    return getattr(owner, "__qualname__", None) or getattr(owner, "__name__", repr(owner))


def compat_problems(overridden=OVERRIDDEN, swapped=SWAPPED) -> list[str]:
    """What of `overridden` (members whose leading parameters must be the given ones) and `swapped` (names that
    must hold the given class) the installed DeepSpeed does not have; empty when every override applies."""
    problems = []
    for owner, member, params in overridden:
        fn: Callable | None = getattr(owner, member, None)
        if fn is None:
            problems.append(f"{_name(owner)}.{member} is gone")
            continue
        have = tuple(inspect.signature(fn).parameters)[: len(params)]
        if have != params:
            problems.append(f"{_name(owner)}.{member} takes ({', '.join(have)}), the override expects "
                            f"({', '.join(params)})")
    for owner, name, cls in swapped:
        if getattr(owner, name, None) is not cls:
            problems.append(f"{_name(owner)}.{name} is not {cls.__module__}.{cls.__qualname__}")
    return problems


def check_deepspeed(version: str = deepspeed.__version__, overridden=OVERRIDDEN, swapped=SWAPPED) -> None:
    """Run when an engine is built: raise DeepSpeedIncompatible when DeepSpeed `version` lacks what the overrides
    need (`compat_problems`), warn (UntestedDeepSpeedWarning) when it is not one of TESTED_DEEPSPEED."""
    tested = ", ".join(TESTED_DEEPSPEED)
    problems = compat_problems(overridden, swapped)
    if problems:
        raise DeepSpeedIncompatible(f"DeepSpeed {version} does not work with ling/train/deepspeed_compat.py "
                                    f"(tested on DeepSpeed {tested}): {'; '.join(problems)}. Install DeepSpeed "
                                    f"{TESTED_DEEPSPEED[-1]}, or port the overrides")
    if version not in TESTED_DEEPSPEED:
        warnings.warn(f"DeepSpeed {version} is installed; ling/train/deepspeed_compat.py's overrides were tested "
                      f"on DeepSpeed {tested} only (their members are still there: run "
                      "tests/runtime/test_deepspeed_compat.py before trusting a run)", UntestedDeepSpeedWarning,
                      stacklevel=2)


# ----------------------------------------------------------------------------------------- the entry
def initialize_engine(model: nn.Module, optimizer: torch.optim.Optimizer, config: dict[str, Any],
                      lr_scheduler: Any = None, expert_parallel: bool = False) -> tuple:
    """`deepspeed.initialize(model, optimizer, config, lr_scheduler)` with this project's classes: ZeRO-1's
    BF16_Optimizer with the lean gradient hook (LeanBF16Optimizer) and, with `expert_parallel`, the
    ExpertParallelEngine. The trainer, the benchmarks and the tests build their engines here, so that they all
    run the same gradient path. → deepspeed.initialize's tuple (engine, optimizer, data loader, lr scheduler)."""
    check_deepspeed()
    with project_classes(ExpertParallelEngine if expert_parallel else DeepSpeedEngine):
        return deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, config=config)


# ------------------------------------------------------------------------------------------------ op builds
# DeepSpeed's JIT-built C++ op that training does not use, kept from being built (checked on TESTED_DEEPSPEED;
# tests/runtime/test_deepspeed_ops.py fails when DeepSpeed's behaviour here changes).
#
# On a CPU machine `deepspeed.init_distributed` constructs `deepspeed.comm.torch.TorchBackend`, which calls
# `build_shm_op()`: it JIT-compiles DeepSpeed's `deepspeed_shm_comm` op with `torch.utils.cpp_extension.load` (88 s
# the first time on 2 cores; a ninja no-op later) inside torch's extension cache,
# `~/.cache/torch_extensions/<python>_cpu/deepspeed_shm_comm/`, guarded by the empty lock file `lock` there
# (`torch.utils.file_baton.FileBaton`: created on entry, removed on exit, waited on forever and silently while it
# exists). A run killed while it held the lock left the file behind, and every later run on the machine waited on
# it. The op serves only `deepspeed.comm.inference_all_reduce` (DeepSpeed-Inference's tensor-parallel layers);
# training's collectives (ZeRO's reduce-scatters and all-gathers, our all-to-alls and all-reduces) are
# torch.distributed's, through gloo on CPU. So nothing is built and no lock is taken.
#
# How: `build_shm_op` builds only when `deepspeed.ops.__compatible_ops__[name]` is true, DeepSpeed's probe of every
# op, computed once on first access and cached in that dict ("edits to it persist", DeepSpeed's comment says).
# `skip_unused_op_builds` sets the shared-memory op's entry to False before `init_distributed`. On a GPU machine the
# CUDA accelerator has no such builder and nothing changes.
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
