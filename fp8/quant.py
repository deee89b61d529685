"""Blockwise E4M3 quantizers (DeepSeek-V3 / Ling 2.0 recipe): Triton kernels and their PyTorch references.

Conventions (shared by every function here and by `fp8/gemm.py`):
- E4M3 (`torch.float8_e4m3fn`, max 448). Scales are fp32, one per block: scale = max(amax, AMAX_FLOOR) / 448
  with AMAX_FLOOR = 1e-12 * 448 (an all-zero block gets scale 1e-12 and stays exactly zero). With
  `pow2_scales=True` the scale is rounded UP to a power of two (exact bit manipulation, so the quantized
  values never exceed 448). dequantized = x_fp8.float() * scale (per block).
- q = RN_e4m3(x / scale): fp32 IEEE division (`div_rn` in the kernels), then round-to-nearest-even to E4M3.
- 1x128 tiles along the last dim: x [M, K] -> x_fp8 [M, K] and scale [M, ceil(K/128)]. The scale tensor is
  stored with the row index fastest (`scale.stride() == (1, M)`, the layout cuBLAS/DeepGEMM use for LHS
  scales, so the GEMM reads BLOCK_M consecutive floats per K block); call `.contiguous()` if you need
  row-major. 128x128 blocks: w [N, K] -> w_fp8 [N, K] and a row-major scale [ceil(N/128), ceil(K/128)].
- Tails (K or M not a multiple of 128) form partial blocks: their scale covers only the valid elements.
- NaN anywhere in a block makes that block's scale NaN (so every value of the block dequantizes to NaN);
  Inf makes the scale Inf (dequantizes to NaN/Inf). Nothing is silently clipped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fp8._triton_utils import AMAX_FLOOR, BLOCK, E4M3, E4M3_MAX, HAS_TRITON, cdiv, col_major, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = [
    "quantize_1x128",
    "quantize_1x128_ref",
    "quantize_128x128",
    "quantize_128x128_ref",
    "quantize_1x128_transposed",
    "quantize_1x128_transposed_ref",
    "quantize_1x128_dual",
    "fp8_transpose_128x128",
    "fp8_transpose_128x128_ref",
    "dequantize_1x128",
    "dequantize_128x128",
    "quantize_tensorwise",
]


# ----------------------------------------------------------------------------------------------------------
# PyTorch reference (also the CPU path)
# ----------------------------------------------------------------------------------------------------------
def scale_from_amax(amax: torch.Tensor, pow2_scales: bool = False) -> torch.Tensor:
    """fp32 scale from fp32 amax: max(amax, floor) / 448, optionally rounded up to a power of two.

    NaN amax stays NaN (torch.clamp propagates it); Inf stays Inf.
    """
    scale = torch.clamp(amax.float(), min=AMAX_FLOOR) / E4M3_MAX
    if pow2_scales:
        bits = scale.view(torch.int32)
        exp_bits = bits & 0x7F800000
        rounded = torch.where((bits & 0x7FFFFF) != 0, exp_bits + (1 << 23), bits)
        bits = torch.where(exp_bits == 0x7F800000, bits, rounded)  # leave Inf / NaN untouched
        scale = bits.view(torch.float32)
    return scale


def _check_2d(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [rows, cols], got shape {tuple(x.shape)}")
    if not (x.dtype.is_floating_point):
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")


def quantize_1x128_ref(x: torch.Tensor, pow2_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference 1x128 quantizer. x [M, K] (any float dtype) -> (E4M3 [M, K], fp32 scale [M, ceil(K/128)])."""
    _check_2d(x, "x")
    m, k = x.shape
    kb = cdiv(k, BLOCK)
    xf = x.float()
    if kb * BLOCK != k:
        xf = F.pad(xf, (0, kb * BLOCK - k))  # zeros never change a block's amax
    xb = xf.reshape(m, kb, BLOCK)
    scale = scale_from_amax(xb.abs().amax(dim=-1), pow2_scales)  # amax propagates NaN
    q = (xb / scale[..., None]).to(E4M3).reshape(m, kb * BLOCK)[:, :k].contiguous()
    return q, col_major(scale)


