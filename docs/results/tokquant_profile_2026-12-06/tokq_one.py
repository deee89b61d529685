"""For ncu: the gathered token-dim quantization of x at 16,384 tokens, top-8 of 64 experts, committed kernel then
the prototype (16x8 s3 w1), a few launches each."""
import os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "bench")); sys.path.insert(0, os.path.join(os.getcwd(), "scratch"))
import torch
import fp8.grouped as G
from bench_moe import H, routing
from model.dispatch import plan_dispatch
from tokq_sweep2 import pipe
idx, _ = routing(16384, 64)
plan = plan_dispatch(idx, 64, 16)
x = torch.randn(16384, H, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    G.quantize_tokens_grouped(x, plan.rows, plan.row_src)
for _ in range(3):
    pipe(x, plan.rows, plan.row_src, *(int(v) for v in os.environ.get("PIPE", "16,8,3,1").split(",")))
torch.cuda.synchronize()
