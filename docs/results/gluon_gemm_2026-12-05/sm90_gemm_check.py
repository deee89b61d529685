"""Scratch (not committed): the Gluon sm_90 GEMM against the Triton GEMM, cuBLAS blockwise and bf16 on the Ling
shapes; bit-exactness against the Triton kernel and error against a float64 reference."""
import functools, sys, time
import torch, triton
sys.path.insert(0, "."); sys.path.insert(0, "bench")
from bench.bench_fp8_linear import SHAPES, gemm_operands, cublas_blockwise, bench_ms, tflops
from fp8.gemm import fp8_gemm, fp8_gemm_wgrad, GEMM_TUNING
GEMM_TUNING._overrides.append((object(), GEMM_TUNING.default.__class__(sm90=None)))  # scratch: Triton for 'Triton' rows
import fp8.grouped as _G
_G.GROUPED_TUNING._overrides.append((object(), _G.GROUPED_TUNING.default.__class__(sm90=None)))
from fp8.gemm_sm90 import fp8_gemm_sm90, Sm90GemmConfig
from fp8.quant import dequantize_1x128, dequantize_128x128, quantize_1x128, quantize_128x128, quantize_1x128_transposed
from fp8.health import relative_error

torch.manual_seed(0)
m = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
cfgs = [Sm90GemmConfig(stages=4), Sm90GemmConfig(stages=3), Sm90GemmConfig(stages=5)]
# correctness on odd shapes first
print("== odd shapes (bits against the Triton kernel)")
bad = 0
for (mm, n, k) in [(1000, 384, 640), (333, 256, 200), (128, 128, 128), (4096, 1024, 2048), (257, 640, 1152), (64, 128, 384)]:
    for bw in (True, False):
        x = torch.randn(mm, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        a, a_s = quantize_1x128(x)
        if bw:
            b, b_s = quantize_128x128(w)
        else:
            b, b_s = quantize_1x128(w)
        odt = torch.bfloat16 if bw else torch.float32
        ref_t = fp8_gemm(a, a_s, b, b_s, out_dtype=odt) if bw else fp8_gemm_wgrad(a, a_s, b, b_s, out_dtype=odt)
        for cfg in cfgs:
            out = torch.full((mm, n), float("nan"), device="cuda", dtype=odt)
            fp8_gemm_sm90(a, a_s, b, b_s, odt, b_blockwise=bw, config=cfg, out=out)
            deq = (dequantize_1x128(a, a_s, torch.float64) @ (dequantize_128x128(b, b_s, torch.float64) if bw else dequantize_1x128(b, b_s, torch.float64)).t())
            same = torch.equal(out, ref_t)
            err = float(relative_error(out.double(), deq))
            nan = int(out.isnan().sum())
            if not same or nan: bad += 1
            print(f"  {mm}x{n}x{k} bw={bw} stages={cfg.stages}: same bits as Triton {same}, err {err:.2e}, nan {nan}, maxdiff {float((out.float()-ref_t.float()).abs().max()):.3e}")
print("odd-shape failures:", bad, flush=True)

rows = []
for name, (n, k) in SHAPES.items():
    for kind in ("fprop", "dgrad", "wgrad"):
        a, a_s, b, b_s, bw, odt, a16, b16 = gemm_operands(kind, m, n, k)
        mm, nn_ = a.shape[0], b.shape[0]
        flops = 2.0 * mm * nn_ * a.shape[1]
        tri = functools.partial(fp8_gemm if bw else fp8_gemm_wgrad, a, a_s, b, b_s, out_dtype=odt)
        ref_t = tri()
        t_tri = bench_ms(tri)
        res = []
        for cfg in cfgs:
            g = functools.partial(fp8_gemm_sm90, a, a_s, b, b_s, odt, b_blockwise=bw, config=cfg)
            out = g()
            same = torch.equal(out, ref_t)
            res.append((bench_ms(g), same, cfg.stages))
        try:
            c = functools.partial(cublas_blockwise, a, a_s, b, b_s, bw, odt); c(); t_cub = bench_ms(c)
        except Exception as e:
            t_cub = float("nan")
        t_bf = bench_ms(functools.partial(torch.matmul, a16, b16.t()))
        best = min(res)
        rows.append((name, kind, f"{mm}x{nn_}x{a.shape[1]}", tflops(flops, t_tri), *[tflops(flops, r[0]) for r in res],
                     tflops(flops, t_cub), tflops(flops, t_bf), tflops(flops, best[0]) / tflops(flops, t_cub), all(r[1] for r in res)))
        print(rows[-1], flush=True)
        del a, b, a16, b16, ref_t
        torch.cuda.empty_cache()
print()
print(f"M = {m}: TFLOPS (triton.testing.do_bench medians)")
print("| shape | kind | MxNxK | Triton | Gluon s4 | Gluon s3 | Gluon s5 | cuBLAS blockwise | bf16 | best Gluon / cuBLAS | same bits |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    print("| " + " | ".join([r[0], r[1], r[2]] + [f"{v:.0f}" for v in r[3:9]] + [f"{r[9]:.2f}", str(r[10])]) + " |")

# ------------------------------------------------------------------ grouped forward / dgrad
import fp8.grouped as G
from fp8.gemm_sm90 import grouped_gemm_sm90
from fp8.quant import fp8_transpose_128x128
from bench.bench_moe import routing, TOPK, INTER, H
from model.dispatch import plan_dispatch
grows = []
cfg = Sm90GemmConfig()
for tokens, experts in ((16384, 64), (16384, 256), (4096, 256), (4096, 64)):
    idx, _ = routing(tokens, experts)
    plan = plan_dispatch(idx, experts, 16)
    plan_u = plan_dispatch(idx, experts, 1)
    rows, mrows = plan.rows, tokens * TOPK
    offs_u = plan_u.rows.offsets[1:].contiguous()
    for name, (n, k) in {"gate_up fwd": (2 * INTER, H), "gate_up dgrad": (H, 2 * INTER), "down fwd": (H, INTER), "down dgrad": (INTER, H)}.items():
        x = torch.randn(rows.num_rows, k, device="cuda", dtype=torch.bfloat16)
        x[plan.row_src < 0] = 0
        w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        xq, xs = quantize_1x128(x)
        if "dgrad" in name:
            wq0, ws0 = G.quantize_expert_weights(w.transpose(1, 2).contiguous())
            wq, ws = fp8_transpose_128x128(wq0, ws0)
        else:
            wq, ws = G.quantize_expert_weights(w)
        wq = wq.contiguous()
        flops = 2 * mrows * n * k
        tri = lambda: G.grouped_gemm(xq, xs, wq, ws, rows)
        gl_ = lambda: grouped_gemm_sm90(xq, xs, wq, ws, rows.offsets, rows.block_offsets(cfg.block_m), rows.max_blocks(cfg.block_m) * (n // 128), config=cfg)
        ref_t = tri(); out = gl_()
        used = int(rows.offsets[-1])
        same = torch.equal(out[:used], ref_t[:used])
        xu = torch.randn(mrows, k, device="cuda", dtype=torch.bfloat16)
        wt = w.transpose(1, 2)
        t_tri, t_gl = bench_ms(tri), bench_ms(gl_)
        t_bf = bench_ms(lambda: torch._grouped_mm(xu, wt, offs=offs_u))
        grows.append((tokens, experts, name, flops / t_tri / 1e9, flops / t_gl / 1e9, flops / t_bf / 1e9, same))
        print(grows[-1], flush=True)
print()
print("| tokens | experts | GEMM | Triton | Gluon | torch._grouped_mm bf16 | Gluon / Triton | same bits |")
print("|---|---|---|---|---|---|---|---|")
for r in grows:
    print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.0f} | {r[4]:.0f} | {r[5]:.0f} | {r[4]/r[3]:.2f} | {r[6]} |")

# ------------------------------------------------------------------ grouped wgrad (k-grouped)
from fp8.gemm_sm90 import grouped_gemm_wgrad_sm90
wrows = []
for tokens, experts in ((16384, 64), (16384, 256), (4096, 256), (4096, 64)):
    idx, _ = routing(tokens, experts)
    plan = plan_dispatch(idx, experts, 16)
    plan_u = plan_dispatch(idx, experts, 1)
    rows, mrows = plan.rows, tokens * TOPK
    offs_u = plan_u.rows.offsets[1:].contiguous()
    for name, (n, k) in {"gate_up wgrad": (2 * INTER, H), "down wgrad": (H, INTER)}.items():
        dy = torch.randn(rows.num_rows, n, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(rows.num_rows, k, device="cuda", dtype=torch.bfloat16)
        dy[plan.row_src < 0] = 0
        x[plan.row_src < 0] = 0
        dyt = G.quantize_tokens_grouped(dy, rows)
        xt = G.quantize_tokens_grouped(x, rows)
        flops = 2 * mrows * n * k
        same_all = True
        for odt in (torch.float32, torch.bfloat16):
            ref_t = G.grouped_gemm_wgrad(*dyt, *xt, rows, out_dtype=odt)
            out = torch.full((experts, n, k), float("nan"), device="cuda", dtype=odt)
            grouped_gemm_wgrad_sm90(*dyt, *xt, rows.block_offsets(), out)
            same_all &= torch.equal(out, ref_t)
        tri = lambda: G.grouped_gemm_wgrad(*dyt, *xt, rows, out_dtype=torch.bfloat16)
        ob = torch.empty(experts, n, k, device="cuda", dtype=torch.bfloat16)
        gl_ = lambda: grouped_gemm_wgrad_sm90(*dyt, *xt, rows.block_offsets(), ob)
        dyu = torch.randn(mrows, n, device="cuda", dtype=torch.bfloat16)
        xu = torch.randn(mrows, k, device="cuda", dtype=torch.bfloat16)
        t_tri, t_gl = bench_ms(tri), bench_ms(gl_)
        t_bf = bench_ms(lambda: torch._grouped_mm(dyu.t(), xu, offs=offs_u))
        wrows.append((tokens, experts, name, flops / t_tri / 1e9, flops / t_gl / 1e9, flops / t_bf / 1e9, same_all))
        print(wrows[-1], flush=True)
print()
print("| tokens | experts | GEMM | Triton | Gluon | torch._grouped_mm bf16 | Gluon / bf16 | same bits (fp32, bf16 out) |")
print("|---|---|---|---|---|---|---|---|")
for r in wrows:
    print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.0f} | {r[4]:.0f} | {r[5]:.0f} | {r[4]/r[5]:.2f} | {r[6]} |")
