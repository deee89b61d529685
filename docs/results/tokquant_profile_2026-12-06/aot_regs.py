"""AOT-compile a Triton kernel for sm_90 on the CPU machine; print registers, spills, shared memory."""
import os, sys
sys.path.insert(0, os.getcwd())
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from fp8 import grouped

TARGET = GPUTarget("cuda", 90, 32)

def compile_kernel(fn, signature, constexprs, num_warps, ones=(), div16=()):
    """ones: argument names specialised to 1 (Triton's JIT does that for ints equal to 1); div16: names given
    16-divisibility (pointers and ints the JIT sees divisible by 16)."""
    names = list(signature)
    signature = dict(signature)
    constexprs = dict(constexprs)
    for n in ones:
        signature[n] = "constexpr"
        constexprs[n] = 1
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(n),): v for n, v in constexprs.items()}, attrs=attrs)
    k = triton.compile(src, target=TARGET, options={"num_warps": num_warps})
    import subprocess, tempfile
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas-blackwell")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    out = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"], capture_output=True, text=True)
    info = " ".join(l.split("info    : ")[-1] for l in out.stderr.splitlines() if "Used" in l or "spill" in l)
    print(fn.__name__, {k_: v for k_, v in constexprs.items() if k_ in ("BLOCK_F", "HAS_IDX", "CHUNKS", "STAGES")},
          f"warps {num_warps}: shared {k.metadata.shared} | {info}", flush=True)
    return k

if __name__ == "__main__":
    fn = grouped._quant_tokens_grouped_kernel
    sig = {"x_ptr": "*bf16", "xs_ptr": "*fp32", "idx_ptr": "*i32", "gate_ptr": "*fp32", "qt_ptr": "*fp8e4nv",
           "st_ptr": "*fp32", "offs_ptr": "*i32", "blk_ptr": "*i32", "grp_ptr": "*i32", "K": "i32", "G": "i32",
           **{f"stride_{n}": "i32" for n in ("xm", "xk", "xsm", "xsk", "qtk", "qtm", "stk", "stb")},
           "BLOCK_F": "constexpr", "FEATURES_FIRST": "constexpr", "PROLOGUE": "constexpr", "HAS_IDX": "constexpr",
           "ALIGNED": "constexpr", "POW2": "constexpr"}
    for bf, w, idx in ((8, 1, True), (16, 1, True), (16, 1, False)):
        c = {"BLOCK_F": bf, "FEATURES_FIRST": False, "PROLOGUE": 0, "HAS_IDX": idx, "ALIGNED": True, "POW2": False}
        k = compile_kernel(fn, sig, c, w, ones=("stride_xk", "stride_qtm", "stride_stk", "stride_xsk"),
                           div16=("x_ptr", "xs_ptr", "idx_ptr", "gate_ptr", "qt_ptr", "st_ptr", "offs_ptr", "blk_ptr",
                                  "grp_ptr", "K", "stride_xm", "stride_qtk", "stride_stb", "stride_xsm"))
        if len(sys.argv) > 1:
            open(f"/tmp/tok_{bf}_{w}_{int(idx)}.ptx", "w").write(k.asm["ptx"])
