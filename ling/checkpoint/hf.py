"""Hugging Face interchange in the BailingMoeV2 layout of the published Ling-mini-2.0.

Export (`save_hf`): our state_dict → the reference's parameter names (`modeling_bailing_moe_v2.py`, inclusionAI
Ling-V2): stacked experts split into `mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight`, fused gate|up
split into `gate_proj` / `up_proj`, the router as `mlp.gate.weight` + `mlp.gate.expert_bias`, MTP depth k as
`model.layers.{num_layers + k}` (`enorm`, `hnorm`, `eh_proj`, the layer's own modules, `final_layernorm`);
a `config.json` with BailingMoeV2Config's field names, safetensors shards with an index, and the tokenizer.
`fp8=True` stores the linears DeepSeek-V3 / Ling quantize as E4M3 with fp32 128x128 `weight_scale_inv`.

Import (`load_hf_checkpoint`): the same layout back, one file or sharded, any float dtype, exact; each tensor
is read lazily (one parameter at a time), so a rank never holds a second copy of the model.

    python -m ling.checkpoint.hf export runs/NAME OUT_DIR [--fp8] [--dtype bf16|fp32] [--max-shard-size 5GB]
    python -m ling.checkpoint.hf check HF_DIR            # names, shapes and config against our model; prints a summary
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from data.config import DataError
from data.tokenizer import Tokenizer, tokenizer_json_from_sentencepiece
from fp8.quant import BLOCK, dequantize_128x128, quantize_128x128
from ling.checkpoint.safe_load import UnsafeCheckpointError
from ling.checkpoint.weights import find_checkpoint, name_list, read_model_state, run_tokenizer
from model.config import ModelConfig
from model.ling import LingForCausalLM

MODEL_TYPE = "bailing_moe"
ARCHITECTURE = "BailingMoeV2ForCausalLM"
# the reference modeling code (inclusionAI/Ling-V2 models/, or the Ling-mini-2.0 model repository): not ours to
# ship; `save_hf(modeling_code=DIR)` copies these two files from DIR and writes the auto_map that names them
REFERENCE_CODE_FILES = ("configuration_bailing_moe_v2.py", "modeling_bailing_moe_v2.py")
AUTO_MAP = {
    "AutoConfig": "configuration_bailing_moe_v2.BailingMoeV2Config",
    "AutoModel": "modeling_bailing_moe_v2.BailingMoeV2Model",
    "AutoModelForCausalLM": "modeling_bailing_moe_v2.BailingMoeV2ForCausalLM",
}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SCALE_SUFFIX = "_scale_inv"  # DeepSeek-V3 naming: `<linear>.weight_scale_inv`, dequantized = weight · scale_inv
log = logging.getLogger(__name__)
OWN_KEY = "ling_fp8"  # config.json sub-dict with our training-only settings (ignored by the reference)
# linears stored in FP8 by `fp8=True` (as DeepSeek-V3 / Ling): attention, dense MLP, experts, shared experts.
# Embeddings, LM head, norms, the router and MTP's eh_proj stay in high precision.
_FP8_LINEAR = re.compile(r"\.(query_key_value|dense|gate_proj|up_proj|down_proj)\.weight$")


class HFCheckpointError(ValueError):
    """An HF checkpoint that does not fit: missing/unexpected tensors, other shapes, FP8 where bf16 is needed."""


# ------------------------------------------------------------------------------------------------ config
# What the reference uses for a config.json field that is absent (a hand-written or trimmed file, another tool's):
# BailingMoeV2Config.__init__'s defaults (inclusionAI/Ling-V2, models/configuration_bailing_moe_v2.py); and for
# partial_rotary_factor, which that class does not define (its save_pretrained writes it only when it was given),
# the fallback of the modeling code (models/modeling_bailing_moe_v2.py, BailingMoeV2Attention, and transformers'
# default RoPE: 1.0). Its save_pretrained writes no model_type (the class sets none).
REFERENCE_DEFAULTS: dict[str, Any] = {
    "vocab_size": 157184, "hidden_size": 2048, "intermediate_size": 5120, "num_hidden_layers": 20,
    "num_attention_heads": 16, "num_key_value_heads": 4, "hidden_act": "silu", "use_qkv_bias": False,
    "use_bias": False, "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "embedding_dropout": 0.0,
    "attention_dropout": 0.0, "output_dropout": 0.0, "initializer_range": 0.02, "max_position_embeddings": 32768,
    "rope_theta": 600000.0, "use_cache": True, "max_window_layers": 20, "rope_scaling": None,
    "pad_token_id": 156892, "eos_token_id": 156892, "num_experts": 256, "num_shared_experts": 1,
    "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "moe_intermediate_size": 512,
    "first_k_dense_replace": 1, "head_dim": 128, "output_router_logits": False, "use_qk_norm": True,
    "num_nextn_predict_layers": 0, "mtp_loss_scaling_factor": 0, "moe_router_enable_expert_bias": True,
    "routed_scaling_factor": 1.0,
    "partial_rotary_factor": 1.0,
}
MODEL_TYPES = (MODEL_TYPE, "bailing_moe_v2")


def hf_config(config: ModelConfig, *, eos_token_id: int | None = None, pad_token_id: int | None = None,
              bos_token_id: int | None = None, max_position_embeddings: int = 32768,
              dtype: str = "bfloat16") -> dict[str, Any]:
    """ModelConfig → config.json (BailingMoeV2Config field names, as in the published Ling-mini-2.0; every field
    written, so the file reads the same whatever a reader's defaults are)."""
    c = config
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.dense_intermediate_size,
        "num_hidden_layers": c.num_layers,
        "first_k_dense_replace": c.num_dense_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "partial_rotary_factor": c.rotary_fraction,
        "rotary_dim": c.rotary_dim,
        "rope_theta": c.rope_base,
        "rope_scaling": None,
        "max_position_embeddings": max_position_embeddings,
        "use_qk_norm": True,
        "use_qkv_bias": False,
        "use_bias": False,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_eps,
        "initializer_range": c.init_std,
        "tie_word_embeddings": False,
        "embedding_dropout": 0.0,
        "attention_dropout": 0.0,
        "output_dropout": 0.0,
        "num_experts": c.num_experts,
        "num_experts_per_tok": c.num_experts_per_tok,
        "num_shared_experts": c.num_shared_experts,
        "moe_intermediate_size": c.expert_intermediate_size,
        "moe_shared_expert_intermediate_size": c.expert_intermediate_size * c.num_shared_experts,
        "n_group": c.num_expert_groups,
        "topk_group": c.topk_groups,
        "routed_scaling_factor": c.routed_scaling_factor,
        "norm_topk_prob": True,
        "score_function": "sigmoid",
        "router_dtype": "fp32",
        "moe_router_enable_expert_bias": True,
        "num_nextn_predict_layers": c.num_mtp_layers,
        # the reference adds factor × each depth's loss; we add weight × their mean
        "mtp_loss_scaling_factor": c.mtp_loss_weight / c.num_mtp_layers if c.num_mtp_layers else c.mtp_loss_weight,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "bos_token_id": bos_token_id,
        "use_cache": True,
        "dtype": dtype,
        OWN_KEY: {"z_loss_coef": c.z_loss_coef, "aux_loss_coef": c.aux_loss_coef,
                  "bias_update_rate": c.bias_update_rate, "mtp_loss_weight": c.mtp_loss_weight},
    }


