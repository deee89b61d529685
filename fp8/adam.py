"""`FP8AdamW`: AdamW with both moments stored in E4M3 with one fp32 scale per block of elements.

State per parameter with numel >= `min_fp8_numel` (n elements, B = block_size, nb = ceil(n / B) blocks):

| key                     | dtype   | shape  | meaning                                                   |
|-------------------------|---------|--------|-----------------------------------------------------------|
| `step`                  | float32 | []     | number of updates taken (CPU scalar, like torch.optim)    |
| `exp_avg`               | uint8   | [n]    | raw E4M3 bits of m / exp_avg_scale[block]                 |
| `exp_avg_scale`         | float32 | [nb]   | amax(|m| in block) / 448                                  |
| `exp_avg_sq_root`       | uint8   | [n]    | raw E4M3 bits of sqrt(v) / exp_avg_sq_root_scale[block]   |
| `exp_avg_sq_root_scale` | float32 | [nb]   | amax(sqrt(v) in block) / 448                              |

That is 2 + 8 / B bytes per parameter (2.0625 at B = 128) against 8 for fp32 moments. With
`fp32_moments=("exp_avg",)` / `("exp_avg_sq",)` (the ablation `fp8.ablate=[adam_m]` / `[adam_v]`) that moment is
kept as fp32 [n] instead (`exp_avg` holds m, `exp_avg_sq_root` holds sqrt(v); no scale key).

Why the second moment is kept as sqrt(v) ("range-safe form"): v = EMA(g²) spans twice the binade range of
|g|, and E4M3 with one scale per block only covers amax · 2⁻¹⁸ ... amax (448 down to the smallest subnormal
2⁻⁹). Stored directly, the small entries of v in a block flush to zero, and an element with v = 0 but m ≠ 0
takes a step of m / eps, i.e. an enormous one. sqrt(v) halves the log-range, so the same 18 binades of E4M3
cover 36 binades of v. On top of that, a non-zero sqrt(v) never rounds to 0: it is floored at the smallest
positive subnormal (which over-estimates v for those entries and so only shrinks their step).

Why the stored moments are rounded stochastically (`rounding="stochastic"`, the default): an EMA moves by a
small fraction of itself per step (sqrt(v) by at most 1 − sqrt(β2) = 2.5 % at β2 = 0.95 when g = 0), less than
half an E4M3 step (3.3–6.25 % relative). Rounded to nearest, a value that should shrink returns to its code
every step and never decreases while its block's scale holds (the block's largest element sets the scale): its
v stays at its old level and its updates shrink. tests/test_fp8_adam.py::test_moments_track_decaying_gradients
measures this against fp32 AdamW (README: after 400 steps of gradients decaying 1 % per step, rounded to
nearest the stored sqrt(v) is 43x fp32's and the parameters travel 0.44x as far; stochastic rounding: 0.99x and
1.00x). Stochastic rounding picks the upper neighbour with probability (y − lo) / (hi − lo), so the stored value
is unbiased and the EMA decays as it should. The noise is a counter-based hash of (step, element
index; both moments share it, see `noise_key`): no RNG state, identical on the Triton and torch paths,
reproducible on resume.

The update itself runs in fp32 from the dequantized moments and the fp32 gradient; only the stored moments
are rounded. On CUDA one fused Triton kernel does, per launch, all tensors of a param group that share the
gradient dtype and the step count (a table of per-tensor element offsets, one program per chunk of `NB`
blocks): read fp32 param, grad, FP8 moments and scales, update, write param, FP8 moments and new scales
(16 + 8/B·2 bytes of traffic per parameter with fp32 grads). The tables are rebuilt whenever any pointer or
size they were built from differs (the cache is keyed by all of them, the grad table by the grad pointers).
On CPU the same maths runs in plain torch (`fp8_adamw_update_reference`), which the tests also use as the
reference for the kernel.

DeepSpeed ZeRO: works on its flat 1-D fp32 partitions (padding included) and with the param-group swapping
of `_optimizer_step` (state is keyed by tensor, never by group index). ZeRO's *elastic* checkpoint format
trims every state tensor by the partition padding and re-partitions tensors that have the partition's shape;
per-block scales cannot survive that, so `ling.engine.check_deepspeed_config` refuses such a config before the
engine is built; a state of the wrong size (trimmed, re-partitioned, another block size) is refused at the
step with a message saying so. DeepSpeed's default (`elastic_checkpoint: false`) saves
`optimizer.state_dict()` per rank, which round-trips exactly.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.optim.adamw import adamw as _torch_adamw

from fp8.format import E4M3_MAX
from kernels.backend import HAS_TRITON, cdiv, tl, triton

E4M3_MIN_SUBNORMAL = 2.0**-9  # smallest positive E4M3 value; floor for a non-zero sqrt(v)
E4M3_MIN_NORMAL = 2.0**-6
# A moment block's amax is clamped to at least this, so that an all-zero block gets a finite, positive scale. Far
# below the GEMM operands' floor (fp8.format.OPERAND_AMAX_FLOOR, 4.48e-10): |m| and sqrt(v) scale with the
# gradients and may lie far below that, and a larger floor would raise such a block's scale and flush it to zero.
MOMENT_AMAX_FLOOR = 1e-30
NOISE_BITS = 20  # fp32 mantissa bits below E4M3's 3: the stochastic-rounding noise width

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8_STATE_KEYS = ("exp_avg", "exp_avg_scale", "exp_avg_sq_root", "exp_avg_sq_root_scale")
ROUNDINGS = ("stochastic", "nearest")
MOMENTS = ("exp_avg", "exp_avg_sq")  # names for `fp32_moments`
_SCALE_KEY = {"exp_avg": "exp_avg_scale", "exp_avg_sq_root": "exp_avg_sq_root_scale"}
# each stored moment: (state key, its name in `fp32_moments`, floor_nonzero of its E4M3 blocks); sqrt(v) is stored,
# and its blocks never flush a non-zero value to zero
_STORED_MOMENTS = (("exp_avg", "exp_avg", False), ("exp_avg_sq_root", "exp_avg_sq", True))


def _f32(x: float) -> float:
    """Round a Python float to the nearest float32 (the value both the kernel and the reference use)."""
    return float(np.float32(x))


def _hash32(x: int) -> int:
    """The 32-bit integer hash of the noise (host twin of `rounding_noise`)."""
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x5BD1E995) & 0xFFFFFFFF
    return x ^ (x >> 16)


def noise_key(step: int) -> int:
    """Per-step key (< 2^31) of the counter-based rounding noise. Both moments of an element share its noise:
    where m and sqrt(v) sit at the same point between two codes (e.g. after the first step, both ∝ |g|) they
    round the same way, so the ratio m / sqrt(v) that the update uses keeps its value; each stays unbiased."""
    return _hash32(_hash32(step) + 0x632BE5AB) & 0x7FFFFFFF


@dataclass(frozen=True)
class AdamScalars:
    """Per-launch fp32 scalars of one AdamW step (all already rounded to float32) and the rounding keys.

    p ← p·decay − step_size · m / (sqrt(v)·inv_sqrt_bc2 + eps), with m ← beta1·m + omb1·g and
    v ← beta2·v + omb2·g², where decay = 1 − lr·wd, step_size = lr / (1 − beta1^t),
    inv_sqrt_bc2 = 1 / sqrt(1 − beta2^t). key: the step's stochastic-rounding key (None: round to nearest).
    """

    beta1: float
    omb1: float
    beta2: float
    omb2: float
    eps: float
    decay: float
    step_size: float
    inv_sqrt_bc2: float
    key: int | None = None

    @classmethod
    def from_hparams(
        cls, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
        rounding: str = "stochastic",
    ) -> AdamScalars:  # fmt: skip
        if rounding not in ROUNDINGS:
            raise ValueError(f"FP8AdamW rounding must be one of {ROUNDINGS}, got {rounding!r}")
        bc1 = 1.0 - beta1**step
        bc2 = 1.0 - beta2**step
        stochastic = rounding == "stochastic"
        return cls(
            beta1=_f32(beta1),
            omb1=_f32(1.0 - beta1),
            beta2=_f32(beta2),
            omb2=_f32(1.0 - beta2),
            eps=_f32(eps),
            decay=_f32(1.0 - lr * weight_decay),
            step_size=_f32(lr / bc1),
            inv_sqrt_bc2=_f32(1.0 / math.sqrt(bc2)),
            key=noise_key(step) if stochastic else None,
        )


# ----------------------------------------------------------------------------------------------------
# PyTorch reference (CPU path and test oracle)
# ----------------------------------------------------------------------------------------------------


def _blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """x [n] → [nb, block_size], zero-padded at the end (a copy when n % block_size != 0)."""
    n = x.numel()
    nb = cdiv(n, block_size)
    pad = nb * block_size - n
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.view(nb, block_size)


def rounding_noise(idx: torch.Tensor, key: int) -> torch.Tensor:
    """int64 element indices → int32 noise in [0, 2^20): hash32(idx ^ key)'s low bits (kernel twin: `_noise`).
    Products stay below 2^63 (32-bit values times 31-bit constants), so int64 arithmetic is exact. In place on
    one int64 buffer: the torch path's optimizer step hashes every element every step."""
    h = torch.bitwise_xor(idx, key).bitwise_and_(0xFFFFFFFF)
    for shift, mult in ((16, 0x7FEB352D), (15, 0x5BD1E995)):
        h.bitwise_xor_(h >> shift).mul_(mult).bitwise_and_(0xFFFFFFFF)
    h.bitwise_xor_(h >> 16)
    return h.bitwise_and_((1 << NOISE_BITS) - 1).to(torch.int32)


