"""Mixture of Experts: the sigmoid group-limited router with aux-loss-free bias, grouped experts, the block."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from model.config import ModelConfig
from model.layers import MLP


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
    top-2 biased scores, the top `topk_groups` groups are kept, then the top-k experts inside them. The
    gates are the *unbiased* sigmoid scores of the chosen experts, normalised to sum 1 and scaled.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.num_groups = config.num_expert_groups
        self.topk_groups = config.topk_groups
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(config.num_experts, dtype=torch.float32))
        # tokens routed to each expert since the last bias update (summed over micro-batches)
        self.register_buffer("tokens_per_expert", torch.zeros(config.num_experts, dtype=torch.float32),
                             persistent=False)

    def _apply(self, fn, recurse=True):  # the bias and the counts stay fp32 when the model is cast
        super()._apply(fn, recurse)
        self.expert_bias = self.expert_bias.float()
        self.tokens_per_expert = self.tokens_per_expert.float()
        return self

    def forward(self, x: torch.Tensor) -> RouterOutput:
        """x [N, hidden] (any float dtype) → RouterOutput."""
        logits = F.linear(x.float(), self.weight.float())  # [N, E] fp32
        scores = torch.sigmoid(logits)
        topk_idx = self.select(scores)
        weight = scores.gather(1, topk_idx)
        weight = weight / (weight.sum(-1, keepdim=True) + 1e-20) * self.scaling
        counts = torch.bincount(topk_idx.flatten(), minlength=self.num_experts)
        if self.training:
            self.tokens_per_expert += counts.float()
        z_loss = torch.logsumexp(logits, dim=-1).pow(2).mean()
        # switch-style balance loss on normalised scores: E · Σ_e f_e · P_e
        probs = scores / scores.sum(-1, keepdim=True)
        aux_loss = self.num_experts * (counts.float() / topk_idx.numel() * probs.mean(0)).sum()
        return RouterOutput(topk_idx, weight, z_loss, aux_loss, counts)

    @torch.no_grad()
    def select(self, scores: torch.Tensor) -> torch.Tensor:
        """scores fp32 [N, E] → int64 [N, k] experts chosen on biased scores within the top groups."""
        n = scores.shape[0]
        biased = scores + self.expert_bias
        grouped = biased.view(n, self.num_groups, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [N, G]
        group_idx = group_scores.topk(self.topk_groups, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(n, -1)
        masked = biased.masked_fill(~expert_mask, float("-inf"))
        return masked.topk(self.top_k, dim=-1).indices

    @torch.no_grad()
    def update_expert_bias(self, rate: float) -> dict[str, float]:
        """b += rate · (sign(mean − n_e) − mean(sign(mean − n_e))), with n_e summed over all ranks.

        Call once per optimizer step; returns the load statistics of the step (max/mean, before update).
        """
        counts = self.tokens_per_expert.clone()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(counts)
        mean = counts.mean()
        stats = {"max_over_mean": float(counts.max() / mean) if mean > 0 else 0.0}
        if rate > 0 and mean > 0:
            sign = torch.sign(mean - counts)
            self.expert_bias += rate * (sign - sign.mean())
        self.tokens_per_expert.zero_()
        return stats


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU experts stored stacked; tokens arrive sorted into contiguous per-expert segments.

    gate_up_proj [E, 2·I, H] and down_proj [E, H, I] (each expert is an nn.Linear-style [out, in] matrix).
    On CUDA with bf16 one `torch._grouped_mm` launch runs all experts; elsewhere a loop over segments.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        E, H, inter = config.num_experts, config.hidden_size, config.expert_intermediate_size
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * inter, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, inter))

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x [N, H] sorted by expert; tokens_per_expert int64 [E] (sums to N) → [N, H]."""
        if x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
            offs = torch.cumsum(tokens_per_expert, 0).to(torch.int32)
            h = torch._grouped_mm(x, self.gate_up_proj.transpose(1, 2), offs=offs)
            gate, up = h.chunk(2, dim=-1)
            return torch._grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=offs)
        out = x.new_empty(x.shape)
        start = 0
        for e, n in enumerate(tokens_per_expert.tolist()):
            if n == 0:
                continue
            seg = x[start:start + n]
            gate, up = F.linear(seg, self.gate_up_proj[e]).chunk(2, dim=-1)
            out[start:start + n] = F.linear(F.silu(gate) * up, self.down_proj[e])
            start += n
        return out


class MoE(nn.Module):
    """Routed experts (weighted, summed in fp32) plus the shared expert (added unscaled)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.router = Router(config)
        self.experts = GroupedExperts(config)
        self.shared_experts = (
            MLP(config.hidden_size, config.expert_intermediate_size * config.num_shared_experts, config)
            if config.num_shared_experts > 0 else None
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RouterOutput]:
        """x [B, T, H] → ([B, T, H], router output)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        routing = self.router(flat)
        k = routing.topk_idx.shape[1]
        flat_expert = routing.topk_idx.flatten()
        order = torch.argsort(flat_expert, stable=True)  # permutation into per-expert segments
        token_idx = order // k
        expert_out = self.experts(flat[token_idx], routing.tokens_per_expert)
        weighted = expert_out.float() * routing.topk_weight.flatten()[order].unsqueeze(-1)
        routed = torch.zeros(flat.shape, dtype=torch.float32, device=flat.device).index_add_(0, token_idx, weighted)
        out = routed.to(x.dtype).view(shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out, routing
