"""`FP8AdamW`: AdamW with both moments stored in E4M3 with one fp32 scale per block of elements.

State per parameter with numel >= `min_fp8_numel` (n elements, B = block_size, nb = ceil(n / B) blocks):

| key                     | dtype   | shape  | meaning                                                   |
|-------------------------|---------|--------|-----------------------------------------------------------|
| `step`                  | float32 | []     | number of updates taken (CPU scalar, like torch.optim)    |
| `exp_avg`               | uint8   | [n]    | raw E4M3 bits of m / exp_avg_scale[block]                 |
| `exp_avg_scale`         | float32 | [nb]   | amax(|m| in block) / 448                                  |
| `exp_avg_sq_root`       | uint8   | [n]    | raw E4M3 bits of sqrt(v) / exp_avg_sq_root_scale[block]   |
| `exp_avg_sq_root_scale` | float32 | [nb]   | amax(sqrt(v) in block) / 448                              |

That is 2 + 8 / B bytes per parameter (2.0625 at B = 128) against 8 for fp32 moments.

Why the second moment is kept as sqrt(v) ("range-safe form"): v = EMA(g²) spans twice the binade range of
|g|, and E4M3 with one scale per block only covers amax · 2⁻¹⁸ ... amax (448 down to the smallest subnormal
2⁻⁹). Stored directly, the small entries of v in a block flush to zero, and an element with v = 0 but m ≠ 0
takes a step of m / eps, i.e. an enormous one. sqrt(v) halves the log-range, so the same 18 binades of E4M3
cover 36 binades of v. On top of that, a non-zero sqrt(v) never rounds to 0: it is floored at the smallest
positive subnormal (which over-estimates v for those entries and so only shrinks their step). The underflow
rates measured by `bench/bench_fp8_adam.py` / `tests/test_fp8_adam.py::test_second_moment_underflow` are in
the README. sqrt(v) is also what the update needs (denominator sqrt(v̂) + eps), so it costs no extra work.

The update itself runs in fp32 from the dequantized moments and the fp32 gradient; only the stored moments
are rounded. On CUDA one fused Triton kernel does, per launch, all tensors of a param group that share the
gradient dtype and the step count (a table of per-tensor offsets, one program per chunk of `NB` blocks):
read fp32 param, grad, FP8 moments and scales, update, write param, FP8 moments and new scales
(16 + 8/B·2 bytes of traffic per parameter with fp32 grads). On CPU the same maths runs in plain torch
(`fp8_adamw_update_reference`), which the tests also use as the reference for the kernel.

DeepSpeed ZeRO: works on its flat 1-D fp32 partitions (padding included) and with the param-group swapping
of `_optimizer_step` (state is keyed by tensor, never by group index). ZeRO's *elastic* checkpoint format
trims every state tensor by the partition padding and re-partitions tensors that have the partition's shape;
per-block scales cannot survive that (they are not per element), so FP8AdamW refuses to run under a ZeRO
optimizer with `elastic_checkpoint=True` (checked on the first step) and `check_deepspeed_config` rejects
such a config up front. DeepSpeed's default (`elastic_checkpoint: false`) saves `optimizer.state_dict()`
per rank, which round-trips exactly.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.optim.adamw import adamw as _torch_adamw

from fp8._triton_utils import E4M3_MAX, HAS_TRITON, cdiv

if HAS_TRITON:  # Triton is optional on CPU-only installs; the torch reference path needs none of it.
    import triton
    import triton.language as tl

E4M3_MIN_SUBNORMAL = 2.0**-9  # smallest positive E4M3 value; floor for a non-zero sqrt(v)
AMAX_FLOOR = 1e-30  # amax is clamped to this so that an all-zero block gets a finite, positive scale

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FP8_BYTES_KEYS = ("exp_avg", "exp_avg_sq_root")  # uint8 E4M3 bits in FP8 state
FP8_STATE_KEYS = ("exp_avg", "exp_avg_scale", "exp_avg_sq_root", "exp_avg_sq_root_scale")


def _f32(x: float) -> float:
    """Round a Python float to the nearest float32 (the value both the kernel and the reference use)."""
    return float(np.float32(x))


@dataclass(frozen=True)
class AdamScalars:
    """Per-launch fp32 scalars of one AdamW step (all already rounded to float32).

    p ← p·decay − step_size · m / (sqrt(v)·inv_sqrt_bc2 + eps), with m ← beta1·m + omb1·g and
    v ← beta2·v + omb2·g², where decay = 1 − lr·wd, step_size = lr / (1 − beta1^t),
    inv_sqrt_bc2 = 1 / sqrt(1 − beta2^t).
    """

    beta1: float
    omb1: float
    beta2: float
    omb2: float
    eps: float
    decay: float
    step_size: float
    inv_sqrt_bc2: float

    @classmethod
    def from_hparams(
        cls, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int
    ) -> AdamScalars:
        bc1 = 1.0 - beta1**step
        bc2 = 1.0 - beta2**step
        return cls(
            beta1=_f32(beta1),
            omb1=_f32(1.0 - beta1),
            beta2=_f32(beta2),
            omb2=_f32(1.0 - beta2),
            eps=_f32(eps),
            decay=_f32(1.0 - lr * weight_decay),
            step_size=_f32(lr / bc1),
            inv_sqrt_bc2=_f32(1.0 / math.sqrt(bc2)),
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


def quantize_blockwise_reference(
    x: torch.Tensor, block_size: int, floor_nonzero: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise E4M3 quantization of a flat fp32 tensor.

    x: fp32 [n] → (q uint8 [n] holding E4M3 bits, scale fp32 [ceil(n / block_size)]), with
    scale = max(amax, AMAX_FLOOR) / 448 and x ≈ e4m3(q) · scale[block]. With `floor_nonzero`, entries
    with x > 0 that would round to 0 are stored as the smallest positive subnormal instead (for x ≥ 0).
    """
    n = x.numel()
    xb = _blocks(x.float().reshape(-1), block_size)
    amax = xb.abs().amax(dim=1)
    amax = torch.clamp(amax, min=AMAX_FLOOR)
    scale = amax / E4M3_MAX
    y = xb * (E4M3_MAX / amax)[:, None]  # one division per block, as in the kernel
    if floor_nonzero:
        y = torch.where(xb > 0, torch.clamp(y, min=E4M3_MIN_SUBNORMAL), y)
    q = y.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8).reshape(-1)[:n]
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
    b0, b1 = start // block_size, cdiv(start + numel, block_size)
    x = dequantize_blockwise_reference(state[bits][b0 * block_size : b1 * block_size], state[scale][b0:b1], block_size)
    x = x[start - b0 * block_size :][:numel]
    return x * x if key == "exp_avg_sq" else x


