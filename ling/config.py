"""The run config (Hydra's) → what the model and the FP8 recipe are told: the ModelConfig (the `model` node plus
the `moe`, `precision` and `fp8` nodes), the device, and the `fp8.ablate` switches. Shared by training,
evaluation and the checkpoint readers.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from fp8.linear import ABLATION_COMPONENTS, FP8Linear
from model.config import ModelConfig
from model.moe import GroupedExperts

MOE_KEYS = {"pad_for_fp8": "pad_for_fp8", "pad_multiple": "moe_pad_multiple", "ep_size": "ep_size"}  # → ModelConfig
# `fp8.ablate`: FP8 components kept in high precision, one switch each (README "FP8 ablation"): the FP8Linear
# GEMM operands (fp8.linear.ABLATION_COMPONENTS), the routed experts as a whole, FP8AdamW's two moments.
ADAM_ABLATIONS = {"adam_m": "exp_avg", "adam_v": "exp_avg_sq"}
EXPERTS_ABLATION = "experts"
FRESH = ("none", "null", "None", "")  # train.resume values that start a run afresh


def model_config_from(cfg: DictConfig, vocab_size_from_data: int | None) -> ModelConfig:
    """The `model` node + the `moe`/`precision`/`fp8` nodes → ModelConfig; vocab follows the data when null."""
    d: dict[str, Any] = OmegaConf.to_container(cfg.model, resolve=True)  # type: ignore[assignment]
    moe = plain_dict(cfg.moe)
    unknown = sorted(set(moe) - set(MOE_KEYS))
    if unknown:
        raise ValueError(f"moe.{unknown[0]}: unknown key (known: {', '.join(sorted(MOE_KEYS))})")
    for key, field in MOE_KEYS.items():
        if field in d:
            raise ValueError(f"model.{field}: set moe.{key} instead (the moe node carries it into the model)")
        if key in moe:
            d[field] = moe[key]
    d["precision"] = cfg.precision.name
    d.update(fp8_model_options(cfg.fp8))
    if d.get("vocab_size") is None:
        if vocab_size_from_data is None:
            raise ValueError("model.vocab_size is null and the data source reports no vocab size")
        d["vocab_size"] = vocab_size_from_data
    elif vocab_size_from_data is not None and d["vocab_size"] < vocab_size_from_data:
        raise ValueError(f"model.vocab_size={d['vocab_size']} is smaller than the tokenizer's vocab "
                         f"({vocab_size_from_data}); set model.vocab_size=null to follow the tokenizer")
    return ModelConfig.from_dict(d)


def fp8_model_options(fp8: DictConfig) -> dict[str, Any]:
    """The `fp8` node's model options → ModelConfig fields."""
    return {"fp8_recipe": fp8.recipe, "fp8_pow2_scales": bool(fp8.pow2_scales),
            "fp8_expert_wgrad": str(fp8.expert_wgrad)}


def fp8_ablation(cfg: DictConfig) -> frozenset[str]:
    """The validated `fp8.ablate` list (empty when absent)."""
    ablate = frozenset(cfg.fp8.get("ablate") or ())
    known = (*ABLATION_COMPONENTS, EXPERTS_ABLATION, *ADAM_ABLATIONS)
    unknown = sorted(ablate - set(known))
    if unknown:
        raise ValueError(f"fp8.ablate: unknown component(s) {unknown}; known: {list(known)}")
    if ablate & set(ADAM_ABLATIONS) and cfg.optim.name != "fp8_adamw":
        raise ValueError(f"fp8.ablate={sorted(ablate)}: adam_m / adam_v need optim=fp8_adamw, got "
                         f"optim.name={cfg.optim.name!r}")
    linear = ablate - set(ADAM_ABLATIONS)
    if linear and cfg.precision.name != "fp8":
        raise ValueError(f"fp8.ablate={sorted(linear)} needs precision=fp8 (got precision={cfg.precision.name})")
    return ablate


def apply_fp8_ablation(model: nn.Module, ablate: frozenset[str]) -> None:
    """Switch the model's FP8 components named in `ablate` to high precision (FP8Linear operands; the routed
    experts' grouped GEMMs with "experts")."""
    for m in model.modules():
        if isinstance(m, FP8Linear):
            m.set_ablation(ablate & set(ABLATION_COMPONENTS))
        elif isinstance(m, GroupedExperts) and EXPERTS_ABLATION in ablate:
            m.fp8 = False  # the bf16 grouped-GEMM path (torch._grouped_mm), same weights


def resolve_device(cfg: DictConfig) -> torch.device:
    want = cfg.train.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("train.device=cuda but CUDA is not available")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if want != "cpu":
        raise ValueError(f"train.device={want!r} is unknown (known: auto, cpu, cuda)")
    return torch.device("cpu")


def plain_dict(node: Any) -> dict[str, Any]:
    """A config node (or mapping, or None) as a plain dict."""
    if node is None:
        return {}
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node)