# config.json field → ModelConfig field, for the fields that shape the model (checked on import)
_SHAPE_FIELDS = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "dense_intermediate_size",
    "num_hidden_layers": "num_layers", "first_k_dense_replace": "num_dense_layers",
    "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim",
    "num_experts": "num_experts", "moe_intermediate_size": "expert_intermediate_size",
    "num_shared_experts": "num_shared_experts", "num_nextn_predict_layers": "num_mtp_layers",
}
# fields that change the maths but not the shapes
_MATH_FIELDS = {
    "partial_rotary_factor": "rotary_fraction", "rope_theta": "rope_base", "rms_norm_eps": "rms_eps",
    "num_experts_per_tok": "num_experts_per_tok", "n_group": "num_expert_groups", "topk_group": "topk_groups",
    "routed_scaling_factor": "routed_scaling_factor",
}
# settings the reference has and our model implements one value of: field → (accepted values, what ours does)
_FIXED_SETTINGS: dict[str, tuple[tuple[Any, ...], str]] = {
    "hidden_act": (("silu", "swish"), "SwiGLU MLPs and experts (silu)"),
    "use_qkv_bias": ((False,), "no bias in query_key_value"),
    "use_bias": ((False,), "no bias in the attention output"),
    "use_qk_norm": ((True,), "RMSNorm on queries and keys"),
    "tie_word_embeddings": ((False,), "a separate lm_head"),
    "rope_scaling": ((None, {}), "plain RoPE (no scaling)"),
    "score_function": (("sigmoid",), "sigmoid router scores"),
}