def state_from_moments(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: float, block_size: int,
                       min_fp8_numel: int) -> dict[str, Any]:  # fmt: skip
    """The FP8AdamW state of a flat fp32 tensor whose moments are m = exp_avg and v = exp_avg_sq (fp32 [n])
    after `step` updates: E4M3 blocks of m and sqrt(v) as a step writes them (or fp32 moments when
    n < min_fp8_numel). Used to re-partition a checkpoint (ling/reshard.py)."""
    state: dict[str, Any] = {"step": torch.tensor(float(step), dtype=torch.float32)}
    if exp_avg.numel() < min_fp8_numel:
        return {**state, "exp_avg": exp_avg.float().clone(), "exp_avg_sq": exp_avg_sq.float().clone()}
    mq, ms = quantize_blockwise_reference(exp_avg, block_size)
    rq, rs = quantize_blockwise_reference(exp_avg_sq.float().sqrt(), block_size, floor_nonzero=True)
    return {**state, "exp_avg": mq, "exp_avg_scale": ms, "exp_avg_sq_root": rq, "exp_avg_sq_root_scale": rs}


def fp8_adamw_update_reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_scale: torch.Tensor,
    exp_avg_sq_root: torch.Tensor,
    exp_avg_sq_root_scale: torch.Tensor,
    s: AdamScalars,
    block_size: int,
) -> None:
    """One FP8AdamW step on one tensor, in place, in plain torch (the maths of the Triton kernel).

    param fp32 [n] (flat, contiguous); grad fp32/bf16/fp16 [n]; exp_avg / exp_avg_sq_root uint8 [n]
    (E4M3 bits); the two scales fp32 [ceil(n / block_size)].
    """
    n = param.numel()
    g = grad.reshape(-1).float()
    m = dequantize_blockwise_reference(exp_avg, exp_avg_scale, block_size)
    r = dequantize_blockwise_reference(exp_avg_sq_root, exp_avg_sq_root_scale, block_size)
    # Same operations as the kernel (fp32 throughout). The interpreted kernel rounds like this; the compiled
    # one uses the GPU's approximate fp32 division and square root (≤ 2 ulp) and may fuse a·b+c into FMAs.
    m = s.beta1 * m + s.omb1 * g
    v = s.beta2 * (r * r) + s.omb2 * (g * g)
    r = torch.sqrt(v)
    denom = r * s.inv_sqrt_bc2 + s.eps
    p = param.view(-1)
    p.copy_(p * s.decay - s.step_size * (m / denom))
    mq, ms = quantize_blockwise_reference(m, block_size)
    rq, rs = quantize_blockwise_reference(r, block_size, floor_nonzero=True)
    exp_avg.copy_(mq[:n])
    exp_avg_scale.copy_(ms)
    exp_avg_sq_root.copy_(rq[:n])
    exp_avg_sq_root_scale.copy_(rs)


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

    # Measured on an H200 (bench/bench_fp8_adam.py, 477 × [1024, 2048]): 8 × 8 × 1 4.76 ms, 16 × 16 × 1
    # 4.88 ms, 16 × 16 × 2 5.05 ms, 8 × 8 × 4 5.57 ms, 16 × 8 × 1 5.85 ms, 32 × 8 × 1 6.76 ms.
    blocks_per_program: int = 8
    num_warps: int = 8
    iters_per_program: int = 1


