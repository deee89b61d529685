"""Mixture of Experts: the sigmoid group-limited router with aux-loss-free bias, grouped experts, the block.

One MoE forward: router (fp32 logits, group-limited top-k) → `plan_dispatch` (expert-sorted rows, optional
routing-map padding; model/dispatch.py) → `GroupedExperts` (bf16: two `torch._grouped_mm`; fp8: the
blockwise-FP8 grouped kernels of fp8/grouped.py) with the gate folded into the down projection's input → the
ordered combine; plus the shared expert. Nothing on this path waits for the host. With expert parallelism
(`moe.ep_size` > 1, an expert-parallel process group given) each rank holds E / ep_size experts and the rows
travel to them and back by all-to-all (`model.dispatch.expert_parallel`: one host sync per layer forward).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fp8.grouped import fp8_grouped_experts, quantize_expert_weights
from fp8.health import grouped_experts_health
from fp8.linear import WeightCache
from kernels.fusable import Fusable
from kernels.routing import select_experts
from model.config import ModelConfig
from model.dispatch import DispatchPlan, expert_parallel, permute, plan_dispatch, row_gates, unpermute
from model.layers import MLP, scope, use_compiled

# The router's buffers that stay fp32 whatever the model's dtype: the expert bias (its updates are 1e-3 steps) and
# the routed-token counts (integers far above bf16's 256). Router._apply keeps them fp32 through casts; under ZeRO-3
# `zero.Init` builds every floating tensor in bf16, and DeepSpeed's engine upcasts the ones its
# `data_types.keep_in_fp32_modules` names (ling/train/engine.py's deepspeed_config passes these).
ROUTER_FP32_BUFFERS = ("expert_bias", "tokens_per_expert")


class RouterOutput(NamedTuple):
    """A NamedTuple, not a dataclass: DeepSpeed ZeRO-3 must see the tensors a module returns to hook their
    backward (re-gathering the router weight); it looks inside tuples but not inside dataclasses."""

    topk_idx: torch.Tensor  # int64 [N, k]: chosen experts per token
    topk_weight: torch.Tensor  # fp32 [N, k]: gates (normalised unbiased scores × scaling factor)
    z_loss: torch.Tensor  # fp32 scalar: mean over tokens of logsumexp(logits)^2 (unweighted)
    aux_loss: torch.Tensor  # fp32 scalar: switch-style balance loss (unweighted)
    tokens_per_expert: torch.Tensor  # int64 [E]: how many of the N·k assignments each expert received


class Router(nn.Module):
    """Sigmoid router with group-limited top-k and an aux-loss-free expert bias.

    Logits are computed in fp32. Selection uses score + expert_bias: a group's score is the sum of its
    top-2 biased scores, the top `topk_groups` groups are kept, then the top-k experts inside them, largest first
    (`kernels.routing.select_experts`: one Triton kernel on CUDA; ties to the lower index). The gates are the
    *unbiased* sigmoid scores of the chosen experts, normalised to sum 1 and scaled.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.num_groups = config.num_expert_groups
        self.topk_groups = config.topk_groups
        self.scaling = config.routed_scaling_factor
        self.compile_ops = config.compile_ops
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(config.num_experts, dtype=torch.float32))
        # tokens routed to each expert since the last bias update (summed over micro-batches)
        self.register_buffer("tokens_per_expert", torch.zeros(config.num_experts, dtype=torch.float32),
                             persistent=False)

    def _apply(self, fn, recurse=True):  # the bias and the counts stay fp32 when the model is cast
        super()._apply(fn, recurse)
        for name in ROUTER_FP32_BUFFERS:
            setattr(self, name, getattr(self, name).float())
        return self

    def forward(self, x: torch.Tensor) -> RouterOutput:
        """x [N, hidden] (any float dtype) → RouterOutput."""
        topk_idx, weight, z_loss, aux_loss, counts = route(
            x, self.weight, self.expert_bias, self.num_groups, self.topk_groups, self.top_k, self.scaling,
            compiled=use_compiled(self.compile_ops, x))
        # count once per micro-batch: activation checkpointing reruns this forward inside backward
        if self.training and torch._C._current_graph_task_id() == -1:
            self.tokens_per_expert += counts.float()
        return RouterOutput(topk_idx, weight, z_loss, aux_loss, counts)

    def update_expert_bias(self, rate: float) -> dict[str, float]:
        """This router alone: `update_expert_biases([self], rate)[0]`."""
        return update_expert_biases([self], rate)[0]