def _block_noise(nb: int, block_size: int, key: int, device: torch.device) -> torch.Tensor:
    """The noise of the elements of nb blocks (pad elements included): int32 [nb, block_size]."""
    idx = torch.arange(nb * block_size, dtype=torch.int64, device=device).view(nb, block_size)
    return rounding_noise(idx, key)


def stochastic_round_e4m3(y: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """fp32 y (|y| ≤ 448) → fp32 values on the E4M3 grid: the upper neighbour with probability (|y| − lo) / (hi −
    lo) for uniform 20-bit `noise`. Normals: add the noise below E4M3's 3 mantissa bits and truncate (a carry
    moves into the exponent exactly); subnormals (|y| < 2⁻⁶, fixed step 2⁻⁹): floor(|y|·2⁹ + u)·2⁻⁹."""
    a = y.abs()
    up = ((a.view(torch.int32) + noise) & -(1 << NOISE_BITS)).view(torch.float32)
    sub = torch.floor(a * 512.0 + noise.float() * 2.0**-NOISE_BITS) * E4M3_MIN_SUBNORMAL
    a = torch.clamp(torch.where(a < E4M3_MIN_NORMAL, sub, up), max=E4M3_MAX)
    return torch.where(y < 0, -a, a)


def quantize_blockwise_reference(
    x: torch.Tensor, block_size: int, floor_nonzero: bool = False, key: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise E4M3 quantization of a flat fp32 tensor.

    x: fp32 [n] → (q uint8 [n] holding E4M3 bits, scale fp32 [ceil(n / block_size)]), with
    scale = max(amax, MOMENT_AMAX_FLOOR) / 448 and x ≈ e4m3(q) · scale[block]. Rounded to nearest, or stochastically
    with the noise of `key` (`rounding_noise` of the element index). With `floor_nonzero`, entries with x > 0
    that would round to 0 are stored as the smallest positive subnormal instead (for x ≥ 0).
    """
    noise = None if key is None else _block_noise(cdiv(x.numel(), block_size), block_size, key, x.device)
    return _quantize_blocks(x, block_size, floor_nonzero, noise)


def _quantize_blocks(x: torch.Tensor, block_size: int, floor_nonzero: bool,
                     noise: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_blockwise_reference` with the stochastic rounding's noise given (int32 [nb, block_size]) or
    None (round to nearest): the optimizer step computes it once for both moments, which share it."""
    n = x.numel()
    xb = _blocks(x.float().reshape(-1), block_size)
    amax = xb.abs().amax(dim=1)
    amax = torch.clamp(amax, min=MOMENT_AMAX_FLOOR)
    scale = amax / E4M3_MAX
    y = (xb * (E4M3_MAX / amax)[:, None]).clamp(-E4M3_MAX, E4M3_MAX)  # one division per block, as the kernel
    if noise is not None:
        y = stochastic_round_e4m3(y, noise)
    if floor_nonzero:
        y = torch.where(xb > 0, torch.clamp(y, min=E4M3_MIN_SUBNORMAL), y)
    q = y.to(torch.float8_e4m3fn).view(torch.uint8).reshape(-1)[:n]
    return q.contiguous(), scale


def dequantize_blockwise_reference(q: torch.Tensor, scale: torch.Tensor, block_size: int) -> torch.Tensor:
    """q uint8 [n] (E4M3 bits), scale fp32 [nb] → fp32 [n]."""
    n = q.numel()
    qb = _blocks(q.view(torch.float8_e4m3fn).float(), block_size)
    return (qb * scale[:, None]).reshape(-1)[:n]


def moment_slice(state: dict[str, Any], key: str, start: int, numel: int, block_size: int) -> torch.Tensor:
    """Elements start … start + numel − 1 of one tensor's FP8AdamW moment as fp32: key "exp_avg" (m) or
    "exp_avg_sq" (v = sqrt(v)²), dequantized from only the E4M3 blocks that hold them (the state may be
    memory-mapped); tensors below min_fp8_numel keep fp32 moments, which are sliced."""
    if "exp_avg_sq" in state:  # fp32-moment tensor
        return state[key][start : start + numel].float()
    bits, scale = ("exp_avg", "exp_avg_scale") if key == "exp_avg" else ("exp_avg_sq_root", "exp_avg_sq_root_scale")
    if scale not in state:  # this moment kept in fp32 (`fp32_moments`, the ablation): m or sqrt(v) per element
        x = state[bits][start : start + numel].float()
    else:
        b0, b1 = start // block_size, cdiv(start + numel, block_size)
        x = dequantize_blockwise_reference(state[bits][b0 * block_size : b1 * block_size], state[scale][b0:b1],
                                           block_size)
        x = x[start - b0 * block_size :][:numel]
    return x * x if key == "exp_avg_sq" else x


def state_from_moments(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: float, block_size: int,
                       min_fp8_numel: int, fp32_moments: Collection[str] = ()) -> dict[str, Any]:  # fmt: skip
    """The FP8AdamW state of a flat fp32 tensor whose moments are m = exp_avg and v = exp_avg_sq (fp32 [n])
    after `step` updates, as a step of an FP8AdamW with these `fp32_moments` writes it: E4M3 blocks of m and
    sqrt(v), or per-element fp32 m / sqrt(v) for the moments named in `fp32_moments` (the ablation), or fp32
    moments when n < min_fp8_numel. Used to re-partition a checkpoint (ling/checkpoint/reshard.py)."""
    state: dict[str, Any] = {"step": torch.tensor(float(step), dtype=torch.float32)}
    if exp_avg.numel() < min_fp8_numel:
        return {**state, "exp_avg": exp_avg.float().clone(), "exp_avg_sq": exp_avg_sq.float().clone()}
    for (key, moment, floor), x in zip(_STORED_MOMENTS, (exp_avg.float(), exp_avg_sq.float().sqrt()), strict=True):
        if moment in fp32_moments:
            state[key] = x.clone()
        else:
            state[key], state[_SCALE_KEY[key]] = quantize_blockwise_reference(x, block_size, floor)
    return state


def _load_moment(q: torch.Tensor, scale: torch.Tensor | None, block_size: int) -> torch.Tensor:
    return q.float().reshape(-1) if scale is None else dequantize_blockwise_reference(q, scale, block_size)


def _store_moment(x, q, scale, block_size: int, floor_nonzero: bool, noise: torch.Tensor | None) -> None:
    if scale is None:  # an fp32 moment (ablation)
        q.copy_(x)
        return
    xq, xs = _quantize_blocks(x, block_size, floor_nonzero, noise)
    q.copy_(xq)
    scale.copy_(xs)


def fp8_adamw_update_reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_scale: torch.Tensor | None,
    exp_avg_sq_root: torch.Tensor,
    exp_avg_sq_root_scale: torch.Tensor | None,
    s: AdamScalars,
    block_size: int,
) -> None:
    """One FP8AdamW step on one tensor, in place, in plain torch (the maths of the Triton kernel).

    param fp32 [n] (flat, contiguous); grad fp32/bf16/fp16 [n]; exp_avg / exp_avg_sq_root uint8 [n] (E4M3
    bits) with fp32 scales [ceil(n / block_size)], or fp32 [n] with scale None (an fp32 moment).
    """
    g = grad.reshape(-1).float()
    m = _load_moment(exp_avg, exp_avg_scale, block_size)
    r = _load_moment(exp_avg_sq_root, exp_avg_sq_root_scale, block_size)
    # Same operations as the kernel (fp32 throughout). The interpreted kernel rounds like this; the compiled
    # one uses the GPU's approximate fp32 division and square root (≤ 2 ulp) and may fuse a·b+c into FMAs.
    m = s.beta1 * m + s.omb1 * g
    v = s.beta2 * (r * r) + s.omb2 * (g * g)
    r = torch.sqrt(v)
    denom = r * s.inv_sqrt_bc2 + s.eps
    p = param.view(-1)
    p.copy_(p * s.decay - s.step_size * (m / denom))
    e4m3 = exp_avg_scale is not None or exp_avg_sq_root_scale is not None
    noise = _block_noise(cdiv(p.numel(), block_size), block_size, s.key, p.device) if s.key is not None and e4m3 \
        else None  # one element's noise is the same for both moments (`noise_key`)
    _store_moment(m, exp_avg, exp_avg_scale, block_size, False, noise)
    _store_moment(r, exp_avg_sq_root, exp_avg_sq_root_scale, block_size, True, noise)


# ----------------------------------------------------------------------------------------------------
# Triton kernel: all tensors of a launch in one grid, one program per chunk of NB blocks of BS elements
# ----------------------------------------------------------------------------------------------------

TABLE_COLS = 8  # p_off, m_off, ms_off, r_off, rs_off, numel, unused, unused (element offsets)


@dataclass(frozen=True)
class KernelConfig:
    """Launch shape of the fused kernel: each program updates `iters_per_program` tiles of
    `blocks_per_program` blocks. With blocks_per_program · block_size = 4 · 32 · num_warps every thread
    holds 4 contiguous elements, so fp32 and fp8 accesses share one layout (16- and 4-byte accesses, no
    layout conversion through shared memory)."""

    # The default is the fastest shape of bench/bench_fp8_adam.py's launch sweep on an H200 (README, FP8 Adam).
    blocks_per_program: int = 8
    num_warps: int = 8
    iters_per_program: int = 1


if HAS_TRITON:

    @triton.jit
    def _noise(idx, key):
        """Kernel twin of `rounding_noise`: int64 indices → int32 noise in [0, 2^20), in uint32 arithmetic
        (multiplications wrap modulo 2^32, shifts are logical: the low 32 bits of the reference's int64 maths)."""
        h = (idx ^ key).to(tl.uint32)
        h = h ^ (h >> 16)
        h = h * 0x7FEB352D
        h = h ^ (h >> 15)
        h = h * 0x5BD1E995
        h = h ^ (h >> 16)
        return (h & 0xFFFFF).to(tl.int32)

    @triton.jit
    def _round_stored(y, idx, key, STOCH: tl.constexpr):
        """fp32 y (|y| ≤ 448) → fp32 to be cast to E4M3: unchanged (the cast rounds to nearest) or rounded
        stochastically onto the E4M3 grid (twin of `stochastic_round_e4m3`)."""
        if STOCH:
            noise = _noise(idx, key)
            a = tl.abs(y)
            up = ((a.to(tl.int32, bitcast=True) + noise) & -1048576).to(tl.float32, bitcast=True)
            sub = tl.floor(a * 512.0 + noise.to(tl.float32) * 9.5367431640625e-07) * 0.001953125
            a = tl.minimum(tl.where(a < 0.015625, sub, up), 448.0)
            y = tl.where(y < 0, -a, a)
        return y

    @triton.jit
    def _load(ptr, mask, MASKED: tl.constexpr):
        if MASKED:
            return tl.load(ptr, mask=mask, other=0.0)
        return tl.load(ptr)

    @triton.jit
    def _store(ptr, value, mask, MASKED: tl.constexpr):
        if MASKED:
            tl.store(ptr, value, mask=mask)
        else:
            tl.store(ptr, value)

    @triton.jit
    def _adam_chunk(
        p_ptr, g_ptr, m_ptr, ms_ptr, r_ptr, rs_ptr, numel, start, blk0,
        beta1, omb1, beta2, omb2, eps, decay, step_size, inv_sqrt_bc2, key,
        BS: tl.constexpr, NB: tl.constexpr, MASKED: tl.constexpr, STOCH: tl.constexpr,
        M_FP32: tl.constexpr, R_FP32: tl.constexpr,
        AMAX_MIN: tl.constexpr, QMAX: tl.constexpr, QMIN_SUB: tl.constexpr,
    ):  # fmt: skip
        rows = tl.arange(0, NB)
        cols = tl.arange(0, BS)
        idx = start + rows[:, None] * BS + cols[None, :]  # [NB, BS] int64 element index in the tensor
        bidx = blk0 + rows  # [NB] block index
        mask = idx < numel
        bmask = bidx * BS < numel
        p = _load(p_ptr + idx, mask, MASKED)
        g = _load(g_ptr + idx, mask, MASKED).to(tl.float32)
        m = _load(m_ptr + idx, mask, MASKED).to(tl.float32)
        r = _load(r_ptr + idx, mask, MASKED).to(tl.float32)
        if not M_FP32:
            m = m * _load(ms_ptr + bidx, bmask, MASKED)[:, None]
        if not R_FP32:
            r = r * _load(rs_ptr + bidx, bmask, MASKED)[:, None]
        m = beta1 * m + omb1 * g
        v = beta2 * (r * r) + omb2 * (g * g)
        r = tl.sqrt(v)
        denom = r * inv_sqrt_bc2 + eps
        p = p * decay - step_size * (m / denom)
        _store(p_ptr + idx, p, mask, MASKED)
        # Requantize: one scale per row (block) of BS elements; masked-off entries are 0 and do not move amax.
        if M_FP32:
            _store(m_ptr + idx, m, mask, MASKED)
        else:
            m_amax = tl.maximum(tl.max(tl.abs(m), axis=1), AMAX_MIN)
            y = tl.clamp(m * (QMAX / m_amax)[:, None], -QMAX, QMAX)
            _store(m_ptr + idx, _round_stored(y, idx, key, STOCH).to(tl.float8e4nv), mask, MASKED)
            _store(ms_ptr + bidx, m_amax / QMAX, bmask, MASKED)
        if R_FP32:
            _store(r_ptr + idx, r, mask, MASKED)
        else:
            r_amax = tl.maximum(tl.max(r, axis=1), AMAX_MIN)
            y = _round_stored(tl.minimum(r * (QMAX / r_amax)[:, None], QMAX), idx, key, STOCH)
            y = tl.where(r > 0.0, tl.maximum(y, QMIN_SUB), y)  # never flush a non-zero sqrt(v) to 0
            _store(r_ptr + idx, y.to(tl.float8e4nv), mask, MASKED)
            _store(rs_ptr + bidx, r_amax / QMAX, bmask, MASKED)

    @triton.jit(do_not_specialize=["key"])
    def _fp8_adamw_kernel(
        p_base, g_base, m_base, ms_base, r_base, rs_base,
        table_ptr, gtable_ptr, chunk_tensor_ptr, chunk_index_ptr,
        beta1, omb1, beta2, omb2, eps, decay, step_size, inv_sqrt_bc2, key,
        BS: tl.constexpr, NB: tl.constexpr, ITERS: tl.constexpr, ALIGNED: tl.constexpr, STOCH: tl.constexpr,
        M_FP32: tl.constexpr, R_FP32: tl.constexpr,
        AMAX_MIN: tl.constexpr, QMAX: tl.constexpr, QMIN_SUB: tl.constexpr,
    ):  # fmt: skip
        # Each tensor is addressed as base pointer + element offset (offsets computed on the host from
        # data_ptr differences), so one launch covers any number of separately allocated tensors.
        pid = tl.program_id(0)
        t = tl.load(chunk_tensor_ptr + pid).to(tl.int64)
        c = tl.load(chunk_index_ptr + pid).to(tl.int64)
        row = table_ptr + t * 8  # TABLE_COLS (a plain global cannot be read inside a Triton kernel)
        p_off = tl.load(row + 0)
        m_off = tl.load(row + 1)
        ms_off = tl.load(row + 2)
        r_off = tl.load(row + 3)
        rs_off = tl.load(row + 4)
        numel = tl.load(row + 5)
        g_off = tl.load(gtable_ptr + t)
        if ALIGNED:  # all element offsets are multiples of 16: lets the compiler emit 16-byte accesses
            p_off = tl.multiple_of(p_off, 16)
            g_off = tl.multiple_of(g_off, 16)
            m_off = tl.multiple_of(m_off, 16)
            r_off = tl.multiple_of(r_off, 16)
        for it in range(ITERS):  # ITERS tiles of NB blocks per program: amortizes the table look-ups
            blk0 = (c * ITERS + it) * NB
            start = blk0 * BS
            if start + NB * BS <= numel:
                _adam_chunk(
                    p_base + p_off, g_base + g_off, m_base + m_off, ms_base + ms_off, r_base + r_off,
                    rs_base + rs_off, numel, start, blk0,
                    beta1, omb1, beta2, omb2, eps, decay, step_size, inv_sqrt_bc2, key,
                    BS, NB, False, STOCH, M_FP32, R_FP32, AMAX_MIN, QMAX, QMIN_SUB,
                )  # fmt: skip
            elif start < numel:
                _adam_chunk(
                    p_base + p_off, g_base + g_off, m_base + m_off, ms_base + ms_off, r_base + r_off,
                    rs_base + rs_off, numel, start, blk0,
                    beta1, omb1, beta2, omb2, eps, decay, step_size, inv_sqrt_bc2, key,
                    BS, NB, True, STOCH, M_FP32, R_FP32, AMAX_MIN, QMAX, QMIN_SUB,
                )  # fmt: skip


def _offset(t: torch.Tensor, base: torch.Tensor) -> int:
    diff = t.data_ptr() - base.data_ptr()
    size = t.element_size()
    if diff % size:
        raise ValueError(f"tensor at {t.data_ptr():#x} is not {size}-byte aligned relative to its base")
    return diff // size


@dataclass
class LaunchPlan:
    """Device-side tables of one multi-tensor launch.

    table int64 [T, 8]: element offsets of param, exp_avg, its scale, exp_avg_sq_root, its scale (relative
    to the first tensor of each kind) and numel; chunk_tensor / chunk_index int32 [n_chunks]: which tensor and
    which chunk of it each program updates; gtable int64 [T]: grad offsets, rebuilt when the grads move
    (`gkey`: the grad pointers it was built from).
    """

    table: torch.Tensor
    chunk_tensor: torch.Tensor
    chunk_index: torch.Tensor
    aligned: bool
    gkey: tuple[int, ...] = ()
    gtable: torch.Tensor | None = None
    galigned: bool = True


def _static_key(tensors: Sequence[tuple], block_size: int, cfg: KernelConfig) -> tuple:
    """Everything a plan's static tables are built from: every pointer and size but the grads'."""
    ptrs = tuple(t.data_ptr() if t is not None else 0 for tup in tensors for t in (tup[0], *tup[2:]))
    return (ptrs, tuple(tup[0].numel() for tup in tensors), block_size, cfg)


def build_launch_plan(tensors: Sequence[tuple], block_size: int, cfg: KernelConfig) -> LaunchPlan:
    """Offset tables for tuples (param, grad, exp_avg, exp_avg_scale, exp_avg_sq_root, its scale); a scale is
    None for an fp32 moment (offset 0, never read). The grad table is added by `_grad_table`."""
    base = tensors[0]
    rows = []
    for tup in tensors:
        offs = [_offset(tup[i], base[i]) if tup[i] is not None else 0 for i in (0, 2, 3, 4, 5)]
        rows.append(offs + [tup[0].numel()] + [0] * (TABLE_COLS - 6))
    device = base[0].device
    chunk = cfg.iters_per_program * cfg.blocks_per_program * block_size
    counts = torch.tensor([cdiv(r[5], chunk) for r in rows], dtype=torch.int64)
    starts = torch.cumsum(counts, 0) - counts
    chunk_tensor = torch.repeat_interleave(torch.arange(len(rows), dtype=torch.int64), counts)
    chunk_index = torch.arange(int(counts.sum()), dtype=torch.int64) - torch.repeat_interleave(starts, counts)
    return LaunchPlan(
        table=torch.tensor(rows, dtype=torch.int64).to(device),
        chunk_tensor=chunk_tensor.to(torch.int32).to(device),
        chunk_index=chunk_index.to(torch.int32).to(device),
        aligned=all(r[0] % 16 == 0 and r[1] % 16 == 0 and r[3] % 16 == 0 for r in rows),
    )


def _grad_table(plan: LaunchPlan, tensors: Sequence[tuple]) -> None:
    gkey = tuple(tup[1].data_ptr() for tup in tensors)
    if plan.gtable is None or plan.gkey != gkey:
        goffs = [_offset(tup[1], tensors[0][1]) for tup in tensors]
        plan.gkey, plan.gtable = gkey, torch.tensor(goffs, dtype=torch.int64).to(tensors[0][1].device)
        plan.galigned = all(o % 16 == 0 for o in goffs)


def fp8_adamw_update_triton(
    tensors: Sequence[tuple],
    s: AdamScalars,
    block_size: int,
    cfg: KernelConfig = KernelConfig(),
    cache: dict | None = None,
) -> None:
    """One fused launch over all `tensors` = [(param, grad, exp_avg, exp_avg_scale, exp_avg_sq_root,
    exp_avg_sq_root_scale), ...]: params fp32 contiguous (any shape), grads contiguous and all of one
    dtype, moments uint8 [numel] with fp32 scales [ceil(numel / block_size)] (or, in every tuple alike, an fp32
    [numel] moment with scale None), all on one device.

    `cache` (a dict the caller keeps) maps the static key (every pointer and size but the grads') to its plan,
    whose grad table follows the grad pointers: tables are uploaded again only when something moved."""
    if not HAS_TRITON:
        raise RuntimeError("FP8AdamW's fused kernel needs triton; use backend='torch' on this machine")
    key = _static_key(tensors, block_size, cfg)
    plan = cache.get(key) if cache is not None else None
    if plan is None:
        plan = build_launch_plan(tensors, block_size, cfg)
        if cache is not None:
            if len(cache) >= 64:  # tensors keep moving (unusual): don't hoard tables
                cache.clear()
            cache[key] = plan
    _grad_table(plan, tensors)
    p, g, m, ms, r, rs = tensors[0]
    m_fp32, r_fp32 = ms is None, rs is None
    grid = (plan.chunk_tensor.numel(),)
    _fp8_adamw_kernel[grid](
        p, g, m if m_fp32 else m.view(torch.float8_e4m3fn), m if m_fp32 else ms,
        r if r_fp32 else r.view(torch.float8_e4m3fn), r if r_fp32 else rs,
        plan.table, plan.gtable, plan.chunk_tensor, plan.chunk_index,
        s.beta1, s.omb1, s.beta2, s.omb2, s.eps, s.decay, s.step_size, s.inv_sqrt_bc2,
        s.key or 0,
        BS=block_size, NB=cfg.blocks_per_program, ITERS=cfg.iters_per_program,
        ALIGNED=plan.aligned and plan.galigned, STOCH=s.key is not None, M_FP32=m_fp32, R_FP32=r_fp32,
        AMAX_MIN=MOMENT_AMAX_FLOOR, QMAX=E4M3_MAX, QMIN_SUB=E4M3_MIN_SUBNORMAL,
        num_warps=cfg.num_warps,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------------
# The optimizer
# ----------------------------------------------------------------------------------------------------


class FP8AdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias correction) with E4M3 block-scaled moments.

    Args:
        params: tensors or param-group dicts (extra keys such as DeepSpeed's "name"/"moe" are kept).
            Every parameter must be fp32 (master weights); grads may be fp32, bf16 or fp16, dense.
        lr, betas, eps, weight_decay: as `torch.optim.AdamW`, overridable per group.
        block_size: elements per quantization block (power of two, 16..4096).
        min_fp8_numel: tensors with fewer elements keep fp32 moments (updated by torch's AdamW).
        backend: "auto" (Triton on CUDA, torch on CPU), "triton" (also CPU under TRITON_INTERPRET=1)
            or "torch".
        kernel: launch shape of the fused kernel.
        rounding: "stochastic" (default; see the module doc) or "nearest" rounding of the stored moments.
        fp32_moments: moments ("exp_avg", "exp_avg_sq") kept in fp32 instead of E4M3 (ablation).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        block_size: int = 128,
        min_fp8_numel: int = 4096,
        *,
        backend: str = "auto",
        kernel: KernelConfig | None = None,
        rounding: str = "stochastic",
        fp32_moments: Sequence[str] = (),
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            block_size=block_size,
            min_fp8_numel=min_fp8_numel,
        )
        if backend not in ("auto", "triton", "torch"):
            raise ValueError(f"FP8AdamW backend must be 'auto', 'triton' or 'torch', got {backend!r}")
        if rounding not in ROUNDINGS:
            raise ValueError(f"FP8AdamW rounding must be one of {ROUNDINGS}, got {rounding!r}")
        unknown = sorted(set(fp32_moments) - set(MOMENTS))
        if unknown:
            raise ValueError(f"FP8AdamW fp32_moments: unknown moment(s) {unknown} (known: {list(MOMENTS)})")
        self.backend = backend
        self.kernel = kernel or KernelConfig()
        self.rounding = rounding
        self.fp32_moments = frozenset(fp32_moments)
        self._plans: dict[tuple, LaunchPlan] = {}  # static launch key (pointers and sizes) -> device tables
        super().__init__(params, defaults)

    # -- validation ------------------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _validate_group(group)
        for p in group["params"]:
            _check_param(p)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Exact round trip of `state_dict()`.

        torch's loader casts every state tensor of a floating-point param to the param's dtype, which would
        turn the uint8 E4M3 bits into fp32 numbers (4 bytes each); the FP8 moments are therefore set aside,
        the rest is loaded by torch, and the moments are moved (not cast) to their param's device.
        """
        raw: dict[Any, dict[str, torch.Tensor]] = {}
        lean: dict[Any, dict[str, Any]] = {}
        for pid, st in state_dict["state"].items():
            # a moment is FP8 when its scale is there (fp32-moment tensors use the same names without one)
            raw[pid] = {k: st[k] for k, scale in _SCALE_KEY.items() if k in st and scale in st}
            lean[pid] = {k: v for k, v in st.items() if k not in raw[pid]}
        super().load_state_dict({**state_dict, "state": lean})
        saved_ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(saved_ids, params):
            for k, v in raw.get(pid, {}).items():
                if v.dtype != torch.uint8:  # e.g. a state dict that went through torch's cast before
                    v = v.to(torch.uint8)
                self.state[p][k] = v.to(device=p.device, copy=True)
        self._match_fp32_moments()
        self._plans.clear()

    def _match_fp32_moments(self) -> None:
        """Give every loaded moment this optimizer's layout: a state saved with another `fp32_moments` (e.g. an
        FP8AdamW checkpoint resumed with `fp8.ablate=[adam_v]`, or back) has that moment converted, E4M3 blocks
        dequantized to per-element fp32 or fp32 quantized (nearest) to E4M3 blocks; otherwise the ablation would
        silently not apply to a resumed run. Tensors below min_fp8_numel (fp32 `exp_avg_sq`) are left alone."""
        for group in self.param_groups:
            bs = int(group["block_size"])
            for p in group["params"]:
                st = self.state.get(p, {})
                if "exp_avg_sq_root" not in st:
                    continue
                for key, moment, floor in _STORED_MOMENTS:
                    scale_key = _SCALE_KEY[key]
                    is_fp32, want_fp32 = scale_key not in st, moment in self.fp32_moments
                    if is_fp32 and not want_fp32:
                        st[key], st[scale_key] = quantize_blockwise_reference(
                            st[key].float().reshape(-1), bs, floor_nonzero=floor)
                    elif want_fp32 and not is_fp32:
                        st[key] = _load_moment(st[key], st.pop(scale_key), bs)

    # -- step ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 (torch's signature)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _use_triton(self, device: torch.device) -> bool:
        if self.backend == "torch":
            return False
        if self.backend == "triton":
            return True
        return device.type == "cuda" and HAS_TRITON

    def _step_group(self, group: dict[str, Any]) -> None:
        bs = int(group["block_size"])
        small: list[tuple[torch.Tensor, torch.Tensor, dict]] = []
        fp8: list[tuple[torch.Tensor, torch.Tensor, dict]] = []
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            _check_grad(p, g)
            state = self.state[p]
            if len(state) == 0:
                self._init_state(p, state, group)
            (small if "exp_avg_sq" in state else fp8).append((p, g, state))
        if fp8:
            self._step_fp8_moments(group, fp8, bs)
        if small:
            _step_fp32_moments(group, small)

    def _step_fp8_moments(self, group: dict[str, Any], fp8: list, bs: int) -> None:
        steps = [st["step"] for _, _, st in fp8]
        torch._foreach_add_(steps, 1.0)
        # (device, grad dtype, step) -> tensor tuples of one fused launch (one launch in the common case)
        launches: dict[tuple, list[tuple]] = {}
        writebacks: list[tuple[torch.Tensor, torch.Tensor]] = []
        for (p, g, st), step in zip(fp8, torch.stack(steps).tolist()):  # CPU step counters: no device sync
            _check_fp8_state(p, st, bs)
            pf = p if p.is_contiguous() else p.contiguous()
            if pf is not p:
                writebacks.append((p, pf))
            m, r = st["exp_avg"], st["exp_avg_sq_root"]  # uint8 codes + scale, or fp32 (scale None)
            tup = (pf, g if g.is_contiguous() else g.contiguous(), m, st["exp_avg_scale"] if m.dtype == torch.uint8
                   else None, r, st["exp_avg_sq_root_scale"] if r.dtype == torch.uint8 else None)  # fmt: skip
            layout = (tup[3] is None, tup[5] is None)  # which moments are fp32: one kernel variant per launch
            launches.setdefault((p.device, g.dtype, int(step), layout), []).append(tup)
        beta1, beta2 = group["betas"]
        for (device, _, step, _), tensors in launches.items():
            s = AdamScalars.from_hparams(group["lr"], beta1, beta2, group["eps"], group["weight_decay"], step,
                                         self.rounding)  # fmt: skip
            if self._use_triton(device):
                fp8_adamw_update_triton(tensors, s, bs, self.kernel, self._plans)
            else:
                for p, g, *moments in tensors:
                    fp8_adamw_update_reference(p.view(-1), g.view(-1), *moments, s=s, block_size=bs)
        for p, pf in writebacks:
            p.copy_(pf)

    def _init_state(self, p: torch.Tensor, state: dict, group: dict[str, Any]) -> None:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        n = p.numel()
        if n < int(group["min_fp8_numel"]):
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            return
        nb = cdiv(n, int(group["block_size"]))
        for key, moment, _ in _STORED_MOMENTS:
            if moment in self.fp32_moments:
                state[key] = torch.zeros(n, dtype=torch.float32, device=p.device)
            else:
                state[key] = torch.zeros(n, dtype=torch.uint8, device=p.device)
                state[_SCALE_KEY[key]] = torch.ones(nb, dtype=torch.float32, device=p.device)

    # -- introspection ---------------------------------------------------------------------------------

    def state_bytes(self) -> int:
        """Bytes held in optimizer state tensors (moments and scales; not the step counters)."""
        total = 0
        for st in self.state.values():
            for k, v in st.items():
                if k != "step" and torch.is_tensor(v):
                    total += v.numel() * v.element_size()
        return total

    def dequantized_moments(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(m, v) of `p` as fp32 tensors of p's shape (for tests and health logging)."""
        st = self.state[p]
        if "exp_avg_sq" in st:
            return st["exp_avg"].clone(), st["exp_avg_sq"].clone()
        bs = self._group_of(p)["block_size"]
        m = _load_moment(st["exp_avg"], st.get("exp_avg_scale"), bs)
        r = _load_moment(st["exp_avg_sq_root"], st.get("exp_avg_sq_root_scale"), bs)
        return m.view(p.shape).clone(), (r * r).view(p.shape)

    def _group_of(self, p: torch.Tensor) -> dict[str, Any]:
        for g in self.param_groups:
            if any(q is p for q in g["params"]):
                return g
        raise KeyError("parameter is not in this optimizer")


def _step_fp32_moments(group: dict[str, Any], small: list) -> None:
    """Tensors below min_fp8_numel: torch's own AdamW (foreach) on fp32 moments."""
    beta1, beta2 = group["betas"]
    _torch_adamw(
        [p for p, _, _ in small],
        [g for _, g, _ in small],
        [st["exp_avg"] for _, _, st in small],
        [st["exp_avg_sq"] for _, _, st in small],
        [],
        [st["step"] for _, _, st in small],
        amsgrad=False,
        beta1=beta1,
        beta2=beta2,
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=False,
    )


def _validate_group(group: dict[str, Any]) -> None:
    lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    bs, mn = group["block_size"], group["min_fp8_numel"]
    if not (isinstance(lr, float | int) and lr >= 0):
        raise ValueError(f"FP8AdamW: invalid lr {lr!r} (a float >= 0)")
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
        raise ValueError(f"FP8AdamW: invalid betas {(b1, b2)!r} (each in [0, 1))")
    if not eps >= 0.0:
        raise ValueError(f"FP8AdamW: invalid eps {eps!r}")
    if not wd >= 0.0:
        raise ValueError(f"FP8AdamW: invalid weight_decay {wd!r}")
    if not (isinstance(bs, int) and 16 <= bs <= 4096 and bs & (bs - 1) == 0):
        raise ValueError(f"FP8AdamW: block_size must be a power of two in [16, 4096], got {bs!r}")
    if not (isinstance(mn, int) and mn >= 0):
        raise ValueError(f"FP8AdamW: min_fp8_numel must be an int >= 0, got {mn!r}")


def _check_param(p: torch.Tensor) -> None:
    if p.dtype != torch.float32:
        raise TypeError(
            f"FP8AdamW updates fp32 master weights, but got a {p.dtype} parameter of shape {tuple(p.shape)}: "
            "keep fp32 master weights (DeepSpeed bf16/fp16 with ZeRO does; or call model.float())"
        )


def _check_grad(p: torch.Tensor, g: torch.Tensor) -> None:
    _check_param(p)
    if g.is_sparse:
        raise RuntimeError(
            f"FP8AdamW does not support sparse gradients (param of shape {tuple(p.shape)}); "
            "use dense gradients (e.g. nn.Embedding(sparse=False))"
        )
    if g.shape != p.shape:
        raise ValueError(f"grad shape {tuple(g.shape)} does not match param shape {tuple(p.shape)}")
    if g.dtype not in _GRAD_DTYPES:
        raise TypeError(f"FP8AdamW needs fp32/bf16/fp16 grads, got {g.dtype}")


def _check_fp8_state(p: torch.Tensor, state: dict, block_size: int) -> None:
    """The moments and scales must have exactly the sizes the kernel will index (else it would write out of
    bounds): n elements per moment (uint8 codes or fp32), ceil(n / block_size) per scale."""
    n = p.numel()
    nb = -(-n // block_size)
    for key, scale_key in _SCALE_KEY.items():
        q, scale = state.get(key), state.get(scale_key)
        if q is None or q.numel() != n or (
            scale.numel() != nb if q.dtype == torch.uint8 and scale is not None else q.dtype != torch.float32
        ):
            shapes = {k: tuple(state[k].shape) for k in FP8_STATE_KEYS if k in state}
            raise RuntimeError(
                f"FP8AdamW state of a parameter with {n} elements (block_size {block_size}) has shapes {shapes}, "
                f"expected moments ({n},) with scales ({nb},) (or fp32 moments ({n},) without): was the state "
                "trimmed or re-partitioned (DeepSpeed elastic checkpoint?) or saved with another block_size?"
            )