if HAS_TRITON:

    @triton.jit
    def _adam_chunk(
        p_ptr, g_ptr, m_ptr, ms_ptr, r_ptr, rs_ptr, numel, start, blk0,
        beta1, omb1, beta2, omb2, eps, decay, step_size, inv_sqrt_bc2,
        BS: tl.constexpr, NB: tl.constexpr, MASKED: tl.constexpr,
        AMAX_MIN: tl.constexpr, QMAX: tl.constexpr, QMIN_SUB: tl.constexpr,
    ):  # fmt: skip
        rows = tl.arange(0, NB)
        cols = tl.arange(0, BS)
        idx = start + rows[:, None] * BS + cols[None, :]  # [NB, BS] int64 element index in the tensor
        bidx = blk0 + rows  # [NB] block index
        if MASKED:
            mask = idx < numel
            bmask = bidx * BS < numel
            p = tl.load(p_ptr + idx, mask=mask, other=0.0)
            g = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32)
            mq = tl.load(m_ptr + idx, mask=mask, other=0.0).to(tl.float32)
            rq = tl.load(r_ptr + idx, mask=mask, other=0.0).to(tl.float32)
            ms = tl.load(ms_ptr + bidx, mask=bmask, other=0.0)
            rs = tl.load(rs_ptr + bidx, mask=bmask, other=0.0)
        else:
            p = tl.load(p_ptr + idx)
            g = tl.load(g_ptr + idx).to(tl.float32)
            mq = tl.load(m_ptr + idx).to(tl.float32)
            rq = tl.load(r_ptr + idx).to(tl.float32)
            ms = tl.load(ms_ptr + bidx)
            rs = tl.load(rs_ptr + bidx)
        m = mq * ms[:, None]
        r = rq * rs[:, None]
        m = beta1 * m + omb1 * g
        v = beta2 * (r * r) + omb2 * (g * g)
        r = tl.sqrt(v)
        denom = r * inv_sqrt_bc2 + eps
        p = p * decay - step_size * (m / denom)
        # Requantize: one scale per row (block) of BS elements; masked-off entries are 0 and do not move amax.
        m_amax = tl.maximum(tl.max(tl.abs(m), axis=1), AMAX_MIN)
        r_amax = tl.maximum(tl.max(r, axis=1), AMAX_MIN)
        m_scale = m_amax / QMAX
        r_scale = r_amax / QMAX
        m_out = tl.clamp(m * (QMAX / m_amax)[:, None], -QMAX, QMAX).to(tl.float8e4nv)
        y = tl.minimum(r * (QMAX / r_amax)[:, None], QMAX)
        r_out = tl.where(r > 0.0, tl.maximum(y, QMIN_SUB), y).to(tl.float8e4nv)  # never flush sqrt(v) to 0
        if MASKED:
            tl.store(p_ptr + idx, p, mask=mask)
            tl.store(m_ptr + idx, m_out, mask=mask)
            tl.store(r_ptr + idx, r_out, mask=mask)
            tl.store(ms_ptr + bidx, m_scale, mask=bmask)
            tl.store(rs_ptr + bidx, r_scale, mask=bmask)
        else:
            tl.store(p_ptr + idx, p)
            tl.store(m_ptr + idx, m_out)
            tl.store(r_ptr + idx, r_out)
            tl.store(ms_ptr + bidx, m_scale)
            tl.store(rs_ptr + bidx, r_scale)

    @triton.jit
    def _fp8_adamw_kernel(
        p_base, g_base, m_base, ms_base, r_base, rs_base,
        table_ptr, gtable_ptr, chunk_tensor_ptr, chunk_index_ptr,
        beta1, omb1, beta2, omb2, eps, decay, step_size, inv_sqrt_bc2,
        BS: tl.constexpr, NB: tl.constexpr, ITERS: tl.constexpr, ALIGNED: tl.constexpr,
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
                    beta1, omb1, beta2, omb2, eps, decay, step_size, inv_sqrt_bc2,
                    BS, NB, False, AMAX_MIN, QMAX, QMIN_SUB,
                )  # fmt: skip
            elif start < numel:
                _adam_chunk(
                    p_base + p_off, g_base + g_off, m_base + m_off, ms_base + ms_off, r_base + r_off,
                    rs_base + rs_off, numel, start, blk0,
                    beta1, omb1, beta2, omb2, eps, decay, step_size, inv_sqrt_bc2,
                    BS, NB, True, AMAX_MIN, QMAX, QMIN_SUB,
                )  # fmt: skip


