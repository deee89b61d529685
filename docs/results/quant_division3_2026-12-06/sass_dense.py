"""SASS of the dense TMA GEMM's K loop (sm_90, ptxas on CPU), PREFETCH from argv[1]: where the scale loads sit."""
import os, sys, subprocess, tempfile
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "scratch"))
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from fp8 import gemm
from sass_kernels import BIN
PF = sys.argv[1] == "1"
names = ["a_ptr", "b_ptr", "c_ptr", "as_ptr", "bs_ptr", "ws_ptr", "M", "N", "K", "stride_am", "stride_bn", "stride_cm",
         "stride_asm", "stride_ask", "stride_bsn", "stride_bsk", "B_BLOCKWISE", "BLOCK_M", "BLOCK_N", "GROUP_M",
         "NUM_PROGRAMS", "WS", "SPLIT_K", "PREFETCH"]
sig = {n: "i32" for n in names}
sig.update({"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "c_ptr": "*bf16", "as_ptr": "*fp32", "bs_ptr": "*fp32",
            "ws_ptr": "*fp32"})
const = {"B_BLOCKWISE": True, "BLOCK_M": 64, "BLOCK_N": 128, "GROUP_M": 8, "NUM_PROGRAMS": 264, "WS": False,
         "SPLIT_K": 1, "PREFETCH": PF, "stride_asm": 1}
for n in const:
    sig[n] = "constexpr"
attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ("a_ptr", "b_ptr", "c_ptr", "as_ptr", "bs_ptr", "ws_ptr",
         "M", "N", "K", "stride_am", "stride_bn", "stride_cm", "stride_ask", "stride_bsn")}
src = ASTSource(fn=gemm._fp8_gemm_tma_kernel, signature=sig, constexprs={(names.index(n),): v for n, v in const.items()},
                attrs=attrs)
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 4})
with tempfile.TemporaryDirectory() as d:
    open(f"{d}/k.ptx", "w").write(k.asm["ptx"])
    info = subprocess.run([f"{BIN}/ptxas-blackwell", "-arch=sm_90a", "-v", f"{d}/k.ptx", "-o", f"{d}/k.cubin"],
                          capture_output=True, text=True).stderr
    sass = subprocess.run([f"{BIN}/cuobjdump", "-sass", f"{d}/k.cubin"], capture_output=True, text=True).stdout
import re
lines = [re.sub(r"^\s*/\*[0-9a-f]+\*/\s*", "", l).split(";")[0] for l in sass.splitlines() if re.match(r"^\s*/\*[0-9a-f]+\*/", l)]
print([l for l in info.splitlines() if "Used" in l])
loop = [i for i, l in enumerate(lines) if l.startswith("QGMMA")]
lo = max(0, loop[0] - 40)
for l in lines[lo:loop[0] + 2]:
    if any(t in l for t in ("LDG", "FMUL", "TRYWAIT", "ARRIVE", "QGMMA", "BAR.SYNC")):
        print("   ", l)
