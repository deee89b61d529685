"""Building blocks: RMSNorm, half RoPE, GQA attention with QK-norm, SwiGLU MLP, and the linear switch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ModelConfig


def make_linear(in_features: int, out_features: int, config: ModelConfig) -> nn.Linear:
    """The one precision switch: a bias-free `nn.Linear`, or `FP8Linear` when `config.precision == "fp8"`."""
    if config.precision == "fp8":
        from fp8.linear import FP8Linear

        return FP8Linear(in_features, out_features, bias=False, recipe=config.fp8_recipe,
                         pow2_scales=config.fp8_pow2_scales)
    return nn.Linear(in_features, out_features, bias=False)


class RMSNorm(nn.Module):
    """y = gain · (x / rms(x)); the normalisation runs in fp32 and is cast back before the gain."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class RotaryEmbedding(nn.Module):
    """RoPE over the first `rotary_dim` dims of each head (rotate_half pairing i ↔ i + rotary_dim/2).

    inv_freq_j = 1 / base^(2j / rotary_dim) — the denominator is the rotary dim, not head_dim.
    """

    def __init__(self, rotary_dim: int, base: float) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def _apply(self, fn, recurse=True):  # keep inv_freq fp32 when the model is cast to bf16
        super()._apply(fn, recurse)
        self.inv_freq = self.inv_freq.float()
        return self

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int [T] → cos, sin fp32 [T, rotary_dim]."""
        freqs = torch.outer(positions.float(), self.inv_freq.to(positions.device))
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; rotate the first cos.shape[-1] dims, pass the rest through. Maths in fp32."""
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    xr = x_rot.float()
    xr = xr * cos + _rotate_half(xr) * sin
    return torch.cat([xr.to(x.dtype), x_pass], dim=-1)


def document_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """doc_ids int [B, T] → bool [B, 1, T, T]: position t attends to s ≤ t of the same document. Built once
    per forward and shared by every attention layer."""
    T = doc_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
    return (causal & same_doc)[:, None]


class Attention(nn.Module):
    """GQA self-attention: fused QKV (rows Q | K | V, head-major), QK-norm, half RoPE, causal SDPA."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        qkv_out = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.query_key_value = make_linear(config.hidden_size, qkv_out, config)
        self.dense = make_linear(config.num_heads * config.head_dim, config.hidden_size, config)
        self.query_layernorm = RMSNorm(config.head_dim, config.rms_eps)
        self.key_layernorm = RMSNorm(config.head_dim, config.rms_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, hidden] → [B, T, hidden]; attn_mask bool [B, 1, T, T] (`document_causal_mask`) or None for
        plain causal attention."""
        B, T, _ = x.shape
        qkv = self.query_key_value(x)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rotary(self.query_layernorm(q), cos, sin)
        k = apply_rotary(self.key_layernorm(k), cos, sin)
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:  # query head h reads KV head h // groups
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        if attn_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        out = out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)
        return self.dense(out)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) · up(x)); gate and up fused in one [2·inter, hidden] weight."""

    def __init__(self, hidden_size: int, intermediate_size: int, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = make_linear(hidden_size, 2 * intermediate_size, config)
        self.down_proj = make_linear(intermediate_size, hidden_size, config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
