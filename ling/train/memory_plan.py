"""The memory plan: per-GPU memory of a run, estimated from its configs before anything is built, and the
refusal of a run that cannot fit, naming set-ups that would.

`plan_memory(cfg, model_config, world)` → MemoryPlan: bytes per GPU for
- weights (the model in its training dtype: this rank's share of the experts under moe.ep_size; ZeRO-3 keeps
  1/world of them plus the gathered working set),
- gradients (DeepSpeed's: ZeRO-1 with fp32 accumulation keeps whole fp32 gradients on every GPU, ZeRO-2/3
  their 1/world partition plus reduction buckets),
- master weights (fp32, 1/world each under ZeRO), optimizer moments (AdamW: 8 bytes per parameter; FP8AdamW:
  two E4M3 moments and an fp32 scale per 128-block each, 2.0625 bytes, 1/world each),
- FP8 weight caches (precision=fp8: every FP8 linear's E4M3 copy and its transpose, 2 bytes per weight, and
  every expert stack's E4M3 copy, 1 byte per weight: the experts' transposes are built on demand),
- activations: what autograd keeps per token for backward, summed block by block over the layers
  (`activation_bytes_per_token`, derived from the tensors each block saves on the GPU path: compiled norms,
  RoPE and SwiGLU, flash/flex attention, bf16 grouped GEMMs or the FP8 grouped experts), times
  micro_batch_size × seq_len, with recomputation taken into account,
- the LM-head transients at the end of the forward: the fused loss keeps an fp32 dW [V, H] per head call
  (main + MTP) until backward, and one chunk of logits is live with its gradient (model/loss.py: 4 bytes per
  logit in bf16 on a GPU, where the epilogue is the Triton kernel; the eager reference elsewhere adds an fp32 copy).
Parameter counts come from the model built on the meta device (no memory). The estimate is compared with
measured peaks (torch's max_memory_allocated) of the e64 proxy in docs/runtime_scale.md.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from ling.config import model_config_from
from ling.train.launch import StopRun
from model.config import ModelConfig
from model.ling import LingForCausalLM
from model.loss import default_chunk_size

GIB = 2**30
FP8_BLOCK = 128  # elements per FP8 scale (1x128 activations, 128-blocks of the Adam moments)
FP8_ADAM_BYTES = 2 + 2 * 4 / FP8_BLOCK  # two E4M3 moments and their fp32 block scales, per parameter
FP8_LINEAR_CACHE_BYTES = 2  # an FP8Linear caches W and Wᵀ in E4M3 (fp8/linear.py), per weight
EAGER_EPILOGUE_BYTES_PER_LOGIT = 4  # the eager loss epilogue's fp32 copy of a chunk's logits (kernels/cross_entropy.py)
ZERO_BUCKET_ELEMENTS = 5 * 10**8  # DeepSpeed's default reduce / allgather bucket sizes (ZeRO-2/3), elements
ZERO3_LIVE_PARAMETERS = 10**9  # DeepSpeed's stage3_max_live_parameters default: gathered at most at once
CONTEXT_RESERVE = 1 * GIB  # CUDA context, NCCL and the allocator's slack beyond torch's allocations
WARN_FRACTION = 0.9  # a plan above this fraction of a GPU is logged as a warning


class MemoryPlanRefusal(StopRun):
    """The plan does not fit the GPUs (train.memory_check=false skips the check)."""

    exit_code = 2


@dataclass(frozen=True)
class MemorySetup:
    """What the plan depends on: the model and the run's precision, optimizer, ZeRO stage, world size,
    micro-batch and sequence length (moe.ep_size and the recompute mode are in `model`)."""

    model: ModelConfig
    world: int = 1
    zero_stage: int = 1
    bf16: bool = True  # bf16 weights and activations (GPU runs); False: fp32
    fp32_grad_accum: bool = True  # deepspeed.grad_accum_dtype=fp32
    optimizer: str = "adamw"  # adamw | fp8_adamw
    fp32_moments: int = 0  # FP8AdamW moments kept in fp32 (fp8.ablate adam_m / adam_v)
    fp8_experts: bool = True  # precision=fp8 runs the routed experts in FP8 (fp8.ablate experts: bf16)
    micro_batch_size: int = 1
    seq_len: int = 4096
    on_gpu: bool = True  # CUDA devices: the loss's Triton epilogue (no fp32 copy of a chunk's logits)

    @classmethod
    def from_config(cls, cfg: DictConfig, model: ModelConfig, world: int, on_gpu: bool = True) -> MemorySetup:
        """The setup of run config `cfg` (deepspeed.bf16=auto: bf16 `on_gpu`, fp32 elsewhere)."""
        ablate = set(cfg.fp8.get("ablate") or ())
        bf16 = cfg.deepspeed.get("bf16", "auto")
        return cls(
            model=model, world=world, zero_stage=int(cfg.deepspeed.zero_stage),
            bf16=bf16 is True or (bf16 == "auto" and on_gpu),
            fp32_grad_accum=cfg.deepspeed.get("grad_accum_dtype") == "fp32", optimizer=str(cfg.optim.name),
            fp32_moments=len(ablate & {"adam_m", "adam_v"}), fp8_experts="experts" not in ablate,
            micro_batch_size=int(cfg.train.micro_batch_size), seq_len=int(cfg.train.seq_len), on_gpu=on_gpu)

    def replace(self, **changes) -> MemorySetup:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class ParameterSplit:
    """Parameter counts of the whole model (all experts), by what the plan treats differently."""

    total: int
    experts: int  # the routed expert stacks (split by moe.ep_size)
    fp8_linear: int  # FP8Linear weights (precision=fp8; cached in E4M3)
    largest_layer: int  # the largest decoder or MTP layer (ZeRO-3's working set)

    @classmethod
    def of(cls, model: ModelConfig) -> ParameterSplit:
        """Counted on the meta device: no memory, no kernels."""
        with torch.device("meta"):
            net = LingForCausalLM(model.replace(ep_size=1))
        total = sum(p.numel() for p in net.parameters())
        experts = sum(p.numel() for _, p in net.expert_parameters())
        fp8 = sum(m.weight.numel() for m in net.modules() if type(m).__name__ == "FP8Linear")
        layers = [*net.layers, *net.mtp_layers]
        largest = max(sum(p.numel() for p in layer.parameters()) for layer in layers) if layers else 0
        return cls(total, experts, fp8, largest)


# ------------------------------------------------------------------------------------------------ activations
def _saved_input(features: int, fp8: bool, element: int) -> float:
    """Bytes per token a linear keeps of its input: the input itself, or FP8Linear's E4M3 transposed copy with
    one fp32 scale per 128 tokens."""
    return features * (1 + 4 / FP8_BLOCK) if fp8 else features * element


def activation_bytes_per_token(model: ModelConfig, element: int, tokens: int, fp8_experts: bool = True
                               ) -> dict[str, float]:
    """Bytes autograd keeps per token for backward, by block, without recomputation: {"attention" (one
    layer's), "dense_mlp", "moe" (router, routed and shared experts of one layer), "routed_experts" (the part
    of "moe" the routed experts keep), "mtp_extra" (an MTP depth beyond its decoder layer), "head" (embeddings,
    final norm, the fused loss's dh per head call)}.
    `element`: bytes of the activation dtype (2 for bf16); `tokens`: per micro-batch (the routing-map padding's
    share per token).

    Derived from what each block saves on the GPU path (compiled norms, QK-norm+RoPE and SwiGLU; flash/flex
    attention; FP8 linears under precision=fp8)."""
    H, a = model.hidden_size, element
    fp8 = model.precision == "fp8"
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    norm = H * a + 4  # a compiled RMSNorm keeps its input and fp32 rstd
    attention = (norm + _saved_input(H, fp8, a)  # input norm; QKV projection's input
                 + (q + 2 * kv) * a + 4 * (model.num_heads + model.num_kv_heads)  # QKV output, QK-norm rstd
                 + (q + kv) * a  # RoPE'd q, k (the attention's inputs; v is a view of the QKV output)
                 + q * a + 4 * model.num_heads  # attention output and logsumexp
                 + _saved_input(q, fp8, a))  # the output projection's input

    def mlp(inter: int) -> float:  # gate/up projection's input is counted by the caller (it may be shared)
        return 2 * inter * a + _saved_input(inter, fp8, a)  # gate_up output (compiled SwiGLU), down's input

    dense = norm + _saved_input(H, fp8, a) + mlp(model.dense_intermediate_size)
    k, e_inter = model.num_experts_per_tok, model.expert_intermediate_size
    pad = model.moe_pad_multiple if model.pad_for_fp8_resolved else 1
    tokens = max(tokens, 1)
    experts = model.num_local_experts
    bound = -(-(tokens * k + experts * (pad - 1)) // 16) * 16  # the dispatch plan's static row count M
    rows = bound / tokens  # expert rows per token (routing-map padding included)
    if fp8 and fp8_experts:
        if model.fp8_expert_wgrad == "fp8":  # xᵀ in E4M3, each expert's tokens in whole 128-blocks (a static bound)
            blocks = -(-bound // FP8_BLOCK) + experts
            wgrad = blocks * FP8_BLOCK * H * (1 + 4 / FP8_BLOCK) / tokens
        else:
            wgrad = H * a  # bf16: x itself
        routed = rows * (2 * e_inter * (1 + 4 / FP8_BLOCK) + 4 + 4) + wgrad + 4 * k  # FP8 h, gate, row_src; pos
    else:  # bf16 grouped GEMMs: gathered rows, gate_up output, silu(g) and silu(g)·u, down's input; fp32 gates
        routed = rows * (a * (H + 5 * e_inter) + 4)
    shared_inter = e_inter * model.num_shared_experts
    shared = (_saved_input(H, True, a) if fp8 else 0) + mlp(shared_inter) if shared_inter else 0.0
    moe = norm + H * a + 8 * model.num_experts + routed + shared  # input norm, its output h (router), router fp32
    mtp_extra = 2 * norm + 2 * H * a + norm  # enorm, hnorm inputs; eh_proj's bf16 input [2H]; final norm
    heads = 1 + model.num_mtp_layers
    head = 8 * heads + norm + heads * H * a  # token ids; final norm; dh of each fused loss call
    return {"attention": attention, "dense_mlp": dense, "moe": moe, "routed_experts": routed, "mtp_extra": mtp_extra,
            "head": head}


def activation_bytes(setup: MemorySetup) -> float:
    """Activation bytes of one micro-batch at the end of its forward (the peak), with `model.recompute_mode`:
    none, selective (attention core and dense/shared SwiGLU recomputed: the core keeps its QKV input only), or
    full (each layer keeps its input; one layer's activations live again during its recomputation)."""
    m = setup.model
    a = 2 if setup.bf16 else 4
    tokens = setup.micro_batch_size * setup.seq_len
    per = activation_bytes_per_token(m, a, tokens, setup.fp8_experts)
    attention = per["attention"]
    if m.recompute_mode == "selective":  # RoPE'd q, k, attention output, logsumexp and rstd recomputed
        q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
        attention -= (q + kv) * a + q * a + 4 * m.num_heads + 4 * (m.num_heads + m.num_kv_heads)
    dense_layer, moe_layer = attention + per["dense_mlp"], attention + per["moe"]
    n_dense, n_moe = m.num_dense_layers, m.num_layers - m.num_dense_layers + m.num_mtp_layers
    if m.recompute_mode == "full":
        layer_inputs = (m.num_layers + 2 * m.num_mtp_layers) * m.hidden_size * a  # MTP: its two inputs
        largest = max(moe_layer if n_moe else 0, dense_layer if n_dense else 0)
        per_token = layer_inputs + largest + per["head"]
    else:
        per_token = n_dense * dense_layer + n_moe * moe_layer + m.num_mtp_layers * per["mtp_extra"] + per["head"]
    return per_token * tokens


# --------------------------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class MemoryPlan:
    """Estimated bytes per GPU, by part (`parts`, in the order shown), for `setup`."""

    setup: MemorySetup
    parts: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def describe(self) -> str:
        s, m = self.setup, self.setup.model
        head = (f"memory plan per GPU (estimate): ≈ {self.total / GIB:.1f} GiB for {s.world} rank(s), ZeRO-"
                f"{s.zero_stage}, moe.ep_size={m.ep_size}, {m.precision} linears, {s.optimizer}, micro-batch "
                f"{s.micro_batch_size} x {s.seq_len} tokens, recompute={m.recompute_mode}")
        return head + "".join(f"\n  {name:<20} {value / GIB:8.2f} GiB" for name, value in self.parts.items())

    def refusal(self, capacity: int, visible_gpus: int | None = None) -> str | None:
        """None when the plan fits a GPU of `capacity` bytes (less CONTEXT_RESERVE); else the refusal, with
        set-ups that would fit (more GPUs, a higher ZeRO stage, expert parallelism, recomputation)."""
        usable = capacity - CONTEXT_RESERVE
        if self.total <= usable:
            return None
        visible = visible_gpus if visible_gpus is not None else (torch.cuda.device_count() or 1)
        parts = ", ".join(f"{name} {value / GIB:.1f}" for name, value in self.parts.items() if value >= GIB / 20)
        fits = [f"{how} it is ≈ {plan.total / GIB:.1f} GiB" for how, plan in alternatives(self.setup, usable)]
        advice = ("; ".join(fits[:3]) + "." if fits else
                  "no set-up tried fits (more GPUs, ZeRO-2/3, moe.ep_size, recompute=full, micro_batch_size=1).")
        return (f"the run needs ≈ {self.total / GIB:.1f} GiB per GPU ({parts} GiB) but a GPU has "
                f"{capacity / GIB:.1f} GiB ({visible} visible). {advice} (train.memory_check=false skips this "
                "check; docs/runtime_scale.md says how the plan is made)")


def plan_for(setup: MemorySetup, split: ParameterSplit | None = None) -> MemoryPlan:
    """The plan of `setup` (`split`: the model's parameter counts, counted when not given)."""
    m, w = setup.model, setup.world
    split = split or ParameterSplit.of(m)
    a = 2 if setup.bf16 else 4
    local = split.total - split.experts + split.experts / m.ep_size  # parameters this rank holds
    stage = setup.zero_stage
    if stage == 3:
        weights = a * split.total / w + a * min(split.total, ZERO3_LIVE_PARAMETERS + split.largest_layer)
    else:
        weights = a * local
    if stage >= 2:
        # the fp32 partition; DeepSpeed's reduce and allgather buckets (at most this rank's parameter count:
        # ling.train.engine.cap_zero_buckets counts the parameters the rank holds)
        grads = 4 * split.total / w + 2 * a * min(ZERO_BUCKET_ELEMENTS, local)
    elif setup.bf16 and (setup.fp32_grad_accum or stage == 0):
        grads = 4 * local  # DeepSpeed's BF16_Optimizer: whole fp32 gradients on every GPU
    else:
        grads = a * local + 4 * split.total / w  # whole gradients in the training dtype, the fp32 partition
    master = 4 * split.total / w if (stage >= 1 or setup.bf16) else 0.0
    if setup.optimizer == "fp8_adamw":
        moments = split.total / w * (FP8_ADAM_BYTES + setup.fp32_moments * (4 - FP8_ADAM_BYTES / 2))
    else:
        moments = 8 * split.total / w
    caches = 0.0
    if m.precision == "fp8":
        caches = FP8_LINEAR_CACHE_BYTES * split.fp8_linear + (split.experts / m.ep_size if setup.fp8_experts else 0)
    activations = activation_bytes(setup)
    tokens = setup.micro_batch_size * setup.seq_len
    chunk = min(default_chunk_size(m.vocab_size, a), tokens)
    # one chunk's logits and their gradient in the compute dtype, plus the eager epilogue's fp32 copy off the GPU
    per_logit = 2 * a + (0 if setup.on_gpu else EAGER_EPILOGUE_BYTES_PER_LOGIT)
    transients = (1 + m.num_mtp_layers) * 4 * m.vocab_size * m.hidden_size + per_logit * chunk * m.vocab_size
    parts = {"weights": weights, "gradients": grads, "master weights": master, "optimizer moments": moments,
             "FP8 weight caches": caches, "activations": activations, "LM-head transients": transients}
    return MemoryPlan(setup, parts)


def plan_memory(cfg: DictConfig, model: ModelConfig, world: int, on_gpu: bool = True) -> MemoryPlan:
    """The plan of run config `cfg` with the resolved `model` on `world` ranks (`on_gpu`: CUDA devices)."""
    return plan_for(MemorySetup.from_config(cfg, model, world, on_gpu))


WORLD_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
RECOMPUTE_ORDER = ("none", "selective", "full")  # less memory, more recomputation


def alternatives(setup: MemorySetup, usable: float) -> list[tuple[str, MemoryPlan]]:
    """Set-ups like `setup` that fit `usable` bytes per GPU, at most three: the fewest GPUs with this run's own
    settings; the fewest GPUs with the fewest other changes (a higher ZeRO stage, moe.ep_size, recomputation,
    micro-batch 1); and, if it differs, the fewest changes on this run's GPU count. Each (world, ZeRO stage,
    moe.ep_size) takes the least recomputation and the largest micro-batch that fit.
    → [("with 8 GPUs (ZeRO-1)", plan), ...]"""
    m = setup.model
    split = ParameterSplit.of(m)
    recomputes = RECOMPUTE_ORDER[RECOMPUTE_ORDER.index(m.recompute_mode):]
    micros = sorted({setup.micro_batch_size, 1}, reverse=True)
    fits: list[tuple[int, int, float, str, MemoryPlan]] = []  # (world, number of changes, total, how, plan)
    for world in (w for w in WORLD_SIZES if w >= setup.world):
        for stage in (s for s in (1, 2, 3) if s >= setup.zero_stage):
            for ep in (e for e in WORLD_SIZES if world % e == 0 and m.num_experts % e == 0):
                if ep > 1 and stage == 3:
                    continue  # expert parallelism runs under ZeRO-1/2 only
                candidates = (setup.replace(model=m.replace(ep_size=ep, recompute=r, activation_checkpointing=False),
                                            world=world, zero_stage=stage, micro_batch_size=mb)
                              for r in recomputes for mb in micros)
                plan = next((p for c in candidates if (p := plan_for(c, split)).total <= usable), None)
                if plan is not None:
                    changes = _changes(setup, plan.setup)
                    fits.append((world, len(changes) - (world != setup.world), plan.total, _how(changes), plan))
    if not fits:
        return []
    picks = [min((f for f in fits if f[1] == 0), default=None),  # only the GPU count changes
             min(fits, key=lambda f: (f[0], f[1], f[2])),
             min((f for f in fits if f[0] == setup.world), key=lambda f: (f[1], f[2]), default=None)]
    chosen: list[tuple[str, MemoryPlan]] = []
    for pick in picks:
        if pick is not None and pick[3] not in [how for how, _ in chosen]:
            chosen.append((pick[3], pick[4]))
    return chosen


def _changes(base: MemorySetup, other: MemorySetup) -> list[str]:
    """What `other` changes from `base`, as config keys (the GPU count first)."""
    m, o = base.model, other.model
    return [x for x in (
        (f"{other.world} GPUs" + (f" (ZeRO-{other.zero_stage})" if other.zero_stage == base.zero_stage else ""))
        if other.world != base.world else None,
        f"ZeRO-{other.zero_stage}" if other.zero_stage != base.zero_stage else None,
        f"moe.ep_size={o.ep_size}" if o.ep_size != m.ep_size else None,
        f"model.recompute={o.recompute_mode}" if o.recompute_mode != m.recompute_mode else None,
        f"train.micro_batch_size={other.micro_batch_size}" if other.micro_batch_size != base.micro_batch_size
        else None) if x]


def _how(changes: list[str]) -> str:
    return "with " + (", ".join(changes[:-1]) + " and " + changes[-1] if len(changes) > 1 else changes[0])


def data_vocab_size(cfg: DictConfig) -> int | None:
    """The vocab the data would give the model without preparing it: synthetic's `vocab_size`, else the
    tokenizer's configured size."""
    tokenizer = cfg.data.get("tokenizer")
    return cfg.data.get("vocab_size") or (tokenizer.get("vocab_size") if tokenizer is not None else None)


def main(argv: list[str] | None = None) -> None:
    """`python -m ling.train.memory_plan [--world N] [--gpu-gib G] +exp=fp8_mtp [key=value ...]`: the plan of a
    run (the config as train.py composes it), and on a GPU of G GiB what would fit when it does not."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--world", type=int, default=1, help="ranks (GPUs) the run would use")
    parser.add_argument("--gpu-gib", type=float, default=None, help="memory of one GPU (default: this one's)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    conf = Path(__file__).resolve().parents[2] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose(config_name="config", overrides=args.overrides)
    plan = plan_memory(cfg, model_config_from(cfg, data_vocab_size(cfg)), args.world)
    print(plan.describe())
    capacity = args.gpu_gib * GIB if args.gpu_gib else (
        torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None)
    if capacity is not None:
        refusal = plan.refusal(int(capacity), visible_gpus=args.world)
        print(refusal or f"fits a GPU of {capacity / GIB:.1f} GiB ({CONTEXT_RESERVE / GIB:.0f} GiB kept for the "
                         "CUDA context and NCCL)")


if __name__ == "__main__":
    main()