def _offset(t: torch.Tensor, base: torch.Tensor) -> int:
    diff = t.data_ptr() - base.data_ptr()
    size = t.element_size()
    if diff % size:
        raise ValueError(f"tensor at {t.data_ptr():#x} is not {size}-byte aligned relative to its base")
    return diff // size


def _to_device(rows: list, device: torch.device) -> torch.Tensor:
    t = torch.tensor(rows, dtype=torch.int64)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass
class LaunchPlan:
    """Device-side tables of one multi-tensor launch, reused while no pointer moves.

    table int64 [T, 8]: element offsets of param, exp_avg, its scale, exp_avg_sq_root, its scale (relative
    to the first tensor of each kind) and numel; gtable int64 [T]: grad offsets; chunk_tensor /
    chunk_index int32 [n_chunks]: which tensor and which chunk of it each program updates.
    """

    key: tuple[int, ...]
    table: torch.Tensor
    chunk_tensor: torch.Tensor
    chunk_index: torch.Tensor
    aligned: bool
    gkey: tuple[int, ...] = ()
    gtable: torch.Tensor | None = None
    galigned: bool = True


def _static_key(tensors: Sequence[tuple[torch.Tensor, ...]]) -> tuple[int, ...]:
    # Our state tensors move only through load_state_dict (which drops plans); a param moves with data_ptr.
    return tuple(x for tup in tensors for x in (tup[0].data_ptr(), tup[0].numel(), tup[2].data_ptr()))


