"""`FP8Linear`: a drop-in `nn.Linear` whose three GEMMs run in blockwise FP8 (DeepSeek-V3 / Ling 2.0 recipe).

recipe="blockwise" (the default):
- forward  y  = x·Wᵀ : x quantized 1x128 (along K), W 128x128; bf16 (input dtype) output.
- dgrad    dx = dy·W : dy quantized 1x128 along N; Wᵀ in FP8 is cached with W: the weight's one quantization pass
  per change writes both (a 128x128 block's transpose shares its scale, so Wᵀ is exact), one more byte per
  parameter instead of a transpose in every backward.
- wgrad    dW = dyᵀ·x: dyᵀ and xᵀ quantized 1x128 along the token dim; dyᵀ in the same pass (one read of dy)
  that quantizes dy for dgrad, xᵀ in the forward's pass over x (one read of x gives the 1x128-along-K x
  for the forward GEMM and the token-dim xᵀ for wgrad); fp32 accumulation, rounded once to the weight's
  dtype when the GEMM stores dW.
- saved for backward: the FP8 x in the layout wgrad reads (xᵀ, 1x128 along tokens) and its scales, about
  half the bytes of a bf16 x, and the cached FP8 W. (Quantizing xᵀ straight from the high-precision x
  rounds it once; the alternative, saving x 1x128 along K and re-quantizing it in backward, rounds it
  twice and costs another pass.) Under torch.no_grad (e.g. the first pass of activation checkpointing) or
  with a frozen weight, only the forward's x is quantized and nothing is saved for wgrad.
recipe="tensorwise": one current scale per tensor for x, W and dy (the comparison recipe); GEMMs through
`torch._scaled_mm` on CUDA (dims multiples of 16) else the dequantize+matmul reference.

Weight cache (`WeightCache`, one per weight, owned by its module): W is quantized once and reused for as long as
its key is unchanged. The key is (weight.data_ptr(), weight._version, shape, dtype, device): an optimizer's
in-place update bumps `_version`, so W is re-quantized once per optimizer step and reused across the micro-batches
of gradient accumulation. For parameters rewritten behind autograd's back (DeepSpeed writes through `.data`; a
ZeRO-3 re-gather into the same buffer) `invalidate_fp8_weight_caches(model)` clears every cache the model's
modules own: `ling.train.engine.build_engine` calls it from an optimizer step hook, so no loop has to remember
it. `module.invalidate_weight_cache()` drops one layer's cache.

Health, check and fallback hooks (read and set by `fp8.monitor.FP8Monitor`): `collect_health = True` makes the
next forward+backward fill `health` with 0-dim device tensors (act/grad/gradT/weight underflow and distortion,
no host sync); with `check_dw = True` as well, the forward keeps the high-precision x for that one pass and the
backward recomputes dW = dyᵀ·x in fp32 from dy and x and stores ||dW_fp8 − dW_ref|| / ||dW_ref|| as
`health["dw_rel_err"]`. `use_fp8 = False` turns the layer into a plain high-precision linear (F.linear in the
input dtype: BF16 under DeepSpeed bf16), the monitor's per-layer fallback.

Ablation (`set_ablation(components)`, config `fp8.ablate`): each named component of `ABLATION_COMPONENTS` runs
in high precision while the others keep their FP8 rounding; the GEMMs then run as fp32 matmuls of the
dequantized (or exact) operands (`_AblatedFP8Fn`, slower, for experiments only; an ablated layer collects no
health). `EMULATED` alone takes that path with nothing in high precision: on CPU it computes exactly what the FP8
path computes, on CUDA the same rounded operands summed in another order (the ablations' baseline).

Devices: CUDA tensors run the Triton kernels; CPU tensors run the same maths in PyTorch (fp8/quant.py and
fp8/gemm.py references), so `precision=fp8` also trains on CPU (fp32 in, fp32 out).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fp8.format import E4M3
from fp8.gemm import fp8_gemm, fp8_gemm_wgrad
from fp8.health import health_stats, relative_error
from fp8.quant import (
    dequantize_1x128,
    dequantize_128x128,
    fp8_transpose_128x128,
    quantize_1x128,
    quantize_1x128_dual,
    quantize_1x128_transposed,
    quantize_128x128_with_transpose,
    quantize_tensorwise,
)
from kernels.gradient_outputs import GRADIENT_OUTPUTS

__all__ = ["FP8Linear", "WeightCache", "invalidate_fp8_weight_caches", "weight_caches", "RECIPES",
           "ABLATION_COMPONENTS", "EMULATED"]

RECIPES = ("blockwise", "tensorwise")
# What `FP8Linear.set_ablation` can keep in high precision: the forward's x and W, dgrad's dy and W, wgrad's dyᵀ
# and xᵀ, and the rounding of dW to the weight's dtype in the wgrad epilogue (with a bf16 weight autograd rounds
# the returned fp32 dW to bf16 at once, round to nearest even like the epilogue: bit-identical, see README).
# EMULATED keeps every operand rounded but runs the GEMMs as the ablation path's fp32 matmuls: the baseline that an
# ablated layer is measured against (the Triton GEMMs sum in another order, which moves outputs by ~1 bf16 ulp).
EMULATED = "emulated"
ABLATION_COMPONENTS = ("fwd_x", "fwd_w", "dgrad_dy", "dgrad_w", "wgrad_dy", "wgrad_x", "wgrad_bf16", EMULATED)


class WeightCache:
    """The FP8 form of one weight, re-quantized only when the weight changed.

    The key is (data_ptr, _version, shape, dtype, device): an optimizer's in-place update bumps `_version`;
    updates autograd does not see (DeepSpeed writes through `.data`) need `clear()`, which
    `invalidate_fp8_weight_caches(model)` calls on every cache of a model. `quantize(w) -> tuple of tensors` runs
    under no_grad.

    `stable = True` (set by `model.graphs.LayerGraphs` for the layers it captures): a re-quantization writes into
    the tensors already cached instead of replacing them, so that a CUDA graph that reads them reads the new
    weight; `clear()` then keeps the tensors, and a quantization of another shape or dtype is refused.
    """

    def __init__(self, quantize: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]) -> None:
        self.quantize = quantize
        self.stable = False
        self._key: tuple | None = None
        self._value: tuple[torch.Tensor, ...] = ()

    def get(self, w: torch.Tensor, *options: Any) -> tuple[torch.Tensor, ...]:
        """The quantized `w`; `options` (e.g. the recipe) are part of the key."""
        key = (w.data_ptr(), w._version, tuple(w.shape), w.dtype, w.device, *options)
        if self._key != key:
            with torch.no_grad():
                value = self.quantize(w.detach())
                if self.stable and self._value:
                    self._write_in_place(value)
                else:
                    self._value = value
            self._key = key
        return self._value

    def _write_in_place(self, value: tuple[torch.Tensor, ...]) -> None:
        layouts = lambda ts: [(t.shape, t.dtype, t.device) for t in ts]  # noqa: E731
        if layouts(value) != layouts(self._value):
            raise RuntimeError(f"an FP8 weight cache read by a CUDA graph (model.cuda_graphs) changed its layout: "
                               f"{layouts(self._value)} -> {layouts(value)}; the graph would read stale memory")
        for old, new in zip(self._value, value):
            old.copy_(new)

    def clear(self) -> None:
        """Drop the cached FP8 weight: the next `get` quantizes again (into the same tensors when `stable`)."""
        self._key = None
        if not self.stable:
            self._value = ()


def weight_caches(model: nn.Module) -> list[WeightCache]:
    """Every FP8 weight cache owned by `model`'s modules (FP8Linear, the FP8 grouped experts: any `WeightCache`
    attribute)."""
    return [value for module in model.modules() for value in vars(module).values() if isinstance(value, WeightCache)]


def invalidate_fp8_weight_caches(model: nn.Module) -> None:
    """Make every FP8 weight cache owned by `model`'s modules (FP8Linear, the FP8 grouped experts: any
    `WeightCache` attribute) re-quantize at its next use; call after the weights changed in place unseen by
    autograd."""
    for cache in weight_caches(model):
        cache.clear()


# ----------------------------------------------------------------------------------------------------------
# blockwise recipe
# ----------------------------------------------------------------------------------------------------------
class _BlockwiseFP8Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, w_fp8, pow2: bool, module: Any, need_wgrad: bool):  # x [M, K], W [N, K]
        w_q, w_s, wt_q, wt_s = w_fp8  # W and Wᵀ in FP8, from the weight cache
        if need_wgrad:  # one read of x: 1x128 along K for this GEMM, along tokens (transposed) for wgrad
            x_q, x_s, xt_q, xt_s = quantize_1x128_dual(x, pow2)
        else:
            x_q, x_s = quantize_1x128(x, pow2)
            xt_q = xt_s = None
        y = fp8_gemm(x_q, x_s, w_q, w_s, out_dtype=x.dtype)
        ctx.save_for_backward(xt_q, xt_s, wt_q, wt_s, _kept_for_dw_check(module, x, need_wgrad))
        ctx.pow2, ctx.x_dtype, ctx.w_dtype = pow2, x.dtype, weight.dtype
        ctx.weight_key = (weight.data_ptr(), tuple(weight.shape))  # GRADIENT_OUTPUTS' key and dW's shape
        ctx.module = module  # set only while health is being collected
        if module is not None:
            module.health.update(health_stats("act", x, x_q))
        return y

    @staticmethod
    def backward(ctx, dy):
        xt_q, xt_s, wt_q, wt_s, x_kept = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if need_dw and xt_q is None:
            raise RuntimeError("FP8Linear: weight gradient requested but the forward ran without it in mind")
        dy = dy.reshape(-1, dy.shape[-1])
        dx = dw = None
        if need_dx and need_dw:
            dy_q, dy_s, dyt_q, dyt_s = quantize_1x128_dual(dy, ctx.pow2)  # one read of dy, both layouts
        elif need_dx:
            dy_q, dy_s = quantize_1x128(dy, ctx.pow2)
        elif need_dw:
            dyt_q, dyt_s = quantize_1x128_transposed(dy, None, ctx.pow2)
        if need_dx:
            dx = fp8_gemm(dy_q, dy_s, wt_q, wt_s, out_dtype=ctx.x_dtype)
        if need_dw:  # fp32 accumulation, rounded once to the weight's dtype in the GEMM's epilogue
            ptr, shape = ctx.weight_key  # a registered output (model.graphs' gradient slab), else a new tensor
            dw = fp8_gemm_wgrad(dyt_q, dyt_s, xt_q, xt_s, out_dtype=ctx.w_dtype,
                                out=GRADIENT_OUTPUTS.get(ptr, shape, ctx.w_dtype, dy.device))
        if ctx.module is not None:
            if need_dx:
                ctx.module.health.update(health_stats("grad", dy, dy_q))
            if need_dw:
                ctx.module.health.update(health_stats("gradT", dy.t(), dyt_q))
            _check_dw(ctx.module, dw, dy, x_kept)
        return dx, dw, None, None, None, None


def _kept_for_dw_check(module: Any, x: torch.Tensor, need_wgrad: bool) -> torch.Tensor | None:
    """The high-precision x, kept for backward only while the module collects health with `check_dw`."""
    return x if module is not None and need_wgrad and module.check_dw else None


def _check_dw(module: Any, dw: torch.Tensor | None, dy: torch.Tensor, x: torch.Tensor | None) -> None:
    """health["dw_rel_err"] = ||dW − dyᵀ·x|| / ||dyᵀ·x|| with the reference in fp32 from the high-precision dy
    [M, N] and x [M, K] of the same micro-batch (the Ling team's recompute check)."""
    if dw is not None and x is not None:
        with torch.no_grad():
            module.health["dw_rel_err"] = relative_error(dw, dy.float().t() @ x.float())


# ----------------------------------------------------------------------------------------------------------
# tensorwise recipe (comparison)
# ----------------------------------------------------------------------------------------------------------
def _tensorwise_mm(a_q, a_s, b_q, b_s, out_dtype: torch.dtype) -> torch.Tensor:
    """a [M, K] · b [N, K]ᵀ with one scale each; cuBLAS on CUDA when the shapes allow, else reference."""
    m, k = a_q.shape
    n = b_q.shape[0]
    if a_q.is_cuda and k % 16 == 0 and n % 16 == 0 and hasattr(torch, "_scaled_mm"):
        return torch._scaled_mm(a_q, b_q.t(), scale_a=a_s, scale_b=b_s, out_dtype=out_dtype)
    return ((a_q.float() * a_s) @ (b_q.float() * b_s).t()).to(out_dtype)


class _TensorwiseFP8Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, w_fp8, pow2: bool, module: Any, need_wgrad: bool):
        w_q, w_s = w_fp8
        x_q, x_s = quantize_tensorwise(x)
        y = _tensorwise_mm(x_q, x_s, w_q, w_s, x.dtype)
        ctx.save_for_backward(x_q, x_s, w_q, w_s, _kept_for_dw_check(module, x, need_wgrad))
        ctx.x_dtype, ctx.w_dtype, ctx.module = x.dtype, weight.dtype, module
        if module is not None:
            module.health.update(health_stats("act", x, x_q))
        return y

    @staticmethod
    def backward(ctx, dy):
        x_q, x_s, w_q, w_s, x_kept = ctx.saved_tensors
        dy = dy.reshape(-1, dy.shape[-1])
        dy_q, dy_s = quantize_tensorwise(dy)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _tensorwise_mm(dy_q, dy_s, w_q.t().contiguous(), w_s, ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            dyt = dy_q.t().contiguous()
            dw = _tensorwise_mm(dyt, dy_s, x_q.t().contiguous(), x_s, torch.float32).to(ctx.w_dtype)
            if ctx.module is not None:
                ctx.module.health.update(health_stats("gradT", dy.t(), dyt))
        if ctx.module is not None:
            ctx.module.health.update(health_stats("grad", dy, dy_q))
            _check_dw(ctx.module, dw, dy, x_kept)
        return dx, dw, None, None, None, None


# ----------------------------------------------------------------------------------------------------------
# ablation: chosen components in high precision, the rest with the blockwise recipe's rounding
# ----------------------------------------------------------------------------------------------------------
def _rounded_1x128(t: torch.Tensor, pow2: bool) -> torch.Tensor:
    """t [M, K] → fp32 dequantize(quantize_1x128(t)): the values the FP8 GEMM sees."""
    return dequantize_1x128(*quantize_1x128(t, pow2))


class _AblatedFP8Fn(torch.autograd.Function):
    """The blockwise recipe's three GEMMs as fp32 matmuls of operands that are either rounded like the recipe
    (dequantized 1x128 / 128x128 values, the cached W included) or exact, per `ablate`. Saves the
    high-precision x (experiments only)."""

    @staticmethod
    def forward(ctx, x, weight, w_q, w_s, pow2: bool, ablate: frozenset):  # x [M, K], W [N, K]
        a = x.float() if "fwd_x" in ablate else _rounded_1x128(x, pow2)
        b = weight.float() if "fwd_w" in ablate else dequantize_128x128(w_q, w_s)
        ctx.save_for_backward(x, weight, w_q, w_s)
        ctx.pow2, ctx.ablate = pow2, ablate
        return (a @ b.t()).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, w_q, w_s = ctx.saved_tensors
        ab, pow2 = ctx.ablate, ctx.pow2
        dy = dy.reshape(-1, dy.shape[-1])
        dx = dw = None
        if ctx.needs_input_grad[0]:
            a = dy.float() if "dgrad_dy" in ab else _rounded_1x128(dy, pow2)
            wt = weight.t().float() if "dgrad_w" in ab else dequantize_128x128(*fp8_transpose_128x128(w_q, w_s))
            dx = (a @ wt.t()).to(x.dtype)
        if ctx.needs_input_grad[1]:
            a = dy.t().float() if "wgrad_dy" in ab else _rounded_1x128(dy.t(), pow2)
            b = x.t().float() if "wgrad_x" in ab else _rounded_1x128(x.t(), pow2)
            dw = a @ b.t()
            dw = dw if "wgrad_bf16" in ab else dw.to(weight.dtype)
        return dx, dw, None, None, None, None


# ----------------------------------------------------------------------------------------------------------
# module
# ----------------------------------------------------------------------------------------------------------
class FP8Linear(nn.Linear):
    """nn.Linear with FP8 GEMMs. Same constructor, `weight`/`bias` Parameters and state_dict keys.

    Input [..., in_features] of any float dtype; output [..., out_features] in the input's dtype. `bias`
    is supported (added in the input dtype after the FP8 GEMM). Set `collect_health = True` to have the
    next forward+backward fill `health` with act/grad/gradT/weight underflow and distortion (0-dim device
    tensors), plus `dw_rel_err` with `check_dw = True`; `use_fp8 = False` makes it a plain linear;
    `set_ablation(...)` keeps chosen parts of the recipe in high precision (module doc).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        device=None,
        dtype=None,
        *,
        recipe: str = "blockwise",
        pow2_scales: bool = False,
    ) -> None:
        if recipe not in RECIPES:
            raise ValueError(f"FP8Linear recipe must be one of {RECIPES}, got {recipe!r}")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = recipe
        self.pow2_scales = bool(pow2_scales)
        self.collect_health: bool = False
        self.check_dw: bool = False
        self.health: dict[str, torch.Tensor] = {}
        self.use_fp8: bool = True
        self.ablate: frozenset[str] = frozenset()
        self._wcache = WeightCache(self._quantize_weight)

    def extra_repr(self) -> str:
        extra = "" if self.use_fp8 else ", use_fp8=False"
        extra += f", ablate={sorted(self.ablate)}" if self.ablate else ""
        return f"{super().extra_repr()}, recipe={self.recipe}, pow2_scales={self.pow2_scales}{extra}"

    def set_ablation(self, components) -> None:
        """Keep `components` (names from ABLATION_COMPONENTS) in high precision; an empty set restores the recipe."""
        components = frozenset(components)
        unknown = sorted(components - set(ABLATION_COMPONENTS))
        if unknown:
            raise ValueError(f"unknown FP8Linear ablation component(s) {unknown}; known: {list(ABLATION_COMPONENTS)}")
        if components and self.recipe != "blockwise":
            raise ValueError(f"FP8Linear ablation needs recipe='blockwise', this layer has recipe={self.recipe!r}")
        self.ablate = components

    def invalidate_weight_cache(self) -> None:
        self._wcache.clear()

    def _quantize_weight(self, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.recipe == "blockwise":  # W and Wᵀ (dgrad's operand) from one pass
            return quantize_128x128_with_transpose(w, self.pow2_scales)
        return quantize_tensorwise(w)

    def quantized_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_fp8 [N, K], scale) for the current weight, from the cache when the weight is unchanged."""
        return self._wcache.get(self.weight, self.recipe, self.pow2_scales)[:2]  # type: ignore[return-value]

    def fp8_weights(self) -> tuple[torch.Tensor, ...]:
        """The cache's whole FP8 form: blockwise (W_q, W_s, Wᵀ_q, Wᵀ_s), tensorwise (W_q, scale)."""
        return self._wcache.get(self.weight, self.recipe, self.pow2_scales)

    def refresh_fp8_weights(self) -> None:
        """Quantize the weight now if it changed (what the next forward would do first): a CUDA graph that
        replays this layer's forward calls no Python, so `model.graphs.LayerGraphs` calls this before a replay."""
        if self.use_fp8 and not self.ablate:
            self.fp8_weights()

    def graph_state(self) -> tuple:
        """What a captured graph of this layer depends on besides tensors (`model.graphs.LayerGraphs` recaptures
        when it changes)."""
        return self.use_fp8, self.ablate, self.recipe, self.pow2_scales

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"FP8Linear expects input [..., {self.in_features}], got {tuple(x.shape)}")
        if not x.dtype.is_floating_point or x.dtype == E4M3:
            raise TypeError(f"FP8Linear input must be a high-precision float tensor, got {x.dtype}")
        if not self.use_fp8:  # the monitor's per-layer fallback: a plain high-precision linear
            return F.linear(x, self.weight, self.bias)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        w_fp8 = self.fp8_weights()
        w_q, w_s = w_fp8[:2]
        if self.ablate:
            y = _AblatedFP8Fn.apply(x2, self.weight, w_q, w_s, self.pow2_scales, self.ablate)
            return self._finish(y, lead)
        module = None
        if self.collect_health:
            self.health = health_stats("weight", self.weight.detach(), w_q)
            module = self
        fn = _BlockwiseFP8Fn if self.recipe == "blockwise" else _TensorwiseFP8Fn
        need_wgrad = torch.is_grad_enabled() and self.weight.requires_grad
        return self._finish(fn.apply(x2, self.weight, w_fp8, self.pow2_scales, module, need_wgrad), lead)

    def _finish(self, y: torch.Tensor, lead: torch.Size) -> torch.Tensor:
        y = y.reshape(*lead, self.out_features)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y
