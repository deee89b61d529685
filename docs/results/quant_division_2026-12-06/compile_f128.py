import os, sys, time
sys.path.insert(0, os.getcwd())
import torch
from fp8.quant import QUANT_TUNING, quantize_1x128_transposed
x = torch.randn(256, 300, device="cuda", dtype=torch.bfloat16)
for opts in ({"col_block_f": 128, "trans32": False}, {"col_block_f": 128, "col_warps": 4}, {"col_block_f": 32, "col_warps": 4, "col_features_first": False}):
    t = time.time()
    with QUANT_TUNING.override(**opts):
        quantize_1x128_transposed(x); torch.cuda.synchronize()
    print(sys.argv[1], opts, f"first call {time.time() - t:.1f} s", flush=True)