@Fusable
def route(x: torch.Tensor, router_weight: torch.Tensor, expert_bias: torch.Tensor, num_groups: int, topk_groups: int,
          top_k: int, scaling: float) -> tuple[torch.Tensor, ...]:
    """The router's maths: x [N, hidden] (any float dtype), router_weight [E, hidden], expert_bias fp32 [E] →
    (topk_idx int64 [N, k], gates fp32 [N, k], z_loss, aux_loss fp32 scalars, counts int64 [E]); see `Router`."""
    num_experts = router_weight.shape[0]
    logits = F.linear(x.float(), router_weight.float())  # [N, E] fp32
    scores = torch.sigmoid(logits)
    # .float(): the kernel takes fp32; a caller's bf16 bias is promoted, as `scores + bias` did (the Router's own
    # buffer is fp32: ROUTER_FP32_BUFFERS)
    topk_idx = select_experts(scores, expert_bias.float(), num_groups, topk_groups, top_k)
    weight = scores.gather(1, topk_idx)
    weight = weight / (weight.sum(-1, keepdim=True) + 1e-20) * scaling
    flat = topk_idx.flatten()  # scatter_add, not bincount: CUDA's bincount waits for the host twice
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    z_loss = torch.logsumexp(logits, dim=-1).pow(2).mean()
    # switch-style balance loss on normalised scores: E · Σ_e f_e · P_e
    probs = scores / scores.sum(-1, keepdim=True)
    aux_loss = num_experts * (counts.float() / topk_idx.numel() * probs.mean(0)).sum()
    return topk_idx, weight, z_loss, aux_loss, counts


@torch.no_grad()
def update_expert_biases(routers: list[Router], rate: float) -> list[dict[str, float]]:
    """For every router: b += rate · (sign(mean − n_e) − mean(sign(mean − n_e))), with n_e the tokens routed to
    expert e since the last call, summed over all ranks (one all-reduce for all routers); the counts restart.
    Under expert parallelism too: every rank counts its own tokens' choices over all E experts, wherever they run.

    Call once per optimizer step; returns each router's load statistics of the step (max/mean, before the
    update), read from the device once for all routers."""
    if not routers:
        return []
    counts = torch.stack([r.tokens_per_expert for r in routers])  # [L, E] fp32
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(counts)
    mean = counts.mean(1, keepdim=True)
    busy = mean > 0
    if rate > 0:
        sign = torch.sign(mean - counts)
        delta = rate * (sign - sign.mean(1, keepdim=True)) * busy
        for r, d in zip(routers, delta):
            r.expert_bias += d
    for r in routers:
        r.tokens_per_expert.zero_()
    ratio = torch.where(busy, counts.amax(1, keepdim=True) / mean.clamp(min=1e-30), torch.zeros_like(mean))
    return [{"max_over_mean": v} for v in ratio.flatten().tolist()]


def check_expert_parallel_group(config: ModelConfig, group):
    """The expert-parallel process group to use (None without expert parallelism); raise if it does not fit."""
    if config.ep_size == 1:
        return None
    if group is None or dist.get_world_size(group) != config.ep_size:
        size = None if group is None else dist.get_world_size(group)
        raise ValueError(f"moe.ep_size={config.ep_size}: the model needs its expert-parallel process group of "
                         f"{config.ep_size} ranks (got {'none' if size is None else f'one of {size} ranks'}); "
                         "ling.train.engine.build_engine creates it")
    return group