def reference_config(hf: Mapping[str, Any]) -> dict[str, Any]:
    """config.json with every absent field at the reference's value (REFERENCE_DEFAULTS); a null or 0 head_dim
    is hidden_size // num_attention_heads, a null num_shared_experts none, as in the reference."""
    filled = {**REFERENCE_DEFAULTS, "score_function": "sigmoid", **hf}
    if not filled["head_dim"] and isinstance(filled["hidden_size"], int) \
            and isinstance(filled["num_attention_heads"], int) and filled["num_attention_heads"] > 0:
        filled["head_dim"] = filled["hidden_size"] // filled["num_attention_heads"]
    if filled["num_shared_experts"] is None:
        filled["num_shared_experts"] = 0
    return filled


def check_hf_config(hf: Mapping[str, Any], source: str = "config.json") -> dict[str, Any]:
    """The one check of an HF config (`python -m ling.checkpoint.hf check`, eval.py, train.init_from): a
    BailingMoeV2 config whose settings our model implements. A missing model_type (the reference's own
    save_pretrained writes none) is fine when `architectures` says BailingMoeV2. Returns the config with the
    reference's defaults filled in (`reference_config`); raises HFCheckpointError naming each field at fault."""
    archs = hf.get("architectures") or []
    archs = [archs] if isinstance(archs, str) else list(archs)
    model_type = hf.get("model_type") or None
    if archs and not any(str(a).startswith("BailingMoeV2") for a in archs):
        raise HFCheckpointError(f"{source}: architectures={archs!r} is not BailingMoeV2 ({ARCHITECTURE!r})")
    if model_type is not None and model_type not in MODEL_TYPES:
        raise HFCheckpointError(f"{source}: model_type={model_type!r} is not BailingMoeV2 ({MODEL_TYPE!r})")
    if not archs and model_type is None:
        raise HFCheckpointError(f"{source}: neither model_type nor architectures says BailingMoeV2 "
                                f"(expected architectures [{ARCHITECTURE!r}])")
    filled = reference_config(hf)
    problems = [f"{k}={filled[k]!r} (ours: {what})" for k, (ok, what) in _FIXED_SETTINGS.items()
                if filled[k] not in ok]
    numbers = [k for k in {**_SHAPE_FIELDS, **_MATH_FIELDS, "mtp_loss_scaling_factor": 0, "initializer_range": 0}
               if not isinstance(filled[k], (int, float)) or isinstance(filled[k], bool)]
    if "num_experts" in numbers and filled["num_experts"] is None:
        numbers.remove("num_experts")
        problems.append("num_experts=None (a dense model; ours is a mixture of experts)")
    problems += [f"{k}={filled[k]!r} (expected a number)" for k in numbers]
    if filled["num_experts_per_tok"] == 1:
        problems.append("num_experts_per_tok=1 (the reference leaves a single expert's gate unnormalised; ours "
                        "normalises the chosen gates to sum 1)")
    if problems:
        raise HFCheckpointError(f"{source}: settings our model does not implement: " + "; ".join(problems))
    return filled


def model_config_from_hf(hf: Mapping[str, Any], source: str = "config.json", **overrides: Any) -> ModelConfig:
    """config.json → ModelConfig: absent fields take the reference's defaults; our training-only settings come
    from its `ling_fp8` entry, else from the reference's mtp_loss_scaling_factor and our defaults."""
    filled = check_hf_config(hf, source)
    d: dict[str, Any] = {ours: filled[theirs] for theirs, ours in {**_SHAPE_FIELDS, **_MATH_FIELDS}.items()}
    d["mtp_loss_weight"] = filled["mtp_loss_scaling_factor"] * max(d["num_mtp_layers"], 1)  # sum → mean
    d["init_std"] = filled["initializer_range"]
    d.update(hf.get(OWN_KEY) or {})
    d.update(overrides)
    try:
        return ModelConfig(**d)
    except ValueError as e:
        raise HFCheckpointError(f"{source}: not a model ours can build: {e}") from e


def config_differences(hf: Mapping[str, Any], config: ModelConfig) -> list[str]:
    """The shape- and maths-relevant fields where config.json (absent fields at the reference's defaults) and
    `config` disagree, as readable lines."""
    filled = reference_config(hf)
    out = []
    for theirs, ours in {**_SHAPE_FIELDS, **_MATH_FIELDS}.items():
        if filled[theirs] != getattr(config, ours):
            given = "" if theirs in hf else " (absent: the reference's default)"
            out.append(f"model.{ours}: checkpoint {theirs}={filled[theirs]!r}{given}, model {getattr(config, ours)!r}")
    return out


