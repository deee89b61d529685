"""Build the model, the optimizer, the lr schedule and the DeepSpeed engine from the Hydra config.

Expert parallelism (`moe.ep_size` = P > 1): DeepSpeed's groups API (`deepspeed.utils.groups`) creates the
expert-parallel groups (P consecutive ranks: [0..P-1], [P..2P-1], …; the experts are split over one) and the
expert-data-parallel groups (the ranks holding the same experts: {r, r+P, r+2P, …}); the model gets its
expert-parallel group; the expert stacks are marked as DeepSpeed MoE parameters (`allreduce=False`,
`group_name="ep_size_P"`) and go into DeepSpeed MoE parameter groups (`moe: True`), which ZeRO-1/2 partition
and reduce over the expert-data-parallel group only (gradients are still divided by the whole world, as the
dense ones: the experts' tokens came from every rank); dense parameters stay over all ranks.

What this project changes in DeepSpeed itself (its engine and BF16 optimizer subclasses, the private groups
calls, the version check) is in ling/train/deepspeed_compat.py; engines are built through its `initialize_engine`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from omegaconf import DictConfig
from torch import nn

from fp8.adam import FP8AdamW
from fp8.linear import invalidate_fp8_weight_caches
from ling.checkpoint.hf import load_hf_checkpoint
from ling.config import ADAM_ABLATIONS, apply_fp8_ablation, fp8_ablation, plain_dict
from ling.train.deepspeed_compat import create_expert_groups, expert_group_name, initialize_engine
from ling.train.memory_plan import ZERO_BUCKET_ELEMENTS
from ling.train.schedule import lr_multiplier
from model.config import ModelConfig
from model.ling import LingForCausalLM
from model.moe import ROUTER_FP32_BUFFERS

OPTIM_KEYS = {"name", "lr", "betas", "eps", "weight_decay", "grad_clip", "schedule", "warmup_steps",
              "min_lr_ratio", "decay_fraction"}
FP8_OPTIM_KEYS = {"block_size", "min_fp8_numel", "rounding"}


def expert_parallel_group(ep_size: int, zero_stage: int):
    """This rank's expert-parallel process group for `moe.ep_size` (None for 1), created once with DeepSpeed's
    groups API together with the expert-data-parallel groups ZeRO reduces the experts over
    (deepspeed_compat.create_expert_groups)."""
    if ep_size == 1:
        return None
    if zero_stage not in (1, 2):
        raise ValueError(f"moe.ep_size={ep_size} needs deepspeed.zero_stage 1 or 2 (got {zero_stage}): DeepSpeed "
                         "reduces MoE parameter groups over their expert-data-parallel group only under ZeRO-1/2")
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world % ep_size:
        raise ValueError(f"moe.ep_size={ep_size} does not divide the world size ({world} ranks): the experts are "
                         "split over groups of ep_size consecutive ranks")
    return create_expert_groups(ep_size)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices; no decay for 1-D parameters (norm gains)."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
              {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]
    return [g for g in groups if g["params"]]


def moe_param_groups(model: LingForCausalLM, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mark the expert stacks as DeepSpeed MoE parameters and move them into MoE parameter groups (same
    hyper-parameters as the group each came from, `moe: True`, named after their expert-parallel group)."""
    for _, p in model.expert_parameters():
        p.allreduce = False
        p.group_name = expert_group_name(model.config.ep_size)
    return split_params_into_different_moe_groups_for_optimizer(groups)


def check_deepspeed_config(ds_config: dict[str, Any], optim_name: str) -> None:
    """Refuse DeepSpeed settings the optimizer cannot work under. FP8AdamW keeps one scale per block of
    elements, which ZeRO's elastic checkpoint (zero_optimization.elastic_checkpoint=true) trims and
    re-partitions as if it were per element."""
    zero = ds_config.get("zero_optimization", {}) or {}
    if optim_name == "fp8_adamw" and zero.get("elastic_checkpoint", False):
        raise ValueError(
            "optim=fp8_adamw keeps one scale per block of elements, which DeepSpeed's elastic checkpoint "
            "(zero_optimization.elastic_checkpoint=true) trims and re-partitions as if it were per element; "
            "set zero_optimization.elastic_checkpoint=false (the default)"
        )


