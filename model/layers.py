"""Building blocks: RMSNorm, half RoPE, GQA attention with QK-norm (SDPA, or FlexAttention over packed
documents), SwiGLU MLP with optional recomputation, and the linear switch."""

from __future__ import annotations

import functools
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.utils.checkpoint import checkpoint

from fp8.linear import FP8Linear
from kernels.fusable import Fusable
from model.config import ModelConfig

AttentionMask = torch.Tensor | BlockMask | None  # None: causal; bool [B, 1, T, T]: dense; BlockMask: flex


def scope(name: str):
    """A profiler range `name` while a torch profiler records (ling/analysis/profiling.py groups kernels by these
    ranges: attention_core, attention_proj, mlp, moe, lm_head_loss, ...); a no-op otherwise."""
    return torch.profiler.record_function(name) if torch.autograd._profiler_enabled() else nullcontext()


def use_compiled(compile_ops: str, x: torch.Tensor) -> bool:
    """`model.compile_ops` for a call on x: "on" compiles wherever, "auto" on CUDA tensors, "off" never."""
    return compile_ops == "on" or (compile_ops == "auto" and x.is_cuda)


def make_linear(in_features: int, out_features: int, config: ModelConfig) -> nn.Linear:
    """The one precision switch: a bias-free `nn.Linear`, or `FP8Linear` when `config.precision == "fp8"`."""
    if config.precision == "fp8":
        return FP8Linear(in_features, out_features, bias=False, recipe=config.fp8_recipe,
                         pow2_scales=config.fp8_pow2_scales)
    return nn.Linear(in_features, out_features, bias=False)


@Fusable
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] (any float dtype), weight [D] → weight · (x / rms(x)) [..., D]: the normalisation in fp32,
    cast back to x's dtype before the gain."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


class RMSNorm(nn.Module):
    """y = gain · (x / rms(x)); the normalisation runs in fp32 and is cast back before the gain.
    `compile_ops` (`model.compile_ops`): whether `rms_norm` runs compiled."""

    def __init__(self, dim: int, eps: float = 1e-6, compile_ops: str = "auto") -> None:
        super().__init__()
        self.eps = eps
        self.compile_ops = compile_ops
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, compiled=use_compiled(self.compile_ops, x))


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


