"""Ahead-of-time compile of fp8/gemm_sm90.py's warp-specialised kernel for sm_90a on a machine without a GPU.
Needs Triton 3.6 (the GPU image's) unpacked at /tmp/t36: pip download triton==3.6.0 --no-deps, then
pip install --no-deps --target /tmp/t36 <wheel>. Run from the repository root:
MODE=0|1 CARRY=0|1 python aot_ws.py BLOCKWISE(1|0) STAGES CONSUMER_REGS [bf16|fp32]; writes /tmp/aotws/k.{ptx,ttgir,sass}."""
import os, sys, subprocess, tempfile
sys.path.insert(0, "/tmp/t36")
import triton
print(triton.__version__, triton.__file__)
from triton.experimental.gluon._runtime import GluonASTSource
from triton.backends.compiler import GPUTarget
sys.path.insert(0, os.getcwd())
from fp8 import gemm_sm90 as G
BLOCKWISE = int(sys.argv[1]) if len(sys.argv) > 1 else 1
STAGES = int(sys.argv[2]) if len(sys.argv) > 2 else 4
CREGS = int(sys.argv[3]) if len(sys.argv) > 3 else 232
OUT = sys.argv[4] if len(sys.argv) > 4 else "bf16"
MODE = int(os.environ.get("MODE", "0"))  # 0 dense, 1 grouped
CARRY = bool(int(os.environ.get("CARRY", "0")))
names = ["a_ptr", "b_ptr", "c_ptr", "as_ptr", "bs_ptr", "offs_ptr", "tiles_ptr", "M", "N", "K", "G", "B_ROWS",
         "stride_am", "stride_bn", "stride_cm", "stride_asm", "stride_ask", "stride_bsg", "stride_bsn", "stride_bsk",
         "MODE", "B_BLOCKWISE", "CARRY", "BLOCK_M", "BLOCK_N", "GROUP_M", "STEPS", "STAGES", "NUM_PROGRAMS",
         "CONSUMER_REGS", "LOADER_REGISTERS"]
sig = {n: "i32" for n in names}
sig.update({"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "c_ptr": "*" + OUT, "as_ptr": "*fp32", "bs_ptr": "*fp32",
            "offs_ptr": "*i32", "tiles_ptr": "*i32"})
const = {"MODE": MODE, "CARRY": CARRY, "B_BLOCKWISE": bool(BLOCKWISE), "BLOCK_M": 128, "BLOCK_N": 128,
         "GROUP_M": 8, "STEPS": 7 if MODE else 1, "STAGES": STAGES, "NUM_PROGRAMS": 132, "CONSUMER_REGS": CREGS,
         "LOADER_REGISTERS": 40}
const.update({"stride_ask": 1} if BLOCKWISE else {"stride_asm": 1})
for n in const:
    sig[n] = "constexpr"
attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ("a_ptr", "b_ptr", "c_ptr", "as_ptr", "bs_ptr",
         "offs_ptr", "tiles_ptr", "K", "N", "stride_am", "stride_bn", "stride_cm")}
src = GluonASTSource(fn=G._fp8_gemm_sm90_ws_kernel, signature=sig, constexprs={(names.index(n),): v for n, v in const.items()}, attrs=attrs)
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
BIN = "/tmp/t36/triton/backends/nvidia/bin"
d = "/tmp/aotws"
os.makedirs(d, exist_ok=True)
open(f"{d}/k.ptx", "w").write(k.asm["ptx"])
open(f"{d}/k.ttgir", "w").write(k.asm["ttgir"])
info = subprocess.run([f"{BIN}/ptxas", "-arch=sm_90a", "-v", f"{d}/k.ptx", "-o", f"{d}/k.cubin"], capture_output=True, text=True)
print(info.stderr[-3000:])
sass = subprocess.run([f"{BIN}/cuobjdump", "-sass", f"{d}/k.cubin"], capture_output=True, text=True).stdout
open(f"{d}/k.sass", "w").write(sass)
print("shared", k.metadata.shared, "num_warps", k.metadata.num_warps)
