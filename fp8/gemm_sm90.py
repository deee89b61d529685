"""Hopper (sm_90) blockwise FP8 GEMMs in Gluon: the dense GEMM of `fp8/gemm.py` and the grouped forward/dgrad and
k-grouped wgrad GEMMs of `fp8/grouped.py`, the same maths, with each K block's promotion taken off the tensor
cores' critical path.

Why a second set of kernels: Triton waits for each 128-deep block's wgmma before it promotes the block's product
into the running sum (acc += part · sa · sb), so the tensor cores idle while the CUDA cores promote; the Triton
kernels hide that only through several resident programs per SM, with small 64x128 tiles whose operand traffic
then bounds them. Here block k's wgmma is issued asynchronously and block k-1's product is promoted while it
runs (DeepSeek-V3's schedule), with 128x128 tiles: two warpgroups, three fp32 [64, 128] register tiles each (the
running sum, the product being promoted, the product in flight).

Layout of the work: a persistent grid; each program walks its output tiles and their K blocks as one flat
sequence of (tile, K block) steps, so the TMA loads of the next tile start while the current one finishes and a
tile's epilogue overlaps the next tile's first wgmma. STAGES shared-memory buffers per operand, each filled by
TMA and signalled on an mbarrier; a buffer is refilled once the wgmma that read it is known complete. The three
GEMMs differ only in how a tile is decoded (`_decode`, MODE):
- DENSE: grouped ordering over [M, N]; C by TMA store.
- GROUPED (forward/dgrad): expert g's row tiles over its segment offsets[g] : offsets[g+1] of A, B as the
  [G·N, K] rows of the expert weights, a masked store (the rows after a segment are another expert's).
- WGRAD (k-grouped): work items (expert, row tile, column tile); the K blocks of expert g are its token blocks
  blocks[g] : blocks[g+1] of the block-aligned operands; C [G·M, N] by TMA store; an expert without tokens
  gets a zero tile.

Bits: each block's product is 4 chained m64n128k32 wgmmas into a fresh accumulator, promoted by the same fp32
expressions as `fp8.triton_blocks.promote`, in the same K order: the same output bits as the Triton kernels
(checked by tests/fp8/test_fp8_gemm_sm90.py on the GPU).

Measured on the H200 (docs/benchmarks.md, 2026-12-05) at 0.87-0.96x the Triton kernels' speed on the dense Ling
shapes and 0.53-0.65x on the grouped ones (one program per SM leaves the tensor cores idle between steps, which
the Triton kernels' two or three resident programs cover), so `fp8.gemm` and `fp8.grouped` run it only when
asked (`GemmChoice.sm90`, `GroupedConfig.sm90`).

Warp-specialised kernel (`Sm90GemmConfig.warp_specialized`; DENSE and GROUPED, not WGRAD): the same tiles' maths
split over three partitions (`gl.warp_specialize`): a one-warp loader streams the A and B boxes of every (tile, K block)
by TMA into STAGES buffers (a ready barrier per buffer counts the bytes; an empty barrier counts two releases), and
two consumer warpgroups each own one 64-row half of every 128-row tile: wait for the buffer, wgmma, wait for it,
release the buffer, promote. The consumers never wait for each other, so one's promotion runs while the other's
wgmma does (CUTLASS's and DeepGEMM's cooperative schedule); each stores its half through its own shared buffer
(GROUPED: a masked store at the segment end). The same products in the same K order: the Triton kernels' bits.
Not yet measured on a GPU (docs/kernel_tuning.md), so nothing runs it unless asked.

Defined only where Triton ships Gluon's Hopper language (`HAS_GLUON`); `sm90_available(t)` says whether the
kernels can run on a tensor's device. Gluon kernels do not run in Triton's CPU interpreter: the CPU path and
the interpreter tests keep the Triton kernels.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from kernels.backend import HAS_TRITON, cdiv, num_sms, set_descriptor_allocator, tma_compatible

try:  # Gluon is Triton's lower-level language (Triton >= 3.5); absent from CPU-only or older installs
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    HAS_GLUON = HAS_TRITON
except Exception:  # pragma: no cover - depends on the environment
    HAS_GLUON = False

__all__ = [
    "HAS_GLUON",
    "SM90_CONFIG",
    "SM90_SMALL_TILES",
    "SM90_WARP_SPECIALIZED",
    "Sm90GemmConfig",
    "fp8_gemm_sm90",
    "grouped_gemm_sm90",
    "grouped_gemm_wgrad_sm90",
    "sm90_available",
]


@dataclasses.dataclass(frozen=True)
class Sm90GemmConfig:
    """Tiles of the Gluon kernel: BLOCK_M rows (16 per warp), BLOCK_N columns, STAGES operand buffers.

    `warp_specialized` (dense and grouped forward/dgrad GEMMs): the warp-specialised kernel instead (see
    "Warp-specialised kernel" in the module doc): 128-row tiles, two consumer warpgroups of 4 warps and a loader
    warp (num_warps and programs_per_sm are then ignored: one program per SM); `carry`: its consumers issue each K
    block's wgmma before promoting the previous block's product; `consumer_regs`: the registers each consumer
    thread may use."""

    block_m: int = 128
    block_n: int = 128
    group_m: int = 8
    stages: int = 4
    num_warps: int = 8
    programs_per_sm: int = 1
    warp_specialized: bool = False
    carry: bool = False
    consumer_regs: int = 232

    @property
    def resident_programs(self) -> int:
        """Programs per SM of the launch: one for the warp-specialised kernel, else `programs_per_sm`."""
        return 1 if self.warp_specialized else self.programs_per_sm


SM90_CONFIG = Sm90GemmConfig()  # the tiles of every GEMM it runs (the defaults above)
# 64x128 tiles of one warpgroup, two resident programs per SM: the tiles of the expert wgrad of short segments
# (fp8/grouped.py: GroupedConfig.sm90_wgrad)
SM90_SMALL_TILES = Sm90GemmConfig(block_m=64, num_warps=4, programs_per_sm=2)
# the warp-specialised kernel (fp8.gemm_kernel=gluon_ws; not a default): the carried product measured faster on 11
# of the 12 Ling forward/dgrad shapes (docs/kernel_tuning.md, 2026-12-07)
SM90_WARP_SPECIALIZED = Sm90GemmConfig(warp_specialized=True, carry=True)
LOADER_REGS = 40  # the warp-specialised kernel's loader warp: TMA issue and barrier waits only


def sm90_available(t: torch.Tensor) -> bool:
    """Whether the Gluon kernel can run on t's device: CUDA compute capability 9.x and Gluon installed."""
    if not (HAS_GLUON and t.is_cuda):
        return False
    return _major(t.device.index if t.device.index is not None else torch.cuda.current_device()) == 9