def quantize_128x128_ref(w: torch.Tensor, pow2_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference 128x128 quantizer. w [N, K] -> (E4M3 [N, K], fp32 scale [ceil(N/128), ceil(K/128)])."""
    _check_2d(w, "w")
    n, k = w.shape
    nb, kb = cdiv(n, BLOCK), cdiv(k, BLOCK)
    wf = F.pad(w.float(), (0, kb * BLOCK - k, 0, nb * BLOCK - n))
    wb = wf.reshape(nb, BLOCK, kb, BLOCK)
    scale = scale_from_amax(wb.abs().amax(dim=(1, 3)), pow2_scales)
    q = (wb / scale[:, None, :, None]).to(E4M3).reshape(nb * BLOCK, kb * BLOCK)[:n, :k].contiguous()
    return q, scale.contiguous()


def dequantize_1x128(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x_fp8 [M, K], scale [M, ceil(K/128)] -> dequantized [M, K] (computed in fp32, cast to dtype)."""
    k = q.shape[1]
    return (q.float() * scale.float().repeat_interleave(BLOCK, dim=1)[:, :k]).to(dtype)


def dequantize_128x128(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w_fp8 [N, K], scale [ceil(N/128), ceil(K/128)] -> dequantized [N, K]."""
    n, k = q.shape
    s = scale.float().repeat_interleave(BLOCK, dim=0)[:n].repeat_interleave(BLOCK, dim=1)[:, :k]
    return (q.float() * s).to(dtype)


def quantize_1x128_transposed_ref(
    x: torch.Tensor, x_scale: torch.Tensor | None = None, pow2_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of the fused quantize-with-transpose.

    x [M, K] (tokens M) -> (E4M3 [K, M], fp32 scale [K, ceil(M/128)]): 1x128 tiles along the token dim.
    If `x_scale` is given, x is an E4M3 tensor quantized 1x128 along K with that scale and is dequantized
    (fp32 multiply) first: this is how wgrad rebuilds its operand from the FP8 x saved in forward.
    """
    src = dequantize_1x128(x, x_scale) if x_scale is not None else x.float()
    return quantize_1x128_ref(src.t(), pow2_scales)


def fp8_transpose_128x128_ref(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Transpose of a 128x128-quantized weight: ([K, N] E4M3, [ceil(K/128), ceil(N/128)] scale); exact."""
    return q.t().contiguous(), scale.t().contiguous()


def quantize_tensorwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One current scale per tensor (the comparison recipe): (E4M3 like x, fp32 scalar scale)."""
    scale = scale_from_amax(x.detach().abs().amax().float())
    return (x.float() / scale).to(E4M3), scale


# ----------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _scale_from_amax(amax, nan_count, POW2: tl.constexpr):
        """Kernel twin of `scale_from_amax` (NaN handled explicitly: max/min instructions drop NaN)."""
        amax = tl.maximum(amax, 4.48e-10)  # AMAX_FLOOR (1e-12 * 448), as an fp32 literal
        amax = tl.where(nan_count > 0, float("nan"), amax)
        scale = tl.math.div_rn(amax, 448.0)
        if POW2:
            bits = scale.to(tl.int32, bitcast=True)
            exp_bits = bits & 0x7F800000
            rounded = tl.where((bits & 0x7FFFFF) != 0, exp_bits + (1 << 23), bits)
            bits = tl.where(exp_bits == 0x7F800000, bits, rounded)
            scale = bits.to(tl.float32, bitcast=True)
        return scale

    @triton.jit
    def _quant_1x128_kernel(
        x_ptr, xs_ptr, q_ptr, s_ptr, qt_ptr, st_ptr,
        M, K,
        stride_xm, stride_xk, stride_xsm, stride_xsk,
        stride_qm, stride_qk, stride_sm, stride_sk,
        stride_qtk, stride_qtm, stride_stk, stride_stm,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, HAS_IN_SCALE: tl.constexpr, DO_ROW: tl.constexpr,
        DO_COL: tl.constexpr, POW2: tl.constexpr, TRANS32: tl.constexpr,
    ):  # fmt: skip
        """One [BLOCK_M, BLOCK_K] tile of x [M, K]: row-wise (1x128 along K; needs BLOCK_K == 128) and/or
        column-wise (1x128 along M, needs BLOCK_M == 128; written transposed into [K, M]) quantization;
        optional dequantization of an FP8 input (1x128 scales along K) first."""
        pid_m = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        m_ok = offs_m < M
        k_ok = offs_k < K
        mask = m_ok[:, None] & k_ok[None, :]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk, mask=mask, other=0.0)
        x = x.to(tl.float32)
        if HAS_IN_SCALE:  # x is E4M3 quantized 1x128 along K: this tile is exactly one of its K blocks
            xs = tl.load(xs_ptr + offs_m * stride_xsm + (pid_k * BLOCK_K // 128) * stride_xsk, mask=m_ok, other=0.0)
            x = x * xs[:, None]
        isnan = (x != x).to(tl.int32)
        ax = tl.abs(x)
        if DO_ROW:
            scale = _scale_from_amax(tl.max(ax, axis=1), tl.sum(isnan, axis=1), POW2)
            q = tl.math.div_rn(x, scale[:, None]).to(tl.float8e4nv)
            tl.store(q_ptr + offs_m[:, None] * stride_qm + offs_k[None, :] * stride_qk, q, mask=mask)
            tl.store(s_ptr + offs_m * stride_sm + (pid_k * BLOCK_K // 128) * stride_sk, scale, mask=m_ok)
        if DO_COL:  # BLOCK_M == 128: the tile holds one whole 128-token block of every column
            scale_c = _scale_from_amax(tl.max(ax, axis=0), tl.sum(isnan, axis=0), POW2)
            if TRANS32:  # transpose 32-bit values (fast shared-memory path), then cast to E4M3
                qc = tl.math.div_rn(tl.trans(x), scale_c[:, None]).to(tl.float8e4nv)  # [128 (K), BLOCK_M]
            else:
                qc = tl.trans(tl.math.div_rn(x, scale_c[None, :]).to(tl.float8e4nv))
            tl.store(
                qt_ptr + offs_k[:, None] * stride_qtk + offs_m[None, :] * stride_qtm,
                qc,
                mask=k_ok[:, None] & m_ok[None, :],
            )
            tl.store(st_ptr + offs_k * stride_stk + pid_m * stride_stm, scale_c, mask=k_ok)

    @triton.jit
    def _quant_128x128_kernel(
        w_ptr, q_ptr, s_ptr, N, K,
        stride_wn, stride_wk, stride_qn, stride_qk, stride_sn, stride_sk,
        POW2: tl.constexpr,
    ):  # fmt: skip
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * 128 + tl.arange(0, 128)
        offs_k = pid_k * 128 + tl.arange(0, 128)
        mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk, mask=mask, other=0.0)
        w = w.to(tl.float32)
        amax = tl.max(tl.max(tl.abs(w), axis=1), axis=0)
        nan_count = tl.sum(tl.sum((w != w).to(tl.int32), axis=1), axis=0)
        scale = _scale_from_amax(amax, nan_count, POW2)
        q = tl.math.div_rn(w, scale).to(tl.float8e4nv)
        tl.store(q_ptr + offs_n[:, None] * stride_qn + offs_k[None, :] * stride_qk, q, mask=mask)
        tl.store(s_ptr + pid_n * stride_sn + pid_k * stride_sk, scale)

    @triton.jit
    def _transpose_fp8_kernel(
        q_ptr, t_ptr, N, K, stride_qn, stride_qk, stride_tk, stride_tn,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TRANS32: tl.constexpr,
    ):  # fmt: skip
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
        # move the bytes as uint8: a transpose is exact and needs no float8 arithmetic
        q = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_k[None, :] * stride_qk, mask=mask, other=0)
        if TRANS32:  # widen to 32 bits for the transpose (byte transposes take a slow path)
            qt = tl.trans(q.to(tl.int32)).to(tl.uint8)
        else:
            qt = tl.trans(q)
        tl.store(
            t_ptr + offs_k[:, None] * stride_tk + offs_n[None, :] * stride_tn,
            qt,
            mask=(offs_k < K)[:, None] & (offs_n < N)[None, :],
        )


# Launch options of the quantize kernels (the benchmark sweeps them; defaults from the H200 runs).
# col_block_k: features per program of the column-only (transposed) quantizer; dual_fused: whether
# quantize_1x128_dual is one fused launch (one read of x) or a row launch plus a column launch.
# Defaults = the configuration behind the measured FP8Linear layer table (H200 run 2); the benchmark's
# --sweep times the alternatives (all bit-identical, see tests/test_fp8_quant.py).
QUANT_OPTIONS: dict = {"trans32": True, "col_warps": 4, "transpose_block": 64, "col_block_k": 128, "dual_fused": True}


def _launch_1x128(
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    do_row: bool,
    do_col: bool,
    pow2_scales: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    m, k = x.shape
    kb, mb = cdiv(k, BLOCK), cdiv(m, BLOCK)
    dev = x.device
    q = s = qt = st = None
    dummy = torch.empty(1, 1, device=dev, dtype=torch.float32)  # stands in for unused operands
    if do_row:
        q = torch.empty(m, k, device=dev, dtype=E4M3)
        s = torch.empty(kb, m, device=dev, dtype=torch.float32).t()  # [M, KB], row index fastest
    if do_col:
        qt = torch.empty(k, m, device=dev, dtype=E4M3)
        st = torch.empty(mb, k, device=dev, dtype=torch.float32).t()  # [K, MB], row index fastest
    if m == 0 or k == 0:
        return q, s, qt, st
    block_m = 128 if do_col else 64
    block_k = 128 if do_row else QUANT_OPTIONS["col_block_k"]
    xs2 = x_scale if x_scale is not None else dummy
    qq2, ss = (q, s) if do_row else (dummy, dummy)
    qqt2, sst = (qt, st) if do_col else (dummy, dummy)
    grid = (cdiv(m, block_m), cdiv(k, block_k))
    _quant_1x128_kernel[grid](
        x, xs2, qq2, ss, qqt2, sst, m, k,
        x.stride(0), x.stride(1), xs2.stride(0), xs2.stride(1),
        qq2.stride(0), qq2.stride(1), ss.stride(0), ss.stride(1),
        qqt2.stride(0), qqt2.stride(1), sst.stride(0), sst.stride(1),
        BLOCK_M=block_m, BLOCK_K=block_k, HAS_IN_SCALE=x_scale is not None, DO_ROW=do_row, DO_COL=do_col,
        POW2=pow2_scales,
        TRANS32=QUANT_OPTIONS["trans32"], num_warps=QUANT_OPTIONS["col_warps"] if do_col else 4,
    )  # fmt: skip
    return q, s, qt, st


def _check_in_scale(x: torch.Tensor, x_scale: torch.Tensor | None) -> None:
    if x_scale is None:
        return
    if x.dtype != E4M3:
        raise TypeError(f"x_scale given, so x must be float8_e4m3fn, got {x.dtype}")
    want = (x.shape[0], cdiv(x.shape[1], BLOCK))
    if tuple(x_scale.shape) != want or x_scale.dtype != torch.float32:
        raise ValueError(f"x_scale must be fp32 {want}, got {x_scale.dtype} {tuple(x_scale.shape)}")


# ----------------------------------------------------------------------------------------------------------
# Public ops (Triton on CUDA tensors, reference otherwise)
# ----------------------------------------------------------------------------------------------------------
def quantize_1x128(
    x: torch.Tensor, pow2_scales: bool = False, *, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16/fp16/fp32) -> (E4M3 [M, K], fp32 scale [M, ceil(K/128)], stride (1, M))."""
    _check_2d(x, "x")
    if not use_triton(x, backend):
        return quantize_1x128_ref(x, pow2_scales)
    q, s, _, _ = _launch_1x128(x, None, True, False, pow2_scales)
    return q, s


def quantize_1x128_transposed(
    x: torch.Tensor,
    x_scale: torch.Tensor | None = None,
    pow2_scales: bool = False,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused quantize-with-transpose: x [M, K] -> (E4M3 [K, M], fp32 scale [K, ceil(M/128)], stride (1, K)).

    1x128 tiles along the token dim M; no bf16 transpose is ever materialised. With `x_scale`, x is an
    E4M3 tensor with 1x128 scales along K, dequantized in registers first (wgrad from the saved FP8 x).
    """
    _check_2d(x, "x")
    _check_in_scale(x, x_scale)
    if not use_triton(x, backend):
        return quantize_1x128_transposed_ref(x, x_scale, pow2_scales)
    _, _, qt, st = _launch_1x128(x, x_scale, False, True, pow2_scales)
    return qt, st


def quantize_1x128_dual(
    x: torch.Tensor, pow2_scales: bool = False, *, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One read of x [M, K] gives both quantizations the backward pass needs for dy:
    (E4M3 [M, K], scale [M, KB]) along K for dgrad and (E4M3 [K, M], scale [K, MB]) along M for wgrad."""
    _check_2d(x, "x")
    if not use_triton(x, backend):
        q, s = quantize_1x128_ref(x, pow2_scales)
        qt, st = quantize_1x128_ref(x.t(), pow2_scales)
        return q, s, qt, st
    if QUANT_OPTIONS["dual_fused"]:
        return _launch_1x128(x, None, True, True, pow2_scales)  # type: ignore[return-value]
    q, s, _, _ = _launch_1x128(x, None, True, False, pow2_scales)
    _, _, qt, st = _launch_1x128(x, None, False, True, pow2_scales)
    return q, s, qt, st


def quantize_128x128(
    w: torch.Tensor, pow2_scales: bool = False, *, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (E4M3 [N, K], fp32 scale [ceil(N/128), ceil(K/128)], row-major)."""
    _check_2d(w, "w")
    if not use_triton(w, backend):
        return quantize_128x128_ref(w, pow2_scales)
    n, k = w.shape
    q = torch.empty(n, k, device=w.device, dtype=E4M3)
    s = torch.empty(cdiv(n, BLOCK), cdiv(k, BLOCK), device=w.device, dtype=torch.float32)
    if n and k:
        _quant_128x128_kernel[(s.shape[0], s.shape[1])](
            w, q, s, n, k, w.stride(0), w.stride(1), q.stride(0), q.stride(1), s.stride(0), s.stride(1),
            POW2=pow2_scales, num_warps=8,
        )  # fmt: skip
    return q, s


def fp8_transpose_128x128(
    q: torch.Tensor, scale: torch.Tensor, *, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """On-demand transpose of a 128x128-quantized weight: E4M3 [N, K] -> [K, N]; block scales transposed
    with it (a 128x128 block's scale is shared by its transpose, so the result is exact)."""
    if q.dtype != E4M3 or q.dim() != 2:
        raise TypeError(f"q must be a 2-D float8_e4m3fn tensor, got {q.dtype} {tuple(q.shape)}")
    if not use_triton(q, backend):
        return fp8_transpose_128x128_ref(q, scale)
    n, k = q.shape
    t = torch.empty(k, n, device=q.device, dtype=E4M3)
    if n and k:
        qu, tu = q.view(torch.uint8), t.view(torch.uint8)
        bt = QUANT_OPTIONS["transpose_block"]
        _transpose_fp8_kernel[(cdiv(n, bt), cdiv(k, bt))](
            qu, tu, n, k, qu.stride(0), qu.stride(1), tu.stride(0), tu.stride(1), BLOCK_N=bt, BLOCK_K=bt,
            TRANS32=QUANT_OPTIONS["trans32"], num_warps=4,
        )  # fmt: skip
    return t, scale.t().contiguous()
