"""Ahead-of-time compile of fp8/gemm_sm90.py's one-stream kernel (`_fp8_gemm_sm90_kernel`, MODE 0/1/2 = dense, grouped,
k-grouped wgrad) for sm_90a without a GPU, to /tmp/aotws/k.ptx: used to check that a refactor leaves its PTX unchanged.
Needs Triton 3.6 at /tmp/t36 (see aot_ws.py). Run from the repository root: python aot_one_stream.py MODE."""
import os
import sys
sys.path.insert(0, "/tmp/t36"); sys.path.insert(0, os.getcwd())
import triton
from triton.experimental.gluon._runtime import GluonASTSource
from triton.backends.compiler import GPUTarget
from fp8 import gemm_sm90 as G
MODE = int(sys.argv[1]); BW = MODE != 2
names = ["a_ptr","b_ptr","c_ptr","as_ptr","bs_ptr","offs_ptr","tiles_ptr","M","N","K","G","B_ROWS","C_ROWS",
         "stride_am","stride_bn","stride_cm","stride_asm","stride_ask","stride_bsg","stride_bsn","stride_bsk",
         "B_BLOCKWISE","MODE","BLOCK_M","BLOCK_N","GROUP_M","STEPS","STAGES","NUM_PROGRAMS","num_warps"]
sig = {n: "i32" for n in names}
sig.update({"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "c_ptr": "*bf16", "as_ptr": "*fp32", "bs_ptr": "*fp32",
            "offs_ptr": "*i32", "tiles_ptr": "*i32"})
const = {"B_BLOCKWISE": BW, "MODE": MODE, "BLOCK_M": 128, "BLOCK_N": 128, "GROUP_M": 8, "STEPS": 7, "STAGES": 4,
         "NUM_PROGRAMS": 132, "num_warps": 8}
for n in const: sig[n] = "constexpr"
src = GluonASTSource(fn=G._fp8_gemm_sm90_kernel, signature=sig, constexprs={(names.index(n),): v for n, v in const.items()})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
os.makedirs("/tmp/aotws", exist_ok=True)
open("/tmp/aotws/k.ptx", "w").write(k.asm["ptx"])