# The compute capability's major per CUDA device index: a driver query, constant for the process.
@functools.lru_cache(maxsize=64)
def _major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


DENSE, GROUPED, WGRAD = 0, 1, 2  # the kernel's MODE


if HAS_GLUON:

    @gluon.jit
    def _tile_coords(tile, M, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
        """Grouped ordering of output tiles (the Triton kernel's `_tile_coords`)."""
        num_pid_m = gl.cdiv(M, BLOCK_M)
        num_pid_n = gl.cdiv(N, BLOCK_N)
        num_pid_in_group = GROUP_M * num_pid_n
        first_pid_m = (tile // num_pid_in_group) * GROUP_M
        group_size_m = gl.minimum(num_pid_m - first_pid_m, GROUP_M)
        pid_m = first_pid_m + ((tile % num_pid_in_group) % group_size_m)
        pid_n = (tile % num_pid_in_group) // group_size_m
        return pid_m, pid_n

    @gluon.jit
    def _find_group(table_ptr, x, G, STEPS: gl.constexpr):
        """The largest g in [0, G) with table[g] <= x (fp8/grouped.py's `_find_group`)."""
        lo = x * 0
        hi = lo + G
        for _ in gl.static_range(STEPS):
            mid = (lo + hi) // 2
            right = gl.load(table_ptr + mid) <= x
            lo = gl.where(right, mid, lo)
            hi = gl.where(right, hi, mid)
        return lo

    @gluon.jit
    def _decode(tile, M, N, G, num_kb, offs_ptr, tiles_ptr, MODE: gl.constexpr, BLOCK_M: gl.constexpr,
                BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, STEPS: gl.constexpr):  # fmt: skip
        """Output tile `tile` → (A's first row, the end of the rows it may store, its column block, its expert,
        its first K block, its number of K blocks). See the module doc for the three MODEs."""
        if MODE == 1:  # GROUPED: expert g owns tile ids tiles[g]·nN : tiles[g+1]·nN, row tiles fastest
            num_n = gl.cdiv(N, BLOCK_N)
            g = _find_group(tiles_ptr, tile // num_n, G, STEPS)
            t0 = gl.load(tiles_ptr + g)
            mt = gl.load(tiles_ptr + g + 1) - t0
            local = tile - t0 * num_n
            pid_n = local // mt
            row0 = gl.load(offs_ptr + g) + (local % mt) * BLOCK_M
            row_end = gl.load(offs_ptr + g + 1)
            kb0 = tile * 0
            nkb = num_kb + kb0
        elif MODE == 2:  # WGRAD: (expert, row tile, column tile), column tiles fastest; offs_ptr: token blocks
            num_n = gl.cdiv(N, BLOCK_N)
            per_g = gl.cdiv(M, BLOCK_M) * num_n
            g = gl.minimum(tile // per_g, G - 1)  # clamped past the last tile (the load stream runs ahead)
            pid_n = tile % num_n
            row0 = ((tile % per_g) // num_n) * BLOCK_M
            row_end = M + tile * 0
            kb0 = gl.load(offs_ptr + g)
            nkb = gl.load(offs_ptr + g + 1) - kb0
        else:  # DENSE
            pid_m, pid_n = _tile_coords(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            row0 = pid_m * BLOCK_M
            row_end = M + tile * 0
            g = tile * 0
            kb0 = g
            nkb = num_kb + g
        return row0, row_end, pid_n, g, kb0, nkb

    @gluon.jit
    def _num_tiles(M, N, G, tiles_ptr, MODE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """The output tiles of a MODE (see `_decode`): DENSE a grid over [M, N]; GROUPED the experts' row tiles
        (a device-side count); WGRAD every (expert, row tile, column tile)."""
        if MODE == 1:
            return gl.load(tiles_ptr + G) * gl.cdiv(N, BLOCK_N)
        elif MODE == 2:
            return G * gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N)
        else:
            return gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N)

    @gluon.jit
    def _next_step(kb, tile, row0, row_end, pid_n, g, kb0, nkb, num_tiles, M, N, G, num_kb, offs_ptr, tiles_ptr,
                   MODE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr,
                   STEPS: gl.constexpr, NUM_PROGRAMS: gl.constexpr):  # fmt: skip
        """The step after (tile, K block kb): the next K block, or the first of the program's next tile with K
        blocks (WGRAD skips experts without tokens). Carried from step to step so that the tile's decoding
        (divisions, the expert search) runs once per tile."""
        kb += 1
        if kb == nkb:
            kb = kb * 0
            tile += NUM_PROGRAMS
            row0, row_end, pid_n, g, kb0, nkb = _decode(tile, M, N, G, num_kb, offs_ptr, tiles_ptr, MODE, BLOCK_M,
                                                        BLOCK_N, GROUP_M, STEPS)  # fmt: skip
            if MODE == 2:
                while (nkb == 0) & (tile < num_tiles):
                    tile += NUM_PROGRAMS
                    row0, row_end, pid_n, g, kb0, nkb = _decode(tile, M, N, G, num_kb, offs_ptr, tiles_ptr, MODE,
                                                                BLOCK_M, BLOCK_N, GROUP_M, STEPS)  # fmt: skip
        return kb, tile, row0, row_end, pid_n, g, kb0, nkb

    @gluon.jit
    def _a_scale_offsets(row0, M, stride_asm, BLOCK_M: gl.constexpr, mma_layout: gl.constexpr):
        """int32 offsets of a tile's A row scales (rows past M clamped onto the last: never stored)."""
        rows = gl.minimum(row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_layout)), M - 1)
        return rows * stride_asm

    @gluon.jit
    def _b_scales(bs_ptr, g, pid_n, kb, N, stride_bsg, stride_bsn, stride_bsk, B_BLOCKWISE: gl.constexpr,
                  BLOCK_N: gl.constexpr, mma_layout: gl.constexpr):  # fmt: skip
        """B's scales of K block kb of a tile: a scalar (128x128 blocks) or [BLOCK_N] (1x128 rows, those past N
        clamped onto the last). Expanded at every K block: a [BLOCK_N] vector carried across steps costs the
        registers of a spill."""
        base = bs_ptr + g * stride_bsg + kb * stride_bsk
        if B_BLOCKWISE:
            return gl.load(base + pid_n * stride_bsn)
        else:
            rows = gl.minimum(pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_layout)), N - 1)
            return gl.load(base + rows * stride_bsn)

    @gluon.jit
    def _promote(acc, part, sa, sb, B_BLOCKWISE: gl.constexpr):
        """acc + part·sa·sb in fp32, as `fp8.triton_blocks.promote` (a scalar B scale is folded into sa first)."""
        if B_BLOCKWISE:
            return acc + part * gl.expand_dims(sa * sb, 1)
        else:
            return acc + (part * gl.expand_dims(sa, 1)) * gl.expand_dims(sb, 0)

    @gluon.jit
    def _issue_load(ld, total, kb, row0, pid_n, g, kb0, N, a_desc, b_desc, a_smem, b_smem, ready,
                    MODE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
        """TMA loads of step `ld` (A rows row0…, B rows pid_n·BLOCK_N… (GROUPED: of expert g's), K block
        kb0 + kb) into buffer ld % STAGES; none past the program's last step."""
        if ld < total:
            s = ld % STAGES
            bar = ready.index(s)
            col = (kb0 + kb) * 128
            if MODE == 1:
                b_row = g * N + pid_n * BLOCK_N
            else:
                b_row = pid_n * BLOCK_N
            mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [row0, col], bar, a_smem.index(s))
            tma.async_copy_global_to_shared(b_desc, [b_row, col], bar, b_smem.index(s))

    @gluon.jit
    def _store_tile(acc, c_ptr, c_desc, c_smem, row0, row_end, pid_n, g, M, N, stride_cm, MODE: gl.constexpr,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, mma_layout: gl.constexpr):  # fmt: skip
        """DENSE / WGRAD: cast, into shared memory (once the previous TMA store has read it), TMA store (clipped
        at the edges; WGRAD at rows g·M + row0 of C's [G·M, N] view). GROUPED: a masked store of the rows before
        row_end (the next rows are another expert's)."""
        if MODE == 1:
            rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_layout))
            cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_layout))
            ptrs = c_ptr + gl.expand_dims(rows.to(gl.int64) * stride_cm, 1) + gl.expand_dims(cols, 0)
            mask = gl.expand_dims(rows < row_end, 1) & gl.expand_dims(cols < N, 0)
            gl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
        else:
            tma.store_wait(0)
            c_smem.store(acc.to(c_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(c_desc, [g * M + row0, pid_n * BLOCK_N], c_smem)

    @gluon.jit
    def _mma_step(step, total, acc, prev, prev_sa, prev_sb, prev_r0, prev_re, prev_pn, prev_g,
                  kb, tile, row0, row_end, pid_n, g, kb0, nkb, sa_offs,
                  ld, ld_kb, ld_tile, ld_r0, ld_re, ld_pn, ld_g, ld_kb0, ld_nkb,
                  zero, num_tiles, a_desc, b_desc, c_ptr, c_desc, a_smem, b_smem, c_smem, ready, as_ptr, bs_ptr,
                  offs_ptr, tiles_ptr, M, N, G, num_kb, stride_cm, stride_asm, stride_ask, stride_bsg, stride_bsn,
                  stride_bsk, B_BLOCKWISE: gl.constexpr, MODE: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, STEPS: gl.constexpr, STAGES: gl.constexpr,
                  NUM_PROGRAMS: gl.constexpr, mma_layout: gl.constexpr):  # fmt: skip
        """One step (K block kb of `tile`): refill the buffer of step - 1 (its wgmma is complete) with step
        `ld` = step + STAGES - 1, issue this step's wgmma and, while it runs, promote step - 1's product `prev`
        and store step - 1's tile if this step starts a new one; then wait for the wgmma. Returns the carried
        state for the next step.

        The wait comes after the promotion instead of letting the wgmma run on into the next step: ptxas
        serializes every wgmma of a kernel in which registers that a later wgmma writes are read while an earlier
        one is in flight (C7514), which a product carried in flight from one step to the next is."""
        _issue_load(ld, total, ld_kb, ld_r0, ld_pn, ld_g, ld_kb0, N, a_desc, b_desc, a_smem, b_smem, ready, MODE,
                    BLOCK_N, STAGES)  # fmt: skip
        ld_kb, ld_tile, ld_r0, ld_re, ld_pn, ld_g, ld_kb0, ld_nkb = _next_step(
            ld_kb, ld_tile, ld_r0, ld_re, ld_pn, ld_g, ld_kb0, ld_nkb, num_tiles, M, N, G, num_kb, offs_ptr,
            tiles_ptr, MODE, BLOCK_M, BLOCK_N, GROUP_M, STEPS, NUM_PROGRAMS)  # fmt: skip
        s = step % STAGES
        mbarrier.wait(ready.index(s), (step // STAGES) & 1)
        cur = warpgroup_mma(a_smem.index(s), b_smem.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
        acc = _promote(acc, prev, prev_sa, prev_sb, B_BLOCKWISE)
        if kb == 0:  # step - 1 was its tile's last K block
            _store_tile(acc, c_ptr, c_desc, c_smem, prev_r0, prev_re, prev_pn, prev_g, M, N, stride_cm, MODE,
                        BLOCK_M, BLOCK_N, mma_layout)  # fmt: skip
            acc = zero
        # this step's scales, loaded after the promotion so that two sets of B's row scales are never live
        sa = gl.load(as_ptr + sa_offs + (kb0 + kb) * stride_ask)
        sb = _b_scales(bs_ptr, g, pid_n, kb0 + kb, N, stride_bsg, stride_bsn, stride_bsk, B_BLOCKWISE, BLOCK_N,
                       mma_layout)  # fmt: skip
        cur = warpgroup_mma_wait(num_outstanding=0, deps=(cur,))
        prev_r0 = row0
        prev_re = row_end
        prev_pn = pid_n
        prev_g = g
        kb, tile, row0, row_end, pid_n, g, kb0, nkb = _next_step(
            kb, tile, row0, row_end, pid_n, g, kb0, nkb, num_tiles, M, N, G, num_kb, offs_ptr, tiles_ptr, MODE,
            BLOCK_M, BLOCK_N, GROUP_M, STEPS, NUM_PROGRAMS)  # fmt: skip
        if kb == 0:
            sa_offs = _a_scale_offsets(row0, M, stride_asm, BLOCK_M, mma_layout)
        return (acc, cur, sa, sb, prev_r0, prev_re, prev_pn, prev_g, kb, tile, row0, row_end, pid_n, g, kb0, nkb,
                sa_offs, ld + 1, ld_kb, ld_tile, ld_r0, ld_re, ld_pn, ld_g, ld_kb0, ld_nkb)  # fmt: skip

    @gluon.jit
    def _fp8_gemm_sm90_kernel(
        a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, offs_ptr, tiles_ptr,
        M, N, K, G, B_ROWS, C_ROWS,
        stride_am, stride_bn, stride_cm, stride_asm, stride_ask, stride_bsg, stride_bsn, stride_bsk,
        B_BLOCKWISE: gl.constexpr, MODE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        GROUP_M: gl.constexpr, STEPS: gl.constexpr, STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
        num_warps: gl.constexpr,
    ):  # fmt: skip
        """C = Σ over K blocks of (A · Bᵀ) per block, scaled and promoted in fp32 (see the module doc for the
        MODEs). A [M, K] and B [B_ROWS, K] E4M3 with unit inner strides (K tails are zero-filled by TMA); C has
        C_ROWS rows of N columns."""
        BLOCK_K: gl.constexpr = 128
        a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.float8e4nv)
        b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.float8e4nv)
        c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], c_ptr.dtype.element_ty)
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BLOCK_N, 32])  # fmt: skip
        a_desc = tma.make_tensor_descriptor(a_ptr, [M, K], [stride_am, 1], [BLOCK_M, BLOCK_K], a_layout)
        b_desc = tma.make_tensor_descriptor(b_ptr, [B_ROWS, K], [stride_bn, 1], [BLOCK_N, BLOCK_K], b_layout)
        c_desc = tma.make_tensor_descriptor(c_ptr, [C_ROWS, N], [stride_cm, 1], [BLOCK_M, BLOCK_N], c_layout)

        a_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_M, BLOCK_K], a_layout)
        b_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, BLOCK_K], b_layout)
        c_smem = gl.allocate_shared_memory(c_ptr.dtype.element_ty, [BLOCK_M, BLOCK_N], c_layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)

        zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout)
        num_kb = gl.cdiv(K, BLOCK_K)
        pid = gl.program_id(0)
        num_tiles = _num_tiles(M, N, G, tiles_ptr, MODE, BLOCK_M, BLOCK_N)
        # this program's (tile, K block) steps; none for a program past the (GROUPED: device-side) tile count
        if MODE == 2:  # K blocks vary by expert: count them, and give the experts without tokens zero tiles
            total = pid * 0
            for t in range(pid, num_tiles, NUM_PROGRAMS):
                r0, re, pn, gg, k0, nk = _decode(t, M, N, G, num_kb, offs_ptr, tiles_ptr, MODE, BLOCK_M, BLOCK_N,
                                                 GROUP_M, STEPS)  # fmt: skip
                total += nk
                if nk == 0:
                    _store_tile(zero, c_ptr, c_desc, c_smem, r0, re, pn, gg, M, N, stride_cm, MODE, BLOCK_M,
                                BLOCK_N, mma_layout)  # fmt: skip
        else:
            total = gl.maximum(gl.cdiv(num_tiles - pid, NUM_PROGRAMS), 0) * num_kb
        if total > 0:
            # the first tile with K blocks
            tile = pid
            row0, row_end, pid_n, g, kb0, nkb = _decode(tile, M, N, G, num_kb, offs_ptr, tiles_ptr, MODE, BLOCK_M,
                                                        BLOCK_N, GROUP_M, STEPS)  # fmt: skip
            if MODE == 2:
                while nkb == 0:
                    tile += NUM_PROGRAMS
                    row0, row_end, pid_n, g, kb0, nkb = _decode(tile, M, N, G, num_kb, offs_ptr, tiles_ptr, MODE,
                                                                BLOCK_M, BLOCK_N, GROUP_M, STEPS)  # fmt: skip
            kb = tile * 0
            # the load stream runs STAGES - 1 steps ahead of the wgmmas
            ld_kb = kb
            ld_tile = tile
            ld_r0 = row0
            ld_re = row_end
            ld_pn = pid_n
            ld_g = g
            ld_kb0 = kb0
            ld_nkb = nkb
            for ld in gl.static_range(STAGES - 1):
                _issue_load(ld, total, ld_kb, ld_r0, ld_pn, ld_g, ld_kb0, N, a_desc, b_desc, a_smem, b_smem, ready,
                            MODE, BLOCK_N, STAGES)  # fmt: skip
                ld_kb, ld_tile, ld_r0, ld_re, ld_pn, ld_g, ld_kb0, ld_nkb = _next_step(
                    ld_kb, ld_tile, ld_r0, ld_re, ld_pn, ld_g, ld_kb0, ld_nkb, num_tiles, M, N, G, num_kb, offs_ptr,
                    tiles_ptr, MODE, BLOCK_M, BLOCK_N, GROUP_M, STEPS, NUM_PROGRAMS)  # fmt: skip

            # step 0, complete before the loop; step 1 promotes it
            sa_offs = _a_scale_offsets(row0, M, stride_asm, BLOCK_M, mma_layout)
            mbarrier.wait(ready.index(0), 0)
            prev = warpgroup_mma(a_smem.index(0), b_smem.index(0).permute((1, 0)), zero, use_acc=False)
            prev_sa = gl.load(as_ptr + sa_offs + kb0 * stride_ask)
            prev_sb = _b_scales(bs_ptr, g, pid_n, kb0, N, stride_bsg, stride_bsn, stride_bsk, B_BLOCKWISE, BLOCK_N,
                                mma_layout)  # fmt: skip
            prev_r0 = row0
            prev_re = row_end
            prev_pn = pid_n
            prev_g = g
            kb, tile, row0, row_end, pid_n, g, kb0, nkb = _next_step(
                kb, tile, row0, row_end, pid_n, g, kb0, nkb, num_tiles, M, N, G, num_kb, offs_ptr, tiles_ptr, MODE,
                BLOCK_M, BLOCK_N, GROUP_M, STEPS, NUM_PROGRAMS)  # fmt: skip
            if kb == 0:
                sa_offs = _a_scale_offsets(row0, M, stride_asm, BLOCK_M, mma_layout)
            acc = zero
            ld = kb * 0 + (STAGES - 1)
            # Two steps per iteration (unrolled), so that the products alternate between two register tiles
            # instead of being copied from one to the other at every step.
            pairs_end = 1 + ((total - 1) // 2) * 2
            for pair in range(1, pairs_end, 2):
                for half in gl.static_range(2):
                    (acc, prev, prev_sa, prev_sb, prev_r0, prev_re, prev_pn, prev_g, kb, tile, row0, row_end, pid_n,
                     g, kb0, nkb, sa_offs, ld, ld_kb, ld_tile, ld_r0, ld_re, ld_pn, ld_g, ld_kb0, ld_nkb) = _mma_step(
                        pair + half, total, acc, prev, prev_sa, prev_sb, prev_r0, prev_re, prev_pn, prev_g,
                        kb, tile, row0, row_end, pid_n, g, kb0, nkb, sa_offs,
                        ld, ld_kb, ld_tile, ld_r0, ld_re, ld_pn, ld_g, ld_kb0, ld_nkb,
                        zero, num_tiles, a_desc, b_desc, c_ptr, c_desc, a_smem, b_smem, c_smem, ready, as_ptr,
                        bs_ptr, offs_ptr, tiles_ptr, M, N, G, num_kb, stride_cm, stride_asm, stride_ask, stride_bsg,
                        stride_bsn, stride_bsk, B_BLOCKWISE, MODE, BLOCK_M, BLOCK_N, GROUP_M, STEPS, STAGES,
                        NUM_PROGRAMS, mma_layout)  # fmt: skip
            if pairs_end < total:  # an odd step count: the last step
                (acc, prev, prev_sa, prev_sb, prev_r0, prev_re, prev_pn, prev_g, kb, tile, row0, row_end, pid_n, g,
                 kb0, nkb, sa_offs, ld, ld_kb, ld_tile, ld_r0, ld_re, ld_pn, ld_g, ld_kb0, ld_nkb) = _mma_step(
                    pairs_end, total, acc, prev, prev_sa, prev_sb, prev_r0, prev_re, prev_pn, prev_g,
                    kb, tile, row0, row_end, pid_n, g, kb0, nkb, sa_offs,
                    ld, ld_kb, ld_tile, ld_r0, ld_re, ld_pn, ld_g, ld_kb0, ld_nkb,
                    zero, num_tiles, a_desc, b_desc, c_ptr, c_desc, a_smem, b_smem, c_smem, ready, as_ptr, bs_ptr,
                    offs_ptr, tiles_ptr, M, N, G, num_kb, stride_cm, stride_asm, stride_ask, stride_bsg, stride_bsn,
                    stride_bsk, B_BLOCKWISE, MODE, BLOCK_M, BLOCK_N, GROUP_M, STEPS, STAGES, NUM_PROGRAMS,
                    mma_layout)  # fmt: skip
            acc = _promote(acc, prev, prev_sa, prev_sb, B_BLOCKWISE)
            _store_tile(acc, c_ptr, c_desc, c_smem, prev_r0, prev_re, prev_pn, prev_g, M, N, stride_cm, MODE,
                        BLOCK_M, BLOCK_N, mma_layout)  # fmt: skip
        tma.store_wait(0)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))


    # ------------------------------------------------------------ the warp-specialised dense / grouped kernel
    @gluon.jit
    def _ws_loader(a_desc, b_desc, a_smem, b_smem, ready, empty, offs_ptr, tiles_ptr, M, N, K, G,
                   MODE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr,
                   STEPS: gl.constexpr, STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr):  # fmt: skip
        """The loader warp: the A and B boxes of every (tile, K block) of the program, in the consumers' order,
        into buffer `it % STAGES` once both consumers released its previous use (empty), signalled on ready."""
        num_kb = gl.cdiv(K, 128)
        it = 0
        for tile in range(gl.program_id(0), _num_tiles(M, N, G, tiles_ptr, MODE, BLOCK_M, BLOCK_N), NUM_PROGRAMS):
            row0, _, pid_n, g, _, _ = _decode(tile, M, N, G, num_kb, offs_ptr, tiles_ptr, MODE, BLOCK_M, BLOCK_N,
                                              GROUP_M, STEPS)  # fmt: skip
            b_row = g * N + pid_n * BLOCK_N  # GROUPED: expert g's rows of the stacked weights (g = 0 if DENSE)
            for kb in range(num_kb):
                s = it % STAGES
                # a fresh barrier counts as released: its phase "before 0" is complete
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                bar = ready.index(s)
                mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(a_desc, [row0, kb * 128], bar, a_smem.index(s))
                tma.async_copy_global_to_shared(b_desc, [b_row, kb * 128], bar, b_smem.index(s))
                it += 1

    @gluon.jit
    def _ws_issue(a_smem, b_smem, ready, s, phase, zero, WG: gl.constexpr, HALF: gl.constexpr):
        """Once buffer s is loaded: this consumer's [HALF, BLOCK_N] wgmma of its K block, issued asynchronously."""
        mbarrier.wait(ready.index(s), phase)
        return warpgroup_mma(a_smem.index(s).slice(WG * HALF, HALF, dim=0), b_smem.index(s).permute((1, 0)), zero,
                             use_acc=False, is_async=True)  # fmt: skip

    @gluon.jit
    def _ws_complete(part, empty, s):
        """The product of `_ws_issue`, complete; buffer s released (its refill waits for both consumers)."""
        part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
        mbarrier.arrive(empty.index(s), count=1)
        return part

    @gluon.jit
    def _ws_scales(as_ptr, sa_offs, stride_ask, bs_ptr, g, pid_n, kb, N, stride_bsg, stride_bsn, stride_bsk,
                   B_BLOCKWISE: gl.constexpr, BLOCK_N: gl.constexpr, mma_layout: gl.constexpr):  # fmt: skip
        """K block kb's scales of this consumer's rows (A) and of the tile's columns (B)."""
        sa = gl.load(as_ptr + sa_offs + kb * stride_ask)
        sb = _b_scales(bs_ptr, g, pid_n, kb, N, stride_bsg, stride_bsn, stride_bsk, B_BLOCKWISE, BLOCK_N, mma_layout)
        return sa, sb

    @gluon.jit
    def _ws_consumer(a_smem, b_smem, c_ptr, c_smem, c_desc, ready, empty, as_ptr, bs_ptr, offs_ptr, tiles_ptr, M, N,
                     K, G, stride_cm, stride_asm, stride_ask, stride_bsg, stride_bsn, stride_bsk, WG: gl.constexpr,
                     MODE: gl.constexpr, B_BLOCKWISE: gl.constexpr, CARRY: gl.constexpr, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, STEPS: gl.constexpr, STAGES: gl.constexpr,
                     NUM_PROGRAMS: gl.constexpr):  # fmt: skip
        """Consumer warpgroup WG: rows WG·HALF… of every tile of the program. Per K block: wait for the buffer,
        wgmma, wait for it, release the buffer, promote (CARRY: the next block's wgmma is issued before this
        block's promotion, which then overlaps it). No barrier between the two consumers: one's promotion
        overlaps the other's wgmma. DENSE stores by TMA; GROUPED by a masked store of the rows before the
        expert's segment end (the next rows are another expert's)."""
        HALF: gl.constexpr = BLOCK_M // 2
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BLOCK_N, 32])  # fmt: skip
        zero = gl.zeros([HALF, BLOCK_N], gl.float32, mma_layout)
        num_kb = gl.cdiv(K, 128)
        it = 0
        for tile in range(gl.program_id(0), _num_tiles(M, N, G, tiles_ptr, MODE, BLOCK_M, BLOCK_N), NUM_PROGRAMS):
            tile_row0, row_end, pid_n, g, _, _ = _decode(tile, M, N, G, num_kb, offs_ptr, tiles_ptr, MODE, BLOCK_M,
                                                         BLOCK_N, GROUP_M, STEPS)  # fmt: skip
            row0 = tile_row0 + WG * HALF
            sa_offs = _a_scale_offsets(row0, M, stride_asm, HALF, mma_layout)
            acc = zero
            if CARRY:
                s = it % STAGES
                prev = _ws_complete(_ws_issue(a_smem, b_smem, ready, s, (it // STAGES) & 1, zero, WG, HALF), empty, s)
                prev_sa, prev_sb = _ws_scales(as_ptr, sa_offs, stride_ask, bs_ptr, g, pid_n, 0, N, stride_bsg,
                                              stride_bsn, stride_bsk, B_BLOCKWISE, BLOCK_N, mma_layout)  # fmt: skip
                it += 1
                for kb in range(1, num_kb):
                    s = it % STAGES
                    cur = _ws_issue(a_smem, b_smem, ready, s, (it // STAGES) & 1, zero, WG, HALF)
                    acc = _promote(acc, prev, prev_sa, prev_sb, B_BLOCKWISE)
                    prev_sa, prev_sb = _ws_scales(as_ptr, sa_offs, stride_ask, bs_ptr, g, pid_n, kb, N, stride_bsg,
                                                  stride_bsn, stride_bsk, B_BLOCKWISE, BLOCK_N, mma_layout)  # fmt: skip
                    prev = _ws_complete(cur, empty, s)
                    it += 1
                acc = _promote(acc, prev, prev_sa, prev_sb, B_BLOCKWISE)
            else:
                for kb in range(num_kb):
                    sa, sb = _ws_scales(as_ptr, sa_offs, stride_ask, bs_ptr, g, pid_n, kb, N, stride_bsg, stride_bsn,
                                        stride_bsk, B_BLOCKWISE, BLOCK_N, mma_layout)  # fmt: skip
                    s = it % STAGES
                    part = _ws_complete(_ws_issue(a_smem, b_smem, ready, s, (it // STAGES) & 1, zero, WG, HALF),
                                        empty, s)  # fmt: skip
                    acc = _promote(acc, part, sa, sb, B_BLOCKWISE)
                    it += 1
            _store_tile(acc, c_ptr, c_desc, c_smem, row0, row_end, pid_n, 0, M, N, stride_cm, MODE, HALF, BLOCK_N,
                        mma_layout)  # fmt: skip
        tma.store_wait(0)

    @gluon.jit
    def _fp8_gemm_sm90_ws_kernel(
        a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, offs_ptr, tiles_ptr, M, N, K, G, B_ROWS,
        stride_am, stride_bn, stride_cm, stride_asm, stride_ask, stride_bsg, stride_bsn, stride_bsk,
        MODE: gl.constexpr, B_BLOCKWISE: gl.constexpr, CARRY: gl.constexpr, BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, STEPS: gl.constexpr, STAGES: gl.constexpr,
        NUM_PROGRAMS: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGISTERS: gl.constexpr,
    ):  # fmt: skip
        """`_fp8_gemm_sm90_kernel`'s DENSE and GROUPED modes, warp-specialised: the default partition and worker
        0 are the two consumer warpgroups, worker 1 the loader warp. Ready barriers count the TMA bytes; empty
        barriers count two arrivals (one per consumer)."""
        HALF: gl.constexpr = BLOCK_M // 2
        a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, 128], gl.float8e4nv)
        b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 128], gl.float8e4nv)
        c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, BLOCK_N], c_ptr.dtype.element_ty)
        a_desc = tma.make_tensor_descriptor(a_ptr, [M, K], [stride_am, 1], [BLOCK_M, 128], a_layout)
        b_desc = tma.make_tensor_descriptor(b_ptr, [B_ROWS, K], [stride_bn, 1], [BLOCK_N, 128], b_layout)
        c_desc = tma.make_tensor_descriptor(c_ptr, [M, N], [stride_cm, 1], [HALF, BLOCK_N], c_layout)
        a_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_M, 128], a_layout)
        b_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, 128], b_layout)
        if MODE == 1:  # masked register stores: the staging buffer is never used
            c0_smem = gl.allocate_shared_memory(c_ptr.dtype.element_ty, [HALF, BLOCK_N], c_layout)
            c1_smem = c0_smem
        else:
            c0_smem = gl.allocate_shared_memory(c_ptr.dtype.element_ty, [HALF, BLOCK_N], c_layout)
            c1_smem = gl.allocate_shared_memory(c_ptr.dtype.element_ty, [HALF, BLOCK_N], c_layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        gl.warp_specialize(
            [
                (_ws_consumer, (a_smem, b_smem, c_ptr, c0_smem, c_desc, ready, empty, as_ptr, bs_ptr, offs_ptr,
                                tiles_ptr, M, N, K, G, stride_cm, stride_asm, stride_ask, stride_bsg, stride_bsn,
                                stride_bsk, 0, MODE, B_BLOCKWISE, CARRY, BLOCK_M, BLOCK_N, GROUP_M, STEPS, STAGES,
                                NUM_PROGRAMS)),
                (_ws_consumer, (a_smem, b_smem, c_ptr, c1_smem, c_desc, ready, empty, as_ptr, bs_ptr, offs_ptr,
                                tiles_ptr, M, N, K, G, stride_cm, stride_asm, stride_ask, stride_bsg, stride_bsn,
                                stride_bsk, 1, MODE, B_BLOCKWISE, CARRY, BLOCK_M, BLOCK_N, GROUP_M, STEPS, STAGES,
                                NUM_PROGRAMS)),
                (_ws_loader, (a_desc, b_desc, a_smem, b_smem, ready, empty, offs_ptr, tiles_ptr, M, N, K, G, MODE,
                              BLOCK_M, BLOCK_N, GROUP_M, STEPS, STAGES, NUM_PROGRAMS)),
            ],
            [4, 1],
            [CONSUMER_REGS, LOADER_REGISTERS],
        )  # fmt: skip
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
            mbarrier.invalidate(empty.index(i))


def _check_tma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> None:
    """Refuses operands the kernels' TMA descriptors cannot read or write; sets Triton's descriptor allocator."""
    if not tma_compatible(a, b, c):
        raise ValueError("the Gluon GEMM reads and writes through TMA: every operand needs a unit inner stride and "
                         f"16-byte aligned rows and base, got a {tuple(a.shape)} stride {a.stride()} {a.dtype}, "
                         f"b {tuple(b.shape)} stride {b.stride()}, out {tuple(c.shape)} stride {c.stride()} "
                         f"{c.dtype}")  # fmt: skip
    set_descriptor_allocator()


def _launch(a, b2, c2, a_scale, b_scale, offsets, tiles, m, n, k, g, b_blockwise: bool, mode: int, progs: int,
            config: Sm90GemmConfig, b_scale_strides: tuple[int, int, int]) -> None:  # fmt: skip
    """a [M, K], b2 [B_ROWS, K] and c2 [C_ROWS, N]: the 2-D views the kernel's TMA descriptors read and write; the
    warp-specialised kernel where `config` asks for it (DENSE and GROUPED, 128-row tiles)."""
    steps = max(1, (max(g, 2) - 1).bit_length())
    if not config.warp_specialized:
        _check_tma(a, b2, c2)
        _fp8_gemm_sm90_kernel[(progs,)](
            a, b2, c2, a_scale, b_scale, offsets, tiles, m, n, k, g, b2.shape[0], c2.shape[0],
            a.stride(0), b2.stride(0), c2.stride(0), a_scale.stride(0), a_scale.stride(1), *b_scale_strides,
            B_BLOCKWISE=b_blockwise, MODE=mode, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
            GROUP_M=config.group_m, STEPS=steps, STAGES=config.stages, NUM_PROGRAMS=progs, num_warps=config.num_warps,
        )  # fmt: skip
        return
    if mode == WGRAD:
        raise ValueError("the warp-specialised Gluon kernel runs the dense and grouped forward/dgrad GEMMs, not the "
                         "k-grouped wgrad")  # fmt: skip
    if config.block_m != 128:
        raise ValueError(f"the warp-specialised kernel takes 128-row tiles (two 64-row consumers), got "
                         f"block_m={config.block_m}")  # fmt: skip
    _check_tma(a, b2, c2)
    _fp8_gemm_sm90_ws_kernel[(progs,)](
        a, b2, c2, a_scale, b_scale, offsets, tiles, m, n, k, g, b2.shape[0], a.stride(0), b2.stride(0),
        c2.stride(0), a_scale.stride(0), a_scale.stride(1), *b_scale_strides, MODE=mode, B_BLOCKWISE=b_blockwise,
        CARRY=config.carry, BLOCK_M=config.block_m, BLOCK_N=config.block_n, GROUP_M=config.group_m, STEPS=steps,
        STAGES=config.stages, NUM_PROGRAMS=progs, CONSUMER_REGS=config.consumer_regs,
        LOADER_REGISTERS=LOADER_REGS, num_warps=4,
    )  # fmt: skip


def fp8_gemm_sm90(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    b_blockwise: bool = True,
    config: Sm90GemmConfig = SM90_CONFIG,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """a·bᵀ [M, N] by the Gluon kernel: a [M, K] E4M3 with 1x128 scales [M, KB]; b [N, K] E4M3 with 128x128
    scales [NB, KB] (`b_blockwise`) or 1x128 scales [N, KB]. Operands must be TMA-readable (unit inner stride,
    16-byte aligned rows); the caller (`fp8.gemm`) checks shapes and falls back otherwise."""
    m, k = a.shape
    n = b.shape[0]
    c = torch.empty(m, n, device=a.device, dtype=out_dtype) if out is None else out
    if m == 0 or n == 0:
        return c
    if k == 0:
        return c.zero_()
    if b_blockwise and config.block_n != 128:
        raise ValueError("the 128x128-scaled B needs block_n = 128 (one scale per tile and K block)")
    progs = min(cdiv(m, config.block_m) * cdiv(n, config.block_n), num_sms(a.device) * config.resident_programs)
    _launch(a, b, c, a_scale, b_scale, a_scale, a_scale, m, n, k, 1, b_blockwise, DENSE, progs, config,
            (0, b_scale.stride(0), b_scale.stride(1)))  # fmt: skip
    return c


def grouped_gemm_sm90(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    offsets: torch.Tensor,
    tiles: torch.Tensor,
    max_tiles: int,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    config: Sm90GemmConfig = SM90_CONFIG,
) -> torch.Tensor:
    """Grouped forward / dgrad by the Gluon kernel: out[seg g] = a[seg g]·b[g]ᵀ for a [M, K] (1x128 scales) and
    b [G, N, K] contiguous with 128x128 scales [G, NB, KB]; segment g is rows offsets[g] : offsets[g+1] and owns
    row tiles tiles[g] : tiles[g+1] (`GroupedRows.block_offsets(config.block_m)`); max_tiles bounds the tile count
    on the host. N must be a multiple of block_n (no tile straddles two experts' rows of b). Rows outside the
    segments are left unwritten."""
    m, k = a.shape
    g, n, _ = b.shape
    if config.block_n != 128 or n % config.block_n:
        raise ValueError(f"the grouped kernel needs block_n = 128 dividing N, got {config.block_n} and N={n}")
    c = torch.empty(m, n, device=a.device, dtype=out_dtype)
    progs = max(1, min(max_tiles, num_sms(a.device) * config.resident_programs))
    _launch(a, b.view(g * n, k), c, a_scale, b_scale, offsets, tiles, m, n, k, g, True, GROUPED, progs, config,
            (b_scale.stride(0), b_scale.stride(1), b_scale.stride(2)))  # fmt: skip
    return c


def grouped_gemm_wgrad_sm90(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    blocks: torch.Tensor,
    out: torch.Tensor,
    *,
    config: Sm90GemmConfig = SM90_CONFIG,
) -> torch.Tensor:
    """k-grouped wgrad by the Gluon kernel: out[g] = Σ over expert g's token blocks blocks[g] : blocks[g+1] of
    a[:, block]·b[:, block]ᵀ, for the block-aligned token-dim operands a [N, 128·nb], b [K, 128·nb] with 1x128
    scales [N, nb], [K, nb] (`fp8.grouped.quantize_tokens_grouped`) into out [G, N, K] (contiguous; an expert
    without tokens gets zeros). N must be a multiple of block_m (a tile's rows stay inside one expert's)."""
    n, cols = a.shape
    k = b.shape[0]
    g = out.shape[0]
    if n % config.block_m:
        raise ValueError(f"the wgrad kernel needs block_m = {config.block_m} dividing N, got N={n}")
    tiles = g * cdiv(n, config.block_m) * cdiv(k, config.block_n)
    progs = max(1, min(tiles, num_sms(a.device) * config.resident_programs))
    _launch(a, b, out.view(g * n, k), a_scale, b_scale, blocks, blocks, n, k, cols, g, False, WGRAD, progs, config,
            (0, b_scale.stride(0), b_scale.stride(1)))  # fmt: skip
    return out