# ------------------------------------------------------------------------------------------------ names
@dataclass(frozen=True)
class TensorMap:
    """How one of our tensors maps to HF tensors.

    kind: "copy" (one to one) | "gate_up" (our fused [2I, H] rows gate | up ↔ gate_proj, up_proj) |
    "experts" (our stacked [E, ...] ↔ one tensor per expert) | "experts_gate_up" (stacked and fused ↔
    per expert gate_proj, up_proj; hf lists them expert-major: e0.gate, e0.up, e1.gate, ...).
    """

    ours: str
    hf: tuple[str, ...]
    kind: str


def _layer_map(prefix: str, rest: str, ours: str, num_experts: int) -> TensorMap:
    experts = range(num_experts)
    if rest == "mlp.router.weight":
        return TensorMap(ours, (prefix + "mlp.gate.weight",), "copy")
    if rest == "mlp.router.expert_bias":
        return TensorMap(ours, (prefix + "mlp.gate.expert_bias",), "copy")
    if rest == "mlp.experts.gate_up_proj":
        names = tuple(f"{prefix}mlp.experts.{e}.{p}.weight" for e in experts for p in ("gate_proj", "up_proj"))
        return TensorMap(ours, names, "experts_gate_up")
    if rest == "mlp.experts.down_proj":
        return TensorMap(ours, tuple(f"{prefix}mlp.experts.{e}.down_proj.weight" for e in experts), "experts")
    if rest.endswith("gate_up_proj.weight"):  # dense MLP and shared experts
        base = prefix + rest[: -len("gate_up_proj.weight")]
        return TensorMap(ours, (base + "gate_proj.weight", base + "up_proj.weight"), "gate_up")
    return TensorMap(ours, (prefix + rest,), "copy")


def tensor_map(name: str, config: ModelConfig) -> TensorMap:
    """Our state_dict key → its TensorMap."""
    if name in ("word_embeddings.weight", "norm.weight"):
        return TensorMap(name, ("model." + name,), "copy")
    if name == "lm_head.weight":
        return TensorMap(name, (name,), "copy")
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m:
        return _layer_map(f"model.layers.{m.group(1)}.", m.group(2), name, config.num_experts)
    m = re.fullmatch(r"mtp_layers\.(\d+)\.(?:transformer_layer\.)?(.+)", name)
    if m:  # the reference keeps an MTP layer's modules flat beside enorm / hnorm / eh_proj / final_layernorm
        return _layer_map(f"model.layers.{config.num_layers + int(m.group(1))}.", m.group(2), name,
                          config.num_experts)
    raise HFCheckpointError(f"no BailingMoeV2 name for our tensor {name!r}")


def state_dict_names(config: ModelConfig) -> list[tuple[str, torch.Size]]:
    """Our state_dict keys and shapes for `config`, from a model built on the meta device (no memory)."""
    with torch.device("meta"):
        model = LingForCausalLM(config.replace(precision="bf16", ep_size=1))  # whole expert stacks
    return [(k, v.shape) for k, v in model.state_dict().items()]


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    return [tensor_map(name, config) for name, _ in state_dict_names(config)]


def split_tensor(m: TensorMap, t: torch.Tensor) -> list[torch.Tensor]:
    """Our tensor → the HF tensors of `m.hf`, in order (views; no copy)."""
    if m.kind == "copy":
        return [t]
    if m.kind == "gate_up":
        return list(t.chunk(2, dim=0))
    if m.kind == "experts":
        return list(t.unbind(0))
    if m.kind == "experts_gate_up":
        return [half for expert in t.unbind(0) for half in expert.chunk(2, dim=0)]
    raise AssertionError(m.kind)


def join_tensors(m: TensorMap, parts: list[torch.Tensor]) -> torch.Tensor:
    """The HF tensors of `m.hf` (in order) → our tensor: the exact inverse of `split_tensor`."""
    if m.kind == "copy":
        return parts[0]
    if m.kind == "gate_up":
        return torch.cat(parts, dim=0)
    if m.kind == "experts":
        return torch.stack(parts)
    if m.kind == "experts_gate_up":
        return torch.stack([torch.cat(parts[i:i + 2], dim=0) for i in range(0, len(parts), 2)])
    raise AssertionError(m.kind)