class GroupedExperts(nn.Module):
    """SwiGLU experts stored stacked: gate_up_proj [E_l, 2·I, H] (rows gate | up) and down_proj [E_l, H, I],
    each expert an nn.Linear-style [out, in] matrix. E_l = num_experts / ep_size experts are held here: the
    global experts first_expert … first_expert + E_l − 1 (all of them without expert parallelism).

    forward(x [T, H], topk_weight [T, k], plan) → Σ_j topk_weight[t, j] · expert_{e(t,j)}(x[t]) [T, H], the
    gate applied to the down projection's input (the same maths as weighting the output), summed in fp32.
    precision "fp8": the blockwise-FP8 grouped kernels (`fp8.grouped.fp8_grouped_experts`), expert weights
    quantized 128x128 once per optimizer step (the FP8 weight caches); `fp8_expert_wgrad` picks its weight-gradient
    operands (E4M3, or bf16 with x saved instead of FP8 xᵀ). "bf16": on CUDA with bf16 one
    `torch._grouped_mm` per projection; elsewhere a loop over the segments.
    """

    def __init__(self, config: ModelConfig, ep_rank: int = 0) -> None:
        super().__init__()
        E, H, inter = config.num_local_experts, config.hidden_size, config.expert_intermediate_size
        self.num_experts, self.num_local_experts = config.num_experts, E
        self.first_expert = ep_rank * E
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * inter, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, inter))
        self.fp8 = config.precision == "fp8"
        self.pow2_scales = config.fp8_pow2_scales
        self.wgrad = config.fp8_expert_wgrad  # the FP8 path's weight-gradient operands: "fp8" | "bf16"
        self.collect_health = False  # fp8.monitor's hook: a sampled step fills `health` (fp8.health)
        self.health: dict[str, torch.Tensor] = {}
        if self.fp8:
            quantize = lambda w: quantize_expert_weights(w, self.pow2_scales)  # noqa: E731
            self._gate_up_fp8, self._down_fp8 = WeightCache(quantize), WeightCache(quantize)

    @property
    def local_experts(self) -> slice:
        """The global experts held here (dim 0 of the full [num_experts, ...] stacks)."""
        return slice(self.first_expert, self.first_expert + self.num_local_experts)

    def refresh_fp8_weights(self) -> None:
        """Quantize the expert weights now if they changed (what the next forward would do first; called before a
        CUDA graph replays this layer, `model.graphs.LayerGraphs`)."""
        if self.fp8:
            self._gate_up_fp8.get(self.gate_up_proj)
            self._down_fp8.get(self.down_proj)

    def graph_state(self) -> tuple:
        """What a captured graph of this layer depends on besides tensors."""
        return self.fp8, self.wgrad, self.pow2_scales

    def forward(self, x: torch.Tensor, topk_weight: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        """x [T, H] tokens (under expert parallelism: the received rows), topk_weight [T, k], plan over the
        local experts → [T, H]."""
        if self.fp8:
            wq = (*self._gate_up_fp8.get(self.gate_up_proj), *self._down_fp8.get(self.down_proj))
            out = fp8_grouped_experts(x, topk_weight, self.gate_up_proj, self.down_proj, wq, plan.row_src,
                                      plan.pos, plan.rows, self.pow2_scales, self.wgrad)  # fmt: skip
            if self.collect_health:
                self.health = grouped_experts_health(x, out, (self.gate_up_proj, self.down_proj), wq)
            return out
        rows_x = permute(x, plan)
        gate = row_gates(topk_weight, plan)
        return unpermute(self._mlp(rows_x, gate, plan), plan)

    def _swiglu(self, h: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        g, u = h.chunk(2, dim=-1)
        return (F.silu(g) * u * gate[:, None]).to(h.dtype)

    def _mlp(self, x: torch.Tensor, gate: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        """Expert-sorted rows [M, H] and their gates [M] → gated expert outputs [M, H] (unused rows unspecified)."""
        if x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
            offs = plan.rows.offsets[1:]  # segment ends; rows past offs[-1] are ignored
            h = torch._grouped_mm(x, self.gate_up_proj.transpose(1, 2), offs=offs)
            return torch._grouped_mm(self._swiglu(h, gate), self.down_proj.transpose(1, 2), offs=offs)
        # the reference loop (CPU, where host offsets are free), over each segment's data rows: zero pad rows
        # are left out so that the matmul shapes, and so the bits, do not depend on padding
        parts, end = [], 0
        for e, (lo, hi) in enumerate(plan.rows.host_segments()):
            if lo > end:
                parts.append(x.new_zeros(lo - end, x.shape[1]))
            if hi > lo:
                h = F.linear(x[lo:hi], self.gate_up_proj[e])
                parts.append(F.linear(self._swiglu(h, gate[lo:hi]), self.down_proj[e]))
            end = hi
        parts.append(x.new_zeros(x.shape[0] - end, x.shape[1]))
        return torch.cat(parts)


class MoE(nn.Module):
    """Routed experts (gated, summed in fp32) plus the shared expert (added unscaled).

    Routing-map padding (`pad_for_fp8`, on by default under FP8) rounds every expert's row count up to
    `pad_multiple` with gate-0 pad rows (model/dispatch.py); outputs and gradients are unchanged by it.
    `ep_group`: the expert-parallel process group of `config.ep_size` ranks (None when ep_size is 1); this rank
    holds the experts of its rank in that group."""

    def __init__(self, config: ModelConfig, ep_group=None) -> None:
        super().__init__()
        self.ep_group = check_expert_parallel_group(config, ep_group)
        self.router = Router(config)
        self.experts = GroupedExperts(config, dist.get_rank(self.ep_group) if self.ep_group is not None else 0)
        self.shared_experts = (
            MLP(config.hidden_size, config.expert_intermediate_size * config.num_shared_experts, config)
            if config.num_shared_experts > 0 else None
        )
        self.pad_multiple = config.moe_pad_multiple if config.pad_for_fp8_resolved else 1
        self.compile_ops = config.compile_ops

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RouterOutput]:
        """x [B, T, H] → ([B, T, H], router output)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        with scope("router"):
            routing = self.router(flat)
        out = self.routed_experts(flat, routing.topk_idx, routing.topk_weight).view(shape)
        if self.shared_experts is not None:
            with scope("shared_expert"):
                out = out + self.shared_experts(x)
        return out, routing

    def routed_experts(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        """x [T, H], the router's choices int64 [T, k] and gates [T, k] → Σ_j gate·expert(x) [T, H]: here, or
        through the expert-parallel exchange (the sender plans without padding; the experts' side pads)."""
        if self.ep_group is None:
            with scope("dispatch"):
                plan = plan_dispatch(topk_idx, self.router.num_experts, self.pad_multiple,
                                     use_compiled(self.compile_ops, x))
            with scope("experts"):
                return self.experts(x, topk_weight, plan)
        with scope("dispatch"):
            plan = plan_dispatch(topk_idx, self.router.num_experts, compiled=use_compiled(self.compile_ops, x))
        with scope("expert_parallel"):
            return expert_parallel(self.experts, x, topk_weight, plan, self.pad_multiple, self.ep_group)
