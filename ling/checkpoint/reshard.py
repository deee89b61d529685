"""Resume a ZeRO-1/2 checkpoint under another `moe.ep_size` or another optimizer (at the same world size).

Another optimizer: AdamW's fp32 moments ↔ FP8AdamW's block-scaled E4M3 ones (a branch of a BF16 + AdamW run
trained on in FP8 + FP8AdamW, or back: scripts/parity_branch.sh). The same per-parameter path below reads the
saved moments in fp32 and writes them in this optimizer's format.

When the experts move between ranks, every flat optimizer partition changes: MoE parameter groups
(partitioned over the expert-data-parallel groups) appear, disappear or change size, and the dense groups
gain or lose the expert stacks. So the saved state is reassembled per parameter and copied into this
engine's own partitions:

- the module (weights in the training dtype, buffers such as the expert bias): the model-states file for the
  dense tensors, the expert shards (or the model-states file, from ep_size 1) for the expert stacks; each rank
  keeps its experts;
- the fp32 master weights and the optimizer moments, per element, from every rank's ZeRO file. There
  `param_slice_mappings` says where each parameter's piece sits in that rank's flat partition; the pieces of
  a parameter follow each other in partition order (the ranks in order; for an expert stack, the ranks that
  hold it, in the order of their expert-data-parallel group, recorded in each rank's trainer state), and the
  expert stack of expert-parallel rank k is slice k of the whole stack. Each rank fills the fragments its
  partitions hold (DeepSpeed's `_hp_mapping` of each parameter: where its fragment sits in the parameter and
  in the partition) and reads only those bytes: the files are memory-mapped;
- moments as fp32 per element: torch AdamW's copy exactly; FP8AdamW's block-scaled E4M3 moments are
  dequantized from the saved blocks and quantized again in the new partitions' blocks, whose boundaries have
  moved, so they round again (within E4M3's resolution) and the continued run matches to a tolerance only;
- the lr scheduler (its per-group lists resized: every group has the same lr) and DeepSpeed's step counters.

Not carried over: ZeRO's loss scaler (bf16 and fp32 training do not scale the loss).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fp8.adam import MOMENTS, FP8AdamW, moment_slice, state_from_moments
from ling.checkpoint.layout import EXPERT_SHARD, MODEL_STATES, TRAINER_STATE, ZERO_OPTIM_STATES
from ling.checkpoint.safe_load import load_pt
from ling.ranks import rank_world


def zero_file(folder: Path, rank: int) -> Path:
    """Rank `rank`'s ZeRO-1/2 optimizer file in a checkpoint folder: DeepSpeed names it `bf16_zero_pp_rank_…`
    when the run trained in bf16 (ZeRO-2 and ZeRO-1's BF16_Optimizer alike: every GPU run) and `zero_pp_rank_…`
    otherwise."""
    plain = folder / ZERO_OPTIM_STATES.format(rank=rank)
    for path in (folder / f"bf16_{plain.name}", plain):
        if path.is_file():
            return path
    raise FileNotFoundError(f"{folder}: no ZeRO optimizer file of rank {rank} ({plain.name} or bf16_{plain.name}); "
                            "re-assembling a checkpoint for another moe.ep_size or optimizer needs the ZeRO-1/2 "
                            "files of every rank")


@dataclass
class _Piece:
    """Elements lo … lo + numel − 1 of a whole (all-expert) flattened parameter, at `start` of saved rank
    `rank`'s partition of its param group `group`."""

    rank: int
    group: int
    start: int
    lo: int
    numel: int


class SavedZeroState:
    """Every rank's ZeRO-1/2 optimizer file of one checkpoint, memory-mapped, read by parameter name and
    element range of the whole parameter."""

    def __init__(self, folder: Path, world: int, expert_names: set[str], numel: dict[str, int]) -> None:
        self.sds = [load_pt(zero_file(folder, r), mmap=True)["optimizer_state_dict"] for r in range(world)]
        layouts = [load_pt(folder / TRAINER_STATE.format(rank=r))["expert_parallel"] for r in range(world)]
        self.ep_size = layouts[0]["ep_size"]
        found: dict[str, list[tuple[tuple[int, int], int, int, Any]]] = {}
        for r, sd in enumerate(self.sds):
            for g, mapping in enumerate(sd["param_slice_mappings"]):
                sharded = self.ep_size > 1 and sd["base_optimizer_state"]["param_groups"][g].get("moe", False)
                order = (layouts[r]["ep_rank"], layouts[r]["edp_rank"]) if sharded else (0, r)
                for name, frag in mapping.items():
                    found.setdefault(name, []).append((order, r, g, frag))
        self.pieces: dict[str, list[_Piece]] = {}
        for name, parts in found.items():
            per_rank = numel[name] // self.ep_size if name in expert_names and self.ep_size > 1 else numel[name]
            done: dict[int, int] = {}  # elements so far of each expert-parallel rank's stack
            for (ep_rank, _), r, g, frag in sorted(parts, key=lambda t: t[0]):
                lo = ep_rank * per_rank + done.get(ep_rank, 0)
                self.pieces.setdefault(name, []).append(_Piece(r, g, frag.start, lo, frag.numel))
                done[ep_rank] = done.get(ep_rank, 0) + frag.numel
        first = self.sds[0]["base_optimizer_state"]
        self.step = float(first["state"][first["param_groups"][0]["params"][0]]["step"])

    def _group_state(self, rank: int, group: int) -> tuple[dict[str, Any], dict[str, Any]]:
        base = self.sds[rank]["base_optimizer_state"]
        param_group = base["param_groups"][group]
        return base["state"][param_group["params"][0]], param_group

    def read(self, name: str, lo: int, numel: int, key: str, device: torch.device) -> torch.Tensor:
        """fp32 [numel]: elements lo … of the whole flattened `name`; key "fp32" (master weights) or a moment."""
        out = torch.empty(numel, dtype=torch.float32, device=device)
        covered = 0
        for pc in self.pieces.get(name, []):
            a, b = max(lo, pc.lo), min(lo + numel, pc.lo + pc.numel)
            if a >= b:
                continue
            start, n = pc.start + a - pc.lo, b - a
            if key == "fp32":
                part = self.sds[pc.rank]["single_partition_of_fp32_groups"][pc.group][start : start + n]
            else:
                state, group = self._group_state(pc.rank, pc.group)
                part = _moment_slice(state, group, key, start, n)
            out[a - lo : b - lo] = part.to(device=device, dtype=torch.float32)
            covered += n
        if covered != numel:
            raise ValueError(f"the checkpoint's optimizer state holds {covered} of the {numel} elements of {name} "
                             f"asked for (from element {lo}): not this model's checkpoint?")
        return out


def _moment_slice(state: dict[str, Any], group: dict[str, Any], key: str, start: int, n: int) -> torch.Tensor:
    if "block_size" in group:  # FP8AdamW
        return moment_slice(state, key, start, n, int(group["block_size"]))
    return state[key][start : start + n]


def _new_state(optimizer: torch.optim.Optimizer, group: dict[str, Any], m: torch.Tensor, v: torch.Tensor,
               step: float) -> dict[str, Any]:  # fmt: skip
    if isinstance(optimizer, FP8AdamW):
        return state_from_moments(m, v, step, int(group["block_size"]), int(group["min_fp8_numel"]),
                                  optimizer.fp32_moments)  # an ablated moment (fp8.ablate adam_m / adam_v) in fp32
    if isinstance(optimizer, torch.optim.AdamW):
        return {"step": torch.tensor(step, dtype=torch.float32), "exp_avg": m, "exp_avg_sq": v}
    raise TypeError(f"re-partitioning a checkpoint supports AdamW and FP8AdamW, not {type(optimizer).__name__}")


def _module_state(folder: Path, saved: dict[str, torch.Tensor], saved_ep: int, model) -> dict[str, torch.Tensor]:
    """This rank's module state from a checkpoint written with `saved_ep` (`saved`: its model-states file's
    module state; the expert stacks from the shards, one whole stack at a time)."""
    shards = [load_pt(folder / EXPERT_SHARD.format(ep_rank=k, ep_size=saved_ep), mmap=True)
              for k in range(saved_ep)] if saved_ep > 1 else []  # fmt: skip
    state = {}
    for name in model.state_dict():
        shard = model.expert_shard(name)
        whole = torch.cat([s[name] for s in shards]) if shards and name in shards[0] else saved[name]
        state[name] = whole[shard] if shard is not None else whole
    return state


def _lr_scheduler_state(saved: dict[str, Any], groups: int) -> dict[str, Any]:
    """LambdaLR's state keeps one entry per param group; the group count changes with moe.ep_size."""
    state = dict(saved)
    for key in ("base_lrs", "_last_lr"):
        if key in state:
            if len(set(state[key])) != 1:
                raise ValueError(f"the checkpoint's param groups have different learning rates ({key}="
                                 f"{state[key]}): cannot map them onto another moe.ep_size's groups")
            state[key] = [state[key][0]] * groups
    state["lr_lambdas"] = [None] * groups
    return state


def _flat_partitions(zero) -> list[tuple[torch.Tensor, list[torch.nn.Parameter]]] | None:
    """Per param group: this rank's flat fp32 master partition and the group's parameters (each with DeepSpeed's
    `_hp_mapping` of its fragment in that partition), for DeepSpeed's ZeRO-1/2 optimizer and for its
    BF16_Optimizer (ZeRO-1 with bf16 and fp32 accumulation); None for any other engine optimizer."""
    if hasattr(zero, "single_partition_of_fp32_groups"):
        return list(zip(zero.single_partition_of_fp32_groups, zero.bit16_groups))
    if hasattr(zero, "fp32_groups_flat_partition"):
        return list(zip(zero.fp32_groups_flat_partition, zero.bf16_groups))
    return None


@torch.no_grad()
def load_resharded(engine, folder: Path, saved_ep: int) -> None:
    """Load checkpoint `folder`, written with moe.ep_size=`saved_ep` by as many ranks as this run has, into
    `engine` (ZeRO-1/2; another moe.ep_size and/or another optimizer): module, fp32 master weights, optimizer
    moments (in this engine's optimizer's format), lr scheduler and step counters. Every rank calls it."""
    zero, model = engine.optimizer, engine.module
    partitions = _flat_partitions(zero)
    if partitions is None:
        raise ValueError(f"checkpoint {folder} (moe.ep_size={saved_ep}) needs re-assembling for this run (moe.ep_size="
                         f"{model.config.ep_size}, or another optimizer), which works on ZeRO-1/2 optimizer state, "
                         "not this engine's: use deepspeed=zero1 or zero2")
    _, world = rank_world()
    client = load_pt(folder / MODEL_STATES, mmap=True)
    model.load_state_dict(_module_state(folder, client["module"], saved_ep, model))
    names = {id(p): n for n, p in model.named_parameters()}
    whole = {n: p.numel() * (model.config.ep_size if model.expert_shard(n) is not None else 1)
             for n, p in model.named_parameters()}  # fmt: skip
    saved = SavedZeroState(folder, world, {n for n, _ in model.expert_parameters()}, whole)
    base = zero.optimizer
    new_states = {}
    for i, (flat, params) in enumerate(partitions):
        moments = {key: torch.zeros_like(flat) for key in MOMENTS}
        for p in params:
            mapping = getattr(p, "_hp_mapping", None)
            if mapping is None:  # none of p's elements sit in this rank's partition
                continue
            name = names[id(p)]
            shard = model.expert_shard(name)
            lo = (shard.start * p[0].numel() if shard is not None else 0) + mapping.lp_fragment_address.start
            hp = mapping.hp_fragment_address
            n = hp.numel
            flat[hp.start : hp.start + n] = saved.read(name, lo, n, "fp32", flat.device)
            for key in MOMENTS:
                moments[key][hp.start : hp.start + n] = saved.read(name, lo, n, key, flat.device)
        new_states[i] = _new_state(base, base.param_groups[i], moments["exp_avg"], moments["exp_avg_sq"], saved.step)
    state_dict = base.state_dict()
    lr = saved.sds[0]["base_optimizer_state"]["param_groups"][0]["lr"]
    for group in state_dict["param_groups"]:
        group["lr"] = lr
    base.load_state_dict({"state": new_states, "param_groups": state_dict["param_groups"]})
    if engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(_lr_scheduler_state(client["lr_scheduler"], len(base.param_groups)))
    engine.global_steps, engine.skipped_steps = client["global_steps"], client["skipped_steps"]
    engine.global_samples = client["global_samples"]
