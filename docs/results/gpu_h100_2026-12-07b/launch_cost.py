"""Host cost per launch: fp8_gemm with the Triton kernel vs the warp-specialised Gluon kernel (small, host-bound shape),
and the GPU time of the QKV forward shape for both."""
import os, sys, time
import torch, triton
sys.path.insert(0, os.getcwd())
from fp8.gemm import fp8_gemm
from fp8.kernel_choice import gemm_kernels
from fp8.quant import quantize_1x128, quantize_128x128
for m, n, k in ((256, 256, 256), (8192, 2560, 2048)):
    a, s = quantize_1x128(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
    b, t = quantize_128x128(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
    for kern in ("triton", "gluon_ws"):
        with gemm_kernels(kern):
            for _ in range(20):
                fp8_gemm(a, s, b, t)
            torch.cuda.synchronize()
            reps = 2000 if m == 256 else 200
            t0 = time.perf_counter()
            for _ in range(reps):
                fp8_gemm(a, s, b, t)
            host = (time.perf_counter() - t0) / reps * 1e6
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / reps * 1e6
            gpu = triton.testing.do_bench_cudagraph(lambda: fp8_gemm(a, s, b, t), rep=50) * 1e3
        print(f"{m}x{n}x{k} {kern:9s} host {host:6.1f} us/launch, wall {wall:7.1f} us, GPU (graph) {gpu:7.1f} us", flush=True)

import cProfile, pstats
a, s = quantize_1x128(torch.randn(256, 256, device="cuda", dtype=torch.bfloat16))
b, t = quantize_128x128(torch.randn(256, 256, device="cuda", dtype=torch.bfloat16))
with gemm_kernels("gluon_ws"):
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(500):
        fp8_gemm(a, s, b, t)
    prof.disable()
pstats.Stats(prof).sort_stats("tottime").print_stats(14)
