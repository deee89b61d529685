"""Blockwise E4M3 quantizers (DeepSeek-V3 / Ling 2.0 recipe): Triton kernels and their PyTorch references.

Conventions (shared by every function here and by `fp8/gemm.py`):
- E4M3 (`torch.float8_e4m3fn`, max 448). Scales are fp32, one per block: scale = max(amax, OPERAND_AMAX_FLOOR) /
  448 with OPERAND_AMAX_FLOOR = 1e-12 * 448 (an all-zero block gets scale 1e-12 and stays exactly zero). With
  `pow2_scales=True` the scale is rounded UP to a power of two (exact bit manipulation, so the quantized
  values never exceed 448). dequantized = x_fp8.float() * scale (per block).
- q = RN_e4m3(x / scale): fp32 IEEE division (in the kernels one reciprocal per scale and a correction per value,
  `fp8.triton_blocks.divide_by_scale`, the same bits), then round-to-nearest-even to E4M3.
- 1x128 tiles along the last dim: x [M, K] -> x_fp8 [M, K] and scale [M, ceil(K/128)]. The scale tensor is
  stored with the row index fastest (`scale.stride() == (1, M)`, the layout cuBLAS/DeepGEMM use for LHS
  scales, so the GEMM reads BLOCK_M consecutive floats per K block); call `.contiguous()` if you need
  row-major. 128x128 blocks: w [N, K] -> w_fp8 [N, K] and a row-major scale [ceil(N/128), ceil(K/128)].
- Tails (K or M not a multiple of 128) form partial blocks: their scale covers only the valid elements.
- NaN anywhere in a block makes that block's scale NaN (so every value of the block dequantizes to NaN);
  Inf makes the scale Inf (dequantizes to NaN/Inf). Nothing is silently clipped.
The format's constants live in fp8/format.py (`fp8.quant.BLOCK` is the same object); the kernels' launch shape
is `QuantConfig`, overridable through `QUANT_TUNING.override(...)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fp8.format import BLOCK, E4M3, E4M3_MAX, OPERAND_AMAX_FLOOR, col_major
from kernels.backend import HAS_TRITON, blocks_by_chunks_grid, cdiv, tl, triton, use_triton
from kernels.tuning import Tuning

if HAS_TRITON:
    from fp8.triton_blocks import amax_tl, block_and_chunk, divide_by_scale, quantize_along_tl, scale_from_amax_tl

__all__ = [
    "BLOCK",
    "QUANT_TUNING",
    "QuantConfig",
    "scale_from_amax",
    "quantize_1x128",
    "quantize_1x128_ref",
    "quantize_1x128_triton",
    "quantize_128x128",
    "quantize_128x128_ref",
    "quantize_128x128_with_transpose",
    "quantize_1x128_transposed",
    "quantize_1x128_transposed_ref",
    "quantize_1x128_dual",
    "fp8_transpose_128x128",
    "fp8_transpose_128x128_ref",
    "dequantize_1x128",
    "dequantize_128x128",
    "quantize_tensorwise",
    "e4m3_code_distance",
]


# ----------------------------------------------------------------------------------------------------------
# PyTorch reference (also the CPU path)
# ----------------------------------------------------------------------------------------------------------
def scale_from_amax(amax: torch.Tensor, pow2_scales: bool = False) -> torch.Tensor:
    """fp32 scale from fp32 amax: max(amax, floor) / 448, optionally rounded up to a power of two.

    NaN amax stays NaN (torch.clamp propagates it); Inf stays Inf.
    """
    amax = torch.clamp(amax.float(), min=OPERAND_AMAX_FLOOR)
    # divisor as a tensor on amax's device: for a Python-scalar divisor PyTorch's CUDA kernel multiplies by the
    # fp32 reciprocal instead (1 ulp off IEEE division for some amax), which made this reference disagree
    # with the kernels' IEEE division on GPU
    scale = amax / amax.new_full((), E4M3_MAX)
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
    """Transpose of a 128x128-quantized weight ([N, K] or a stack [G, N, K]): ([..., K, N] E4M3, scale
    [..., ceil(K/128), ceil(N/128)]); exact."""
    return q.transpose(-2, -1).contiguous(), scale.transpose(-2, -1).contiguous()


def e4m3_code_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many E4M3 values lie between a and b, elementwise: a, b `float8_e4m3fn` or their codes as uint8
    (FP8AdamW's stored moments), same shape; int32 on a's device. Codes are sign-magnitude, so the raw code
    difference is wrong across zero (+0 is 0x00, -0 is 0x80: the same value, 128 codes apart): this orders the
    codes -127 … -1, 0 (both zeros), 1 … 127 first."""

    def order(x: torch.Tensor) -> torch.Tensor:
        code = (x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x).to(torch.int32)
        magnitude = code & 0x7F
        return torch.where(code & 0x80 != 0, -magnitude, magnitude)

    return (order(a) - order(b.to(a.device))).abs()


