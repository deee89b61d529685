"""Dense blockwise FP8 GEMMs (Triton, Hopper-tuned) and their PyTorch references.

`fp8_gemm(a, a_scale, b, b_scale)` computes a·bᵀ [M, N] for E4M3 a [M, K] with 1x128 scales [M, KB] and
E4M3 b [N, K] with 128x128 scales [NB, KB] (forward y = x·Wᵀ and dgrad dx = dy·W with W transposed on
demand). `fp8_gemm_wgrad(a, a_scale, b, b_scale)` is the same product with both operands 1x128-scaled along
the reduction dim (wgrad dW = dyᵀ·x from the token-dim quantized dyᵀ [N, M] and xᵀ [K, M]), fp32 output.

Maths of the kernel, per output tile: acc = Σ_kb dot_fp32(a[:, kb], b[:, kb]) · sa[:, kb] · sb[:, kb], where
each 128-wide K block is multiplied on the tensor cores into a fresh fp32 accumulator and then promoted
into the running fp32 sum with both scales applied in fp32 (DeepSeek-V3's per-block promotion); the output is
cast once at the end. Tails in M, N and K are masked (K tails load zeros, which add nothing). A wgrad with few
output tiles (the shared expert's down projection) splits its token reduction (`wgrad_splits`): each split sums
its K blocks as above into an fp32 partial, and a second kernel adds the partials in split order and rounds once.

Kernels: the Triton kernel here; with `GemmChoice.sm90` set (`GEMM_TUNING.override(sm90=SM90_CONFIG)`), the
Hopper Gluon kernel of `fp8/gemm_sm90.py` on sm_90 GPUs (the same bits, the promotion overlapped with the next
block's wgmma; slower on the H200 as measured, so off by default), except for small M or operands TMA cannot
read. Its tiles: `default_gemm_config(m, kind, out_dtype)` picks a
`GemmConfig` per GEMM kind ("fprop": forward and dgrad; "wgrad", whose fp32 outputs get their own tiles).
`config=` on a call, or `GEMM_TUNING.override(fprop=..., wgrad=..., sm90=...)` around a block of calls (e.g.
through `FP8Linear`), forces one (a `GemmConfig` forces the Triton kernel, a `Sm90GemmConfig` the Gluon one).
"""

from __future__ import annotations

import dataclasses

import torch

from fp8.format import BLOCK, E4M3
from fp8.gemm_sm90 import Sm90GemmConfig, fp8_gemm_sm90, sm90_available
from fp8.quant import dequantize_1x128, dequantize_128x128
from kernels.backend import (
    HAS_TRITON,
    cdiv,
    interpreting,
    num_sms,
    set_descriptor_allocator,
    tl,
    tma_compatible,
    triton,
    use_triton,
)
from kernels.gradient_outputs import check_output
from kernels.tuning import Tuning

if HAS_TRITON:
    from fp8.triton_blocks import b_scale_ptrs, promote, tma_k_loop