def cap_zero_buckets(ds_config: dict[str, Any], num_parameters: int) -> None:
    """ZeRO's optimizers allocate their gradient reduce bucket (ZeRO-1/2 also an allgather bucket) at the configured
    size, DeepSpeed's default of ZERO_BUCKET_ELEMENTS, whatever the model's size: gigabytes for a small model, anew
    every micro-batch (and NaN-filled in deterministic mode). A bucket beyond the model's parameter count never
    holds more, so each size the config leaves unset is capped at that count (rounded up to even, DeepSpeed's
    allgather alignment). In place on `ds_config`; ZeRO-0 and sizes the user set are left alone."""
    zero = ds_config["zero_optimization"]
    stage = int(zero.get("stage", 0))
    cap = num_parameters + num_parameters % 2
    if stage == 0 or cap >= ZERO_BUCKET_ELEMENTS:
        return
    for key in ("reduce_bucket_size", "allgather_bucket_size") if stage <= 2 else ("reduce_bucket_size",):
        zero.setdefault(key, cap)


def build_optimizer(groups: Iterable[dict[str, Any]], optim: DictConfig,
                    ablate: frozenset[str] = frozenset()) -> torch.optim.Optimizer:
    """`optim.name`: "adamw" (torch AdamW, fp32 moments) or "fp8_adamw" (E4M3 moments, `fp8.adam`); `ablate`
    may keep FP8AdamW's moments in fp32 (adam_m, adam_v)."""
    known = OPTIM_KEYS | (FP8_OPTIM_KEYS if optim.get("name") == "fp8_adamw" else set())
    unknown = sorted(set(optim.keys()) - known)
    if unknown:
        raise ValueError(f"optim.{unknown[0]}: unknown optimizer key for optim.name={optim.get('name')!r}")
    common = {"lr": float(optim.lr), "betas": tuple(float(b) for b in optim.betas), "eps": float(optim.eps),
              "weight_decay": float(optim.weight_decay)}
    groups = list(groups)
    if optim.name == "adamw":
        # fused on GPU: one kernel per step and no foreach temporaries (which cost ~20 GB on a 5.6B model)
        on_cuda = any(p.is_cuda for g in groups for p in g["params"])
        return torch.optim.AdamW(groups, **common, fused=True if on_cuda else None)
    if optim.name == "fp8_adamw":
        return FP8AdamW(groups, **common, block_size=int(optim.block_size), min_fp8_numel=int(optim.min_fp8_numel),
                        rounding=str(optim.get("rounding", "stochastic")),
                        fp32_moments=[ADAM_ABLATIONS[a] for a in sorted(ablate & set(ADAM_ABLATIONS))])
    raise ValueError(f"optim.name={optim.name!r} is unknown (known: adamw, fp8_adamw)")


GRAD_ACCUM_DTYPES = ("fp32", "bf16")


def deepspeed_config(cfg: DictConfig, use_bf16: bool) -> dict[str, Any]:
    """The DeepSpeed JSON config from `train`, `optim` and `deepspeed` nodes."""
    ds = cfg.deepspeed
    zero: dict[str, Any] = {"stage": int(ds.zero_stage)}
    zero.update(plain_dict(ds.get("zero_extra")))
    conf: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": int(cfg.train.micro_batch_size),
        "gradient_accumulation_steps": int(cfg.train.grad_accum),
        "gradient_clipping": float(cfg.optim.grad_clip),
        "zero_optimization": zero,
        # skip a step whose gradients are not finite (the non-finite guard relies on it, ling/train/guard.py)
        "bf16": {"enabled": use_bf16, "check_grad_overflow": True},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer (on by default, unused here: the trainer times its own steps) synchronizes
        # the device at every micro-batch's forward and step(); each sync empties the GPU's queue, which then waits
        # while the host launches the next forward (812 ms of syncs per e64 fp8@4 step under cProfile)
        "timers": {"throughput": {"enabled": False}},
    }
    accum = ds.get("grad_accum_dtype")
    if accum is not None:
        if accum not in GRAD_ACCUM_DTYPES:
            raise ValueError(f"deepspeed.grad_accum_dtype={accum!r} is unknown (known: {', '.join(GRAD_ACCUM_DTYPES)}, "
                             "null = DeepSpeed's default, the model's dtype)")
        if accum == "fp32" and int(ds.zero_stage) == 0 and use_bf16:
            raise ValueError("deepspeed.grad_accum_dtype=fp32 needs deepspeed.zero_stage 1, 2 or 3 (got 0): DeepSpeed "
                             "refuses fp32 gradient accumulation for bf16 without ZeRO; use deepspeed=zero1, or "
                             "grad_accum_dtype=null")
        if accum == "fp32" and int(ds.zero_stage) == 1 and use_bf16:
            # ZeRO-1 + bf16 + fp32 runs through DeepSpeed's BF16_Optimizer: each micro-batch's bf16 gradient is
            # added into an fp32 gradient in its post-accumulate hook and freed (immediate_grad_update), and the
            # boundary all-reduces the fp32 sums. Its all-reduce would round them to bf16 (1.7e-3 off the exact
            # sum, tests/runtime/test_grad_accum.py) unless it communicates in fp32.
            conf["communication_data_type"] = "fp32"
            conf["bf16"]["immediate_grad_update"] = True
        if use_bf16:  # fp32 runs accumulate in fp32 anyway
            conf["data_types"] = {"grad_accum_dtype": accum}
    if use_bf16:
        # the routers' fp32 buffers: under ZeRO-3, zero.Init builds them in bf16 and the engine upcasts these names
        conf.setdefault("data_types", {})["keep_in_fp32_modules"] = list(ROUTER_FP32_BUFFERS)
    conf.update(plain_dict(ds.get("extra")))
    return conf


