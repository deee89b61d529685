"""Smoke: one small dense GEMM per warp-specialised variant, bits against the Triton kernel (a hang shows as a timeout)."""
import os, sys
import torch
sys.path.insert(0, os.getcwd())
from fp8.gemm import GEMM_TUNING, fp8_gemm
from fp8.gemm_sm90 import Sm90GemmConfig, fp8_gemm_sm90
from fp8.quant import quantize_1x128, quantize_128x128
torch.manual_seed(0)
for m, n, k in ((256, 256, 256), (1000, 384, 640), (4096, 2048, 2048)):
    a, a_s = quantize_1x128(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
    b, b_s = quantize_128x128(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
    with GEMM_TUNING.override(sm90=None):
        ref = fp8_gemm(a, a_s, b, b_s, torch.bfloat16)
    for carry in (False, True):
        got = fp8_gemm_sm90(a, a_s, b, b_s, torch.bfloat16, b_blockwise=True,
                            config=Sm90GemmConfig(warp_specialized=True, carry=carry))
        torch.cuda.synchronize()
        print(m, n, k, "carry" if carry else "plain", "bits equal" if torch.equal(got, ref) else
              f"DIFFER max {(got.float() - ref.float()).abs().max().item():.3g}", flush=True)