def build_launch_plan(tensors: Sequence[tuple[torch.Tensor, ...]], block_size: int, cfg: KernelConfig) -> LaunchPlan:
    """Offset tables for tuples (param, grad, exp_avg, exp_avg_scale, exp_avg_sq_root, its scale)."""
    base = tensors[0]
    rows = []
    aligned = True
    for tup in tensors:
        offs = [_offset(tup[i], base[i]) for i in (0, 2, 3, 4, 5)]
        aligned &= offs[0] % 16 == 0 and offs[1] % 16 == 0 and offs[3] % 16 == 0
        rows.append(offs + [tup[0].numel()] + [0] * (TABLE_COLS - 6))
    device = base[0].device
    chunk = cfg.iters_per_program * cfg.blocks_per_program * block_size
    counts = torch.tensor([cdiv(r[5], chunk) for r in rows], dtype=torch.int64)
    starts = torch.cumsum(counts, 0) - counts
    chunk_tensor = torch.repeat_interleave(torch.arange(len(rows), dtype=torch.int64), counts)
    chunk_index = torch.arange(int(counts.sum()), dtype=torch.int64) - torch.repeat_interleave(starts, counts)
    return LaunchPlan(
        key=_static_key(tensors),
        table=_to_device(rows, device),
        chunk_tensor=chunk_tensor.to(torch.int32).to(device),
        chunk_index=chunk_index.to(torch.int32).to(device),
        aligned=aligned,
    )


def fp8_adamw_update_triton(
    tensors: Sequence[tuple[torch.Tensor, ...]],
    s: AdamScalars,
    block_size: int,
    cfg: KernelConfig = KernelConfig(),
    plan: LaunchPlan | None = None,
    trust_static: bool = False,
) -> LaunchPlan:
    """One fused launch over all `tensors` = [(param, grad, exp_avg, exp_avg_scale, exp_avg_sq_root,
    exp_avg_sq_root_scale), ...]: params fp32 contiguous (any shape), grads contiguous and all of one
    dtype, moments uint8 [numel], scales fp32 [ceil(numel / block_size)], all on one device.

    Returns the launch plan; pass it back as `plan` to skip rebuilding the tables when no pointer moved
    (`trust_static`: the caller has checked that params and state did not move; only grads are checked).
    """
    if not HAS_TRITON:
        raise RuntimeError("FP8AdamW's fused kernel needs triton; use backend='torch' on this machine")
    if plan is None or not (trust_static or plan.key == _static_key(tensors)):
        plan = build_launch_plan(tensors, block_size, cfg)
    gkey = tuple(tup[1].data_ptr() for tup in tensors)
    if plan.gtable is None or plan.gkey != gkey:
        g0 = tensors[0][1]
        goffs = [_offset(tup[1], g0) for tup in tensors]
        plan.gkey, plan.gtable = gkey, _to_device(goffs, g0.device)
        plan.galigned = all(o % 16 == 0 for o in goffs)
    p, g, m, ms, r, rs = tensors[0]
    grid = (plan.chunk_tensor.numel(),)
    _fp8_adamw_kernel[grid](
        p, g, m.view(torch.float8_e4m3fn), ms, r.view(torch.float8_e4m3fn), rs,
        plan.table, plan.gtable, plan.chunk_tensor, plan.chunk_index,
        s.beta1, s.omb1, s.beta2, s.omb2, s.eps, s.decay, s.step_size, s.inv_sqrt_bc2,
        BS=block_size, NB=cfg.blocks_per_program, ITERS=cfg.iters_per_program,
        ALIGNED=plan.aligned and plan.galigned,
        AMAX_MIN=AMAX_FLOOR, QMAX=E4M3_MAX, QMIN_SUB=E4M3_MIN_SUBNORMAL,
        num_warps=cfg.num_warps,
    )  # fmt: skip
    return plan