__all__ = [
    "GEMM_TUNING",
    "GemmChoice",
    "GemmConfig",
    "default_gemm_config",
    "fp8_gemm",
    "fp8_gemm_ref",
    "fp8_gemm_wgrad",
    "fp8_gemm_wgrad_ref",
    "wgrad_splits",
]


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Tile shape and pipelining of the Triton GEMM (BLOCK_K is fixed at 128, the scale block)."""

    block_m: int = 128
    block_n: int = 128
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 4
    tma: bool = False  # operands through TMA tensor descriptors (needs 16-byte aligned rows)
    persistent: bool = False  # one program per SM looping over output tiles (TMA kernel only)
    warp_specialize: bool = False  # Triton warp specialization of the K loop (TMA kernel only)
    programs_per_sm: int = 1  # persistent grid: min(tiles, SMs · programs_per_sm) programs
    # wgrad only, TMA kernel only (operands or output whose rows TMA cannot address run the pointer kernel, unsplit):
    # the K splits of each output tile (fp32 partials summed in split order by a second kernel); None: `wgrad_splits`
    # of the shape, 1: never split
    split_k: int | None = None
    # TMA kernel only: load the next K block's scales during this block's product (`fp8.triton_blocks.tma_k_loop`;
    # the same bits); on in WGRAD_CONFIG, where it measured faster
    prefetch_scales: bool = False
    # TMA kernel only, unsplit: flatten the persistent tile loop and the K loop into one loop (Triton's
    # `tl.range(flatten=True)`), so that the software pipeliner loads the next tile's first K blocks during this
    # tile's promotion and store; the same bits; off: slower on every Ling shape but one (docs/kernel_tuning.md)
    flatten: bool = False


# The defaults. On the H200 every GEMM of the Ling-mini shapes (attention, dense MLP, shared expert; forward,
# dgrad and a 16-bit wgrad) is fastest with 64x128 tiles of one warpgroup, TMA and a persistent grid of two
# programs per SM: one program's epilogue overlaps the other's K loop, which matters most for the short-K shapes
# (figures: docs/kernel_tuning.md).
FPROP_CONFIG = GemmConfig(block_m=64, block_n=128, group_m=8, num_warps=4, num_stages=4, tma=True, persistent=True,
                          programs_per_sm=2)  # fmt: skip
# With a 16-bit output (the weight's dtype in bf16 training) the same tiles, loading each K block's scales during the
# previous block's product: B's scales are a vector per K block here (1x128 along the tokens), where the prefetch
# measured faster; the forward and dgrad gained nothing from it (docs/kernel_tuning.md)
WGRAD_CONFIG = dataclasses.replace(FPROP_CONFIG, prefetch_scales=True)
# An fp32 output tile doubles the epilogue's shared memory, so two programs no longer fit on an SM (the 64x128
# tiles then ran the wgrad at 363-395 TFLOPS): 128x128 tiles, warp specialization, 3 stages (635-660).
WGRAD_FP32_CONFIG = GemmConfig(block_m=128, block_n=128, group_m=8, num_warps=8, num_stages=3, tma=True,
                               persistent=True, warp_specialize=True)  # fmt: skip
SMALL_M_ROWS = 64  # GEMMs with at most this many rows use SMALL_M_CONFIG
SMALL_M_CONFIG = GemmConfig(block_m=64, block_n=128, num_warps=4, num_stages=4)
INTERPRETER_CONFIG = GemmConfig(block_m=64, block_n=64, group_m=4)  # small tiles keep the CPU interpreter fast
GEMM_KINDS = ("fprop", "wgrad")
# Split-K of the wgrad (`wgrad_splits`): a wgrad whose output tiles leave SMs idle (the shared expert's down
# projection, [2048, 512]: 64-128 tiles) splits its token reduction into as many splits as still fit one wave. The
# SM count is the H100 / H200's, not the device's: the rule depends on the shape only, so do the bits. Splits of
# 8 K blocks ran slower than no split on an H100, splits of 16 as fast or faster (docs/kernel_tuning.md).
SPLIT_K_SMS = 132
SPLIT_K_MIN_BLOCKS = 16
SPLIT_K_MAX = 8
SPLIT_SUM_BLOCK = 1024  # elements per program of the kernel that sums the partials


def wgrad_splits(tiles: int, k_blocks: int, programs_per_sm: int = 1, requested: int | None = None) -> int:
    """The K splits of a wgrad of `tiles` output tiles over `k_blocks` K blocks, for a kernel of `programs_per_sm`
    resident programs: `requested` (a config's split_k), else as many as keep tiles · splits within one wave of
    SPLIT_K_SMS · programs_per_sm programs, at most SPLIT_K_MAX and at least SPLIT_K_MIN_BLOCKS K blocks each;
    then trimmed so that no split is empty (every split gets ceil(k_blocks / splits) blocks but the last)."""
    if requested is None:
        requested = min(SPLIT_K_SMS * programs_per_sm // max(tiles, 1), k_blocks // SPLIT_K_MIN_BLOCKS, SPLIT_K_MAX)
    splits = max(1, min(requested, k_blocks))
    return cdiv(k_blocks, cdiv(k_blocks, splits))


def default_gemm_config(m: int, kind: str, out_dtype: torch.dtype = torch.bfloat16) -> GemmConfig:
    """The tiles of a GEMM `kind` in GEMM_KINDS ("fprop": forward and dgrad) with m output rows in out_dtype."""
    if kind not in GEMM_KINDS:
        raise ValueError(f"kind must be one of {GEMM_KINDS}, got {kind!r}")
    if interpreting():
        return INTERPRETER_CONFIG
    if m <= SMALL_M_ROWS:
        return SMALL_M_CONFIG
    if kind == "wgrad":
        return WGRAD_FP32_CONFIG if out_dtype.itemsize == 4 else WGRAD_CONFIG
    return FPROP_CONFIG


@dataclasses.dataclass(frozen=True)
class GemmChoice:
    """A config forced on every GEMM of a kind, whatever its shape (a Triton `GemmConfig` or the Hopper Gluon
    kernel's `Sm90GemmConfig`); None: the default. `sm90`: the Gluon kernel's tiles for every GEMM on an sm_90
    GPU whose operands it can read; None (the default): the Triton kernel everywhere. Off by default because on
    the H200 the Gluon kernel ran the Ling shapes at 0.87-0.96x the Triton kernel's speed (same bits; the step
    0.94x BF16 with it against about 1.0x without: docs/benchmarks.md, 2026-12-05)."""

    fprop: GemmConfig | Sm90GemmConfig | None = None  # forward and dgrad
    wgrad: GemmConfig | Sm90GemmConfig | None = None
    sm90: Sm90GemmConfig | None = None
    # as `sm90`, for the forward and dgrad only (fp8.gemm_kernel=gluon_ws: the warp-specialised kernel, slower on
    # the wgrad as measured)
    sm90_fprop: Sm90GemmConfig | None = None


GEMM_TUNING: Tuning[GemmChoice] = Tuning("fp8.gemm", GemmChoice())
AnyGemmConfig = GemmConfig | Sm90GemmConfig


def _config(a: torch.Tensor, b: torch.Tensor, kind: str, config: AnyGemmConfig | None,
            out_dtype: torch.dtype) -> AnyGemmConfig:  # fmt: skip
    """The call's `config`, else the kind's forced config of GEMM_TUNING, else the Gluon kernel (`sm90`, or
    `sm90_fprop` for the forward and dgrad) on an sm_90 GPU for TMA-readable operands of more than SMALL_M_ROWS
    rows, else the Triton default for the shape."""
    choice = GEMM_TUNING.current()
    forced = config or getattr(choice, kind)
    if forced is not None:
        return forced
    m = a.shape[0]
    sm90 = choice.sm90 or (choice.sm90_fprop if kind == "fprop" else None)
    if sm90 is not None and m > SMALL_M_ROWS and sm90_available(a) and tma_compatible(a, b):
        return sm90
    return default_gemm_config(m, kind, out_dtype)


# ----------------------------------------------------------------------------------------------------------
# References: dequantize, multiply in fp32 (CPU) - the same maths up to fp32 summation order.
# ----------------------------------------------------------------------------------------------------------
def fp8_gemm_ref(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, out_dtype=torch.bfloat16
) -> torch.Tensor:
    """a [M, K] E4M3 (1x128 scales [M, KB]) · b [N, K] E4M3 (128x128 scales [NB, KB])ᵀ -> [M, N] out_dtype."""
    return (dequantize_1x128(a, a_scale) @ dequantize_128x128(b, b_scale).t()).to(out_dtype)


def fp8_gemm_wgrad_ref(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, out_dtype=torch.float32
) -> torch.Tensor:
    """a [M, K] (1x128 scales [M, KB]) · b [N, K] (1x128 scales [N, KB])ᵀ -> [M, N] (fp32 by default)."""
    return (dequantize_1x128(a, a_scale) @ dequantize_1x128(b, b_scale).t()).to(out_dtype)


# ----------------------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _tile_coords(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """Grouped ordering of output tiles: GROUP_M row-tiles share each B column-tile while it is hot in L2."""
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        num_pid_in_group = GROUP_M * num_pid_n
        first_pid_m = (tile // num_pid_in_group) * GROUP_M
        group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
        pid_m = first_pid_m + ((tile % num_pid_in_group) % group_size_m)
        pid_n = (tile % num_pid_in_group) // group_size_m
        return pid_m, pid_n

    @triton.jit
    def _fp8_gemm_kernel(
        a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr,
        M, N, K,
        stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
        stride_asm, stride_ask, stride_bsn, stride_bsk,
        B_BLOCKWISE: tl.constexpr, EVEN_K: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
    ):  # fmt: skip
        """One output tile per program; operands through pointer loads (any strides, K tails masked)."""
        BLOCK_K: tl.constexpr = 128
        pid_m, pid_n = _tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # wrap out-of-range rows onto valid ones so the main loop needs no M/N masks (their results are
        # never stored)
        offs_am = offs_m % M
        offs_bn = offs_n % N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + offs_am[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + offs_bn[:, None] * stride_bn + offs_k[None, :] * stride_bk
        as_ptrs = as_ptr + offs_am * stride_asm
        bs_ptrs = b_scale_ptrs(bs_ptr, pid_n, offs_bn, stride_bsn, B_BLOCKWISE, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                k_ok = offs_k < K - kb * BLOCK_K
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[None, :], other=0.0)
            sa = tl.load(as_ptrs + kb * stride_ask)
            sb = tl.load(bs_ptrs + kb * stride_bsk)
            acc = promote(acc, tl.dot(a, tl.trans(b)), sa, sb, B_BLOCKWISE and BLOCK_N == 128)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk

        c = acc.to(c_ptr.dtype.element_ty)
        c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, c, mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])

    @triton.jit
    def _fp8_gemm_tma_kernel(
        a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, ws_ptr,
        M, N, K,
        stride_am, stride_bn, stride_cm, stride_asm, stride_ask, stride_bsn, stride_bsk,
        B_BLOCKWISE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
        NUM_PROGRAMS: tl.constexpr, WS: tl.constexpr, SPLIT_K: tl.constexpr, PREFETCH: tl.constexpr,
        FLATTEN: tl.constexpr,
    ):  # fmt: skip
        """Same maths as `_fp8_gemm_kernel`; tiles move by TMA (zero-filled out of bounds, so K tails need no
        masks) and, with NUM_PROGRAMS < #work items, each program loops over them (persistent grid). The TMA
        descriptors are built here, once per program (host-built ones cost every launch a Python pass and a
        driver call per descriptor). With SPLIT_K > 1 a work item is (tile, split): split s sums K blocks
        [s·ceil(KB/SPLIT_K), ...) into its own fp32 partial, stored at ws [SPLIT_K, M, N] for `_sum_splits_kernel`."""
        BLOCK_K: tl.constexpr = 128
        a_desc = tl.make_tensor_descriptor(a_ptr, [M, K], [stride_am, 1], [BLOCK_M, BLOCK_K])
        b_desc = tl.make_tensor_descriptor(b_ptr, [N, K], [stride_bn, 1], [BLOCK_N, BLOCK_K])
        if SPLIT_K == 1:
            c_desc = tl.make_tensor_descriptor(c_ptr, [M, N], [stride_cm, 1], [BLOCK_M, BLOCK_N])
        num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        num_kb = tl.cdiv(K, BLOCK_K)
        split_kb = tl.cdiv(num_kb, SPLIT_K)  # K blocks per split (the last split may have fewer)
        for item in tl.range(tl.program_id(0), num_tiles * SPLIT_K, NUM_PROGRAMS, flatten=FLATTEN):
            if SPLIT_K == 1:
                tile = item
                kb0 = 0
                split_blocks = num_kb
            else:
                tile = item % num_tiles
                split = item // num_tiles
                kb0 = split * split_kb
                split_blocks = tl.minimum(split_kb, num_kb - kb0)
            pid_m, pid_n = _tile_coords(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            offs_am = (off_m + tl.arange(0, BLOCK_M)) % M
            offs_bn = (off_n + tl.arange(0, BLOCK_N)) % N
            as_ptrs = as_ptr + offs_am * stride_asm + kb0 * stride_ask
            bs_ptrs = b_scale_ptrs(bs_ptr, pid_n, offs_bn, stride_bsn, B_BLOCKWISE, BLOCK_N) + kb0 * stride_bsk
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc = tma_k_loop(acc, a_desc, b_desc, off_m, off_n, kb0 * BLOCK_K, split_blocks, as_ptrs, stride_ask,
                             bs_ptrs, stride_bsk, B_BLOCKWISE and BLOCK_N == 128, WS, PREFETCH)  # fmt: skip
            if SPLIT_K == 1:
                c_desc.store([off_m, off_n], acc.to(c_desc.dtype))
            else:
                offs_m = off_m + tl.arange(0, BLOCK_M)
                offs_n = off_n + tl.arange(0, BLOCK_N)
                ws_ptrs = ws_ptr + split.to(tl.int64) * M * N + offs_m[:, None] * N + offs_n[None, :]
                tl.store(ws_ptrs, acc, mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])

    @triton.jit
    def _sum_splits_kernel(ws_ptr, c_ptr, MN, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
        """c [M, N] (contiguous) = Σ_s ws[s] over the SPLIT_K fp32 partials [SPLIT_K, M, N], in split order,
        rounded once to c's dtype."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < MN
        acc = tl.load(ws_ptr + offs, mask=mask)
        for s in tl.static_range(1, SPLIT_K):
            acc += tl.load(ws_ptr + s * MN + offs, mask=mask)
        tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=mask)


