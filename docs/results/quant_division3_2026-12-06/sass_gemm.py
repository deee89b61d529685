"""SASS of the grouped forward GEMM's K loop (sm_90, ptxas on CPU): instruction mix per K block."""
import os, sys, subprocess, tempfile
sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "scratch"))
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from fp8 import grouped
from sass_kernels import BIN

names = ["a_ptr", "a_desc", "b_ptr", "b_desc", "c_ptr", "as_ptr", "bs_ptr", "offs_ptr", "tiles_ptr", "M", "N", "K", "G",
         "stride_am", "stride_ak", "stride_bg", "stride_bn", "stride_bk", "stride_cm", "stride_cn", "stride_asm",
         "stride_ask", "stride_bsg", "stride_bsn", "stride_bsk", "BLOCK_M", "BLOCK_N", "NUM_PROGRAMS", "STEPS", "TMA",
         "WS", "EVEN_K", "PREFETCH"]
sig = {n: "i32" for n in names}
sig.update({"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "c_ptr": "*bf16", "as_ptr": "*fp32", "bs_ptr": "*fp32",
            "offs_ptr": "*i32", "tiles_ptr": "*i32", "a_desc": "tensordesc<fp8e4nv[64, 128]>",
            "b_desc": "tensordesc<fp8e4nv[128, 128]>"})
import sys as _s
PF = len(_s.argv) > 1 and _s.argv[1] == "1"
const = {"PREFETCH": PF, "BLOCK_M": 64, "BLOCK_N": 128, "NUM_PROGRAMS": 396, "STEPS": 7, "TMA": True, "WS": False, "EVEN_K": True,
         "stride_ak": 1, "stride_bk": 1, "stride_cn": 1, "stride_asm": 1}
for n in const:
    sig[n] = "constexpr"
attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ("a_ptr", "b_ptr", "c_ptr", "as_ptr", "bs_ptr", "offs_ptr",
         "tiles_ptr", "K", "N", "stride_am", "stride_bg", "stride_bn", "stride_cm", "stride_ask", "stride_bsg")}
src = ASTSource(fn=grouped._grouped_gemm_kernel, signature=sig,
                constexprs={(names.index(n),): v for n, v in const.items()}, attrs=attrs)
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
with tempfile.TemporaryDirectory() as d:
    open(f"{d}/k.ptx", "w").write(k.asm["ptx"])
    info = subprocess.run([f"{BIN}/ptxas-blackwell", "-arch=sm_90a", "-v", f"{d}/k.ptx", "-o", f"{d}/k.cubin"],
                          capture_output=True, text=True).stderr
    sass = subprocess.run([f"{BIN}/cuobjdump", "-sass", f"{d}/k.cubin"], capture_output=True, text=True).stdout
open(f"/tmp/gemm{int(PF)}.sass", "w").write(sass)
print([l for l in info.splitlines() if "Used" in l])
