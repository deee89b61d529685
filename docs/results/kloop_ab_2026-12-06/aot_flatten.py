"""AOT compile (sm_90, ptxas here) of the dense TMA GEMM and the grouped forward GEMM with FLATTEN / PREFETCH:
scf.for count in the TTGIR after the passes, registers, SASS instruction count."""
import os, re, subprocess, sys, tempfile
sys.path.insert(0, os.getcwd())
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from fp8 import gemm, grouped

BIN = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")


def build(fn, sig, const, warps, stages, div16=()):
    names = list(fn.arg_names)
    sig = {n: sig.get(n, "constexpr") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(n),): v for n, v in const.items()}, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    with tempfile.TemporaryDirectory() as d:
        open(f"{d}/k.ptx", "w").write(k.asm["ptx"])
        info = subprocess.run([f"{BIN}/ptxas-blackwell", "-arch=sm_90a", "-v", f"{d}/k.ptx", "-o", f"{d}/k.cubin"],
                              capture_output=True, text=True).stderr
        sass = subprocess.run([f"{BIN}/cuobjdump", "-sass", f"{d}/k.cubin"], capture_output=True, text=True).stdout
    regs = re.search(r"Used (\d+) registers", info).group(1)
    n = sum(1 for l in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", l))
    ttgir = k.asm["ttgir"]
    tag = "_".join(f"{a}{int(b)}" for a, b in const.items() if a in ("PREFETCH", "FLATTEN"))
    open(f"/tmp/aot_{fn.__name__}_{tag}.ttgir", "w").write(ttgir)
    return ttgir.count("scf.for"), regs, n, ttgir.count("scf.if")


i32 = lambda *ns: {n: "i32" for n in ns}
dense_sig = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "c_ptr": "*bf16", "as_ptr": "*fp32", "bs_ptr": "*fp32",
             "ws_ptr": "*bf16", **i32("M", "N", "K", "stride_am", "stride_bn", "stride_cm", "stride_asm", "stride_ask",
                                      "stride_bsn", "stride_bsk")}
grouped_sig = {"a_ptr": "*fp8e4nv", "a_desc": "tensordesc<fp8e4nv[64, 128]>", "b_ptr": "*fp8e4nv",
               "b_desc": "tensordesc<fp8e4nv[128, 128]>", "c_ptr": "*bf16", "as_ptr": "*fp32", "bs_ptr": "*fp32",
               "offs_ptr": "*i32", "tiles_ptr": "*i32", **i32("M", "N", "K", "G"),
               **i32(*[f"stride_{n}" for n in ("am", "ak", "bg", "bn", "bk", "cm", "cn", "asm", "ask", "bsg", "bsn",
                                               "bsk")])}
if __name__ == "__main__":
  for prefetch in (False, True):
      for flatten in (False, True):
          c = dict(B_BLOCKWISE=True, BLOCK_M=64, BLOCK_N=128, GROUP_M=8, NUM_PROGRAMS=264, WS=False, SPLIT_K=1,
                   PREFETCH=prefetch, FLATTEN=flatten)
          print("dense  ", f"prefetch={prefetch:d} flatten={flatten:d}", "scf.for %d, regs %s, SASS %d, scf.if %d" %
                build(gemm._fp8_gemm_tma_kernel, dense_sig, c, 4, 4, ("a_ptr", "b_ptr", "c_ptr", "K", "N",
                                                                        "stride_am", "stride_bn", "stride_cm")), flush=True)
          c = dict(BLOCK_M=64, BLOCK_N=128, NUM_PROGRAMS=396, STEPS=7, TMA=True, WS=False, EVEN_K=True,
                   PREFETCH=prefetch, FLATTEN=flatten)
          print("grouped", f"prefetch={prefetch:d} flatten={flatten:d}", "scf.for %d, regs %s, SASS %d, scf.if %d" %
                build(grouped._grouped_gemm_kernel, grouped_sig, c, 4, 3, ("a_ptr", "b_ptr", "c_ptr", "K", "N")),
                flush=True)