@Fusable
def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_gain: torch.Tensor, k_gain: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention core before `attend`: q [B, Hq, T, D] and k [B, Hkv, T, D] → RMSNorm of every head (gains
    [D]) then half RoPE (cos/sin fp32 [T, rotary_dim]), the maths of the QK-norm modules and `apply_rotary`."""
    return (apply_rotary(rms_norm.eager(q, q_gain, eps), cos, sin),
            apply_rotary(rms_norm.eager(k, k_gain, eps), cos, sin))


def document_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """doc_ids int [B, T] → bool [B, 1, T, T]: position t attends to s ≤ t of the same document (the dense
    reference mask, B·T² bytes)."""
    T = doc_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
    return (causal & same_doc)[:, None]


FLEX_BLOCK = 128  # FlexAttention's default block size (queries and keys)


def _ordered_blocks(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [B, Qb, KVb] → (int32 [B, 1, Qb] count, int32 [B, 1, Qb, KVb] indices of the true blocks first,
    ascending: the layout `create_block_mask` builds)."""
    num = mask.sum(-1, dtype=torch.int32)
    idx = torch.argsort(mask.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return num[:, None], idx[:, None]


def document_block_mask(doc_ids: torch.Tensor) -> BlockMask:
    """doc_ids int [B, T], nondecreasing along T (the document index, as the loaders make them) → the
    document-causal mask as a FlexAttention BlockMask (128x128 blocks: blocks outside every document are
    skipped, blocks inside one document and below the diagonal need no mask, the rest are masked per element).

    Built from each block's first and last document id, [B, T/128] values, instead of evaluating the mask on
    all T² positions (`create_block_mask`, slow at every forward: docs/kernel_tuning.md). With nondecreasing ids a key
    block j < i shares a document with query block i iff last_j == first_i, and is full iff, besides, both
    blocks hold one document each. No host sync. T not a multiple of 128: `create_block_mask`."""
    B, T = doc_ids.shape

    def document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    if T % FLEX_BLOCK:
        return create_block_mask(document_causal, B, None, T, T, device=doc_ids.device)
    blocks = doc_ids.view(B, T // FLEX_BLOCK, FLEX_BLOCK)
    first, last = blocks[:, :, 0], blocks[:, :, -1]  # [B, nb]
    i = torch.arange(T // FLEX_BLOCK, device=doc_ids.device)
    below = (i[:, None] > i[None, :])[None]  # key block before query block: causal for every pair
    shares = below & (last[:, None, :] == first[:, :, None])  # [B, q block, kv block]
    one_doc = first == last
    full = shares & one_doc[:, None, :] & one_doc[:, :, None]
    partial = (shares & ~full) | torch.eye(len(i), dtype=torch.bool, device=doc_ids.device)[None]
    return BlockMask.from_kv_blocks(*_ordered_blocks(partial), *_ordered_blocks(full), BLOCK_SIZE=FLEX_BLOCK,
                                    mask_mod=document_causal, seq_lengths=(T, T))


def attention_mask(doc_ids: torch.Tensor | None, config: ModelConfig) -> AttentionMask:
    """The mask every attention layer of one forward shares: None (causal) without doc_ids, else a BlockMask
    (`document_attention` flex, or auto on CUDA) or the dense bool mask (dense, or auto elsewhere)."""
    if doc_ids is None:
        return None
    impl = config.document_attention
    if impl == "auto":
        impl = "flex" if doc_ids.is_cuda else "dense"
    if impl == "flex":
        if not doc_ids.is_cuda and torch.is_grad_enabled():
            raise ValueError("model.document_attention=flex: FlexAttention has no backward on CPU; "
                             "use auto or dense there")
        return document_block_mask(doc_ids)
    return document_causal_mask(doc_ids)


# One entry: flex_attention's torch.compile wrapper, built on the first CUDA call and kept for the process (its
# fused kernel; a wrapper per call would compile again every time).
@functools.lru_cache(maxsize=1)
def _compiled_flex_attention():
    return torch.compile(flex_attention, dynamic=False)


def _flex(q: torch.Tensor):
    """flex_attention compiled once on CUDA (its fused kernel); eager (the unfused reference) elsewhere."""
    return _compiled_flex_attention() if q.is_cuda else flex_attention


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
    """q [B, Hq, T, D], k/v [B, Hkv, T, D] → [B, Hq, T, D]; query head h reads KV head h // (Hq / Hkv) without a
    K/V copy. Scale 1/sqrt(D)."""
    if isinstance(mask, BlockMask):
        return _flex(q)(q, k, v, block_mask=mask, enable_gqa=True)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return reference_attention(q, k, v, mask)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        mask: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: K/V repeated to every query head, SDPA causal or with a dense bool mask [B, 1, T, T].
    Also the dense-mask path (SDPA's memory-efficient kernel takes the mask but no GQA)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Attention(nn.Module):
    """GQA self-attention: fused QKV (rows Q | K | V, head-major), QK-norm, half RoPE, causal SDPA.

    With `recompute=selective` the core (QK-norm, RoPE, attention) keeps only its input, the QKV output, and
    runs again in backward; the two linears keep their saved inputs."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.recompute_core = config.recompute_mode == "selective"
        self.compile_ops = config.compile_ops
        qkv_out = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.query_key_value = make_linear(config.hidden_size, qkv_out, config)
        self.dense = make_linear(config.num_heads * config.head_dim, config.hidden_size, config)
        self.query_layernorm = RMSNorm(config.head_dim, config.rms_eps, config.compile_ops)
        self.key_layernorm = RMSNorm(config.head_dim, config.rms_eps, config.compile_ops)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: AttentionMask = None) -> torch.Tensor:
        """x [B, T, hidden] → [B, T, hidden]; mask from `attention_mask` (None: plain causal attention)."""
        with scope("attention_proj"):
            qkv = self.query_key_value(x)
        with scope("attention_core"):
            if self.recompute_core and torch.is_grad_enabled():
                out = checkpoint(self.core, qkv, cos, sin, mask, use_reentrant=False)
            else:
                out = self.core(qkv, cos, sin, mask)
        with scope("attention_proj"):
            return self.dense(out)

    def core(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
        """qkv [B, T, (Hq + 2·Hkv)·D] → attention output [B, T, Hq·D] (before the output projection)."""
        B, T, _ = qkv.shape
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if use_compiled(self.compile_ops, qkv):  # QK-norm and RoPE fused: the norms' gains read here
            q, k = qk_norm_rope(q, k, self.query_layernorm.weight, self.key_layernorm.weight, cos, sin,
                                self.query_layernorm.eps, compiled=True)
        else:
            q = apply_rotary(self.query_layernorm(q), cos, sin)
            k = apply_rotary(self.key_layernorm(k), cos, sin)
        out = attend(q, k, v, mask)
        return out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)


class _SwiGLU(torch.autograd.Function):
    """silu(gate) · up of gate_up = [gate | up] that saves only gate_up and recomputes silu(gate) in backward
    (autograd's own graph also keeps silu(gate)); the gradient is autograd's, op for op."""

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (gate_up,) = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        d_gate = torch.ops.aten.silu_backward(grad * up, gate)
        return torch.cat([d_gate, grad * F.silu(gate)], dim=-1)


@Fusable
def _swiglu(gate_up: torch.Tensor, recompute: bool) -> torch.Tensor:
    if recompute:
        return _SwiGLU.apply(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu(gate_up: torch.Tensor, recompute: bool = False, compiled: bool = False) -> torch.Tensor:
    """gate_up [..., 2·I] = [gate | up] → silu(gate) · up [..., I]; `recompute` saves only gate_up for backward;
    `compiled` fuses forward and backward (`model.compile_ops`). (The routed experts' SwiGLU lives in their
    grouped-GEMM function; it can use this too.)"""
    return _swiglu(gate_up, recompute and torch.is_grad_enabled() and gate_up.requires_grad, compiled=compiled)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) · up(x)); gate and up fused in one [2·inter, hidden] weight. With
    `recompute=selective` the activation is recomputed in backward from the saved gate_up output."""

    def __init__(self, hidden_size: int, intermediate_size: int, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.recompute_activation = config.recompute_mode == "selective"
        self.compile_ops = config.compile_ops
        self.gate_up_proj = make_linear(hidden_size, 2 * intermediate_size, config)
        self.down_proj = make_linear(intermediate_size, hidden_size, config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with scope("mlp"):
            gate_up = self.gate_up_proj(x)
            return self.down_proj(swiglu(gate_up, self.recompute_activation, use_compiled(self.compile_ops, gate_up)))