def init_partitioned_parameters(model: LingForCausalLM) -> None:
    """Under `zero.Init` each module's parameters are partitioned as soon as the module is built, so the
    model's own initialisation ran on empty shards. Gather each parameter, initialise it on rank 0 and let
    DeepSpeed scatter the result (one parameter at a time, so no rank ever holds the whole model)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    for name, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
            if rank == 0:
                model.init_parameter(name, p)


def bf16_enabled(cfg: DictConfig, device: torch.device) -> bool:
    """`deepspeed.bf16`: auto (the default: bf16 weights and gradients on GPU, fp32 on CPU), true (bf16 on CPU
    too: slow, but it runs DeepSpeed's bf16 code paths, e.g. ZeRO-1's BF16_Optimizer, where CI can test them) or
    false (fp32 everywhere)."""
    value = cfg.deepspeed.get("bf16", "auto")
    if value == "auto":
        return device.type == "cuda"
    if isinstance(value, bool):
        return value
    raise ValueError(f"deepspeed.bf16={value!r}: expected auto, true or false")


def build_engine(cfg: DictConfig, model_config: ModelConfig, device: torch.device):
    """→ (DeepSpeed engine, LambdaLR scheduler). bf16 per `deepspeed.bf16` (bf16_enabled); ZeRO stage from config."""
    use_bf16 = bf16_enabled(cfg, device)
    ep_group = expert_parallel_group(model_config.ep_size, int(cfg.deepspeed.zero_stage))
    ds_config = deepspeed_config(cfg, use_bf16)
    check_deepspeed_config(ds_config, cfg.optim.name)  # before anything is built: refusals come fast
    ablate = fp8_ablation(cfg)
    if int(cfg.deepspeed.zero_stage) == 3:
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = LingForCausalLM(model_config)
        init_partitioned_parameters(model)
    else:
        with torch.device(device):
            model = LingForCausalLM(model_config, ep_group)
    if cfg.train.get("init_from"):  # start from an HF (BailingMoeV2) checkpoint: exported or published weights
        load_hf_checkpoint(model, cfg.train.init_from)
    apply_fp8_ablation(model, ablate)
    cap_zero_buckets(ds_config, sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()))  # ZeRO-3: whole
    groups = param_groups(model, float(cfg.optim.weight_decay))
    optimizer = build_optimizer(moe_param_groups(model, groups) if ep_group is not None else groups, cfg.optim,
                                ablate)
    # DeepSpeed writes updated weights through `.data` (no autograd version bump): after every optimizer step
    # (whoever calls it: ZeRO's wrapper, a test, another loop) each FP8 weight cache is re-quantized once.
    optimizer.register_step_post_hook(lambda *_: invalidate_fp8_weight_caches(model))
    schedule = lr_multiplier(cfg.optim.schedule, int(cfg.train.steps), int(cfg.optim.warmup_steps),
                             float(cfg.optim.min_lr_ratio), float(cfg.optim.decay_fraction))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    engine, _, _, scheduler = initialize_engine(model, optimizer, ds_config, scheduler,
                                                expert_parallel=ep_group is not None)
    return engine, scheduler