def _check_operands(a, a_scale, b, b_scale, b_blockwise: bool) -> tuple[int, int, int]:
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"a and b must be 2-D, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != E4M3 or b.dtype != E4M3:
        raise TypeError(f"a and b must be float8_e4m3fn, got {a.dtype} and {b.dtype}")
    m, k = a.shape
    n, k2 = b.shape
    if k != k2:
        raise ValueError(f"reduction dims differ: a is [M={m}, K={k}], b is [N={n}, K={k2}]")
    kb = cdiv(k, BLOCK)
    want_b = (cdiv(n, BLOCK), kb) if b_blockwise else (n, kb)
    if tuple(a_scale.shape) != (m, kb):
        raise ValueError(f"a_scale must be [M, ceil(K/128)] = {(m, kb)}, got {tuple(a_scale.shape)}")
    if tuple(b_scale.shape) != want_b:
        raise ValueError(f"b_scale must be {want_b}, got {tuple(b_scale.shape)}")
    if a_scale.dtype != torch.float32 or b_scale.dtype != torch.float32:
        raise TypeError(f"scales must be float32, got {a_scale.dtype} and {b_scale.dtype}")
    if a.device != b.device:
        raise ValueError(f"a on {a.device}, b on {b.device}")
    return m, n, k


def _launch(a, a_scale, b, b_scale, out_dtype, b_blockwise: bool, cfg: AnyGemmConfig,
            out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    m, n, k = a.shape[0], b.shape[0], a.shape[1]
    c = torch.empty(m, n, device=a.device, dtype=out_dtype) if out is None else out
    if m == 0 or n == 0:
        return c
    if k == 0:
        return c.zero_()
    if isinstance(cfg, Sm90GemmConfig):
        if sm90_available(a) and tma_compatible(a, b, c):
            return fp8_gemm_sm90(a, a_scale, b, b_scale, out_dtype, b_blockwise=b_blockwise, config=cfg, out=c)
        # not an sm_90 GPU (the interpreter included), or an operand TMA cannot read or write: the Triton kernel
        cfg = default_gemm_config(m, "fprop" if b_blockwise else "wgrad", out_dtype)
    if cfg.tma and tma_compatible(a, b, c):
        tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
        splits = 1 if b_blockwise else wgrad_splits(tiles, cdiv(k, BLOCK), cfg.programs_per_sm, cfg.split_k)
        items = tiles * splits
        progs = min(items, num_sms(a.device) * cfg.programs_per_sm) if cfg.persistent else items
        ws = c if splits == 1 else torch.empty(splits, m, n, device=a.device, dtype=torch.float32)
        set_descriptor_allocator()
        _fp8_gemm_tma_kernel[(progs,)](
            a, b, c, a_scale, b_scale, ws, m, n, k, a.stride(0), b.stride(0), c.stride(0),
            a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1),
            B_BLOCKWISE=b_blockwise, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP_M=cfg.group_m,
            NUM_PROGRAMS=progs, WS=cfg.warp_specialize, SPLIT_K=splits, PREFETCH=cfg.prefetch_scales,
            FLATTEN=cfg.flatten and splits == 1, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
        if splits > 1:
            _sum_splits_kernel[(cdiv(m * n, SPLIT_SUM_BLOCK),)](ws, c, m * n, SPLIT_K=splits, BLOCK=SPLIT_SUM_BLOCK)
        return c
    grid = (cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n),)
    _fp8_gemm_kernel[grid](
        a, b, c, a_scale, b_scale, m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1),
        B_BLOCKWISE=b_blockwise, EVEN_K=(k % BLOCK == 0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return c


def fp8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    backend: str | None = None,
    config: AnyGemmConfig | None = None,
) -> torch.Tensor:
    """a·bᵀ [M, N] in out_dtype: a [M, K] E4M3 with 1x128 scales [M, ceil(K/128)] (any strides),
    b [N, K] E4M3 with 128x128 scales [ceil(N/128), ceil(K/128)]; fp32 accumulation, scales per K block.
    `config`: the Triton kernel's tiles (default: see the module doc)."""
    _check_operands(a, a_scale, b, b_scale, b_blockwise=True)
    if not use_triton(a, backend):
        return fp8_gemm_ref(a, a_scale, b, b_scale, out_dtype)
    return _launch(a, a_scale, b, b_scale, out_dtype, True, _config(a, b, "fprop", config, out_dtype))


def fp8_gemm_wgrad(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
    *,
    backend: str | None = None,
    config: AnyGemmConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """a·bᵀ [M, N] with both operands 1x128-scaled along the reduction dim: a [M, K] scale [M, KB],
    b [N, K] scale [N, KB] (wgrad: a = dyᵀ [N_out, tokens], b = xᵀ [K_in, tokens]); fp32 output.
    `config`: the Triton kernel's tiles (default: see the module doc); `out`: a contiguous [M, N] tensor of
    out_dtype to write the result into (returned)."""
    m, n, _ = _check_operands(a, a_scale, b, b_scale, b_blockwise=False)
    if out is not None:
        check_output(out, (m, n), out_dtype, a.device)
    if not use_triton(a, backend):
        ref = fp8_gemm_wgrad_ref(a, a_scale, b, b_scale, out_dtype)
        return ref if out is None else out.copy_(ref)
    return _launch(a, a_scale, b, b_scale, out_dtype, False, _config(a, b, "wgrad", config, out_dtype), out)
