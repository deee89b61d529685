"""Grouped blockwise FP8 GEMMs for MoE experts (Triton) with their PyTorch references, the quantizers and SwiGLU
kernels around them, and the FP8 grouped-experts autograd function (the row gather and ordered sum of dispatch
and combine it uses are kernels/rows.py's).

Layout (`GroupedRows`): the M rows of an activation are sorted into contiguous per-expert segments; segment g
is rows offsets[g] : offsets[g + 1] (any length, 0 included). Rows from offsets[G] to M are unused (the
dispatch allocates a static upper bound so that nothing waits for the host): kernels never read their
results and may leave them unwritten. `offsets` lives on the device; every kernel walks it there (a
persistent grid over a tile → expert table found by binary search), so no launch needs a host round trip.

Recipe (the same as `fp8/gemm.py`): E4M3, fp32 scales per block, fp32 accumulation with both scales applied
per 128-wide K block.
- forward / dgrad, `grouped_gemm`: out[seg g] = a[seg g] · b[g]ᵀ with a 1x128-scaled along K ([M, KB]) and the
  expert weights b [G, N, K] 128x128-scaled ([G, NB, KB]); dgrad uses the on-demand transpose of b.
- wgrad, `grouped_gemm_wgrad`: out[g] = Σ over segment g's tokens of a[:, t] · b[:, t]ᵀ, a k-grouped GEMM (the
  reduction runs over each expert's tokens). Its operands are quantized 1x128 along the token dim with blocks
  that restart at every segment start (`quantize_tokens_grouped`) and are stored block-aligned: segment g owns
  token blocks blocks[g] : blocks[g + 1] (`GroupedRows.block_offsets()`), and block b is columns 128·b : 128·b + 128
  of a [N, 128·max_blocks] operand, its tokens first and zeros after them (a segment's last block is partial).
  So segments need no 128-alignment in the rows, yet every K block of the wgrad GEMM is one whole aligned
  128-column box: one TMA descriptor per operand serves every expert and no load needs a mask.

The experts' function `fp8_grouped_experts` fuses the permutation gather into the quantization of the routed
tokens, the SwiGLU and the gate multiply into the down projection's input quantization (y = W_down·(g·a) is
the same as g·(W_down·a), and its gradient needs only the 512-wide row dot <d(g·a), a>), and the combine into
one ordered gather-sum (deterministic, no atomics). Saved for backward: xᵀ in FP8 (gate-up wgrad operand) and
the SwiGLU input h in FP8 (DeepSeek-V3's choice); a = SwiGLU(h) is recomputed in backward.

`wgrad="bf16"` (config `fp8.expert_wgrad`, off by default: a departure from the blockwise recipe) computes the two
weight gradients from high-precision operands instead (`grouped_wgrad_bf16`: torch._grouped_mm on CUDA, fp32
accumulation): dW_down[e] = Σ dy_rᵀ a_r and dW_gate_up[e] = Σ dh_rᵀ x_r over expert e's rows, with a recomputed
from the FP8 h in the activations' dtype (`swiglu_output`). The forward then saves the tokens x [T, H] in their
own dtype instead of the per-row FP8 xᵀ [H, M] (M = T·k rows), and no token-dim quantization runs at all.

Kernels: the Triton kernels here, and the Hopper Gluon kernel of `fp8/gemm_sm90.py` on sm_90 GPUs (the same bits,
each K block's promotion overlapped with the next block's wgmma) where its tiles fit and TMA can read the operands:
by default for the wgrad of short expert segments (`GroupedConfig.sm90_wgrad`, at most
`GroupedConfig.sm90_wgrad_max_blocks` token blocks per expert on average, where it measured faster), with
`GroupedConfig.sm90` set for all three GEMMs (slower forward/dgrad as measured, so off by default).

Launch configuration: `GroupedConfig` (the Gluon tiles, the Triton GEMM tiles per kind and the SwiGLU kernels' row
blocks), its default beside the kernels; `GROUPED_TUNING.override(fprop=GroupedGemmConfig(...))` forces other
Triton tiles inside a block, `override(sm90=SM90_CONFIG)` the Gluon kernels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from fp8.format import BLOCK, E4M3
from fp8.gemm_sm90 import (
    SM90_SMALL_TILES,
    Sm90GemmConfig,
    grouped_gemm_sm90,
    grouped_gemm_wgrad_sm90,
    sm90_available,
)
from fp8.quant import (
    check_token_chunk_launch,
    dequantize_1x128,
    dequantize_128x128,
    fp8_transpose_128x128,
    quantize_1x128_ref,
    quantize_1x128_triton,
    quantize_128x128,
)
from kernels.backend import (
    HAS_TRITON,
    blocks_by_chunks_grid,
    cdiv,
    num_sms,
    set_descriptor_allocator,
    tl,
    tma_compatible,
    triton,
    use_triton,
)
from kernels.fusable import Fusable
from kernels.gradient_outputs import GRADIENT_OUTPUTS, check_output
from kernels.rows import gather_rows, gather_rows_ref, sum_rows
from kernels.tuning import Tuning

if HAS_TRITON:
    from triton.tools.tensor_descriptor import TensorDescriptor

    from fp8.triton_blocks import b_scale_ptrs, block_and_chunk, promote, quantize_along_tl, tma_k_loop

__all__ = [
    "GroupedRows",
    "GroupedGemmConfig",
    "GroupedConfig",
    "GROUPED_TUNING",
    "grouped_gemm",
    "grouped_gemm_ref",
    "grouped_gemm_wgrad",
    "grouped_gemm_wgrad_ref",
    "wgrad_sm90_config",
    "quantize_rows_gathered",
    "quantize_tokens_grouped",
    "quantize_tokens_grouped_ref",
    "token_columns",
    "swiglu_quantize",
    "swiglu_backward",
    "fp8_grouped_experts",
    "quantize_expert_weights",
    "swiglu_quantize_tokens",
    "swiglu_output",
    "grouped_wgrad_bf16",
    "EXPERT_WGRAD",
]


# ----------------------------------------------------------------------------------------------------------
# Segments
# ----------------------------------------------------------------------------------------------------------
@dataclass
class GroupedRows:
    """M rows sorted into G contiguous segments: segment g is rows offsets[g] : offsets[g + 1].

    offsets: int32 [G + 1] on the rows' device, non-decreasing, offsets[0] == 0, offsets[G] <= num_rows.
    num_rows: M, the allocated rows (a static bound; rows >= offsets[G] are unused).
    alignment: every offsets[g] is a multiple of this (a promise the kernels use for vector loads; 1 = none).
    data_lengths: optional int [G]: only the first data_lengths[g] rows of segment g carry data, the rest are
    zero rows (routing-map padding). The kernels need not know (zero rows add nothing); the host-loop
    references skip those rows, so that their matmul shapes, and hence their bits, do not depend on padding.
    """

    offsets: torch.Tensor
    num_rows: int
    alignment: int = 1
    data_lengths: torch.Tensor | None = None
    _tables: dict = field(default_factory=dict, repr=False)

    @property
    def num_groups(self) -> int:
        return self.offsets.numel() - 1

    @property
    def total(self) -> torch.Tensor:
        """int32 [1] device view of offsets[G]: the number of rows in use."""
        return self.offsets[-1:]

    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def block_offsets(self, block: int = BLOCK) -> torch.Tensor:
        """int32 [G + 1]: exclusive prefix sum of cdiv(len_g, block): segment g owns blocks (tiles) b[g]:b[g+1].
        Computed on the device (no sync) once per block size."""
        if block not in self._tables:
            counts = torch.div(self.lengths() + (block - 1), block, rounding_mode="floor")
            table = torch.zeros(self.num_groups + 1, dtype=torch.int32, device=self.offsets.device)
            table[1:] = torch.cumsum(counts, 0)
            self._tables[block] = table
        return self._tables[block]

    def block_groups(self, block: int = BLOCK) -> torch.Tensor:
        """int32 [max_blocks(block)]: the segment owning each block (G past the used blocks), so that a kernel
        with one program per block finds its segment with one load instead of a binary search. On the device,
        once per block size."""
        key = ("groups", block)
        if key not in self._tables:
            table = self.block_offsets(block)
            ids = torch.arange(self.max_blocks(block), device=table.device, dtype=torch.int32)
            # the last g with table[g] <= b: among empty segments' equal entries, the non-empty one after them
            self._tables[key] = torch.searchsorted(table, ids, right=True, out_int32=True) - 1
        return self._tables[key]

    def max_blocks(self, block: int = BLOCK) -> int:
        """A host-side bound on block_offsets(block)[G]: each segment adds at most one partial block."""
        return cdiv(self.num_rows, block) + self.num_groups

    def host_segments(self) -> list[tuple[int, int]]:
        """(first row, end of the data rows) of each segment, on the host (a sync: the reference path only)."""
        offs = self.offsets.tolist()
        ends = offs[1:] if self.data_lengths is None else [o + n for o, n in zip(offs, self.data_lengths.tolist())]
        return list(zip(offs[:-1], ends))


def _check_rows(rows: GroupedRows, m: int, name: str) -> None:
    if rows.num_rows != m:
        raise ValueError(f"{name} has {m} rows but the GroupedRows layout has num_rows={rows.num_rows}")
    if rows.offsets.dtype != torch.int32 or rows.offsets.dim() != 1:
        raise TypeError(f"GroupedRows.offsets must be a 1-D int32 tensor, got {rows.offsets.dtype} "
                        f"{tuple(rows.offsets.shape)}")  # fmt: skip


def _search_steps(groups: int) -> int:
    return max(1, math.ceil(math.log2(max(groups, 2))))


# ----------------------------------------------------------------------------------------------------------
# References (CPU path and tests): loops over segments on the host
# ----------------------------------------------------------------------------------------------------------
def quantize_tokens_grouped_ref(
    x: torch.Tensor, rows: GroupedRows, row_idx: torch.Tensor | None = None, pow2_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of `quantize_tokens_grouped`: (E4M3 [K, 128·max_blocks], fp32 scale [K, max_blocks]) with 1x128
    blocks along the token dim restarting at every segment start, block-aligned (module docstring). Unused
    columns are zero."""
    src = gather_rows_ref(x, row_idx).float()
    k = src.shape[1]
    qt = torch.zeros(k, rows.max_blocks() * BLOCK, dtype=E4M3, device=x.device)
    st = torch.zeros(rows.max_blocks(), k, dtype=torch.float32, device=x.device).t()
    blocks = rows.block_offsets().tolist()
    for g, (lo, hi) in enumerate(rows.host_segments()):
        if hi > lo:  # zero pad rows would not change a block's scale and quantize to zeros
            q, s = quantize_1x128_ref(src[lo:hi].t(), pow2_scales)
            qt[:, blocks[g] * BLOCK:blocks[g] * BLOCK + hi - lo] = q
            st[:, blocks[g]:blocks[g] + s.shape[1]] = s
    return qt, st


