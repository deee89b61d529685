"""SASS instruction counts and registers (sm_90, ptxas on the CPU machine) of the quantizer kernels as the JIT would
specialise them at the step's shapes. Run twice (two trees) to compare."""
import os, subprocess, sys, tempfile
sys.path.insert(0, os.getcwd())
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from fp8 import grouped, quant

BIN = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")


def sass_stats(fn, signature, constexprs, num_warps, ones=(), div16=()):
    names = list(signature)
    signature, constexprs = dict(signature), dict(constexprs)
    for n in ones:
        signature[n] = "constexpr"
        constexprs[n] = 1
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(n),): v for n, v in constexprs.items()},
                    attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    with tempfile.TemporaryDirectory() as d:
        ptx, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        open(ptx, "w").write(k.asm["ptx"])
        info = subprocess.run([f"{BIN}/ptxas-blackwell", "-arch=sm_90a", "-v", ptx, "-o", cubin],
                              capture_output=True, text=True).stderr
        sass = subprocess.run([f"{BIN}/cuobjdump", "-sass", cubin], capture_output=True, text=True).stdout
    regs = [l.split("Used ")[1].split(" registers")[0] for l in info.splitlines() if "Used" in l][0]
    count = sum(1 for l in sass.splitlines() if l.strip().startswith("/*") and "*/" in l and l.strip()[2:6].strip() != "")
    return regs, count


def i32(*names):
    return {n: "i32" for n in names}


KERNELS = {
    "grouped tokens, gathered (16 f, 1 warp)": (
        grouped._quant_tokens_grouped_kernel,
        {"x_ptr": "*bf16", "xs_ptr": "*fp32", "idx_ptr": "*i32", "gate_ptr": "*fp32", "qt_ptr": "*fp8e4nv",
         "st_ptr": "*fp32", "offs_ptr": "*i32", "blk_ptr": "*i32", "grp_ptr": "*i32", **i32("K", "G"),
         **i32(*[f"stride_{n}" for n in ("xm", "xk", "xsm", "xsk", "qtk", "qtm", "stk", "stb")]),
         **{n: "constexpr" for n in ("BLOCK_F", "FEATURES_FIRST", "PROLOGUE", "HAS_IDX", "ALIGNED", "POW2")}},
        {"BLOCK_F": 16, "FEATURES_FIRST": False, "PROLOGUE": 0, "HAS_IDX": True, "ALIGNED": True, "POW2": False}, 1,
        ("stride_xk", "stride_qtm", "stride_stk", "stride_xsk"),
        ("x_ptr", "xs_ptr", "idx_ptr", "gate_ptr", "qt_ptr", "st_ptr", "offs_ptr", "blk_ptr", "grp_ptr", "K",
         "stride_xm", "stride_qtk", "stride_stb", "stride_xsm")),
    "rows, gathered (64 rows, 4 warps)": (
        quant._quant_rows_kernel,
        {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "idx_ptr": "*i32", "total_ptr": "*i32",
         **i32("M", "K"), **i32(*[f"stride_{n}" for n in ("xm", "xk", "qm", "qk", "sm", "sk")]),
         **{n: "constexpr" for n in ("BLOCK_M", "POW2", "HAS_IDX", "HAS_TOTAL", "FEATURES_FIRST")}},
        {"BLOCK_M": 64, "POW2": False, "HAS_IDX": True, "HAS_TOTAL": True, "FEATURES_FIRST": False}, 4,
        ("stride_xk", "stride_qk", "stride_sm"),
        ("x_ptr", "q_ptr", "s_ptr", "idx_ptr", "total_ptr", "M", "K", "stride_xm", "stride_qm", "stride_sk")),
    "dense tokens (16 f, 1 warp)": (
        quant._quant_tokens_kernel,
        {"x_ptr": "*bf16", "xs_ptr": "*fp32", "qt_ptr": "*fp8e4nv", "st_ptr": "*fp32", **i32("M", "K"),
         **i32(*[f"stride_{n}" for n in ("xm", "xk", "xsm", "xsk", "qtk", "qtm", "stk", "stm")]),
         **{n: "constexpr" for n in ("BLOCK_F", "FEATURES_FIRST", "HAS_IN_SCALE", "POW2")}},
        {"BLOCK_F": 16, "FEATURES_FIRST": True, "HAS_IN_SCALE": False, "POW2": False}, 1,
        ("stride_xk", "stride_qtm", "stride_stk", "stride_xsk"),
        ("x_ptr", "xs_ptr", "qt_ptr", "st_ptr", "M", "K", "stride_xm", "stride_qtk", "stride_stm", "stride_xsm")),
}

if __name__ == "__main__":
    for name, (fn, sig, c, w, ones, div16) in KERNELS.items():
        regs, count = sass_stats(fn, sig, c, w, ones, div16)
        print(f"{sys.argv[1] if len(sys.argv) > 1 else ''} {name}: {regs} registers, {count} SASS instructions", flush=True)
