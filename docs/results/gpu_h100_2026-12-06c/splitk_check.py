"""scratch: the dense wgrad with the default split-K against the same config unsplit, bf16 and fp32 outputs, every
Ling FP8Linear shape at 16,384 and 4,096 tokens; torch.matmul bf16 beside. do_bench medians, alternating, 3 rounds."""
import dataclasses, sys, os
import torch, triton
BENCH = triton.testing.do_bench_cudagraph if os.environ.get("GRAPH") else triton.testing.do_bench
sys.path.insert(0, os.getcwd())
from fp8.gemm import default_gemm_config, fp8_gemm_wgrad, fp8_gemm_wgrad_ref, wgrad_splits
from fp8.quant import quantize_1x128_transposed
from kernels.backend import cdiv

SHAPES = {"qkv": (3072, 2048), "o_proj": (2048, 2048), "gate_up": (10240, 2048), "down": (2048, 5120),
          "shared_gate_up": (1024, 2048), "shared_down": (2048, 512)}
rows = []
forced = []
print(torch.cuda.get_device_name(), flush=True)
for tokens in (16384, 4096):
    for name, (n, k) in SHAPES.items():
        torch.manual_seed(0)
        dy = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16) * 1e-3
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        a, a_s = quantize_1x128_transposed(dy)
        b, b_s = quantize_1x128_transposed(x)
        ref = fp8_gemm_wgrad_ref(a, a_s, b, b_s, torch.float64)
        a16, b16 = dy.t().contiguous(), x.t().contiguous()
        flops = 2.0 * n * k * tokens
        for odt in (torch.bfloat16, torch.float32):
            cfg = default_gemm_config(n, "wgrad", odt)
            tiles = cdiv(n, cfg.block_m) * cdiv(k, cfg.block_n)
            s = wgrad_splits(tiles, cdiv(tokens, 128), cfg.programs_per_sm, cfg.split_k)
            unsplit = dataclasses.replace(cfg, split_k=1)
            o1 = fp8_gemm_wgrad(a, a_s, b, b_s, out_dtype=odt)
            o2 = fp8_gemm_wgrad(a, a_s, b, b_s, out_dtype=odt, config=unsplit)
            e1 = float((o1.double() - ref).norm() / ref.norm()); e2 = float((o2.double() - ref).norm() / ref.norm())
            t1, t2, tb = [], [], []
            for _ in range(3):
                t1.append(BENCH(lambda: fp8_gemm_wgrad(a, a_s, b, b_s, out_dtype=odt), rep=50, return_mode="median"))
                t2.append(BENCH(lambda: fp8_gemm_wgrad(a, a_s, b, b_s, out_dtype=odt, config=unsplit), rep=50, return_mode="median"))
                tb.append(BENCH(lambda: torch.matmul(a16, b16.t()), rep=50, return_mode="median"))
            m1, m2, mb = sorted(t1)[1], sorted(t2)[1], sorted(tb)[1]
            tf = lambda ms: flops / ms / 1e9
            rows.append((tokens, name, str(odt).split(".")[1], tiles, s, tf(m2), tf(m1), m2 / m1, tf(mb), e2, e1))
            print(rows[-1], flush=True)
            if name.startswith("shared"):  # forced splits beside the rule's
                for fs in (2, 4):
                    c = dataclasses.replace(cfg, split_k=fs)
                    ms = sorted(BENCH(lambda: fp8_gemm_wgrad(a, a_s, b, b_s, out_dtype=odt, config=c), rep=50, return_mode="median") for _ in range(3))[1]
                    forced.append((tokens, name, str(odt).split(".")[1], fs, flops / ms / 1e9, m2 / ms))
        del dy, x, a, b, ref, a16, b16
        torch.cuda.empty_cache()
print("\n| tokens | shape | out | tiles | splits | unsplit TFLOPS | default TFLOPS | speed-up | bf16 matmul TFLOPS | err unsplit | err default |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {r[5]:.0f} | {r[6]:.0f} | {r[7]:.2f}x | {r[8]:.0f} | {r[9]:.1e} | {r[10]:.1e} |")
print("\n| tokens | shape | out | forced splits | TFLOPS | vs unsplit |\n|---|---|---|---|---|---|")
for r in forced:
    print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]:.0f} | {r[5]:.2f}x |")