def quantize_tensorwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One current scale per tensor (the comparison recipe): (E4M3 like x, fp32 scalar scale)."""
    scale = scale_from_amax(x.detach().abs().amax().float())
    return (x.float() / scale).to(E4M3), scale


# ----------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _quant_rows_kernel(
        x_ptr, q_ptr, s_ptr, idx_ptr, total_ptr, M, K,
        stride_xm, stride_xk, stride_qm, stride_qk, stride_sm, stride_sk,
        BLOCK_M: tl.constexpr, POW2: tl.constexpr, HAS_IDX: tl.constexpr, HAS_TOTAL: tl.constexpr,
        FEATURES_FIRST: tl.constexpr,
    ):  # fmt: skip
        """1x128 quantization along K of one [BLOCK_M, 128] tile (one K block of BLOCK_M rows) of x [M, K].

        HAS_IDX: output row r reads x row idx[r] (a gather; idx < 0 gives a zero row). HAS_TOTAL: rows from
        total[0] on are not needed; programs that start there return at once and leave them unwritten.
        FEATURES_FIRST: program_id(0) walks the K blocks and program_id(1) the rows (else the other way round)."""
        pid_m, pid_k = block_and_chunk(FEATURES_FIRST)
        if HAS_TOTAL:
            if pid_m * BLOCK_M >= tl.load(total_ptr):
                return
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_k = pid_k * 128 + tl.arange(0, 128)
        m_ok = offs_m < M
        k_ok = (offs_k < K)[None, :]
        if HAS_IDX:
            src = tl.load(idx_ptr + offs_m, mask=m_ok, other=-1)
            x = tl.load(x_ptr + src[:, None] * stride_xm + offs_k[None, :] * stride_xk, mask=(src >= 0)[:, None] & k_ok,
                        other=0.0)  # fmt: skip
        else:
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk, mask=m_ok[:, None] & k_ok,
                        other=0.0)  # fmt: skip
        x = x.to(tl.float32)
        q, scale = quantize_along_tl(x, 1, POW2)
        tl.store(q_ptr + offs_m[:, None] * stride_qm + offs_k[None, :] * stride_qk, q, mask=m_ok[:, None] & k_ok)
        tl.store(s_ptr + offs_m * stride_sm + pid_k * stride_sk, scale, mask=m_ok)

    @triton.jit
    def _quant_tokens_kernel(
        x_ptr, xs_ptr, qt_ptr, st_ptr, M, K,
        stride_xm, stride_xk, stride_xsm, stride_xsk, stride_qtk, stride_qtm, stride_stk, stride_stm,
        BLOCK_F: tl.constexpr, FEATURES_FIRST: tl.constexpr, HAS_IN_SCALE: tl.constexpr, POW2: tl.constexpr,
    ):  # fmt: skip
        """1x128 quantization along the token dim M of one [128, BLOCK_F] chunk of x [M, K] (a whole 128-token
        block of BLOCK_F features), written transposed into [K, M]; optionally x is E4M3 with 1x128 scales
        along K and is dequantized in registers first. FEATURES_FIRST: program_id(0) walks the feature chunks
        and program_id(1) the token blocks (else the other way round).

        Narrow chunks keep few registers live, so many programs per SM hide the memory latency (figures:
        docs/kernel_tuning.md)."""
        pid_m, pid_k = block_and_chunk(FEATURES_FIRST)
        offs_m = pid_m * 128 + tl.arange(0, 128)
        offs_k = pid_k * BLOCK_F + tl.arange(0, BLOCK_F)
        m_ok = offs_m < M
        k_ok = offs_k < K
        mask = m_ok[:, None] & k_ok[None, :]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk, mask=mask, other=0.0)
        x = x.to(tl.float32)
        if HAS_IN_SCALE:  # a chunk lies inside one 128-wide K block of the input scales
            xs = tl.load(xs_ptr + offs_m * stride_xsm + (pid_k * BLOCK_F // 128) * stride_xsk, mask=m_ok, other=0.0)
            x = x * xs[:, None]
        q, scale = quantize_along_tl(x, 0, POW2)
        # transposed store by address arithmetic (the compiler moves the bytes through shared memory)
        tl.store(qt_ptr + offs_k[None, :] * stride_qtk + offs_m[:, None] * stride_qtm, q, mask=mask)
        tl.store(st_ptr + offs_k * stride_stk + pid_m * stride_stm, scale, mask=k_ok)

    @triton.jit
    def _quant_128x128_kernel(
        w_ptr, q_ptr, s_ptr, qt_ptr, N, K,
        stride_wn, stride_wk, stride_qn, stride_qk, stride_sn, stride_sk, stride_qtk, stride_qtn,
        POW2: tl.constexpr, TRANSPOSE: tl.constexpr,
    ):  # fmt: skip
        """One 128x128 block of w [N, K]: its codes and scale; with TRANSPOSE also the codes of wᵀ [K, N] (a
        block's transpose shares its scale, so this is the exact `fp8_transpose_128x128` of the result)."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * 128 + tl.arange(0, 128)
        offs_k = pid_k * 128 + tl.arange(0, 128)
        mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk, mask=mask, other=0.0)
        w = w.to(tl.float32)
        scale = scale_from_amax_tl(amax_tl(amax_tl(w, 1), 0), POW2)
        q = divide_by_scale(w, scale, tl.math.div_rn(1.0, scale)).to(tl.float8e4nv)
        tl.store(q_ptr + offs_n[:, None] * stride_qn + offs_k[None, :] * stride_qk, q, mask=mask)
        tl.store(s_ptr + pid_n * stride_sn + pid_k * stride_sk, scale)
        if TRANSPOSE:  # transposed store by address arithmetic
            tl.store(qt_ptr + offs_k[None, :] * stride_qtk + offs_n[:, None] * stride_qtn, q, mask=mask)

    @triton.jit
    def _transpose_fp8_kernel(
        q_ptr, t_ptr, N, K, stride_qg, stride_qn, stride_qk, stride_tg, stride_tk, stride_tn,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TRANS32: tl.constexpr,
    ):  # fmt: skip
        """t[g] = q[g]ᵀ for q [G, N, K] (program_id(2) = g; G = 1 for a plain matrix)."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        g = tl.program_id(2).to(tl.int64)
        q_ptr += g * stride_qg
        t_ptr += g * stride_tg
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


# ----------------------------------------------------------------------------------------------------------
# Launch configuration (the default beside the kernels; a benchmark's sweep or a test overrides it in a block)
# ----------------------------------------------------------------------------------------------------------
# The most fp32 values of one token-dim chunk ([128 tokens, block_f features]) a thread may hold: above it the
# compiled kernel spills registers and compiles for about a minute per variant (16 features on one warp hold 64;
# 128 features on one warp held 512 and took 59.8 s on an H100, docs/kernel_tuning.md).
MAX_TOKEN_CHUNK_VALUES_PER_THREAD = 128


def check_token_chunk_launch(owner: str, block_f: int, warps: int) -> None:
    """Raise ValueError unless a token-dim quantizer's chunk of `block_f` features on `warps` warps is launchable:
    block_f divides 128 (a chunk lies inside one 128-wide K block: input scales, tails) and each thread holds at
    most MAX_TOKEN_CHUNK_VALUES_PER_THREAD values. `owner` names the config fields in the message."""
    if block_f < 1 or BLOCK % block_f:
        raise ValueError(f"{owner}: the features per program must divide {BLOCK}, got {block_f}")
    if warps < 1:
        raise ValueError(f"{owner}: the warps per program must be positive, got {warps}")
    per_thread = BLOCK * block_f // (32 * warps)
    if per_thread > MAX_TOKEN_CHUNK_VALUES_PER_THREAD:
        raise ValueError(
            f"{owner}: {block_f} features x {BLOCK} tokens on {warps} warp(s) put {per_thread} fp32 values in each "
            f"thread, more than {MAX_TOKEN_CHUNK_VALUES_PER_THREAD} (the kernel would spill and compile for a "
            f"minute); use at least {BLOCK * block_f // (32 * MAX_TOKEN_CHUNK_VALUES_PER_THREAD)} warps"
        )


@dataclass(frozen=True)
class QuantConfig:
    """Launch shape of the quantize kernels; every choice gives the same bits (tests/fp8/test_fp8_quant.py).

    The defaults: quantize_1x128_dual runs the row kernel, then the token-dim kernel over narrow chunks (16
    features, one warp, the feature chunks of a token block launched together), which beat every fused one-read
    kernel tried on the H200 and the other chunk shapes and grid orders on the H100; the row kernel launches a row
    block's K blocks together, except where it gathers the routed tokens (docs/kernel_tuning.md)."""

    row_block_m: int = 64  # rows per program of the 1x128 row kernel
    row_features_first: bool = True  # the row kernel's grid walks a row block's K blocks first (x read in place)
    gathered_row_features_first: bool = False  # ... and where it gathers its rows (the routed tokens): rows first
    col_block_f: int = 16  # features per program of the token-dim kernel; divides 128 (fp8/grouped.py has its own)
    col_warps: int = 1  # warps per program of the token-dim kernels
    col_features_first: bool = True  # the token-dim kernel's grid walks a block's feature chunks first
    transpose_block: int = 64  # square tile of the FP8 transpose
    trans32: bool = True  # transpose widened to 32-bit lanes (byte transposes take a slow path)

    def __post_init__(self) -> None:
        check_token_chunk_launch("QuantConfig.col_block_f / col_warps", self.col_block_f, self.col_warps)