# ----------------------------------------------------------------------------------------------------
# The optimizer
# ----------------------------------------------------------------------------------------------------


def check_deepspeed_config(ds_config: dict[str, Any]) -> None:
    """Raise if a DeepSpeed config would save FP8AdamW state in ZeRO's elastic format (see module doc)."""
    zero = ds_config.get("zero_optimization", {}) or {}
    if zero.get("elastic_checkpoint", False):
        raise ValueError(
            "FP8AdamW keeps one scale per block of elements, which DeepSpeed's elastic checkpoint "
            "(zero_optimization.elastic_checkpoint=true) trims and re-partitions as if it were per element; "
            "set zero_optimization.elastic_checkpoint=false (the default)"
        )


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
        self.backend = backend
        self.kernel = kernel or KernelConfig()
        self._plans: dict[tuple, LaunchPlan] = {}
        self._fast: dict[int, dict[str, Any]] = {}  # id(param group) -> what `_fast_step` reuses
        self._version = 0  # bumped whenever state tensors may have been replaced
        self._zero_checked = False
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
            is_fp8 = "exp_avg_scale" in st  # fp32-moment tensors use the same key names with fp32 values
            raw[pid] = {k: st[k] for k in _FP8_BYTES_KEYS if k in st and is_fp8}
            lean[pid] = {k: v for k, v in st.items() if k not in raw[pid]}
        super().load_state_dict({**state_dict, "state": lean})
        saved_ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(saved_ids, params):
            for k, v in raw.get(pid, {}).items():
                if v.dtype != torch.uint8:  # e.g. a state dict that went through torch's cast before
                    v = v.to(torch.uint8)
                self.state[p][k] = v.to(device=p.device, copy=True)
        self._plans.clear()  # state tensors were replaced: rebuild pointer tables
        self._fast.clear()
        self._version += 1

    # -- step ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 (torch's signature)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._zero_checked:
            _refuse_elastic_zero_caller(self)
            self._zero_checked = True
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
        if self._fast_step(group):
            return
        self._slow_step(group)

    def _fast_step(self, group: dict[str, Any]) -> bool:
        """The common case at low host cost (hundreds of tensors per group): the same params have grads
        and sit where they did, their state was checked before, one grad dtype, one step count, the
        Triton backend. Returns False (having changed nothing) when the general path must run."""
        cache = self._fast.get(id(group))
        if cache is None or cache["version"] != self._version:
            return False
        ps = [p for p in group["params"] if p.grad is not None]
        if list(map(id, ps)) != cache["ids"] or [p.data_ptr() for p in ps] != cache["pptrs"]:
            return False
        grads = [p.grad for p in ps]
        try:
            gptrs = [g.data_ptr() for g in grads]
        except RuntimeError:  # e.g. a sparse grad: the general path names the problem
            return False
        if gptrs != cache["gptrs"]:  # grads moved: check them again
            gd = grads[0].dtype
            if any(g.dtype != gd or g.is_sparse or not g.is_contiguous() for g in grads):
                return False
            cache["gptrs"], cache["gdtype"] = gptrs, gd
        cache["step_buf"].add_(1.0)  # every FP8 param's state["step"] is a view into this buffer
        cache["step"] += 1
        beta1, beta2 = group["betas"]
        bs = int(group["block_size"])
        s = AdamScalars.from_hparams(
            group["lr"], beta1, beta2, group["eps"], group["weight_decay"], cache["step"]
        )
        is_fp8 = cache["is_fp8"]
        fp8_grads = [g for g, f in zip(grads, is_fp8) if f]
        tensors = [(t[0], g, *t[1:]) for t, g in zip(cache["tuples"], fp8_grads)]
        # the plan lives in the cache, so it is dropped with it whenever the set of tensors changes
        # (`trust_static` skips re-checking the param/state pointers that the cache key has just checked)
        cache["plan"] = fp8_adamw_update_triton(tensors, s, bs, self.kernel, plan=cache["plan"], trust_static=True)
        if cache["small"]:
            small_grads = [g for g, f in zip(grads, is_fp8) if not f]
            self._step_fp32_moments(group, [(p, g, st) for (p, st), g in zip(cache["small"], small_grads)])
        return True

    def _remember_fast(self, group: dict[str, Any], fp8: list, small: list) -> None:
        """Record a group for `_fast_step` when it qualifies (contiguous params on one Triton device, one
        grad dtype, one step count). Re-points each FP8 param's state["step"] to a view into one shared
        buffer, so that a step increments all of them with one op."""
        self._fast.pop(id(group), None)
        if not fp8 or not all(p.is_contiguous() for p, _, _ in fp8):
            return
        device = fp8[0][0].device
        if not self._use_triton(device) or any(p.device != device for p, _, _ in fp8):
            return
        grads = [g for _, g, _ in fp8] + [g for _, g, _ in small]
        gd = grads[0].dtype
        if any(g.dtype != gd or not g.is_contiguous() for g in grads):
            return
        steps = torch.stack([st["step"].reshape(()) for _, _, st in fp8]).float()
        if not bool((steps == steps[0]).all()):
            return
        buf = steps.clone()
        for i, (_, _, st) in enumerate(fp8):
            st["step"] = buf[i]
        ps = [p for p in group["params"] if p.grad is not None]
        fp8_ids = {id(p) for p, _, _ in fp8}
        small_states = {id(p): st for p, _, st in small}
        self._fast[id(group)] = {
            "version": self._version,
            "ids": [id(p) for p in ps],
            "pptrs": [p.data_ptr() for p in ps],
            "gptrs": [p.grad.data_ptr() for p in ps],
            "gdtype": gd,
            "is_fp8": [id(p) in fp8_ids for p in ps],
            "step_buf": buf,
            "step": int(buf[0].item()),
            "tuples": [
                (p, st["exp_avg"], st["exp_avg_scale"], st["exp_avg_sq_root"], st["exp_avg_sq_root_scale"])
                for p, _, st in fp8
            ],
            "small": [(p, small_states[id(p)]) for p in ps if id(p) in small_states],
            "plan": None,  # LaunchPlan of these exact tuples, built at the first fast step
        }

    def _slow_step(self, group: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        bs = int(group["block_size"])
        small: list[tuple[torch.Tensor, torch.Tensor, dict]] = []
        fp8: list[tuple[torch.Tensor, torch.Tensor, dict]] = []
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
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
            state = self.state[p]
            if len(state) == 0:
                self._init_state(p, state, group)
            if "exp_avg_sq" in state:  # fp32-moment tensor
                small.append((p, g, state))
            else:
                fp8.append((p, g, state))

        if fp8:
            steps = [st["step"] for _, _, st in fp8]
            torch._foreach_add_(steps, 1.0)
            step_values = torch.stack(steps).tolist()
            # (device, grad dtype, step) -> tensor tuples of one fused launch
            launches: dict[tuple, list[tuple[torch.Tensor, ...]]] = {}
            writebacks: list[tuple[torch.Tensor, torch.Tensor]] = []
            for (p, g, st), step in zip(fp8, step_values):
                _check_fp8_state(p, st, bs)
                pf = p if p.is_contiguous() else p.contiguous()
                if pf is not p:
                    writebacks.append((p, pf))
                tup = (
                    pf,
                    g if g.is_contiguous() else g.contiguous(),
                    st["exp_avg"],
                    st["exp_avg_scale"],
                    st["exp_avg_sq_root"],
                    st["exp_avg_sq_root_scale"],
                )
                launches.setdefault((p.device, g.dtype, int(step)), []).append(tup)
            for (device, gdtype, step), tensors in launches.items():
                s = AdamScalars.from_hparams(group["lr"], beta1, beta2, group["eps"], group["weight_decay"], step)
                if self._use_triton(device):
                    pkey = (str(device), gdtype, bs, tensors[0][0].data_ptr())
                    if len(self._plans) > 256:  # params keep moving (unusual): don't hoard tables
                        self._plans.clear()
                    self._plans[pkey] = fp8_adamw_update_triton(tensors, s, bs, self.kernel, plan=self._plans.get(pkey))
                else:
                    for p, g, *st in tensors:
                        fp8_adamw_update_reference(p.view(-1), g.view(-1), *st, s=s, block_size=bs)
            for p, pf in writebacks:
                p.copy_(pf)
        self._remember_fast(group, fp8, small)

        if small:
            self._step_fp32_moments(group, small)

    @staticmethod
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

    def _init_state(self, p: torch.Tensor, state: dict, group: dict[str, Any]) -> None:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        n = p.numel()
        if n < int(group["min_fp8_numel"]):
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            return
        nb = cdiv(n, int(group["block_size"]))
        state["exp_avg"] = torch.zeros(n, dtype=torch.uint8, device=p.device)
        state["exp_avg_scale"] = torch.ones(nb, dtype=torch.float32, device=p.device)
        state["exp_avg_sq_root"] = torch.zeros(n, dtype=torch.uint8, device=p.device)
        state["exp_avg_sq_root_scale"] = torch.ones(nb, dtype=torch.float32, device=p.device)

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
        m = dequantize_blockwise_reference(st["exp_avg"], st["exp_avg_scale"], bs)
        r = dequantize_blockwise_reference(st["exp_avg_sq_root"], st["exp_avg_sq_root_scale"], bs)
        return m.view(p.shape), (r * r).view(p.shape)

    def _group_of(self, p: torch.Tensor) -> dict[str, Any]:
        for g in self.param_groups:
            if any(q is p for q in g["params"]):
                return g
        raise KeyError("parameter is not in this optimizer")


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


def _check_fp8_state(p: torch.Tensor, state: dict, block_size: int) -> None:
    n, nb = p.numel(), cdiv(p.numel(), block_size)
    want = {"exp_avg": n, "exp_avg_scale": nb, "exp_avg_sq_root": n, "exp_avg_sq_root_scale": nb}
    if any(state[k].numel() != size for k, size in want.items()):
        shapes = {k: tuple(state[k].shape) for k in FP8_STATE_KEYS if k in state}
        expected = {k: (size,) for k, size in want.items()}
        raise RuntimeError(
            f"FP8AdamW state of a parameter with {n} elements (block_size {block_size}) has shapes {shapes}, "
            f"expected {expected}: was the state trimmed or re-partitioned (DeepSpeed elastic checkpoint?) "
            "or saved with another block_size?"
        )


def _refuse_elastic_zero_caller(opt: FP8AdamW) -> None:
    """If a DeepSpeed ZeRO optimizer with elastic checkpointing drives `opt`, raise (see module doc)."""
    frame = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            return
        caller = frame.f_locals.get("self")
        if caller is not None and caller is not opt and getattr(caller, "optimizer", None) is opt:
            if getattr(caller, "elastic_checkpoint", False):
                raise RuntimeError(
                    "FP8AdamW under DeepSpeed ZeRO with elastic_checkpoint=true: ZeRO's elastic checkpoint "
                    "trims and re-partitions optimizer state per element, which breaks FP8AdamW's per-block "
                    "scales; set zero_optimization.elastic_checkpoint=false (the default)"
                )
            return
        frame = frame.f_back
