"""Scratch (not committed): Gluon tiles (128x128 1/SM, 64x128 2/SM) against the Triton kernels, cuBLAS blockwise
and bf16 on every Ling shape; bits against the Triton kernel in every cell ('!' = differs)."""
import functools, sys
import torch
sys.path.insert(0, "."); sys.path.insert(0, "bench")
from bench.bench_fp8_linear import SHAPES, gemm_operands, cublas_blockwise, bench_ms, tflops
from fp8.gemm import fp8_gemm, fp8_gemm_wgrad
import fp8.grouped as G
from fp8.gemm_sm90 import fp8_gemm_sm90, grouped_gemm_sm90, grouped_gemm_wgrad_sm90, Sm90GemmConfig as C
from fp8.quant import quantize_1x128, fp8_transpose_128x128
from bench.bench_moe import routing, TOPK, INTER, H
from model.dispatch import plan_dispatch

torch.manual_seed(0)
CFGS = {"G128 s4": C(), "G64 2/SM s4": C(block_m=64, num_warps=4, programs_per_sm=2, stages=4),
        "G64 2/SM s3": C(block_m=64, num_warps=4, programs_per_sm=2, stages=3)}
m = 16384
out = []
def cell(fn, ref, flops, used=None):
    try:
        o = fn()
        ok = torch.equal(o if used is None else o[:used], ref if used is None else ref[:used])
        return f"{flops / bench_ms(fn) / 1e9:.0f}{'' if ok else '!'}"
    except Exception as e:
        return "ERR " + str(e).replace("|", "/")[:50]
print("| dense (16,384 tokens) | Triton | " + " | ".join(CFGS) + " | cuBLAS blockwise | bf16 |\n|---|---|" + "---|" * (len(CFGS) + 2), flush=True)
for name, (n, k) in SHAPES.items():
    for kind in ("fprop", "dgrad", "wgrad"):
        a, a_s, b, b_s, bw, odt, a16, b16 = gemm_operands(kind, m, n, k)
        flops = 2.0 * a.shape[0] * b.shape[0] * a.shape[1]
        with G.GROUPED_TUNING.override(sm90=None):
            tri = functools.partial(fp8_gemm if bw else fp8_gemm_wgrad, a, a_s, b, b_s, out_dtype=odt)
            ref = tri(); r = [f"{name} {kind}", f"{flops / bench_ms(tri) / 1e9:.0f}"]
        r += [cell(functools.partial(fp8_gemm_sm90, a, a_s, b, b_s, odt, b_blockwise=bw, config=c), ref, flops) for c in CFGS.values()]
        try:
            cb = functools.partial(cublas_blockwise, a, a_s, b, b_s, bw, odt); cb(); r.append(f"{flops / bench_ms(cb) / 1e9:.0f}")
        except Exception:
            r.append("–")
        r.append(f"{flops / bench_ms(functools.partial(torch.matmul, a16, b16.t())) / 1e9:.0f}")
        print("| " + " | ".join(r) + " |", flush=True); out.append(r)
        del a, b, a16, b16, ref; torch.cuda.empty_cache()
print("\n| grouped (top-8, pad 16) | Triton | " + " | ".join(CFGS) + " | torch._grouped_mm bf16 |\n|---|---|" + "---|" * (len(CFGS) + 1), flush=True)
for tokens, experts in ((16384, 64), (16384, 256), (4096, 256), (4096, 64)):
    idx, _ = routing(tokens, experts)
    plan, plan_u = plan_dispatch(idx, experts, 16), plan_dispatch(idx, experts, 1)
    rows, mrows = plan.rows, tokens * TOPK
    offs_u = plan_u.rows.offsets[1:].contiguous(); used = int(rows.offsets[-1])
    for name, (n, k) in {"gate_up fwd": (2 * INTER, H), "gate_up dgrad": (H, 2 * INTER), "down fwd": (H, INTER), "down dgrad": (INTER, H)}.items():
        x = torch.randn(rows.num_rows, k, device="cuda", dtype=torch.bfloat16); x[plan.row_src < 0] = 0
        w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        xq, xs = quantize_1x128(x)
        if "dgrad" in name:
            wq, ws = fp8_transpose_128x128(*G.quantize_expert_weights(w.transpose(1, 2).contiguous()))
        else:
            wq, ws = G.quantize_expert_weights(w)
        wq = wq.contiguous(); flops = 2 * mrows * n * k
        with G.GROUPED_TUNING.override(sm90=None):
            tri = lambda: G.grouped_gemm(xq, xs, wq, ws, rows); ref = tri(); r = [f"{tokens}/{experts} {name}", f"{flops / bench_ms(tri) / 1e9:.0f}"]
        for c in CFGS.values():
            r.append(cell(lambda: grouped_gemm_sm90(xq, xs, wq, ws, rows.offsets, rows.block_offsets(c.block_m), rows.max_blocks(c.block_m) * (n // 128), config=c), ref, flops, used))
        xu = torch.randn(mrows, k, device="cuda", dtype=torch.bfloat16); wt = w.transpose(1, 2)
        r.append(f"{flops / bench_ms(lambda: torch._grouped_mm(xu, wt, offs=offs_u)) / 1e9:.0f}")
        print("| " + " | ".join(r) + " |", flush=True); out.append(r)
    for name, (n, k) in {"gate_up wgrad": (2 * INTER, H), "down wgrad": (H, INTER)}.items():
        dy = torch.randn(rows.num_rows, n, device="cuda", dtype=torch.bfloat16); xx = torch.randn(rows.num_rows, k, device="cuda", dtype=torch.bfloat16)
        dy[plan.row_src < 0] = 0; xx[plan.row_src < 0] = 0
        dyt = G.quantize_tokens_grouped(dy, rows); xt = G.quantize_tokens_grouped(xx, rows); flops = 2 * mrows * n * k
        with G.GROUPED_TUNING.override(sm90=None):
            tri = lambda: G.grouped_gemm_wgrad(*dyt, *xt, rows, out_dtype=torch.bfloat16); ref = tri()
            r = [f"{tokens}/{experts} {name}", f"{flops / bench_ms(tri) / 1e9:.0f}"]
        for c in CFGS.values():
            ob = torch.empty(experts, n, k, device="cuda", dtype=torch.bfloat16)
            r.append(cell(lambda: (grouped_gemm_wgrad_sm90(*dyt, *xt, rows.block_offsets(), ob, config=c), ob)[1], ref, flops))
        dyu = torch.randn(mrows, n, device="cuda", dtype=torch.bfloat16); xu = torch.randn(mrows, k, device="cuda", dtype=torch.bfloat16)
        r.append(f"{flops / bench_ms(lambda: torch._grouped_mm(dyu.t(), xu, offs=offs_u)) / 1e9:.0f}")
        print("| " + " | ".join(r) + " |", flush=True); out.append(r)
