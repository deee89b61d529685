"""`LingForCausalLM`: the Ling MoE decoder with Multi-Token-Prediction heads and its losses."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from model.config import ModelConfig
from model.graphs import LayerGraphs
from model.layers import MLP, Attention, AttentionMask, RMSNorm, RotaryEmbedding, attention_mask, scope
from model.loss import IGNORE_INDEX, LMHead, cross_entropy
from model.moe import GroupedExperts, MoE, Router, RouterOutput, check_expert_parallel_group


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x)); the MLP is dense or MoE."""

    def __init__(self, config: ModelConfig, moe: bool, ep_group=None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_eps, config.compile_ops)
        self.attention = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_eps, config.compile_ops)
        self.mlp: nn.Module = (MoE(config, ep_group) if moe
                               else MLP(config.hidden_size, config.dense_intermediate_size, config))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: AttentionMask) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, H] → (x [B, T, H], router losses fp32 [2] = (z_loss, aux_loss), zeros for dense)."""
        x = x + self.attention(self.input_layernorm(x), cos, sin, mask)
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, MoE):
            with scope("moe"):
                out, routing = self.mlp(h)
            losses = torch.stack([routing.z_loss, routing.aux_loss])
        else:
            out, losses = self.mlp(h), torch.zeros(2, device=x.device)
        return x + out, losses


class MTPLayer(nn.Module):
    """One MTP depth: h' = final_norm(layer(eh_proj(cat[enorm(embed(ids shifted by d)), hnorm(h)])))."""

    def __init__(self, config: ModelConfig, ep_group=None) -> None:
        super().__init__()
        self.enorm = RMSNorm(config.hidden_size, config.rms_eps, config.compile_ops)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_eps, config.compile_ops)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)  # stays high precision
        self.transformer_layer = DecoderLayer(config, moe=True, ep_group=ep_group)
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_eps, config.compile_ops)

    def forward(self, emb: torch.Tensor, h: torch.Tensor, cos, sin, mask) -> tuple[torch.Tensor, torch.Tensor]:
        with scope("mtp_proj"):
            x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1))
        x, losses = self.transformer_layer(x, cos, sin, mask)
        return self.final_layernorm(x), losses


@dataclass
class LingOutput:
    logits: torch.Tensor | None = None  # [B, T, V] in the compute dtype; None unless returned (`return_logits`)
    mtp_logits: list[torch.Tensor] | None = None  # one [B, T, V] per MTP depth; None unless returned
    loss: torch.Tensor | None = None  # lm_loss + mtp_weight · mean(mtp) + z + aux
    lm_loss: torch.Tensor | None = None
    mtp_loss: torch.Tensor | None = None  # mean CE over MTP depths (unweighted); None without MTP
    z_loss: torch.Tensor | None = None  # weighted, summed over MoE layers
    aux_loss: torch.Tensor | None = None  # weighted, summed over MoE layers