def token_columns(rows: GroupedRows, g: int, length: int) -> slice:
    """The columns of a block-aligned token-dim operand holding the first `length` tokens of segment g (host)."""
    start = int(rows.block_offsets()[g]) * BLOCK
    return slice(start, start + length)


def grouped_gemm_ref(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, rows: GroupedRows,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:  # fmt: skip
    """out[seg g] = deq(a[seg g]) · deq(b[g])ᵀ in fp32; unused rows are zero. a [M, K], b [G, N, K]."""
    out = torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
    for g, (lo, hi) in enumerate(rows.host_segments()):
        if hi > lo:
            out[lo:hi] = (dequantize_1x128(a[lo:hi], a_scale[lo:hi]) @ dequantize_128x128(b[g], b_scale[g]).t()).to(
                out_dtype
            )
    return out


def grouped_gemm_wgrad_ref(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, rows: GroupedRows,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # fmt: skip
    """out[g] = deq(a[:, seg g]) · deq(b[:, seg g])ᵀ over segment g's data tokens; a [N, 128·max_blocks] and
    b [K, 128·max_blocks] block-aligned token-dim operands (`quantize_tokens_grouped`)."""
    n, k = a.shape[0], b.shape[0]
    out = torch.zeros(rows.num_groups, n, k, dtype=out_dtype, device=a.device)
    blocks = rows.block_offsets().tolist()
    for g, (lo, hi) in enumerate(rows.host_segments()):
        if hi > lo:
            nb = cdiv(hi - lo, BLOCK)
            cols = slice(blocks[g] * BLOCK, blocks[g] * BLOCK + hi - lo)
            sa, sb = a_scale[:, blocks[g]:blocks[g] + nb], b_scale[:, blocks[g]:blocks[g] + nb]
            out[g] = (dequantize_1x128(a[:, cols], sa) @ dequantize_1x128(b[:, cols], sb).t()).to(out_dtype)
    return out


def _silu(g: torch.Tensor) -> torch.Tensor:
    return g / (1.0 + torch.exp(-g))


def _swiglu_output(h_q: torch.Tensor, h_s: torch.Tensor, row_gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """a = silu(h_gate)·h_up·row_gate [M, I] in fp32 from the FP8 SwiGLU input h_q [M, 2I] (1x128 scales h_s),
    rounded to `dtype`: the down projection's input before its quantization. Plain torch ops; `compiled=True`
    fuses them into one kernel (`dynamic=None`: the expert-parallel receiver's row count changes every call)."""
    h = dequantize_1x128(h_q, h_s)
    inter = h.shape[1] // 2
    return (_silu(h[:, :inter]) * h[:, inter:] * row_gate.float()[:, None]).to(dtype)


swiglu_output = Fusable(_swiglu_output, dynamic=None)


def grouped_wgrad_bf16_ref(a: torch.Tensor, b: torch.Tensor, rows: GroupedRows, out_dtype: torch.dtype) -> torch.Tensor:
    """Reference of `grouped_wgrad_bf16`: out[g] = a[seg g]ᵀ · b[seg g] in fp32 over each segment's data rows
    (pad rows left out, so that the shapes, and hence the bits, do not depend on padding); empty segments give
    zeros. a [M, N], b [M, K] → [G, N, K]."""
    out = torch.zeros(rows.num_groups, a.shape[1], b.shape[1], dtype=out_dtype, device=a.device)
    for g, (lo, hi) in enumerate(rows.host_segments()):
        if hi > lo:
            out[g] = (a[lo:hi].float().t() @ b[lo:hi].float()).to(out_dtype)
    return out


def swiglu_quantize_ref(h: torch.Tensor, row_gate: torch.Tensor, pow2_scales: bool = False):
    """a = silu(h_gate)·h_up·row_gate in fp32, quantized 1x128 → (a_q, a_s, h_q, h_s); h_q = quantize_1x128(h)."""
    inter = h.shape[1] // 2
    hf = h.float()
    a = _silu(hf[:, :inter]) * hf[:, inter:] * row_gate.float()[:, None]
    return (*quantize_1x128_ref(a, pow2_scales), *quantize_1x128_ref(h, pow2_scales))


def swiglu_backward_ref(h_q, h_s, da, row_gate, pow2_scales: bool = False):
    """From the FP8 SwiGLU input h and da = d(g·a): (dh [M, 2I] in da's dtype, dh_q, dh_s, d_gate fp32 [M])."""
    h = dequantize_1x128(h_q, h_s)
    inter = h.shape[1] // 2
    g, u = h[:, :inter], h[:, inter:]
    s = 1.0 / (1.0 + torch.exp(-g))
    silu = g * s
    da32 = da.float()
    d_gate = (da32 * silu * u).sum(1)
    da0 = da32 * row_gate.float()[:, None]
    dh = torch.cat([da0 * u * (s + silu * (1.0 - s)), da0 * silu], dim=1).to(da.dtype)
    return (dh, *quantize_1x128_ref(dh, pow2_scales), d_gate)


# ----------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _find_group(table_ptr, x, G, STEPS: tl.constexpr):
        """The largest g in [0, G) with table[g] <= x for a non-decreasing table (table[0] <= x < table[G]):
        the non-empty segment that owns item x."""
        lo = x * 0
        hi = lo + G
        for _ in tl.static_range(STEPS):
            mid = (lo + hi) // 2
            right = tl.load(table_ptr + mid) <= x
            lo = tl.where(right, mid, lo)
            hi = tl.where(right, hi, mid)
        return lo

    @triton.jit
    def _grouped_gemm_kernel(
        a_ptr, a_desc, b_ptr, b_desc, c_ptr, as_ptr, bs_ptr, offs_ptr, tiles_ptr,
        M, N, K, G,
        stride_am, stride_ak, stride_bg, stride_bn, stride_bk, stride_cm, stride_cn,
        stride_asm, stride_ask, stride_bsg, stride_bsn, stride_bsk,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_PROGRAMS: tl.constexpr, STEPS: tl.constexpr,
        TMA: tl.constexpr, WS: tl.constexpr, EVEN_K: tl.constexpr, PREFETCH: tl.constexpr, FLATTEN: tl.constexpr,
    ):  # fmt: skip
        """Persistent grid over the (expert, row tile, column tile) table; expert g owns the tile ids
        tiles[g]·nN : tiles[g+1]·nN, row tiles fastest so neighbouring programs share g's weight tile. With
        TMA the K loop is `tma_k_loop` over host-built descriptors (b as its [G·N, K] rows); else pointer loads (any
        strides, K tails masked). Descriptors built on the device, as the other TMA kernels do, made this kernel
        about 10 % slower on the H200 (docs/kernel_tuning.md). FLATTEN: one flattened loop over (tile, K block)."""
        BLOCK_K: tl.constexpr = 128
        num_n = tl.cdiv(N, BLOCK_N)
        num_tiles = tl.load(tiles_ptr + G) * num_n
        num_kb = tl.cdiv(K, BLOCK_K)
        for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, flatten=FLATTEN):
            g = _find_group(tiles_ptr, tile // num_n, G, STEPS)
            t0 = tl.load(tiles_ptr + g)
            mt = tl.load(tiles_ptr + g + 1) - t0
            local = tile - t0 * num_n
            pid_n = local // mt
            seg_end = tl.load(offs_ptr + g + 1)
            row0 = tl.load(offs_ptr + g) + (local % mt) * BLOCK_M
            n0 = pid_n * BLOCK_N
            offs_m = row0 + tl.arange(0, BLOCK_M)
            offs_n = n0 + tl.arange(0, BLOCK_N)
            offs_am = tl.minimum(offs_m, M - 1).to(tl.int64)  # rows past the segment are computed, never stored
            offs_bn = offs_n % N
            as_ptrs = as_ptr + offs_am * stride_asm
            bs_ptrs = b_scale_ptrs(bs_ptr + g * stride_bsg, pid_n, offs_bn, stride_bsn, True, BLOCK_N)
            offs_k = tl.arange(0, BLOCK_K)
            a_ptrs = a_ptr + offs_am[:, None] * stride_am + offs_k[None, :] * stride_ak
            b_ptrs = b_ptr + g.to(tl.int64) * stride_bg + offs_bn[:, None] * stride_bn + offs_k[None, :] * stride_bk
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if TMA:
                acc = tma_k_loop(acc, a_desc, b_desc, row0, g * N + n0, 0, num_kb, as_ptrs, stride_ask, bs_ptrs,
                                 stride_bsk, BLOCK_N == 128, WS, PREFETCH)  # fmt: skip
            else:
                for kb in tl.range(0, num_kb):
                    if EVEN_K:
                        a = tl.load(a_ptrs + kb * BLOCK_K * stride_ak)
                        b = tl.load(b_ptrs + kb * BLOCK_K * stride_bk)
                    else:
                        k_ok = offs_k < K - kb * BLOCK_K
                        a = tl.load(a_ptrs + kb * BLOCK_K * stride_ak, mask=k_ok[None, :], other=0.0)
                        b = tl.load(b_ptrs + kb * BLOCK_K * stride_bk, mask=k_ok[None, :], other=0.0)
                    sa = tl.load(as_ptrs + kb * stride_ask)
                    sb = tl.load(bs_ptrs + kb * stride_bsk)
                    acc = promote(acc, tl.dot(a, tl.trans(b)), sa, sb, BLOCK_N == 128)
            c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m < seg_end)[:, None] & (offs_n < N)[None, :])

    @triton.jit
    def _grouped_wgrad_kernel(
        a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, blk_ptr,
        N, K, G, COLS,
        stride_an, stride_am, stride_bk, stride_bm, stride_cg, stride_cn, stride_ck,
        stride_asn, stride_asb, stride_bsk, stride_bsb,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_PROGRAMS: tl.constexpr, TMA: tl.constexpr,
        TMA_STORE: tl.constexpr, PREFETCH: tl.constexpr,
    ):  # fmt: skip
        """k-grouped wgrad: out[g] tile = Σ_j dot(a[n-tile, block b0+j], b[k-tile, block b0+j]ᵀ)·sa·sb over
        expert g's token blocks b0 = blocks[g] … blocks[g+1] − 1 of the block-aligned operands (whole 128-column
        boxes: TMA loads from one descriptor each, no masks). Persistent grid over (expert, n-tile, k-tile)
        work items, k-tiles fastest so that neighbouring programs share the a tile; an expert without tokens
        gets an exact zero tile. With TMA the token loop is `tma_k_loop` (a [N, COLS], b [K, COLS]) and with
        TMA_STORE the tiles leave through the [G·N, K] view of out, over descriptors built here once per program."""
        num_n = tl.cdiv(N, BLOCK_N)
        num_k = tl.cdiv(K, BLOCK_K)
        if TMA:
            a_desc = tl.make_tensor_descriptor(a_ptr, [N, COLS], [stride_an, 1], [BLOCK_N, 128])
            b_desc = tl.make_tensor_descriptor(b_ptr, [K, COLS], [stride_bk, 1], [BLOCK_K, 128])
        if TMA_STORE:
            c_desc = tl.make_tensor_descriptor(c_ptr, [G * N, K], [stride_cn, 1], [BLOCK_N, BLOCK_K])
        per_g = num_n * num_k
        rn = tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        rt = tl.arange(0, 128)
        for tile in tl.range(tl.program_id(0), G * per_g, NUM_PROGRAMS):
            g = tile // per_g
            pid_n = (tile % per_g) // num_k
            pid_k = tile % num_k
            b0 = tl.load(blk_ptr + g)
            nblk = tl.load(blk_ptr + g + 1) - b0
            n0 = pid_n * BLOCK_N
            k0 = pid_k * BLOCK_K
            n_ld = tl.minimum(n0 + rn, N - 1)  # tail rows load valid ones (never stored)
            k_ld = tl.minimum(k0 + rk, K - 1)
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            as_ptrs = as_ptr + n_ld * stride_asn + b0 * stride_asb
            bs_ptrs = bs_ptr + k_ld * stride_bsk + b0 * stride_bsb
            if TMA:
                if nblk > 0:
                    acc = tma_k_loop(acc, a_desc, b_desc, n0, k0, b0 * 128, nblk, as_ptrs, stride_asb, bs_ptrs,
                                     stride_bsb, False, False, PREFETCH)  # fmt: skip
            else:
                for j in tl.range(0, nblk):
                    col = (b0 + j) * 128
                    a = tl.load(a_ptr + n_ld[:, None].to(tl.int64) * stride_an + (col + rt)[None, :] * stride_am)
                    b = tl.load(b_ptr + k_ld[:, None].to(tl.int64) * stride_bk + (col + rt)[None, :] * stride_bm)
                    sa = tl.load(as_ptrs + j * stride_asb)
                    sb = tl.load(bs_ptrs + j * stride_bsb)
                    acc = promote(acc, tl.dot(a, tl.trans(b)), sa, sb, False)
            if TMA_STORE:  # the [G·N, K] view: an n-tile never straddles two experts (N % BLOCK_N == 0)
                c_desc.store([g * N + n0, k0], acc.to(c_desc.dtype))
            else:
                c_base = c_ptr + g.to(tl.int64) * stride_cg + n0.to(tl.int64) * stride_cn + k0 * stride_ck
                c_mask = (rn < N - n0)[:, None] & (rk < K - k0)[None, :]
                tl.store(c_base + rn[:, None] * stride_cn + rk[None, :] * stride_ck, acc.to(c_ptr.dtype.element_ty),
                         mask=c_mask)  # fmt: skip

    @triton.jit
    def _quant_tokens_grouped_kernel(
        x_ptr, xs_ptr, idx_ptr, gate_ptr, qt_ptr, st_ptr, offs_ptr, blk_ptr, grp_ptr,
        K, G,
        stride_xm, stride_xk, stride_xsm, stride_xsk, stride_qtk, stride_qtm, stride_stk, stride_stb,
        BLOCK_F: tl.constexpr, FEATURES_FIRST: tl.constexpr, PROLOGUE: tl.constexpr, HAS_IDX: tl.constexpr,
        ALIGNED: tl.constexpr, POW2: tl.constexpr,
    ):  # fmt: skip
        """1x128 quantization along tokens of one [128 tokens, BLOCK_F features] chunk of one segment's token
        block b (blocks restart at segment starts), written transposed into the block's own columns
        128·b : 128·b + 128 of qt [K, 128·max_blocks] (zeros past the segment's end), scales st[:, b].
        FEATURES_FIRST: program_id(0) walks the feature chunks and program_id(1) the blocks (else the other way).

        PROLOGUE 0: x is a float [rows, K] tensor (gathered through idx when HAS_IDX, zeros where idx < 0).
        PROLOGUE 2: x is the FP8 SwiGLU input h [M, 2K] with 1x128 scales xs; the chunk is
        a = silu(h_gate)·h_up·gate[row], recomputed in registers."""
        pid_b, pid_k = block_and_chunk(FEATURES_FIRST)
        if pid_b >= tl.load(blk_ptr + G):
            return
        g = tl.load(grp_ptr + pid_b)  # GroupedRows.block_groups
        row0 = tl.load(offs_ptr + g) + (pid_b - tl.load(blk_ptr + g)) * 128
        left = tl.load(offs_ptr + g + 1) - row0  # rows of the segment from row0 on
        if ALIGNED:  # 16-aligned segments: the row masks are constant over 16 rows (16-byte index loads)
            row0 = tl.multiple_of(row0, 16)
            left = tl.multiple_of(left, 16)
        rows = row0 + tl.arange(0, 128)
        in_seg = tl.arange(0, 128) < left
        offs_k = pid_k * BLOCK_F + tl.arange(0, BLOCK_F)
        k_ok = offs_k < K
        if HAS_IDX:
            src = tl.load(idx_ptr + rows, mask=in_seg, other=-1)
            ok = src >= 0
        else:
            src = rows
            ok = in_seg
        mask = ok[:, None] & k_ok[None, :]
        if PROLOGUE == 2:
            kb = pid_k * BLOCK_F // 128
            hg = tl.load(x_ptr + src[:, None] * stride_xm + offs_k[None, :] * stride_xk, mask=mask, other=0.0)
            hu = tl.load(x_ptr + src[:, None] * stride_xm + (K + offs_k)[None, :] * stride_xk, mask=mask, other=0.0)
            sg = tl.load(xs_ptr + src * stride_xsm + kb * stride_xsk, mask=ok, other=0.0)
            su = tl.load(xs_ptr + src * stride_xsm + (K // 128 + kb) * stride_xsk, mask=ok, other=0.0)
            hg = hg.to(tl.float32) * sg[:, None]
            hu = hu.to(tl.float32) * su[:, None]
            w = tl.load(gate_ptr + rows, mask=ok, other=0.0)
            v = hg / (1.0 + tl.exp(-hg)) * hu * w[:, None]
        else:
            v = tl.load(x_ptr + src[:, None] * stride_xm + offs_k[None, :] * stride_xk, mask=mask, other=0.0)
            v = v.to(tl.float32)
        q, scale = quantize_along_tl(v, 0, POW2)
        cols = pid_b * 128 + tl.arange(0, 128)  # the whole block: its rows past the segment's end are zeros
        tl.store(qt_ptr + offs_k[None, :] * stride_qtk + cols[:, None] * stride_qtm, q, mask=k_ok[None, :])
        tl.store(st_ptr + offs_k * stride_stk + pid_b * stride_stb, scale, mask=k_ok)

    @triton.jit
    def _quant_block(v, q_ptrs, s_ptrs, mask, m_ok, POW2: tl.constexpr):
        """Quantize a [rows, 128] fp32 block 1x128 along its columns; store the codes and the row scales."""
        q, scale = quantize_along_tl(v, 1, POW2)
        tl.store(q_ptrs, q, mask=mask)
        tl.store(s_ptrs, scale, mask=m_ok)

    @triton.jit
    def _swiglu_quant_kernel(
        h_ptr, gate_ptr, aq_ptr, as_ptr, hq_ptr, hs_ptr, total_ptr, M, INTER,
        stride_hm, stride_hk, stride_qm, stride_qk, stride_sm, stride_sk,
        stride_hqm, stride_hqk, stride_hsm, stride_hsk,
        BLOCK_M: tl.constexpr, SAVE_H: tl.constexpr, POW2: tl.constexpr,
    ):  # fmt: skip
        """One [BLOCK_M, 128] block of a = silu(h_gate)·h_up·gate (fp32) quantized 1x128; with SAVE_H also the two
        h blocks it reads (h_q = quantize_1x128(h), kept for backward)."""
        pid_m = tl.program_id(0)
        pid_f = tl.program_id(1)
        if pid_m * BLOCK_M >= tl.load(total_ptr):
            return
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = rows < M
        cols = pid_f * 128 + tl.arange(0, 128)
        mask = m_ok[:, None] & (cols < INTER)[None, :]
        hp = h_ptr + rows[:, None] * stride_hm
        hg = tl.load(hp + cols[None, :] * stride_hk, mask=mask, other=0.0).to(tl.float32)
        hu = tl.load(hp + (INTER + cols)[None, :] * stride_hk, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(gate_ptr + rows, mask=m_ok, other=0.0)
        a = hg / (1.0 + tl.exp(-hg)) * hu * w[:, None]
        _quant_block(a, aq_ptr + rows[:, None] * stride_qm + cols[None, :] * stride_qk,
                     as_ptr + rows * stride_sm + pid_f * stride_sk, mask, m_ok, POW2)  # fmt: skip
        if SAVE_H:
            hqp = hq_ptr + rows[:, None] * stride_hqm
            hsp = hs_ptr + rows * stride_hsm
            _quant_block(hg, hqp + cols[None, :] * stride_hqk, hsp + pid_f * stride_hsk, mask, m_ok, POW2)
            up_scales = hsp + (INTER // 128 + pid_f) * stride_hsk
            _quant_block(hu, hqp + (INTER + cols)[None, :] * stride_hqk, up_scales, mask, m_ok, POW2)

    @triton.jit
    def _swiglu_bwd_kernel(
        hq_ptr, hs_ptr, da_ptr, gate_ptr, dh_ptr, dhq_ptr, dhs_ptr, dgate_ptr, total_ptr, M, INTER,
        stride_hqm, stride_hqk, stride_hsm, stride_hsk, stride_dam, stride_dak, stride_dhm, stride_dhk,
        stride_dqm, stride_dqk, stride_dsm, stride_dsk,
        BLOCK_M: tl.constexpr, POW2: tl.constexpr,
    ):  # fmt: skip
        """SwiGLU backward of BLOCK_M rows from the FP8 input h and da = d(gate·a): dh (stored in da's dtype and
        quantized 1x128 from those rounded values, as any bf16 gradient is) and d_gate = Σ da·silu(h_g)·h_u."""
        pid_m = tl.program_id(0)
        if pid_m * BLOCK_M >= tl.load(total_ptr):
            return
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = rows < M
        w = tl.load(gate_ptr + rows, mask=m_ok, other=0.0)
        d_gate = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for f in tl.range(0, INTER, 128):
            cols = f + tl.arange(0, 128)
            mask = m_ok[:, None] & (cols < INTER)[None, :]
            kb = f // 128
            hqp = hq_ptr + rows[:, None] * stride_hqm
            sg = tl.load(hs_ptr + rows * stride_hsm + kb * stride_hsk, mask=m_ok, other=0.0)
            su = tl.load(hs_ptr + rows * stride_hsm + (INTER // 128 + kb) * stride_hsk, mask=m_ok, other=0.0)
            hg = tl.load(hqp + cols[None, :] * stride_hqk, mask=mask, other=0.0).to(tl.float32) * sg[:, None]
            hu = tl.load(hqp + (INTER + cols)[None, :] * stride_hqk, mask=mask, other=0.0).to(tl.float32) * su[:, None]
            da = tl.load(da_ptr + rows[:, None] * stride_dam + cols[None, :] * stride_dak, mask=mask, other=0.0)
            da = da.to(tl.float32)
            s = 1.0 / (1.0 + tl.exp(-hg))
            silu = hg * s
            d_gate += tl.sum(da * silu * hu, axis=1)
            da0 = da * w[:, None]
            dg = (da0 * hu * (s + silu * (1.0 - s))).to(dh_ptr.dtype.element_ty)
            du = (da0 * silu).to(dh_ptr.dtype.element_ty)
            dhp = dh_ptr + rows[:, None] * stride_dhm
            tl.store(dhp + cols[None, :] * stride_dhk, dg, mask=mask)
            tl.store(dhp + (INTER + cols)[None, :] * stride_dhk, du, mask=mask)
            dqp = dhq_ptr + rows[:, None] * stride_dqm
            dsp = dhs_ptr + rows * stride_dsm
            _quant_block(dg.to(tl.float32), dqp + cols[None, :] * stride_dqk, dsp + kb * stride_dsk, mask, m_ok, POW2)
            up_scales = dsp + (INTER // 128 + kb) * stride_dsk
            _quant_block(du.to(tl.float32), dqp + (INTER + cols)[None, :] * stride_dqk, up_scales, mask, m_ok, POW2)
        tl.store(dgate_ptr + rows, d_gate, mask=m_ok)


# ----------------------------------------------------------------------------------------------------------
# Launch configuration (the default beside the kernels; a benchmark's sweep or a test overrides it in a block)
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GroupedGemmConfig:
    """Tiles of one grouped GEMM kind. Forward/dgrad: block_m x block_n output tiles (BLOCK_K = 128, the scale
    block), TMA operand loads, optional warp specialization of the K loop. Wgrad: block_m x block_n tiles of
    dW [N, K] (block_m along N, block_n along K). programs_per_sm sets the persistent grid (min(tiles,
    SMs · programs_per_sm) programs; a large value gives one program per tile)."""

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 4
    tma: bool = True
    warp_specialize: bool = False
    programs_per_sm: int = 1
    # TMA K loop: load the next K block's scales during this block's product (`fp8.triton_blocks.tma_k_loop`;
    # the same bits); on in GroupedConfig's forward/dgrad tiles, where it measured faster
    prefetch_scales: bool = False
    # forward/dgrad with TMA: flatten the persistent tile loop and the K loop into one (`tl.range(flatten=True)`),
    # so the pipeliner loads the next tile's first K blocks during this tile's store; the same bits; off: slower on
    # the e64 shapes (docs/kernel_tuning.md). Forward/dgrad only: `GroupedConfig` refuses it on the wgrad, whose
    # token loop's length varies by expert, which Triton does not fuse
    flatten: bool = False


@dataclass(frozen=True)
class GroupedConfig:
    """Launch configuration of the grouped kernels: the GEMM tiles per kind ("fprop" covers forward and dgrad)
    and the rows per program of the memory-bound SwiGLU kernels.

    The defaults won the H200 sweeps (bench/bench_moe.py --sweep, 4096 and 16384 tokens, 64 and 256 experts,
    top-8; figures: docs/kernel_tuning.md): forward/dgrad 64x128 tiles with 4 warps, 3 stages, TMA loads and 3
    programs per SM (three programs per SM overlap one program's epilogue with the others' K loops, which are
    short at these shapes). Wgrad 128x64 tiles of dW (128 along N, 64 along K) with 4 warps, 3 stages, TMA and
    2 programs per SM at every expert count and token count swept: an expert's token loop is a few blocks long,
    and two resident programs of small tiles overlap one tile's epilogue with the other's loads. 8 rows per
    SwiGLU program. The token-dim quantizers: 16 features of a 128-token block per one-warp program (the many
    small programs hide the gathered loads' latency; fusing the token-dim quantizers into the row quantizer or the
    SwiGLU backward measured 1.75-2.4x slower, docs/kernel_tuning.md), a block's feature chunks launched together
    except for the gathered tokens (H100 sweep, 2026-12-06). The forward/dgrad tiles load each K block's scales
    during the previous block's product, where it measured faster; the wgrad showed no gain with it, so it stays
    off there (docs/kernel_tuning.md)."""

    fprop: GroupedGemmConfig = GroupedGemmConfig(block_m=64, block_n=128, num_warps=4, num_stages=3, programs_per_sm=3,
                                                 prefetch_scales=True)  # fmt: skip
    wgrad: GroupedGemmConfig = GroupedGemmConfig(block_m=128, block_n=64, num_warps=4, num_stages=3, programs_per_sm=2)
    # on sm_90 GPUs: the Gluon tiles of all three GEMMs (the warp-specialised kernel: forward/dgrad only, the wgrad
    # then as if None); None (the default): the Triton ones, faster forward/dgrad as measured (docs/benchmarks.md,
    # 2026-12-05)
    sm90: Sm90GemmConfig | None = None
    # on sm_90 GPUs, where `sm90` is None: the wgrad's Gluon tiles when the experts average at most
    # `sm90_wgrad_max_blocks` 128-token blocks each (its flat (tile, K block) pipeline prefetches across the short
    # segments, the same bits; faster there, slower on long segments: docs/fp8.md, "The Hopper GEMM kernel");
    # None: the Triton wgrad everywhere
    sm90_wgrad: Sm90GemmConfig | None = SM90_SMALL_TILES
    sm90_wgrad_max_blocks: int = 8
    swiglu_block_m: int = 8  # rows per program of swiglu_quantize
    swiglu_bwd_block_m: int = 8  # rows per program of swiglu_backward
    tokens_block_f: int = 16  # features per program of the token-dim quantizers (quantize_tokens_grouped); divides 128
    tokens_warps: int = 1  # warps per program of the token-dim quantizers
    # their grid order: the feature chunks of one token block launch together for the operands read in place (dh,
    # the SwiGLU output: neighbouring programs read neighbouring bytes of the same rows), while the gathered tokens
    # walk the blocks first (one feature chunk of every block together: the top-k copies of a token then read its
    # chunk from L2 after the first); both as measured (docs/kernel_tuning.md, 2026-12-06)
    tokens_features_first: bool = True
    gathered_features_first: bool = False

    def __post_init__(self) -> None:
        check_token_chunk_launch("GroupedConfig.tokens_block_f / tokens_warps", self.tokens_block_f, self.tokens_warps)
        if self.wgrad.flatten:
            raise ValueError("GroupedConfig.wgrad.flatten=True: the grouped wgrad cannot flatten its tile and K loops "
                             "(an expert's token loop varies in length, which Triton does not fuse); flatten is a "
                             "forward/dgrad option (GroupedConfig.fprop)")


GROUPED_TUNING: Tuning[GroupedConfig] = Tuning(
    "fp8.grouped",
    GroupedConfig(),
    interpreter=GroupedConfig(  # small tiles keep Triton's CPU interpreter fast
        sm90=None,
        sm90_wgrad=None,
        fprop=GroupedGemmConfig(block_m=32, block_n=128, num_warps=4, num_stages=2, tma=False),
        wgrad=GroupedGemmConfig(block_m=32, block_n=32, num_warps=4, num_stages=2, tma=False),
    ),
)


# ----------------------------------------------------------------------------------------------------------
# Public ops
# ----------------------------------------------------------------------------------------------------------
def grouped_gemm(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, rows: GroupedRows,
    out_dtype: torch.dtype = torch.bfloat16, *, backend: str | None = None,
) -> torch.Tensor:  # fmt: skip
    """Forward / dgrad grouped GEMM: out [M, N], out[seg g] = a[seg g]·b[g]ᵀ.

    a [M, K] E4M3 with 1x128 scales [M, ceil(K/128)] (any strides); b [G, N, K] E4M3 with 128x128 scales
    [G, ceil(N/128), ceil(K/128)] (any strides, e.g. the transposed view `fp8_transpose_128x128` returns).
    Rows outside the segments are left unwritten (zero in the reference)."""
    m, k = a.shape
    g, n, k2 = b.shape
    if a.dtype != E4M3 or b.dtype != E4M3:
        raise TypeError(f"a and b must be float8_e4m3fn, got {a.dtype} and {b.dtype}")
    if k != k2 or g != rows.num_groups:
        raise ValueError(f"a [M={m}, K={k}] and b [G={g}, N={n}, K={k2}] do not fit {rows.num_groups} segments")
    _check_rows(rows, m, "a")
    if not use_triton(a, backend):
        return grouped_gemm_ref(a, a_scale, b, b_scale, rows, out_dtype)
    tuning = GROUPED_TUNING.current()
    cfg = tuning.fprop
    if m == 0 or n == 0 or k == 0:
        return torch.zeros(m, n, device=a.device, dtype=out_dtype)
    sm90 = tuning.sm90
    if sm90 is not None and n % sm90.block_n == 0 and sm90_available(a):
        b2 = b if b.is_contiguous() else b.contiguous()  # TMA reads [G·N, K] rows
        if tma_compatible(a, b2):
            return grouped_gemm_sm90(a, a_scale, b2, b_scale, rows.offsets, rows.block_offsets(sm90.block_m),
                                     rows.max_blocks(sm90.block_m) * (n // sm90.block_n), out_dtype, config=sm90)
    c = torch.empty(m, n, device=a.device, dtype=out_dtype)
    tiles = rows.block_offsets(cfg.block_m)
    max_tiles = rows.max_blocks(cfg.block_m) * cdiv(n, cfg.block_n)
    progs = max(1, min(max_tiles, num_sms(a.device) * cfg.programs_per_sm))
    tma = cfg.tma and tma_compatible(a, b)
    a_desc = b_desc = a
    if tma:
        b2 = b if b.is_contiguous() else b.contiguous()  # TMA reads [G·N, K] rows
        a_desc = TensorDescriptor.from_tensor(a, [cfg.block_m, BLOCK])
        b_desc = TensorDescriptor.from_tensor(b2.view(g * n, k), [cfg.block_n, BLOCK])
    _grouped_gemm_kernel[(progs,)](
        a, a_desc, b, b_desc, c, a_scale, b_scale, rows.offsets, tiles, m, n, k, g,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1), b_scale.stride(2),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NUM_PROGRAMS=progs, STEPS=_search_steps(g), TMA=tma,
        WS=cfg.warp_specialize and tma, EVEN_K=k % BLOCK == 0, PREFETCH=cfg.prefetch_scales,
        FLATTEN=cfg.flatten and tma, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return c


def grouped_gemm_wgrad(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, rows: GroupedRows,
    out_dtype: torch.dtype = torch.float32, *, backend: str | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Wgrad grouped GEMM: out [G, N, K], out[g] = Σ over expert g's tokens of a[:, t]·b[:, t]ᵀ.

    a [N, 128·max_blocks] and b [K, 128·max_blocks] E4M3, block-aligned token-dim operands quantized 1x128 per
    segment (`quantize_tokens_grouped`), scales [N, max_blocks] and [K, max_blocks]. Empty segments give zero
    matrices. `out`: a contiguous [G, N, K] tensor of out_dtype to write the result into (returned)."""
    n, cols = a.shape
    k, cols2 = b.shape
    if a.dtype != E4M3 or b.dtype != E4M3:
        raise TypeError(f"a and b must be float8_e4m3fn, got {a.dtype} and {b.dtype}")
    if cols != rows.max_blocks() * BLOCK or cols2 != cols:
        raise ValueError(f"a [N={n}, {cols}] and b [K={k}, {cols2}] must both have 128·max_blocks = "
                         f"{rows.max_blocks() * BLOCK} token columns (quantize_tokens_grouped's layout)")
    g = rows.num_groups
    if out is not None:
        check_output(out, (g, n, k), out_dtype, a.device)
    if not use_triton(a, backend):
        ref = grouped_gemm_wgrad_ref(a, a_scale, b, b_scale, rows, out_dtype)
        return ref if out is None else out.copy_(ref)
    tuning = GROUPED_TUNING.current()
    cfg = tuning.wgrad
    c = torch.empty(g, n, k, device=a.device, dtype=out_dtype) if out is None else out
    if c.numel() == 0:
        return c
    sm90 = wgrad_sm90_config(tuning, rows)
    if (sm90 is not None and n % sm90.block_m == 0 and sm90_available(a)
            and tma_compatible(a, b, c.view(g * n, k))):  # fmt: skip
        return grouped_gemm_wgrad_sm90(a, a_scale, b, b_scale, rows.block_offsets(), c, config=sm90)
    tiles = g * cdiv(n, cfg.block_m) * cdiv(k, cfg.block_n)
    progs = max(1, min(tiles, num_sms(a.device) * cfg.programs_per_sm))
    tma = cfg.tma and tma_compatible(a, b)
    tma_store = tma and n % cfg.block_m == 0 and tma_compatible(c.view(g * n, k))
    if tma or tma_store:
        set_descriptor_allocator()
    _grouped_wgrad_kernel[(progs,)](
        a, b, c, a_scale, b_scale, rows.block_offsets(), n, k, g, cols,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1), c.stride(2),
        a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1),
        BLOCK_N=cfg.block_m, BLOCK_K=cfg.block_n, NUM_PROGRAMS=progs, TMA=tma, TMA_STORE=tma_store,
        PREFETCH=cfg.prefetch_scales, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return c


def wgrad_sm90_config(tuning: GroupedConfig, rows: GroupedRows) -> Sm90GemmConfig | None:
    """The Gluon tiles the wgrad asks for on an sm_90 GPU (None: the Triton kernel): `tuning.sm90` when set (and not
    the warp-specialised kernel, which runs forward/dgrad only), else `tuning.sm90_wgrad` when the experts' token
    blocks, `rows.max_blocks()` (a host-side bound: no sync), average at most `tuning.sm90_wgrad_max_blocks` per
    expert. The caller still checks the GPU and the operands."""
    if tuning.sm90 is not None and not tuning.sm90.warp_specialized:
        return tuning.sm90
    if tuning.sm90_wgrad is not None and rows.max_blocks() <= tuning.sm90_wgrad_max_blocks * rows.num_groups:
        return tuning.sm90_wgrad
    return None


def quantize_rows_gathered(
    x: torch.Tensor, row_idx: torch.Tensor, rows: GroupedRows | None = None, pow2_scales: bool = False,
    *, backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """1x128 quantization along K of x[row_idx] (zero rows where row_idx < 0) without the gathered copy.

    x [T, K] float, row_idx int32 [M] → (E4M3 [M, K], fp32 scale [M, ceil(K/128)] with the row index fastest).
    With `rows`, rows from rows.total on are left unwritten (the reference writes zeros)."""
    if not use_triton(x, backend):
        return quantize_1x128_ref(gather_rows_ref(x, row_idx), pow2_scales)
    return quantize_1x128_triton(x, pow2_scales, row_idx=row_idx, total=rows.total if rows is not None else None)


def quantize_tokens_grouped(
    x: torch.Tensor, rows: GroupedRows, row_idx: torch.Tensor | None = None, pow2_scales: bool = False,
    *, backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """1x128 quantization along the token dim, blocks restarting at every segment start (wgrad operands).

    x [M, K] (or [T, K] gathered through row_idx int32 [M], zero where < 0) → (E4M3 [K, 128·max_blocks], fp32
    scale [K, max_blocks] with the row index fastest), block-aligned: segment g's blocks are columns
    rows.block_offsets()[g] : [g + 1] of the scale and 128 times those of the codes, whose columns past a
    segment's last token are zero (`token_columns` finds a segment's tokens). Blocks past the used ones are left
    unwritten."""
    if not use_triton(x, backend):
        return quantize_tokens_grouped_ref(x, rows, row_idx, pow2_scales)
    k = x.shape[1]
    return _launch_tokens_grouped(x, None, row_idx, None, rows, k, 0, pow2_scales)


def _launch_tokens_grouped(x, xs, row_idx, gate, rows: GroupedRows, k: int, prologue: int, pow2: bool):
    nb = rows.max_blocks()
    qt = torch.empty(k, nb * BLOCK, device=x.device, dtype=E4M3)
    st = torch.empty(nb, k, device=x.device, dtype=torch.float32).t()
    if rows.num_rows and k:
        tuning = GROUPED_TUNING.current()
        bf = tuning.tokens_block_f  # checked by GroupedConfig: divides 128, inside one block of the input scales
        dummy = st
        xs_ = xs if xs is not None else dummy
        features_first = tuning.gathered_features_first if row_idx is not None else tuning.tokens_features_first
        grid, features_first = blocks_by_chunks_grid(nb, cdiv(k, bf), features_first)
        _quant_tokens_grouped_kernel[grid](
            x, xs_, row_idx if row_idx is not None else dummy, gate if gate is not None else dummy, qt, st,
            rows.offsets, rows.block_offsets(), rows.block_groups(), k, rows.num_groups,
            x.stride(0), x.stride(1), xs_.stride(0), xs_.stride(1), qt.stride(0), qt.stride(1), st.stride(0),
            st.stride(1),
            BLOCK_F=bf, FEATURES_FIRST=features_first, PROLOGUE=prologue, HAS_IDX=row_idx is not None,
            ALIGNED=rows.alignment % 16 == 0, POW2=pow2, num_warps=tuning.tokens_warps,
        )  # fmt: skip
    return qt, st


def swiglu_quantize(
    h: torch.Tensor, row_gate: torch.Tensor, rows: GroupedRows, save_h: bool = True, pow2_scales: bool = False,
    *, backend: str | None = None,
):  # fmt: skip
    """h [M, 2I] (gate | up) → a = silu(h_gate)·h_up·row_gate quantized 1x128 (a_q [M, I], a_s), and with save_h
    h_q, h_s = quantize_1x128(h) for backward (else None, None). I must be a multiple of 128."""
    m, two_i = h.shape
    inter = two_i // 2
    if two_i % 256:
        raise ValueError(f"the SwiGLU input must have 2·I columns with I a multiple of 128, got {two_i}")
    if not use_triton(h, backend):
        a_q, a_s, h_q, h_s = swiglu_quantize_ref(h, row_gate, pow2_scales)
        return (a_q, a_s, h_q, h_s) if save_h else (a_q, a_s, None, None)
    a_q = torch.empty(m, inter, device=h.device, dtype=E4M3)
    a_s = torch.empty(inter // BLOCK, m, device=h.device, dtype=torch.float32).t()
    h_q = torch.empty(m, two_i, device=h.device, dtype=E4M3) if save_h else a_q
    h_s = torch.empty(two_i // BLOCK, m, device=h.device, dtype=torch.float32).t() if save_h else a_s
    bm = GROUPED_TUNING.current().swiglu_block_m
    _swiglu_quant_kernel[(cdiv(m, bm), inter // BLOCK)](
        h, row_gate, a_q, a_s, h_q, h_s, rows.total, m, inter,
        h.stride(0), h.stride(1), a_q.stride(0), a_q.stride(1), a_s.stride(0), a_s.stride(1),
        h_q.stride(0), h_q.stride(1), h_s.stride(0), h_s.stride(1),
        BLOCK_M=bm, SAVE_H=save_h, POW2=pow2_scales, num_warps=4,
    )  # fmt: skip
    return (a_q, a_s, h_q, h_s) if save_h else (a_q, a_s, None, None)


def swiglu_quantize_tokens(
    h_q: torch.Tensor, h_s: torch.Tensor, row_gate: torch.Tensor, rows: GroupedRows, pow2_scales: bool = False,
    *, backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """aᵀ for the down projection's wgrad, recomputed from the FP8 SwiGLU input: a = silu·up·gate (fp32) of
    dequantized h, quantized along tokens per segment → (E4M3 [I, 128·max_blocks], scale [I, max_blocks]), the
    layout of `quantize_tokens_grouped`."""
    if not use_triton(h_q, backend):
        return quantize_tokens_grouped_ref(swiglu_output(h_q, h_s, row_gate, torch.float32), rows, None, pow2_scales)
    return _launch_tokens_grouped(h_q, h_s, None, row_gate, rows, h_q.shape[1] // 2, 2, pow2_scales)


def grouped_wgrad_bf16(a: torch.Tensor, b: torch.Tensor, rows: GroupedRows, out_dtype: torch.dtype, *,
                       backend: str | None = None) -> torch.Tensor:  # fmt: skip
    """High-precision wgrad grouped GEMM: out [G, N, K], out[g] = a[seg g]ᵀ · b[seg g] (the sum over expert g's
    rows) with fp32 accumulation, for a [M, N] and b [M, K] in one float dtype; rows past rows.total are ignored.

    On CUDA with bf16 operands: one `torch._grouped_mm` in its 2-D × 2-D form (the ragged dim is the reduction,
    offs = the segment ends; aᵀ is passed as the column-major view, the layout whose empty groups the kernel
    accepts), bf16 output cast to out_dtype. Elsewhere (and with backend="torch"): the loop reference."""
    _check_rows(rows, a.shape[0], "a")
    _check_rows(rows, b.shape[0], "b")
    if a.dtype != b.dtype:
        raise TypeError(f"a and b must share a dtype, got {a.dtype} and {b.dtype}")
    if not (use_triton(a, backend) and a.is_cuda and a.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")):
        return grouped_wgrad_bf16_ref(a, b, rows, out_dtype)
    out = torch._grouped_mm(a.contiguous().t(), b.contiguous(), offs=rows.offsets[1:])
    return out.to(out_dtype)


def swiglu_backward(
    h_q: torch.Tensor, h_s: torch.Tensor, da: torch.Tensor, row_gate: torch.Tensor, rows: GroupedRows,
    pow2_scales: bool = False, *, backend: str | None = None,
):  # fmt: skip
    """SwiGLU backward from the FP8 input h [M, 2I] and da = d(gate·a) [M, I]: (dh [M, 2I] in da's dtype,
    dh_q, dh_s = quantize_1x128(dh), d_gate fp32 [M])."""
    m, two_i = h_q.shape
    inter = two_i // 2
    if not use_triton(h_q, backend):
        return swiglu_backward_ref(h_q, h_s, da, row_gate, pow2_scales)
    dh = torch.empty(m, two_i, device=da.device, dtype=da.dtype)
    dh_q = torch.empty(m, two_i, device=da.device, dtype=E4M3)
    dh_s = torch.empty(two_i // BLOCK, m, device=da.device, dtype=torch.float32).t()
    d_gate = torch.empty(m, device=da.device, dtype=torch.float32)
    bm = GROUPED_TUNING.current().swiglu_bwd_block_m
    _swiglu_bwd_kernel[(cdiv(m, bm),)](
        h_q, h_s, da, row_gate, dh, dh_q, dh_s, d_gate, rows.total, m, inter,
        h_q.stride(0), h_q.stride(1), h_s.stride(0), h_s.stride(1), da.stride(0), da.stride(1),
        dh.stride(0), dh.stride(1), dh_q.stride(0), dh_q.stride(1), dh_s.stride(0), dh_s.stride(1),
        BLOCK_M=bm, POW2=pow2_scales, num_warps=4,
    )  # fmt: skip
    return dh, dh_q, dh_s, d_gate


# ----------------------------------------------------------------------------------------------------------
# FP8 grouped experts (SwiGLU MLPs) with gathered input, gated output and the combine
# ----------------------------------------------------------------------------------------------------------
EXPERT_WGRAD = ("fp8", "bf16")  # fp8_grouped_experts(wgrad=...): the experts' weight-gradient operands


class _FP8GroupedExpertsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weight, w_gate_up, w_down, wq, route, pow2: bool, need_grad: bool, wgrad: str):
        """x [T, H] (unpermuted tokens), topk_weight [T, k] → routed [T, H] = Σ_j gate·expert(x) in x's dtype.
        need_grad: a backward will follow (grad mode was on at the call; inside forward it is always off).
        wgrad: "fp8" (the recipe: saves xᵀ in FP8) or "bf16" (saves x itself; see the module docstring)."""
        row_src, pos, rows = route
        gu_q, gu_s, d_q, d_s = wq
        m = rows.num_rows
        row_gate = torch.zeros(m, device=x.device, dtype=torch.float32)
        row_gate.scatter_(0, pos.reshape(-1).long(), topk_weight.reshape(-1).float())
        need_wgrad = need_grad and (w_gate_up.requires_grad or w_down.requires_grad)
        x_q, x_s = quantize_rows_gathered(x, row_src, rows, pow2)
        if not need_wgrad:
            wgrad_saved = ()
        elif wgrad == "bf16":
            wgrad_saved = (x,)
        else:
            wgrad_saved = quantize_tokens_grouped(x, rows, row_src, pow2)
        h = grouped_gemm(x_q, x_s, gu_q, gu_s, rows, out_dtype=x.dtype)
        del x_q, x_s
        a_q, a_s, h_q, h_s = swiglu_quantize(h, row_gate, rows, save_h=need_grad, pow2_scales=pow2)
        del h
        y = grouped_gemm(a_q, a_s, d_q, d_s, rows, out_dtype=x.dtype)
        out = sum_rows(y, pos, out_dtype=x.dtype)
        ctx.save_for_backward(h_q, h_s, row_gate, gu_q, gu_s, d_q, d_s, row_src, pos, *wgrad_saved)
        ctx.rows, ctx.pow2, ctx.need_wgrad, ctx.wgrad = rows, pow2, need_wgrad, wgrad
        ctx.dtypes = (x.dtype, topk_weight.dtype, w_gate_up.dtype, w_down.dtype)
        ctx.weight_ptrs = (w_gate_up.data_ptr(), w_down.data_ptr())  # GRADIENT_OUTPUTS' keys
        return out

    @staticmethod
    def backward(ctx, dout):
        h_q, h_s, row_gate, gu_q, gu_s, d_q, d_s, row_src, pos, *wgrad_saved = ctx.saved_tensors
        rows, pow2 = ctx.rows, ctx.pow2
        x_dtype, w_dtype, gu_dtype, d_dtype = ctx.dtypes
        dout = dout.contiguous()
        # dy_perm[r] = dout[row_src[r]]: the combine's adjoint, fused into both quantizations of dy
        dy_q, dy_s = quantize_rows_gathered(dout, row_src, rows, pow2)
        dwt_q, dwt_s = fp8_transpose_128x128(d_q, d_s)  # [E, I, H], on demand, freed below
        da = grouped_gemm(dy_q, dy_s, dwt_q, dwt_s, rows, out_dtype=x_dtype)
        del dy_q, dy_s, dwt_q, dwt_s
        dh, dh_q, dh_s, d_gate = swiglu_backward(h_q, h_s, da, row_gate, rows, pow2)
        del da
        dw_gu = dw_d = None
        if ctx.need_wgrad and ctx.wgrad == "bf16":
            (x,) = wgrad_saved
            # the gated SwiGLU output, one fused kernel on CUDA; pad rows: gate 0 → a = 0
            a = swiglu_output(h_q, h_s, row_gate, x_dtype, compiled=h_q.is_cuda and use_triton(h_q, None))
            dw_d = grouped_wgrad_bf16(gather_rows(dout, row_src), a, rows, d_dtype)  # pad rows read dy = 0
            del a
            dw_gu = grouped_wgrad_bf16(dh, gather_rows(x, row_src), rows, gu_dtype)
        elif ctx.need_wgrad:
            xt_q, xt_s = wgrad_saved
            dyt_q, dyt_s = quantize_tokens_grouped(dout, rows, row_src, pow2)
            at_q, at_s = swiglu_quantize_tokens(h_q, h_s, row_gate, rows, pow2)
            gu_ptr, d_ptr = ctx.weight_ptrs  # registered outputs (model.graphs' gradient slab), else new tensors
            dw_d = grouped_gemm_wgrad(dyt_q, dyt_s, at_q, at_s, rows, out_dtype=d_dtype,
                                      out=GRADIENT_OUTPUTS.get(d_ptr, d_q.shape, d_dtype, d_q.device))
            del dyt_q, dyt_s, at_q, at_s
            dht_q, dht_s = quantize_tokens_grouped(dh, rows, None, pow2)
            dw_gu = grouped_gemm_wgrad(dht_q, dht_s, xt_q, xt_s, rows, out_dtype=gu_dtype,
                                       out=GRADIENT_OUTPUTS.get(gu_ptr, gu_q.shape, gu_dtype, gu_q.device))
            del dht_q, dht_s
        del dh
        gwt_q, gwt_s = fp8_transpose_128x128(gu_q, gu_s)  # [E, H, 2I]
        dx_perm = grouped_gemm(dh_q, dh_s, gwt_q, gwt_s, rows, out_dtype=x_dtype)
        del gwt_q, gwt_s, dh_q, dh_s
        dx = sum_rows(dx_perm, pos, out_dtype=x_dtype)
        d_topk = d_gate[pos.long()].to(w_dtype)
        return dx, d_topk, dw_gu, dw_d, None, None, None, None, None


def fp8_grouped_experts(
    x: torch.Tensor,
    topk_weight: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    quantized_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    row_src: torch.Tensor,
    pos: torch.Tensor,
    rows: GroupedRows,
    pow2_scales: bool = False,
    wgrad: str = "fp8",
) -> torch.Tensor:
    """Routed SwiGLU experts in blockwise FP8, combine included: out[t] = Σ_j w[t, j]·expert_e(x[t]).

    x [T, H] tokens in routing order (not permuted); topk_weight [T, k] gates; w_gate_up [E, 2I, H] (rows
    gate | up) and w_down [E, H, I] the parameters (gradients flow to them); quantized_weights = their
    128x128 FP8 forms (gu_q, gu_s, d_q, d_s) from a cache; row_src int32 [M] token of each expert-sorted row
    (-1: a pad row, zero input, or unused); pos int32 [T, k] the row of each (token, slot); rows the segments.
    wgrad: how the weight gradients are computed, one of EXPERT_WGRAD: "fp8" (the blockwise recipe: E4M3 operands
    quantized 1x128 along tokens) or "bf16" (high-precision operands, `grouped_wgrad_bf16`; dx and the gate
    gradients are the same bits either way). Returns [T, H] in x's dtype (fp32 sums)."""
    if wgrad not in EXPERT_WGRAD:
        raise ValueError(f"wgrad must be one of {', '.join(EXPERT_WGRAD)}, got {wgrad!r}")
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if w.dim() != 3 or any(d % BLOCK for d in w.shape[1:]):
            raise ValueError(f"{name} must be [E, N, K] with N and K multiples of 128, got {tuple(w.shape)}")
    route = (row_src, pos, rows)
    need_grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (x, topk_weight, w_gate_up, w_down)
    )
    return _FP8GroupedExpertsFn.apply(x, topk_weight, w_gate_up, w_down, quantized_weights, route, pow2_scales,
                                      need_grad, wgrad)  # fmt: skip


def quantize_expert_weights(w: torch.Tensor, pow2_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked expert weights [E, N, K] (N, K multiples of 128) → E4M3 [E, N, K], scales [E, N/128, K/128]."""
    if w.dim() != 3 or w.shape[1] % BLOCK or w.shape[2] % BLOCK:
        raise ValueError(f"expert weights must be [E, N, K] with N and K multiples of 128, got {tuple(w.shape)}")
    e, n, k = w.shape
    q, s = quantize_128x128(w.reshape(e * n, k), pow2_scales)  # blocks never straddle two experts
    return q.view(e, n, k), s.view(e, n // BLOCK, cdiv(k, BLOCK))

