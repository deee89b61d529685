"""The dense fprop/dgrad at 64x128 p2 (HEAD's default) and 128x128 w8 s4 p1: same bits on every Ling shape, 16,384 rows."""
import torch
from fp8.gemm import GemmConfig, fp8_gemm
from fp8.quant import quantize_1x128, quantize_128x128, fp8_transpose_128x128
A = GemmConfig(block_m=64, block_n=128, group_m=8, num_warps=4, num_stages=4, tma=True, persistent=True, programs_per_sm=2)
B = GemmConfig(block_m=128, block_n=128, group_m=8, num_warps=8, num_stages=4, tma=True, persistent=True)
SHAPES = {"qkv": (3072, 2048), "o_proj": (2048, 2048), "gate_up": (10240, 2048), "down": (2048, 5120),
          "shared_gate_up": (1024, 2048), "shared_down": (2048, 512)}
torch.manual_seed(0)
bad = 0
for name, (n, k) in SHAPES.items():
    for m in (16384, 4096, 1000):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        xq, xs = quantize_1x128(x); wq, ws = quantize_128x128(w); dq, ds = quantize_1x128(dy)
        wtq, wts = fp8_transpose_128x128(wq, ws)
        for kind, args in (("fprop", (xq, xs, wq, ws)), ("dgrad", (dq, ds, wtq, wts))):
            same = torch.equal(fp8_gemm(*args, config=A), fp8_gemm(*args, config=B))
            bad += not same
            print(name, m, kind, "same bits" if same else "DIFFERENT")
print("all same" if bad == 0 else f"{bad} differ")
