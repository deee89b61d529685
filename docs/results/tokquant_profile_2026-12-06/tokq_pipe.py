"""Prototype: the gathered token-dim quantizer with one index load per program and a pipelined loop over feature
chunks (tl.range num_stages), to compare against fp8.grouped._quant_tokens_grouped_kernel."""
import os, sys
sys.path.insert(0, os.getcwd())
import triton
import triton.language as tl
from fp8.triton_blocks import quantize_along_tl


@triton.jit
def quant_tokens_pipe_kernel(
    x_ptr, idx_ptr, qt_ptr, st_ptr, offs_ptr, blk_ptr, grp_ptr, K, G,
    stride_xm, stride_qtk, stride_stb,
    BLOCK_F: tl.constexpr, CHUNKS: tl.constexpr, STAGES: tl.constexpr, HAS_IDX: tl.constexpr, POW2: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_s = tl.program_id(1)
    if pid_b >= tl.load(blk_ptr + G):
        return
    g = tl.load(grp_ptr + pid_b)
    row0 = tl.load(offs_ptr + g) + (pid_b - tl.load(blk_ptr + g)) * 128
    left = tl.load(offs_ptr + g + 1) - row0
    row0 = tl.multiple_of(row0, 16)
    left = tl.multiple_of(left, 16)
    rows = row0 + tl.arange(0, 128)
    in_seg = tl.arange(0, 128) < left
    if HAS_IDX:
        src = tl.load(idx_ptr + rows, mask=in_seg, other=-1)
        ok = src >= 0
    else:
        src = rows
        ok = in_seg
    row_ptrs = x_ptr + src.to(tl.int64)[:, None] * stride_xm
    cols = pid_b * 128 + tl.arange(0, 128)
    k0 = pid_s * CHUNKS * BLOCK_F
    for c in tl.range(0, CHUNKS, num_stages=STAGES):
        offs_k = k0 + c * BLOCK_F + tl.arange(0, BLOCK_F)
        v = tl.load(row_ptrs + offs_k[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        q, scale = quantize_along_tl(v, 0, POW2)
        tl.store(qt_ptr + offs_k[None, :] * stride_qtk + cols[:, None], q)
        tl.store(st_ptr + offs_k + pid_b * stride_stb, scale)


if __name__ == "__main__":
    from aot_regs import compile_kernel
    sig = {"x_ptr": "*bf16", "idx_ptr": "*i32", "qt_ptr": "*fp8e4nv", "st_ptr": "*fp32", "offs_ptr": "*i32",
           "blk_ptr": "*i32", "grp_ptr": "*i32", "K": "i32", "G": "i32", "stride_xm": "i32", "stride_qtk": "i32",
           "stride_stb": "i32", "BLOCK_F": "constexpr", "CHUNKS": "constexpr", "STAGES": "constexpr",
           "HAS_IDX": "constexpr", "POW2": "constexpr"}
    from tokq_sweep2 import VARIANTS
    for bf, ch, st, w in VARIANTS:
        k = compile_kernel(quant_tokens_pipe_kernel, sig,
                           {"BLOCK_F": bf, "CHUNKS": ch, "STAGES": st, "HAS_IDX": True, "POW2": False}, w,
                           div16=("x_ptr", "idx_ptr", "qt_ptr", "st_ptr", "offs_ptr", "blk_ptr", "grp_ptr", "K",
                                  "stride_xm", "stride_qtk", "stride_stb"))
        ptx = k.asm["ptx"]
        print("   cp.async:", ptx.count("cp.async"), "ld.global:", ptx.count("ld.global"), "st.global:", ptx.count("st.global"))
