"""`ModelConfig`: every option of the Ling MoE model, and the named presets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from fp8.format import BLOCK
from fp8.grouped import EXPERT_WGRAD
from fp8.linear import RECIPES


@dataclass
class ModelConfig:
    """Hyper-parameters of a Ling-mini-2.0-style MoE causal LM with MTP heads.

    Defaults are Ling-mini-2.0 as published (BailingMoeV2). `vocab_size=None` means "take it from the
    tokenizer" and must be resolved before the model is built.
    """

    vocab_size: int | None = 157184
    hidden_size: int = 2048
    num_layers: int = 20
    num_dense_layers: int = 1  # the first k layers use a dense SwiGLU MLP ("first_k_dense_replace")
    dense_intermediate_size: int = 5120
    # attention
    num_heads: int = 16
    num_kv_heads: int = 4
    head_dim: int = 128
    rotary_fraction: float = 0.5  # RoPE on the first head_dim * rotary_fraction dims
    rope_base: float = 600000.0
    rms_eps: float = 1e-6
    init_std: float = 0.02
    # MoE
    num_experts: int = 256
    num_experts_per_tok: int = 8
    num_shared_experts: int = 1
    expert_intermediate_size: int = 512
    num_expert_groups: int = 8
    topk_groups: int = 4
    routed_scaling_factor: float = 2.5
    bias_update_rate: float = 1e-3  # aux-loss-free balancing; 0 disables the update
    z_loss_coef: float = 3.5e-6
    aux_loss_coef: float = 0.0
    # routing-map padding: round each expert's rows up to a multiple of moe_pad_multiple with gate-0 pad rows
    # (None: on iff precision == "fp8"); the grouped FP8 kernels use the 16-alignment for 16-byte loads
    pad_for_fp8: bool | None = None
    moe_pad_multiple: int = 16
    # expert parallelism (`moe.ep_size`): the experts are split evenly over the ranks of an expert-parallel
    # process group (ling/train/engine.py creates it and hands it to the model); 1 = every rank holds every expert
    ep_size: int = 1
    # Multi-Token Prediction
    num_mtp_layers: int = 1
    mtp_loss_weight: float = 0.1
    # numerics of the linear layers: "bf16" (plain nn.Linear in the engine's dtype) or "fp8" (FP8Linear)
    precision: str = "bf16"
    fp8_recipe: str = "blockwise"  # "blockwise" (1x128 / 128x128) or "tensorwise"
    fp8_pow2_scales: bool = False
    # the FP8 routed experts' weight gradients (`fp8.expert_wgrad`): "fp8" (the blockwise recipe: E4M3 operands
    # quantized 1x128 along tokens) or "bf16" (bf16 operands, fp32 accumulation; saves x instead of FP8 xᵀ)
    fp8_expert_wgrad: str = "fp8"
    # attention with `doc_ids` (packed documents): "flex" (FlexAttention with a document-causal BlockMask, CUDA),
    # "dense" (SDPA with a dense [B, 1, T, T] bool mask: the CPU/reference path), "auto" (flex on CUDA, else dense)
    document_attention: str = "auto"
    # memory: "none", "full" (checkpoint whole layers), "selective" (recompute the attention core and the SwiGLU
    # of the dense/shared MLPs in backward; the linears keep their saved inputs)
    recompute: str = "none"
    activation_checkpointing: bool = False  # legacy alias: true means recompute="full"
    # host overhead: the elementwise chains (RMSNorm, QK-norm + RoPE, router scoring and selection, the dispatch
    # plan, the dense/shared SwiGLU) fused by torch.compile — "auto" (on CUDA tensors), "on" (everywhere, also
    # CPU through Inductor's C++ backend), "off" (eager: the reference)
    compile_ops: str = "auto"
    # host overhead: each decoder / MTP layer's forward and backward replayed from a CUDA graph (model/graphs.py;
    # CUDA, recompute none or selective, no FlexAttention BlockMask, moe.ep_size 1, ZeRO 0-2)
    cuda_graphs: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Raise ValueError naming the offending key when the shape options don't fit together."""

        def need(cond: bool, key: str, msg: str) -> None:
            if not cond:
                raise ValueError(f"model.{key}: {msg}")

        if self.vocab_size is not None:
            need(self.vocab_size > 0, "vocab_size", f"must be positive, got {self.vocab_size}")
        need(self.hidden_size > 0, "hidden_size", f"must be positive, got {self.hidden_size}")
        need(self.num_heads > 0, "num_heads", f"must be positive, got {self.num_heads}")
        need(self.hidden_size % self.num_heads == 0, "num_heads",
             f"num_heads={self.num_heads} does not divide hidden_size={self.hidden_size}")
        need(self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads == 0, "num_kv_heads",
             f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        need(self.head_dim > 0 and self.head_dim % 2 == 0, "head_dim",
             f"must be positive and even, got {self.head_dim}")
        rot = self.rotary_dim
        need(0 < rot <= self.head_dim and rot % 2 == 0, "rotary_fraction",
             f"head_dim*rotary_fraction={self.head_dim * self.rotary_fraction} must be an even int in (0, head_dim]")
        need(0 <= self.num_dense_layers <= self.num_layers, "num_dense_layers",
             f"must be in [0, num_layers={self.num_layers}], got {self.num_dense_layers}")
        need(self.num_experts > 0, "num_experts", f"must be positive, got {self.num_experts}")
        need(self.num_expert_groups > 0 and self.num_experts % self.num_expert_groups == 0, "num_expert_groups",
             f"num_expert_groups={self.num_expert_groups} must divide num_experts={self.num_experts}")
        need(1 <= self.topk_groups <= self.num_expert_groups, "topk_groups",
             f"must be in [1, num_expert_groups={self.num_expert_groups}], got {self.topk_groups}")
        per_group = self.num_experts // self.num_expert_groups
        need(per_group >= 2, "num_expert_groups", "each group needs >= 2 experts (group score = sum of its top-2)")
        need(1 <= self.num_experts_per_tok <= self.topk_groups * per_group, "num_experts_per_tok",
             f"must be in [1, topk_groups * experts_per_group = {self.topk_groups * per_group}]")
        need(self.num_mtp_layers >= 0, "num_mtp_layers", f"must be >= 0, got {self.num_mtp_layers}")
        need(self.precision in ("bf16", "fp8"), "precision", f"must be 'bf16' or 'fp8', got {self.precision!r}")
        need(self.moe_pad_multiple >= 1, "moe_pad_multiple", f"must be >= 1, got {self.moe_pad_multiple}")
        if not (isinstance(self.ep_size, int) and self.ep_size >= 1 and self.num_experts % self.ep_size == 0):
            raise ValueError(f"moe.ep_size={self.ep_size} must be a positive divisor of model.num_experts="
                             f"{self.num_experts} (each expert-parallel rank holds num_experts / ep_size experts)")
        if self.precision == "fp8" and self.fp8_recipe == "blockwise":
            for key in ("hidden_size", "expert_intermediate_size"):
                need(getattr(self, key) % BLOCK == 0, key,
                     f"must be a multiple of {BLOCK} for the blockwise FP8 experts, got {getattr(self, key)}")
        need(self.fp8_recipe in RECIPES, "fp8_recipe",
             f"must be {' or '.join(map(repr, RECIPES))}, got {self.fp8_recipe!r}")
        need(self.fp8_expert_wgrad in EXPERT_WGRAD, "fp8_expert_wgrad",
             f"(config key fp8.expert_wgrad) must be one of {', '.join(EXPERT_WGRAD)}, got {self.fp8_expert_wgrad!r}")
        need(self.document_attention in DOCUMENT_ATTENTION, "document_attention",
             f"must be one of {', '.join(DOCUMENT_ATTENTION)}, got {self.document_attention!r}")
        need(self.recompute in RECOMPUTE, "recompute", f"must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")
        need(self.compile_ops in COMPILE_OPS, "compile_ops",
             f"must be one of {', '.join(COMPILE_OPS)}, got {self.compile_ops!r}")
        need(not self.cuda_graphs or self.recompute_mode != "full", "cuda_graphs",
             "true needs model.recompute none or selective (a fully recomputed layer runs its forward again inside "
             "backward, which a captured graph cannot)")
        need(not self.cuda_graphs or self.ep_size == 1, "cuda_graphs",
             f"true needs moe.ep_size=1 (got {self.ep_size}): the expert-parallel exchange reads its split sizes on "
             "the host")
        need(not self.activation_checkpointing or self.recompute in ("none", "full"), "activation_checkpointing",
             f"true is the old spelling of model.recompute=full and contradicts model.recompute={self.recompute}; "
             "set only model.recompute")

    # ------------------------------------------------------------------ derived
    @property
    def rotary_dim(self) -> int:
        return int(round(self.head_dim * self.rotary_fraction))

    @property
    def pad_for_fp8_resolved(self) -> bool:
        return self.precision == "fp8" if self.pad_for_fp8 is None else bool(self.pad_for_fp8)

    @property
    def num_local_experts(self) -> int:
        """Experts held by one expert-parallel rank."""
        return self.num_experts // self.ep_size

    @property
    def recompute_mode(self) -> str:
        """`recompute` with the legacy `activation_checkpointing=true` folded in: none | full | selective."""
        return "full" if self.activation_checkpointing else self.recompute

    @property
    def is_moe_layer(self) -> list[bool]:
        return [i >= self.num_dense_layers for i in range(self.num_layers)]

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a plain mapping (e.g. a Hydra node); unknown keys raise naming the key."""
        known = {f.name for f in dataclasses.fields(cls)}
        d = dict(d)
        preset = d.pop("preset", None)
        d.pop("name", None)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"model.{unknown[0]}: unknown model config key (known: {', '.join(sorted(known))})")
        if preset is not None:
            return cls.preset(preset, **d)
        return cls(**d)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """A named preset with `overrides` applied: `ling_mini_2_0` (the published 16.3B model),
        `ling_mini_2_0_e64` (full depth and width, 64 experts: the one-GPU throughput proxy),
        `ling_mini_2_0_l6` (6 layers: the one-GPU memory proxy), `tiny` (CPU tests and the demo)."""
        if name not in PRESETS:
            raise ValueError(f"model preset {name!r} is unknown (known: {', '.join(PRESETS)})")
        return cls(**{**PRESETS[name], **overrides})


DOCUMENT_ATTENTION = ("auto", "flex", "dense")
RECOMPUTE = ("none", "full", "selective")
COMPILE_OPS = ("auto", "on", "off")

PRESETS: dict[str, dict[str, Any]] = {
    "ling_mini_2_0": {},
    # Full depth and width (20 layers, MTP, vocab 157184), 64 experts instead of 256: the real model's per-token
    # compute on one GPU; each GPU's grouped GEMM sees as many routed rows as under 8-way expert parallelism.
    # Routing keeps its shape: 8 groups of 8 experts, top-4 groups, then top-8 experts.
    "ling_mini_2_0_e64": {"num_experts": 64},
    # Same width, 1 dense + 5 MoE layers + MTP: ~5.6B parameters, fits one 141 GB GPU with fp32 Adam.
    "ling_mini_2_0_l6": {"num_layers": 6},
    # Small enough to train for 100+ steps on 2 CPU cores in a few minutes; keeps every mechanism
    # (GQA, half RoPE, group-limited routing, shared expert, MTP) and 128-multiple dims for FP8.
    "tiny": {
        "vocab_size": 8192,
        "hidden_size": 128,
        "num_layers": 3,
        "num_dense_layers": 1,
        "dense_intermediate_size": 384,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 32,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "num_shared_experts": 1,
        "expert_intermediate_size": 128,
        "num_expert_groups": 4,
        "topk_groups": 2,
    },
}
