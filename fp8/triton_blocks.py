"""Triton building blocks shared by the FP8 kernels of fp8/quant.py, fp8/gemm.py and fp8/grouped.py: a block's
amax, scale and codes (`quantize_along_tl`), the pointers to B's scales, the per-K-block promotion of a partial
product, and the K loop of the TMA GEMMs built from them (`tma_k_loop`), and a (row block, feature chunk) program's
ids (`block_and_chunk`).

Defined only when Triton imports (`kernels.backend.HAS_TRITON`: import them under the same condition); they are
`@triton.jit` functions, callable from kernels only.
"""

from __future__ import annotations

from kernels.backend import HAS_TRITON, tl, triton

__all__ = [
    "amax_tl",
    "b_scale_ptrs",
    "block_and_chunk",
    "divide_by_scale",
    "promote",
    "quantize_along_tl",
    "scale_from_amax_tl",
    "tma_k_loop",
]

if HAS_TRITON:

    @triton.jit
    def block_and_chunk(FEATURES_FIRST: tl.constexpr):
        """(row block, feature chunk) of this program in a grid from `kernels.backend.blocks_by_chunks_grid`:
        program_id(0) walks the chunks when FEATURES_FIRST, else the blocks."""
        if FEATURES_FIRST:
            return tl.program_id(1), tl.program_id(0)
        return tl.program_id(0), tl.program_id(1)

    @triton.jit
    def amax_tl(v, AXIS: tl.constexpr):
        """max |v| along AXIS, NaN where any value is NaN (`tl.max` of floats drops NaN: max.f32 is maxNum).

        As the integer max of the magnitudes' bits: with the sign bit cleared, fp32 bit patterns order as their
        values (zeros, subnormals, normals, Inf), and every NaN pattern lies above Inf's. (A float reduction with a
        NaN-keeping combine gives the same values, but Triton's interpreter runs a custom combine value by value in
        Python: 20x slower tests.)"""
        magnitude_bits = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        return tl.max(magnitude_bits, axis=AXIS).to(tl.float32, bitcast=True)

    @triton.jit
    def scale_from_amax_tl(amax, POW2: tl.constexpr):
        """Kernel twin of `fp8.quant.scale_from_amax`: NaN amax gives a NaN scale, Inf an Inf one."""
        # fp8.format.OPERAND_AMAX_FLOOR (1e-12 * 448), as an fp32 literal
        amax = tl.maximum(amax, 4.48e-10, propagate_nan=tl.PropagateNan.ALL)
        # RN(amax / 448) by Markstein's correction with the constant RN(1 / 448) = 0x3B124925 (the literal below is
        # that fp32 value exactly): the same bits as div_rn for every amax from the floor up (checked for all fp32
        # significands; the steps are exact under scaling by 2^k in this range), without div_rn's slow-path branch.
        # A NaN or Inf amax has a NaN residual and keeps q (NaN, Inf).
        reciprocal_448 = 0.0022321429569274187
        q = amax * reciprocal_448
        residual = tl.fma(q, -448.0, amax)
        scale = tl.where(tl.abs(residual) > 0.0, tl.fma(residual, reciprocal_448, q), q)
        if POW2:
            bits = scale.to(tl.int32, bitcast=True)
            exp_bits = bits & 0x7F800000
            rounded = tl.where((bits & 0x7FFFFF) != 0, exp_bits + (1 << 23), bits)
            bits = tl.where(exp_bits == 0x7F800000, bits, rounded)
            scale = bits.to(tl.float32, bitcast=True)
        return scale

    @triton.jit
    def divide_by_scale(v, scale, reciprocal):
        """RN(v / scale) in fp32, bit for bit IEEE division on the quantizers' domain (|v| ≤ 448·scale, or an
        infinite or NaN scale: a block holding an Inf or a NaN), from reciprocal = div_rn(1, scale) computed once
        per scale (v, scale and reciprocal broadcast together).

        q = RN(v·r) is within an ulp of the quotient, so the residual v − q·scale is exact in one FMA and
        RN(q + residual·r) is the correctly rounded quotient (Markstein's theorem, given a correctly rounded r and a
        residual in fp32's normal range: |v| ≥ 2⁻¹⁰⁰; a smaller v has a quotient below 2⁻⁶⁰ with the quantizers'
        scales ≥ 1e-12, which E4M3 rounds to a signed zero either way). Three multiply-adds per value (the
        negations become operand modifiers in ptxas's sm_90 code), with no select:
        - the residual is computed negated, q·scale − v, whose exact zero rounds to +0, and enters the correction
          times −r: for v = ±0, q = ±0 and RN(+0·(−r) + q) = RN(−0 + q) keeps v's sign (with the residual
          v − q·scale the zero would be +0 and v = −0 would give +0);
        - an infinite scale enters the residual as 0 (and r = 1/Inf = 0, −r = −0): q = v·0 and the result is
          (−v)·(−0) + q, ±0 with v's sign for a finite v and NaN for an infinite one, as v / Inf.
        An infinite v with a finite scale lies outside the domain (it gives NaN, not ±Inf). No per-value select: the
        compiler spilled a select's predicates (why, and the instruction counts: docs/kernel_tuning.md).
        tests/fp8/test_division.py checks it against IEEE division."""
        # the negations multiply by -1: Triton 3.6 (the GPU's) lowers a float's unary minus to 0 − x, which maps +0
        # to +0 (3.9 and the interpreter negate); a sign lost there made −0 / s come out +0 on the GPU only
        q = v * reciprocal
        negated_residual = tl.fma(q, tl.where(scale == float("inf"), 0.0, scale), v * -1.0)
        return tl.fma(negated_residual, reciprocal * -1.0, q)

    @triton.jit
    def quantize_along_tl(v, AXIS: tl.constexpr, POW2: tl.constexpr):
        """1x128 blockwise E4M3 quantization of the fp32 block v, one block per line along AXIS (its 128 values lie
        along AXIS): (codes shaped like v, fp32 scales shaped like v without AXIS). The kernels' twin of
        `fp8.quant.quantize_1x128_ref`'s maths."""
        scale = scale_from_amax_tl(amax_tl(v, AXIS), POW2)
        s = tl.expand_dims(scale, AXIS)
        r = tl.expand_dims(tl.math.div_rn(1.0, scale), AXIS)
        return divide_by_scale(v, s, r).to(tl.float8e4nv), scale

    @triton.jit
    def b_scale_ptrs(bs_ptr, pid_n, offs_bn, stride_bsn, B_BLOCKWISE: tl.constexpr, BLOCK_N: tl.constexpr):
        """Pointers to B's scales of K block 0: one scalar per tile (128x128 blocks, BLOCK_N == 128), one per
        128 columns (128x128 blocks, wider tiles) or one per column (1x128 rows)."""
        if B_BLOCKWISE and BLOCK_N == 128:
            return bs_ptr + pid_n * stride_bsn
        elif B_BLOCKWISE:
            return bs_ptr + (offs_bn // 128) * stride_bsn
        else:
            return bs_ptr + offs_bn * stride_bsn

    @triton.jit
    def promote(acc, part, sa, sb, SB_SCALAR: tl.constexpr):
        """acc += part · sa · sb in fp32: the product of one 128-wide K block, computed into a fresh accumulator
        on the tensor cores, scaled by its row scales sa [BLOCK_M] and B scales sb (scalar or [BLOCK_N]).
        With a scalar sb, sa·sb is folded first (one FMA per element); otherwise two multiplies per element
        but no [BLOCK_M, BLOCK_N] outer product of the scales held in registers."""
        if SB_SCALAR:
            return acc + part * (sa * sb)[:, None]
        else:
            return acc + (part * sa[:, None]) * sb[None, :]

    @triton.jit
    def _block_product(a_desc, b_desc, off_a, off_b, col):
        """dot(A[off_a : +BM, col : +128], B[off_b : +BN, col : +128]ᵀ) into a fresh fp32 accumulator."""
        return tl.dot(a_desc.load([off_a, col]), tl.trans(b_desc.load([off_b, col])))

    @triton.jit
    def tma_k_loop(acc, a_desc, b_desc, off_a, off_b, col0, num_kb, as_ptrs, stride_as, bs_ptrs, stride_bs,
                   SB_SCALAR: tl.constexpr, WS: tl.constexpr, PREFETCH: tl.constexpr):  # fmt: skip
        """acc + Σ_kb dot(A block kb, B block kb)·sa_kb·sb_kb over num_kb K blocks of 128 columns, block kb at
        columns col0 + 128·kb of both TMA descriptors (A rows off_a…, B rows off_b…), its scales at
        as_ptrs + kb·stride_as and bs_ptrs + kb·stride_bs; each block's product is promoted before the next one
        is issued (the schedules that issue the next product first measured slower: docs/kernel_tuning.md).
        WS: Triton's warp specialization of the loop. PREFETCH: load block kb + 1's scales while block kb's product
        runs (else they are loaded in block kb's iteration, and the sa·sb multiply that precedes its MMA waits for
        them: the sm_90 code ptxas makes issues those loads after the TMA wait and the MMA after their use); the
        same values in the same order, so the same bits. Not tried together with WS. PREFETCH needs num_kb >= 1
        (it loads block 0's scales before the loop, whose address lies past the tensor when there is no block):
        the dense kernel is not launched for K = 0 and makes no empty split (`fp8.gemm.wgrad_splits`), the grouped
        forward is not launched for K = 0, and the grouped wgrad calls this only for experts with tokens."""
        if PREFETCH:
            # block 0's scales before the loop: needs num_kb >= 1 (see the docstring); no `if` guards it, since an
            # `if` around the loop would hide it from `tl.range(flatten=True)` in the callers' tile loops
            sa = tl.load(as_ptrs)
            sb = tl.load(bs_ptrs)
            for kb in tl.range(0, num_kb, warp_specialize=WS):
                following = tl.minimum(kb + 1, num_kb - 1)  # the last block reloads its own scales
                sa_next = tl.load(as_ptrs + following * stride_as)
                sb_next = tl.load(bs_ptrs + following * stride_bs)
                part = _block_product(a_desc, b_desc, off_a, off_b, col0 + kb * 128)
                acc = promote(acc, part, sa, sb, SB_SCALAR)
                sa = sa_next
                sb = sb_next
        else:
            for kb in tl.range(0, num_kb, warp_specialize=WS):
                part = _block_product(a_desc, b_desc, off_a, off_b, col0 + kb * 128)
                acc = promote(acc, part, tl.load(as_ptrs + kb * stride_as), tl.load(bs_ptrs + kb * stride_bs),
                              SB_SCALAR)  # fmt: skip
        return acc