def shift_left(x: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """[B, T] → [B, T] with out[:, t] = x[:, t + k] and `fill` in the last k positions (no row leakage)."""
    if k == 0:
        return x
    out = torch.full_like(x, fill)
    if k < x.shape[1]:
        out[:, :-k] = x[:, k:]
    return out


class LingForCausalLM(nn.Module):
    """Embedding → decoder layers (dense first, then MoE) → final norm → LM head, plus MTP depths.

    forward(input_ids int64 [B, T], labels int64 [B, T] | None, doc_ids int64 [B, T] | None,
    return_logits bool | None) → LingOutput. labels[:, t] is the token after input_ids[:, t]; MTP depth d
    predicts labels shifted d more positions.

    Expert parallelism (`config.ep_size` > 1): `ep_group` is this rank's expert-parallel process group (of
    ep_size ranks); every MoE layer holds only this rank's share of the experts, under the same parameter names
    (`...mlp.experts.gate_up_proj` [num_experts / ep_size, ...]), and exchanges rows with the group's ranks.
    """

    def __init__(self, config: ModelConfig, ep_group=None) -> None:
        super().__init__()
        if config.vocab_size is None:
            raise ValueError("model.vocab_size is None: resolve it from the tokenizer before building the model")
        self.config = config
        ep_group = check_expert_parallel_group(config, ep_group)
        self.ep_rank = dist.get_rank(ep_group) if ep_group is not None else 0  # which experts this rank holds
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, moe, ep_group) for moe in config.is_moe_layer)
        self.norm = RMSNorm(config.hidden_size, config.rms_eps, config.compile_ops)
        self.lm_head = LMHead(config.hidden_size, config.vocab_size)
        self.mtp_layers = nn.ModuleList(MTPLayer(config, ep_group) for _ in range(config.num_mtp_layers))
        self.rotary = RotaryEmbedding(config.rotary_dim, config.rope_base)
        # `model.cuda_graphs`: the blocks' forward and backward replayed from CUDA graphs (model/graphs.py)
        self.graphs = (LayerGraphs([*self.layers, *self.mtp_layers],
                                   [0 < i < len(self.layers) for i in range(len(self.layers) + len(self.mtp_layers))])
                       if config.cuda_graphs else None)
        self.reset_parameters()

    @torch.no_grad()
    def init_parameter(self, name: str, p: torch.Tensor) -> None:
        """Normal(0, init_std) for a matrix (or stacked expert matrices), ones for a norm gain. This rank's share
        of an expert stack is its slice of the whole stack drawn at once: the same values whatever moe.ep_size."""
        if p.dim() >= 2:
            shard = self.expert_shard(name)
            if shard is None:
                nn.init.normal_(p, 0.0, self.config.init_std)
            else:
                full = p.new_empty(self.config.num_experts, *p.shape[1:])
                p.copy_(nn.init.normal_(full, 0.0, self.config.init_std)[shard])
        elif name.endswith("weight"):  # RMSNorm gains
            nn.init.ones_(p)

    def expert_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(name, parameter) of every routed-expert stack (the tensors split by expert parallelism)."""
        return [(f"{m_name}.{p_name}", p) for m_name, m in self.named_modules() if isinstance(m, GroupedExperts)
                for p_name, p in m.named_parameters()]

    def expert_shard(self, name: str) -> slice | None:
        """For an expert stack split by expert parallelism (ep_size > 1): the global experts it holds here, i.e.
        its slice along dim 0 of the whole [num_experts, ...] stack; None for every other tensor."""
        owner = name.rpartition(".")[0]
        if self.config.ep_size == 1 or not owner.endswith("mlp.experts"):
            return None
        module = self.get_submodule(owner)
        return module.local_experts if isinstance(module, GroupedExperts) else None

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise every parameter (`init_parameter`) and zero the expert biases."""
        for name, p in self.named_parameters():
            self.init_parameter(name, p)
        for m in self.modules():
            if isinstance(m, Router):
                m.expert_bias.zero_()

    def routers(self) -> list[Router]:
        return [m for m in self.modules() if isinstance(m, Router)]

    def _run_layer(self, layer: nn.Module, *args):
        if self.config.recompute_mode == "full" and self.training and torch.is_grad_enabled():
            return checkpoint(layer, *args, use_reentrant=False)
        return layer(*args)

    def _graphed(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, tail: tuple) -> bool:
        """Whether this forward's blocks replay CUDA graphs (`model.cuda_graphs`, training with gradients; the
        graphs are captured or re-captured here when needed). `tail`: the mask as a graph input, () when causal."""
        if self.graphs is None or not (self.training and torch.is_grad_enabled()):
            return False
        samples = [(x, cos, sin, *tail)] * len(self.layers) + [(x, x, cos, sin, *tail)] * len(self.mtp_layers)
        return self.graphs.ready(samples, {} if tail else {"mask": None})

    def _head(self, h: torch.Tensor, labels: torch.Tensor | None,
              return_logits: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """h [B, T, H] → (logits [B, T, V] if asked, mean CE if labels): the fused chunked loss when the logits
        are not asked for, else CE over the returned logits."""
        with scope("lm_head_loss"):
            if not return_logits:
                return None, (self.lm_head(h, labels) if labels is not None else None)
            logits = self.lm_head(h)
            return logits, (cross_entropy(logits, labels) if labels is not None else None)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None, return_logits: bool | None = None) -> LingOutput:
        """return_logits: None = logits iff labels is None. With labels and no logits the LM heads compute their
        loss chunk by chunk (`model.loss.linear_cross_entropy`) and no [B, T, V] tensor exists."""
        cfg = self.config
        return_logits = labels is None if return_logits is None else return_logits
        B, T = input_ids.shape
        cos, sin = self.rotary.cos_sin(torch.arange(T, device=input_ids.device))
        mask = attention_mask(doc_ids, cfg)  # built once, shared by every layer
        with scope("embedding"):
            x = self.word_embeddings(input_ids)
        router_losses = torch.zeros(2, device=x.device)
        tail = () if mask is None else (mask,)
        graphed = self._graphed(x, cos, sin, tail)
        for i, layer in enumerate(self.layers):
            x, losses = (self.graphs.run(i, x, cos, sin, *tail) if graphed
                         else self._run_layer(layer, x, cos, sin, mask))
            router_losses = router_losses + losses
        h = self.norm(x)
        out = LingOutput(mtp_logits=[] if return_logits else None)
        out.logits, out.lm_loss = self._head(h, labels, return_logits)

        mtp_losses: list[torch.Tensor] = []
        for depth, mtp in enumerate(self.mtp_layers, start=1):
            with scope("embedding"):
                emb = self.word_embeddings(shift_left(input_ids, depth, 0))
            # depth d keeps position t's document mask: its input at t is token t+d, its target token t+d+1
            h, losses = (self.graphs.run(len(self.layers) + depth - 1, emb, h, cos, sin, *tail) if graphed
                         else self._run_layer(mtp, emb, h, cos, sin, mask))
            router_losses = router_losses + losses
            mtp_labels = shift_left(labels, depth, IGNORE_INDEX) if labels is not None else None
            logits, loss = self._head(h, mtp_labels, return_logits)
            if logits is not None:
                out.mtp_logits.append(logits)
            if loss is not None:
                mtp_losses.append(loss)

        if labels is not None:
            out.z_loss = cfg.z_loss_coef * router_losses[0]
            out.aux_loss = cfg.aux_loss_coef * router_losses[1]
            out.loss = out.lm_loss + out.z_loss + out.aux_loss
            if mtp_losses:
                out.mtp_loss = torch.stack(mtp_losses).mean()
                out.loss = out.loss + cfg.mtp_loss_weight * out.mtp_loss
        return out