QUANT_TUNING: Tuning[QuantConfig] = Tuning("fp8.quant", QuantConfig())


def quantize_1x128_triton(
    x: torch.Tensor, pow2_scales: bool, row_idx: torch.Tensor | None = None, total: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton row kernel of `quantize_1x128`, with an optional fused gather (fp8/grouped.py's routed tokens).

    x [M, K] -> (E4M3 [M, K], fp32 scale [M, KB] with the row index fastest). With `row_idx` (int32 [R]) the
    output has R rows, row r quantizing x[row_idx[r]] (zeros where row_idx < 0); `total` (int32 device scalar
    tensor) leaves rows from total on unwritten."""
    m = row_idx.shape[0] if row_idx is not None else x.shape[0]
    k = x.shape[1]
    q = torch.empty(m, k, device=x.device, dtype=E4M3)
    s = torch.empty(cdiv(k, BLOCK), m, device=x.device, dtype=torch.float32).t()
    if m and k:
        cfg = QUANT_TUNING.current()
        bm = cfg.row_block_m
        features_first = cfg.gathered_row_features_first if row_idx is not None else cfg.row_features_first
        grid, features_first = blocks_by_chunks_grid(cdiv(m, bm), cdiv(k, BLOCK), features_first)
        dummy = s  # placeholder pointer, never read without HAS_IDX / HAS_TOTAL
        _quant_rows_kernel[grid](
            x, q, s, row_idx if row_idx is not None else dummy, total if total is not None else dummy, m, k,
            x.stride(0), x.stride(1), q.stride(0), q.stride(1), s.stride(0), s.stride(1),
            BLOCK_M=bm, POW2=pow2_scales, HAS_IDX=row_idx is not None, HAS_TOTAL=total is not None,
            FEATURES_FIRST=features_first, num_warps=4,
        )  # fmt: skip
    return q, s


def _launch_tokens(
    x: torch.Tensor, x_scale: torch.Tensor | None, pow2_scales: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (E4M3 [K, M], fp32 scale [K, MB] with the row index fastest), 1x128 along M."""
    m, k = x.shape
    qt = torch.empty(k, m, device=x.device, dtype=E4M3)
    st = torch.empty(cdiv(m, BLOCK), k, device=x.device, dtype=torch.float32).t()
    if m and k:
        xs = x_scale if x_scale is not None else st  # placeholder, never read without HAS_IN_SCALE
        cfg = QUANT_TUNING.current()
        bf = cfg.col_block_f  # checked by QuantConfig: divides 128, so a chunk lies inside one K block
        grid, features_first = blocks_by_chunks_grid(cdiv(m, BLOCK), cdiv(k, bf), cfg.col_features_first)
        _quant_tokens_kernel[grid](
            x, xs, qt, st, m, k, x.stride(0), x.stride(1), xs.stride(0), xs.stride(1),
            qt.stride(0), qt.stride(1), st.stride(0), st.stride(1),
            BLOCK_F=bf, FEATURES_FIRST=features_first, HAS_IN_SCALE=x_scale is not None, POW2=pow2_scales,
            num_warps=cfg.col_warps,
        )  # fmt: skip
    return qt, st


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
    return quantize_1x128_triton(x, pow2_scales)


def quantize_1x128_transposed(
    x: torch.Tensor,
    x_scale: torch.Tensor | None = None,
    pow2_scales: bool = False,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused quantize-with-transpose: x [M, K] -> (E4M3 [K, M], fp32 scale [K, ceil(M/128)], stride (1, K)).

    1x128 tiles along the token dim M; no bf16 transpose is ever materialised. With `x_scale`, x is an
    E4M3 tensor with 1x128 scales along K, dequantized in registers first (for a tensor kept only in FP8;
    FP8Linear itself quantizes xᵀ straight from the high-precision x in its forward).
    """
    _check_2d(x, "x")
    _check_in_scale(x, x_scale)
    if not use_triton(x, backend):
        return quantize_1x128_transposed_ref(x, x_scale, pow2_scales)
    return _launch_tokens(x, x_scale, pow2_scales)


def quantize_1x128_dual(
    x: torch.Tensor, pow2_scales: bool = False, *, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both quantizations of x [M, K] that a linear needs for its next GEMMs: (E4M3 [M, K], scale [M, KB])
    along K and (E4M3 [K, M], scale [K, MB]) along the token dim M. On CUDA: the row kernel, then the
    token-dim kernel (faster on the H200 than every fused one-read kernel we tried, see QuantConfig)."""
    _check_2d(x, "x")
    if not use_triton(x, backend):
        q, s = quantize_1x128_ref(x, pow2_scales)
        qt, st = quantize_1x128_ref(x.t(), pow2_scales)
        return q, s, qt, st
    q, s = quantize_1x128_triton(x, pow2_scales)
    qt, st = _launch_tokens(x, None, pow2_scales)
    return q, s, qt, st


def quantize_128x128(
    w: torch.Tensor, pow2_scales: bool = False, *, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (E4M3 [N, K], fp32 scale [ceil(N/128), ceil(K/128)], row-major)."""
    _check_2d(w, "w")
    if not use_triton(w, backend):
        return quantize_128x128_ref(w, pow2_scales)
    return _launch_128x128(w, pow2_scales, transpose=False)[:2]


def quantize_128x128_with_transpose(
    w: torch.Tensor, pow2_scales: bool = False, *, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`quantize_128x128(w)` and its `fp8_transpose_128x128` from one pass over w [N, K]: (E4M3 [N, K], scale
    [NB, KB], E4M3 [K, N], scale view [KB, NB]). For a weight whose FP8 form is cached, so that dgrad's
    transposed operand costs one more byte per parameter instead of a transpose per backward."""
    _check_2d(w, "w")
    if not use_triton(w, backend):
        q, s = quantize_128x128_ref(w, pow2_scales)
        return q, s, *fp8_transpose_128x128_ref(q, s)
    return _launch_128x128(w, pow2_scales, transpose=True)


def _launch_128x128(w: torch.Tensor, pow2_scales: bool, transpose: bool):
    n, k = w.shape
    q = torch.empty(n, k, device=w.device, dtype=E4M3)
    s = torch.empty(cdiv(n, BLOCK), cdiv(k, BLOCK), device=w.device, dtype=torch.float32)
    qt = torch.empty(k, n, device=w.device, dtype=E4M3) if transpose else q  # q: a placeholder, never written
    if n and k:
        _quant_128x128_kernel[(s.shape[0], s.shape[1])](
            w, q, s, qt, n, k, w.stride(0), w.stride(1), q.stride(0), q.stride(1), s.stride(0), s.stride(1),
            qt.stride(0), qt.stride(1), POW2=pow2_scales, TRANSPOSE=transpose, num_warps=8,
        )  # fmt: skip
    return q, s, qt, s.t()


def fp8_transpose_128x128(
    q: torch.Tensor, scale: torch.Tensor, *, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """On-demand transpose of a 128x128-quantized weight: E4M3 [N, K] -> [K, N]; block scales transposed
    with it (a 128x128 block's scale is shared by its transpose, so the result is exact). A stack of weights
    [G, N, K] (scales [G, NB, KB]) transposes each one: -> [G, K, N] and a scale view [G, KB, NB]."""
    if q.dtype != E4M3 or q.dim() not in (2, 3):
        raise TypeError(f"q must be a 2-D or 3-D float8_e4m3fn tensor, got {q.dtype} {tuple(q.shape)}")
    if not use_triton(q, backend):
        return fp8_transpose_128x128_ref(q, scale)
    q3 = q if q.dim() == 3 else q[None]
    g, n, k = q3.shape
    t = torch.empty(g, k, n, device=q.device, dtype=E4M3)
    if n and k and g:
        qu, tu = q3.view(torch.uint8), t.view(torch.uint8)
        cfg = QUANT_TUNING.current()
        bt = cfg.transpose_block
        _transpose_fp8_kernel[(cdiv(n, bt), cdiv(k, bt), g)](
            qu, tu, n, k, qu.stride(0), qu.stride(1), qu.stride(2), tu.stride(0), tu.stride(1), tu.stride(2),
            BLOCK_N=bt, BLOCK_K=bt, TRANS32=cfg.trans32, num_warps=4,
        )  # fmt: skip
    # the GEMMs read scales through strides, so the transposed scale needs no copy
    return (t if q.dim() == 3 else t[0]), scale.transpose(-2, -1)