def to_hf_state_dict(state_dict: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state_dict → {HF name: tensor} (views of the inputs). Unknown keys raise naming the key."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        m = tensor_map(name, config)
        out.update(zip(m.hf, split_tensor(m, t)))
    return out


# ------------------------------------------------------------------------------------------------ FP8
def is_fp8_linear(hf_name: str) -> bool:
    return bool(_FP8_LINEAR.search(hf_name)) and ".eh_proj." not in hf_name


def quantize_for_export(hf_sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The FP8 linears → E4M3 weight + fp32 [ceil(N/128), ceil(K/128)] `weight_scale_inv`; the rest unchanged."""
    out: dict[str, torch.Tensor] = {}
    for name, t in hf_sd.items():
        if is_fp8_linear(name):
            q, s = quantize_128x128(t.float().contiguous())
            out[name], out[name + SCALE_SUFFIX] = q, s
        else:
            out[name] = t
    return out


def _dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return dequantize_128x128(q, scale, torch.float32)


# ------------------------------------------------------------------------------------------------ files
def _parse_size(size: str | int) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?i?B?)\s*", str(size), re.IGNORECASE)
    if not m:
        raise ValueError(f"max shard size {size!r}: expected e.g. 5GB, 500MB or a byte count")
    unit = m.group(2).upper().rstrip("B").rstrip("I")
    return int(float(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[unit])


def _shards(names: list[str], sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    used = 0
    for name in names:
        if shards[-1] and used + sizes[name] > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += sizes[name]
    return shards


def _cast(name: str, t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """The export dtype of one tensor: FP8 and the fp32 expert-bias buffer / scales keep theirs."""
    keep = dtype is None or not t.is_floating_point() or t.dtype == torch.float8_e4m3fn \
        or name.endswith(("expert_bias", SCALE_SUFFIX))
    return t if keep else t.to(dtype)


def save_hf(state_dict: Mapping[str, torch.Tensor], config: ModelConfig, out_dir: str | os.PathLike, *,
            tokenizer: str | None = None, fp8: bool = False, dtype: torch.dtype | None = torch.bfloat16,
            max_shard_size: str | int = "5GB", overwrite: bool = False,
            modeling_code: str | os.PathLike | None = None) -> Path:
    """Write `state_dict` (ours, any device) as a BailingMoeV2 checkpoint into `out_dir`.

    dtype: the floating-point dtype of the stored tensors (None = keep each tensor's own dtype); fp8: the
    linears as E4M3 + `weight_scale_inv` (the rest in `dtype`). tokenizer: a sentencepiece `.model` or an HF
    `tokenizer.json` to ship beside the weights. modeling_code: a folder with the reference's
    REFERENCE_CODE_FILES, copied in with an `auto_map` naming them (for transformers' trust_remote_code); without
    it config.json has no auto_map. Written into a temporary sibling folder and renamed into place, so `out_dir`
    is either the complete export or untouched."""
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists: choose a new folder, or overwrite it (overwrite=True, --overwrite)")
    code = [Path(modeling_code) / f for f in REFERENCE_CODE_FILES] if modeling_code is not None else []
    missing_code = [str(f) for f in code if not f.is_file()]
    if missing_code:
        raise FileNotFoundError(f"modeling code: {', '.join(missing_code)} missing (the reference's "
                                f"{' and '.join(REFERENCE_CODE_FILES)}: inclusionAI/Ling-V2 models/)")
    tok_meta = _tokenizer_ids(tokenizer) if tokenizer else {}
    hf_sd = to_hf_state_dict(state_dict, config)
    if fp8:
        hf_sd = quantize_for_export(hf_sd)
    hf_sd = {k: _cast(k, v, dtype) for k, v in hf_sd.items()}
    names = list(hf_sd)
    sizes = {k: v.numel() * v.element_size() for k, v in hf_sd.items()}
    shards = _shards(names, sizes, _parse_size(max_shard_size))

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        files = [SINGLE_FILE] if len(shards) == 1 else \
            [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        weight_map = {}
        for file, shard in zip(files, shards):
            # clone: safetensors refuses tensors that share storage (our gate/up halves do)
            save_file({k: hf_sd[k].detach().to("cpu").contiguous().clone() for k in shard}, str(tmp / file),
                      metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        stored = "float8_e4m3fn" if fp8 else str(dtype or next(iter(hf_sd.values())).dtype).removeprefix("torch.")
        conf = hf_config(config, dtype="bfloat16" if fp8 else stored, **{
            k: tok_meta.get(k) for k in ("eos_token_id", "pad_token_id", "bos_token_id")})
        if code:
            conf["auto_map"] = dict(AUTO_MAP)
            for f in code:
                shutil.copyfile(f, tmp / f.name)
        if fp8:
            conf["quantization_config"] = {
                "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [BLOCK, BLOCK],
                "modules_to_not_convert": sorted({k.rsplit(".", 1)[0] for k in names
                                                  if k.endswith(".weight") and hf_sd[k].dim() == 2
                                                  and not is_fp8_linear(k)}),
            }
        (tmp / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
        gen = {k: conf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if conf[k] is not None}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        if tokenizer:
            _export_tokenizer(tokenizer, tmp, tok_meta)
        _make_readable(tmp)
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _make_readable(folder: Path) -> None:
    """mkdtemp makes a 0700 folder: give the export the permissions a plain mkdir/open would (umask)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for f in folder.iterdir():
        os.chmod(f, 0o666 & ~umask)


def _tokenizer_ids(path: str) -> dict[str, Any]:
    tok = Tokenizer(path)
    ids = {"eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id, "bos_token_id": tok.bos_id,
           "unk_token_id": tok.unk_id}
    meta: dict[str, Any] = {k: (v if v is not None and v >= 0 else None) for k, v in ids.items()}
    meta["tokens"] = {k.removesuffix("_token_id"): tok.id_to_token(v) for k, v in meta.items() if v is not None}
    meta["vocab_size"] = tok.vocab_size
    return meta


def _export_tokenizer(path: str, out: Path, meta: Mapping[str, Any]) -> None:
    """Ship the tokenizer. A sentencepiece model: as `tokenizer.model` (transformers' slow LlamaTokenizer) and as
    a `tokenizer.json` that encodes identically (the fast one), with a tokenizer_config.json that loads both from
    any directory and keeps the model's own ids: no BOS/EOS added, its dummy prefix kept, and special-token
    strings in a text encoded as text (`split_special_tokens`), as sentencepiece does. An HF `tokenizer.json`: as
    is, with its tokenizer_config / special_tokens_map siblings."""
    src = Path(path)
    if src.suffix == ".json":
        shutil.copyfile(src, out / "tokenizer.json")
        for sibling in ("tokenizer_config.json", "special_tokens_map.json"):
            if (src.parent / sibling).is_file():
                shutil.copyfile(src.parent / sibling, out / sibling)
        return
    shutil.copyfile(src, out / "tokenizer.model")
    try:
        (out / "tokenizer.json").write_text(tokenizer_json_from_sentencepiece(str(src)))
    except DataError as e:  # transformers can still convert tokenizer.model itself (not exactly, then)
        log.warning("no tokenizer.json in the export: %s", e)
    special = {f"{k}_token": v for k, v in meta["tokens"].items()}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    # no vocab_file (transformers finds tokenizer.model beside this file) and no add_prefix_space (set, it makes
    # the fast tokenizer rebuild itself from tokenizer.model instead of reading tokenizer.json)
    conf = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": False, "add_eos_token": False, "legacy": True,
            "split_special_tokens": True, **special, "model_max_length": 1 << 20,
            "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(conf, indent=2) + "\n")


class HFReader:
    """Lazy access to the tensors of an HF checkpoint folder (one `model.safetensors`, or shards + index)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"HF checkpoint {self.path}: no such folder")
        conf = self.path / "config.json"
        if not conf.is_file():
            raise FileNotFoundError(f"HF checkpoint {self.path}: no config.json")
        self.config: dict[str, Any] = json.loads(conf.read_text())
        index = self.path / INDEX_FILE
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif (self.path / SINGLE_FILE).is_file():
            weight_map = {}
        else:
            pickles = sorted(p.name for p in self.path.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
            if pickles:
                raise HFCheckpointError(
                    f"HF checkpoint {self.path} holds PyTorch pickle weights ({', '.join(pickles)}): unsupported, "
                    "and left unread (loading a pickle can run code). Only safetensors are read: convert them, "
                    "e.g. transformers' save_pretrained(..., safe_serialization=True)")
            raise FileNotFoundError(f"HF checkpoint {self.path}: neither {SINGLE_FILE} nor {INDEX_FILE}")
        self._stack = ExitStack()
        self._files: dict[str, Any] = {}
        for file in sorted(set(weight_map.values()) or {SINGLE_FILE}):
            if not (self.path / file).is_file():
                raise FileNotFoundError(f"HF checkpoint {self.path}: {INDEX_FILE} names {file}, which is missing")
            self._files[file] = self._stack.enter_context(safe_open(str(self.path / file), framework="pt"))
        self.where = {k: f for f, h in self._files.items() for k in h.keys()}
        listed_only = sorted(set(weight_map) - set(self.where))
        if listed_only:
            raise HFCheckpointError(f"HF checkpoint {self.path}: {INDEX_FILE} lists tensors its shards lack: "
                                    f"{name_list(listed_only)}")

    def keys(self) -> list[str]:
        return list(self.where)

    def shape(self, name: str) -> list[int]:
        return list(self._files[self.where[name]].get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        return self._files[self.where[name]].get_slice(name).get_dtype()

    def get(self, name: str) -> torch.Tensor:
        return self._files[self.where[name]].get_tensor(name)

    @property
    def is_fp8(self) -> bool:
        quant = (self.config.get("quantization_config") or {}).get("quant_method")
        return quant == "fp8" or any(k.endswith(SCALE_SUFFIX) for k in self.where)

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> HFReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def check_tensors(reader: HFReader, config: ModelConfig, *, dequantize_fp8: bool = False) -> list[TensorMap]:
    """Check that the checkpoint holds exactly the tensors `config` needs, with the right shapes; raise
    HFCheckpointError listing every missing, unexpected or mis-shaped tensor. Reads no tensor data."""
    if reader.is_fp8 and not dequantize_fp8:
        raise HFCheckpointError(
            f"HF checkpoint {reader.path} is a blockwise-FP8 export (E4M3 weights with {SCALE_SUFFIX} scales), "
            "for inference engines; loading for training needs bf16/fp32 weights: export again without --fp8, "
            "or dequantize explicitly (dequantize_fp8=True)")
    diffs = config_differences(reader.config, config)
    if diffs:
        raise HFCheckpointError(f"HF checkpoint {reader.path} was saved for another model config:\n  "
                                + "\n  ".join(diffs))
    maps = tensor_maps(config)
    present = set(reader.keys())
    expected = {n for m in maps for n in m.hf}
    scales = {n + SCALE_SUFFIX for n in expected if n + SCALE_SUFFIX in present} if dequantize_fp8 else set()
    missing = sorted(expected - present)
    unexpected = sorted(present - expected - scales)
    problems = []
    if missing:
        problems.append(f"missing tensors: {name_list(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {name_list(unexpected)}")
    if not problems:
        shapes = dict(state_dict_names(config))
        for m in maps:
            want = [list(t.shape) for t in split_tensor(m, torch.empty(shapes[m.ours], device="meta"))]
            got = [reader.shape(n) for n in m.hf]
            bad = [f"{n}: {g} (expected {w})" for n, g, w in zip(m.hf, got, want) if g != w]
            if bad:
                problems.append("wrong shapes: " + name_list(bad, 6))
                break
    if problems:
        raise HFCheckpointError(f"HF checkpoint {reader.path} does not match the model:\n  " + "\n  ".join(problems))
    return maps


def read_tensor(reader: HFReader, m: TensorMap, dequantize_fp8: bool = False) -> torch.Tensor:
    """Our tensor `m.ours`, joined from its HF tensors (FP8 ones dequantized to fp32 when asked)."""
    parts = []
    for name in m.hf:
        t = reader.get(name)
        if t.dtype == torch.float8_e4m3fn:
            if not dequantize_fp8:
                raise HFCheckpointError(f"{reader.path}: {name} is stored in FP8; bf16/fp32 weights are needed")
            t = _dequantize(t, reader.get(name + SCALE_SUFFIX))
        parts.append(t)
    return join_tensors(m, parts)


def read_hf_config(path: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of an HF folder's config.json, through `check_hf_config` (eval.py's path)."""
    conf = Path(path) / "config.json"
    if not conf.is_file():
        raise FileNotFoundError(f"HF checkpoint {path}: no config.json")
    return model_config_from_hf(json.loads(conf.read_text()), str(conf))


@torch.no_grad()
def load_hf_checkpoint(model: nn.Module, path: str | os.PathLike, *, strict: bool = True,
                       dequantize_fp8: bool = False) -> None:
    """Copy an HF checkpoint's tensors into `model` (a LingForCausalLM, also ZeRO-3-partitioned or holding its
    expert-parallel share of the experts), exactly (cast to each parameter's dtype). strict=False skips tensors
    the checkpoint lacks instead of raising (shapes and config must still match). Every rank calls this."""
    config: ModelConfig = model.config
    with HFReader(path) as reader:
        check_hf_config(reader.config, str(reader.path / "config.json"))  # the same refusals as `check` and eval
        if strict:
            maps = check_tensors(reader, config, dequantize_fp8=dequantize_fp8)
        else:
            present = set(reader.keys())
            maps = [m for m in tensor_maps(config) if all(n in present for n in m.hf)]
        targets = dict(model.named_parameters()) | dict(model.named_buffers())
        for m in maps:
            value = read_tensor(reader, m, dequantize_fp8)
            shard = model.expert_shard(m.ours)  # expert parallelism: this rank's experts of the stack
            _assign(targets[m.ours], value if shard is None else value[shard])


def _assign(target: torch.Tensor, value: torch.Tensor) -> None:
    if hasattr(target, "ds_id"):  # a ZeRO-3 partitioned parameter: gather, write on rank 0, re-partition
        # imported on use: the export and check CLIs never need DeepSpeed, whose import takes seconds
        import deepspeed

        with deepspeed.zero.GatheredParameters([target], modifier_rank=0):
            if not dist.is_initialized() or dist.get_rank() == 0:
                target.data.copy_(value.view(target.shape))
        return
    target.data.copy_(value)


# ------------------------------------------------------------------------------------------------ CLI
def _dtype(name: str) -> torch.dtype | None:
    table = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
             "fp16": torch.float16, "float16": torch.float16, "keep": None}
    if name not in table:
        raise SystemExit(f"--dtype {name!r}: expected one of {', '.join(table)}")
    return table[name]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ling.checkpoint.hf", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="a training checkpoint → a BailingMoeV2 HF folder")
    ex.add_argument("checkpoint", help="run dir (runs/NAME), its checkpoints folder, or one checkpoint folder")
    ex.add_argument("out", help="output folder (must not exist unless --overwrite)")
    ex.add_argument("--fp8", action="store_true", help="store the linears as blockwise FP8 (E4M3 + 128x128 scales)")
    ex.add_argument("--dtype", default="bf16", help="bf16 (default) | fp32 | fp16 | keep")
    ex.add_argument("--max-shard-size", default="5GB")
    ex.add_argument("--tokenizer", default=None, help="tokenizer file to ship (default: the run's)")
    ex.add_argument("--modeling-code", default=None, metavar="DIR",
                    help=f"folder with the reference's {' and '.join(REFERENCE_CODE_FILES)} (inclusionAI/Ling-V2 "
                         "models/): copied in, with an auto_map naming them, for transformers' trust_remote_code")
    ex.add_argument("--overwrite", action="store_true")
    ck = sub.add_parser("check", help="verify an HF folder against our model (names, shapes, config)")
    ck.add_argument("path")
    args = parser.parse_args(argv)
    try:
        _export(args) if args.cmd == "export" else _check(args.path)
    except (OSError, ValueError, UnsafeCheckpointError) as e:  # HFCheckpointError is a ValueError
        raise SystemExit(f"python -m ling.checkpoint.hf {args.cmd}: error: {e}") from None


def _export(args: argparse.Namespace) -> None:
    ref = find_checkpoint(args.checkpoint)
    state = read_model_state(ref.folder)
    config = ref.model_config(state)
    tokenizer = args.tokenizer or run_tokenizer(ref.run_dir, ref.config)
    out = save_hf(state, config, args.out, tokenizer=tokenizer, fp8=args.fp8, dtype=_dtype(args.dtype),
                  max_shard_size=args.max_shard_size, overwrite=args.overwrite, modeling_code=args.modeling_code)
    print(f"exported {ref.folder} (step {ref.step}) → {out}" + (f" with tokenizer {tokenizer}" if tokenizer
                                                               else " (no tokenizer: synthetic data)"))


def _check(path: str) -> None:
    with HFReader(path) as reader:
        config = model_config_from_hf(reader.config, str(reader.path / "config.json"))
        check_tensors(reader, config, dequantize_fp8=reader.is_fp8)
        print(f"{path}: {len(reader.keys())} tensors, {'FP8' if reader.is_fp8 else 'high-precision'} weights, "
              f"all present with the expected shapes; model config: {config}")


if __name__ == "__main__":
    main()