@dataclass
class ParameterCount:
    total: int  # every parameter, MTP excluded
    activated: int  # parameters one token touches (k routed + shared experts), MTP excluded
    mtp: int  # parameters of the MTP layers
    mtp_activated: int

    def __str__(self) -> str:
        def b(n: int) -> str:
            return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"

        return (f"{b(self.total)} total / {b(self.activated)} activated parameters "
                f"(+{b(self.mtp)} total / {b(self.mtp_activated)} activated in MTP)")


def count_parameters(config: ModelConfig) -> ParameterCount:
    """Count on the meta device (no memory): total and activated, main model and MTP separately."""
    with torch.device("meta"):
        model = LingForCausalLM(config.replace(ep_size=1))  # the whole model, whatever moe.ep_size
    inactive_frac = 1.0 - config.num_experts_per_tok / config.num_experts

    def count(modules) -> tuple[int, int]:
        total = inactive = 0
        for name, p in modules:
            total += p.numel()
            if ".experts." in f".{name}":
                inactive += int(p.numel() * inactive_frac)
        return total, total - inactive

    mtp_params = [(n, p) for n, p in model.named_parameters() if n.startswith("mtp_layers.")]
    main_params = [(n, p) for n, p in model.named_parameters() if not n.startswith("mtp_layers.")]
    total, act = count(main_params)
    mtp_total, mtp_act = count(mtp_params)
    return ParameterCount(total, act, mtp_total, mtp_act)


__all__ = ["IGNORE_INDEX", "LingForCausalLM", "LingOutput", "count_parameters", "cross_entropy", "ParameterCount",
           "RouterOutput", "shift_left"]
