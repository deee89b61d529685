"""FP8 MoE benchmark at Ling-mini-2.0's expert shapes (hidden 2048, expert intermediate 512, top-8 over 8 groups):
grouped GEMMs, the whole MoE layer forward+backward, the padded-row fraction and a kernel profile.

    python bench/bench_moe.py [--tokens 4096,16384] [--experts 256] [--sweep] [--profile] [--out DIR]
    python bench/bench_moe.py --dispatch [--tokens ...]      # the ep_size=1 dispatch alone (compare commits)
    torchrun --nproc_per_node N bench/bench_moe.py --ep [--tokens ...]   # expert parallelism over N GPUs

Grouped GEMMs (TFLOPS = 2·(routed rows)·N·K / median time; our padded rows are not counted): ours (blockwise
FP8, fp8/grouped.py, with routing-map padding to 16) vs `torch._grouped_mm` bf16 vs `torch._scaled_grouped_mm`
with rowwise FP8 scales (cuBLAS/CUTLASS; forward and dgrad only); ours and bf16 also as GPU time (replayed from
a CUDA graph), since at 4,096 tokens a kernel can be shorter than its launch's host time. MoE layer: router +
dispatch + experts + combine + shared expert, forward+backward, FP8 (padding on/off; with `fp8.expert_wgrad=bf16`)
vs bf16, weights cached as within one optimizer step of gradient accumulation. Quantizers: the experts' row and
token-dim quantizations, median ms. Routing comes from the real router with random weights and a mild imbalance.
Markdown tables are printed last.

`--dispatch`: the dispatch of one layer without expert parallelism, on its own: the router's expert selection
(`kernels.routing.select_experts`, the kernel and its PyTorch reference, on random scores), `plan_dispatch`
(routing-map padding to 16) and the bf16 permute + combine forward+backward, median ms, plus the host syncs counted by
CUDA's sync debug mode (0). `--ep` (under torchrun, N ranks = N GPUs, each routing its own tokens): one MoE
layer forward+backward with moe.ep_size = N against the layer holding all experts on the same tokens per GPU
(slowest rank's median), the all-to-all of one layer's rows alone, and the host syncs of one forward (1: the
split sizes). Timed with a fixed number of iterations so that every rank issues the same collectives.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_fp8_linear import SM90_SWEEP, gpu_busy_ms  # noqa: E402

from fp8 import grouped as G  # noqa: E402
from fp8.kernel_choice import gemm_kernels  # noqa: E402
from fp8.quant import QUANT_TUNING, fp8_transpose_128x128, quantize_1x128  # noqa: E402
from kernels.routing import select_experts, select_experts_ref  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from model.dispatch import permute, plan_dispatch, unpermute  # noqa: E402
from model.graphs import LayerGraphs  # noqa: E402
from model.moe import MoE, Router  # noqa: E402

H, INTER, TOPK = 2048, 512, 8


def bench(fn, warmup: int = 10, rep: int = 50) -> float:
    """Median milliseconds (CUDA events, triton.testing.do_bench)."""
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def graph_ms(fn, rep: int = 50) -> float:
    """Median milliseconds of `fn` replayed from a CUDA graph (triton.testing.do_bench_cudagraph): its GPU time
    alone, where `bench` also counts host time whenever the launch takes longer than the kernel; NaN (with a line)
    if `fn` cannot be captured."""
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")
    except Exception as err:  # noqa: BLE001 - a kernel that cannot be captured gets no GPU-time figure
        print(f"graph timing failed: {type(err).__name__}: {str(err)[:200]}", flush=True)
        return float("nan")


def fixed_ms(fn, iters: int = 20, warmup: int = 5) -> float:
    """Median ms of `iters` calls after `warmup` (CUDA events; a fixed count, so that every rank of a
    distributed run issues the same collectives, which do_bench's adaptive count would not)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def host_syncs(fn) -> int:
    """How many times `fn` makes the host wait for the GPU (CUDA's sync debug mode warns once per sync)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def cell(value: float, fmt: str = ".0f") -> str:
    """A table cell: n/a where the figure is NaN (a variant that did not run, a call that could not be captured)."""
    return "n/a" if value != value else format(value, fmt)


def imbalance_bias(experts: int) -> torch.Tensor:
    """An expert bias that makes some experts busier than others (fp32 [experts] on the GPU)."""
    return torch.linspace(0, 0.02, experts, device="cuda")


def routing(tokens: int, experts: int, seed: int = 0):
    """top-8 choices and gates of the real router (random weights, a mild preference for some experts)."""
    cfg = ModelConfig.preset("ling_mini_2_0", num_experts=experts)
    torch.manual_seed(seed)
    router = Router(cfg).cuda()
    torch.nn.init.normal_(router.weight, std=0.02)
    with torch.no_grad():
        router.expert_bias += imbalance_bias(experts)
        x = torch.randn(tokens, H, device="cuda")
        out = router(x)
    return out.topk_idx, out.topk_weight


def rowwise_fp8(x: torch.Tensor):
    """Rowwise E4M3 quantization along the last dim → (q, dequant scale)."""
    amax = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-12)
    scale = amax / 448.0
    return (x.float() / scale).to(torch.float8_e4m3fn), scale.squeeze(-1)


def gemm_rows(tokens: int, experts: int) -> list[dict]:
    """Time the six grouped GEMMs of one MoE layer for ours, bf16 and rowwise FP8."""
    idx, _ = routing(tokens, experts)
    plan = plan_dispatch(idx, experts, 16)
    plan_u = plan_dispatch(idx, experts, 1)
    rows, m = plan.rows, tokens * TOPK
    offs_u = plan_u.rows.offsets[1:].contiguous()
    results = []
    shapes = {  # name: (N, K) of out = x · Wᵀ with W [E, N, K]
        "gate_up fwd": (2 * INTER, H), "gate_up dgrad": (H, 2 * INTER), "down fwd": (H, INTER),
        "down dgrad": (INTER, H),
    }  # fmt: skip
    for name, (n, k) in shapes.items():
        x = torch.randn(rows.num_rows, k, device="cuda", dtype=torch.bfloat16)
        x[plan.row_src < 0] = 0
        w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        xq, xs = quantize_1x128(x)
        if "dgrad" in name:  # dgrad reads the on-demand transpose of the [E, K, N] weight
            wq0, ws0 = G.quantize_expert_weights(w.transpose(1, 2).contiguous())
            wq, ws = fp8_transpose_128x128(wq0, ws0)
        else:
            wq, ws = G.quantize_expert_weights(w)
        flops = 2 * m * n * k
        ours = bench(lambda: G.grouped_gemm(xq, xs, wq, ws, rows))  # noqa: B023
        ours_gpu = graph_ms(lambda: G.grouped_gemm(xq, xs, wq, ws, rows))  # noqa: B023
        with G.GROUPED_TUNING.override(sm90=None, sm90_wgrad=None):
            triton_ms = bench(lambda: G.grouped_gemm(xq, xs, wq, ws, rows))  # noqa: B023
        xu = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        wt = w.transpose(1, 2)
        bf16 = bench(lambda: torch._grouped_mm(xu, wt, offs=offs_u))  # noqa: B023
        bf16_gpu = graph_ms(lambda: torch._grouped_mm(xu, wt, offs=offs_u))  # noqa: B023
        bq, b_s = rowwise_fp8(w)  # [E, N, K] rows along K
        scaled = float("nan")
        for a_in, offs in ((xu, offs_u), (x, rows.offsets[1:].contiguous())):  # it may need 16-aligned groups
            try:
                aq, a_s = rowwise_fp8(a_in)
                scaled = bench(lambda: torch._scaled_grouped_mm(aq, bq.transpose(1, 2), a_s, b_s, offs=offs,  # noqa: B023
                                                                out_dtype=torch.bfloat16, use_fast_accum=True))
                break
            except Exception as err:  # pragma: no cover - depends on the torch build
                print(f"_scaled_grouped_mm failed for {name}: {str(err)[:300]}", flush=True)
        results.append({"gemm": name, "tokens": tokens, "n": n, "k": k, "ours": flops / ours / 1e9,
                        "triton": flops / triton_ms / 1e9, "bf16": flops / bf16 / 1e9,
                        "scaled": flops / scaled / 1e9, "ours_gpu": flops / ours_gpu / 1e9,
                        "bf16_gpu": flops / bf16_gpu / 1e9})  # fmt: skip
    for name, (n, k) in {"gate_up wgrad": (2 * INTER, H), "down wgrad": (H, INTER)}.items():
        dy = torch.randn(rows.num_rows, n, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(rows.num_rows, k, device="cuda", dtype=torch.bfloat16)
        dy[plan.row_src < 0] = 0
        x[plan.row_src < 0] = 0
        dyt = G.quantize_tokens_grouped(dy, rows)
        xt = G.quantize_tokens_grouped(x, rows)
        flops = 2 * m * n * k
        ours = bench(lambda: G.grouped_gemm_wgrad(*dyt, *xt, rows, out_dtype=torch.bfloat16))  # noqa: B023
        ours_gpu = graph_ms(lambda: G.grouped_gemm_wgrad(*dyt, *xt, rows, out_dtype=torch.bfloat16))  # noqa: B023
        with G.GROUPED_TUNING.override(sm90=None, sm90_wgrad=None):
            triton_ms = bench(lambda: G.grouped_gemm_wgrad(*dyt, *xt, rows, out_dtype=torch.bfloat16))  # noqa: B023
        dyu = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        xu = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        bf16 = bench(lambda: torch._grouped_mm(dyu.t(), xu, offs=offs_u))  # noqa: B023
        bf16_gpu = graph_ms(lambda: torch._grouped_mm(dyu.t(), xu, offs=offs_u))  # noqa: B023
        results.append({"gemm": name, "tokens": tokens, "n": n, "k": k, "ours": flops / ours / 1e9,
                        "triton": flops / triton_ms / 1e9, "bf16": flops / bf16 / 1e9,
                        "scaled": float("nan"), "ours_gpu": flops / ours_gpu / 1e9,
                        "bf16_gpu": flops / bf16_gpu / 1e9})  # fmt: skip
    return results


def quant_rows(tokens: int, experts: int) -> list[dict]:
    """The experts' quantizers: the routed tokens' two quantizations (gathered x [T, H] bf16 → rows along K and the
    block-aligned token-dim operand) and the other two token-dim operands (dh, the SwiGLU output from FP8 h). GB/s
    of the pair count one gathered read of x and both codes written."""
    idx, _ = routing(tokens, experts)
    plan = plan_dispatch(idx, experts, 16)
    rows, src = plan.rows, plan.row_src
    x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
    routed = int(rows.offsets[-1])
    gbytes = routed * H * (2 + 2) / 1e9
    rows_ms = bench(lambda: G.quantize_rows_gathered(x, src, rows))
    tokens_ms = bench(lambda: G.quantize_tokens_grouped(x, rows, src))
    pair_ms = bench(lambda: (G.quantize_rows_gathered(x, src, rows), G.quantize_tokens_grouped(x, rows, src)))
    out = [{"tokens": tokens, "kernel": "rows (gathered)", "ms": rows_ms},
           {"tokens": tokens, "kernel": "tokens (gathered, block-aligned)", "ms": tokens_ms},
           {"tokens": tokens, "kernel": "rows + tokens", "ms": pair_ms, "gbs": gbytes / pair_ms * 1e3}]  # fmt: skip
    dh = torch.randn(rows.num_rows, 2 * INTER, device="cuda", dtype=torch.bfloat16)
    h_q, h_s = quantize_1x128(torch.randn(rows.num_rows, 2 * INTER, device="cuda", dtype=torch.bfloat16))
    row_gate = torch.rand(rows.num_rows, device="cuda")
    dh_ms = bench(lambda: G.quantize_tokens_grouped(dh, rows))
    a_ms = bench(lambda: G.swiglu_quantize_tokens(h_q, h_s, row_gate, rows))
    out += [{"tokens": tokens, "kernel": f"tokens (dh [R, {2 * INTER}])", "ms": dh_ms},
            {"tokens": tokens, "kernel": "tokens (SwiGLU output from FP8 h)", "ms": a_ms},
            {"tokens": tokens, "kernel": "tokens: gathered x + dh + SwiGLU output", "ms": tokens_ms + dh_ms + a_ms}]
    return out


def correctness(tokens: int, experts: int) -> dict:
    """Norm-relative error of our forward GEMM against float64 of the dequantized operands (fresh inputs)."""
    from fp8.quant import dequantize_1x128, dequantize_128x128

    idx, _ = routing(tokens, experts, seed=7)
    plan = plan_dispatch(idx, experts, 16)
    rows = plan.rows
    x = torch.randn(rows.num_rows, H, device="cuda", dtype=torch.bfloat16)
    x[plan.row_src < 0] = 0
    w = torch.randn(experts, 2 * INTER, H, device="cuda", dtype=torch.bfloat16) * 0.02
    xq, xs = quantize_1x128(x)
    wq, ws = G.quantize_expert_weights(w)
    out = G.grouped_gemm(xq, xs, wq, ws, rows, out_dtype=torch.float32)
    offs = rows.offsets.tolist()
    err_num = err_den = 0.0
    for e in range(0, experts, max(1, experts // 16)):
        lo, hi = offs[e], offs[e + 1]
        if hi == lo:
            continue
        ref = dequantize_1x128(xq[lo:hi], xs[lo:hi], torch.float64) @ dequantize_128x128(wq[e], ws[e],
                                                                                      torch.float64).t()
        err_num += float((out[lo:hi].double() - ref).norm() ** 2)
        err_den += float(ref.norm() ** 2)
    return {"fwd_rel_err": (err_num / err_den) ** 0.5}


def layer_rows(tokens: int, experts: int) -> list[dict]:
    """MoE layer forward+backward: bf16, FP8 with padding, FP8 without, FP8 with the Triton expert wgrad where the
    default takes the Gluon one, FP8 with the bf16 expert wgrad (`fp8.expert_wgrad=bf16`), FP8 with
    `fp8.gemm_kernel=gluon_ws`, and bf16 / FP8 (and FP8 with gluon_ws) replayed from CUDA graphs
    (`model.cuda_graphs`: the layer's forward and backward captured by `model.graphs.LayerGraphs`). Saved
    activations via saved-tensor hooks (the eager forward's, also for the graphed rows)."""
    results = []
    base = ModelConfig.preset("ling_mini_2_0", num_experts=experts)
    variants = {"bf16": base, "fp8, padding on": base.replace(precision="fp8"),
                "fp8, padding off": base.replace(precision="fp8", pad_for_fp8=False),
                "fp8, Triton wgrad": base.replace(precision="fp8"),
                "fp8, bf16 wgrad": base.replace(precision="fp8", fp8_expert_wgrad="bf16"),
                "fp8, gluon_ws": base.replace(precision="fp8"),
                "bf16, CUDA graph": base, "fp8, CUDA graph": base.replace(precision="fp8"),
                "fp8, gluon_ws, CUDA graph": base.replace(precision="fp8")}  # fmt: skip
    torch.manual_seed(0)
    state = None
    for name, cfg in variants.items():
        # "fp8, Triton wgrad": the expert wgrad on the Triton kernel also where the default takes the Gluon one
        tuning = {"sm90_wgrad": None} if name == "fp8, Triton wgrad" else {}
        # "fp8, gluon_ws": the warp-specialised Gluon GEMMs (fp8.gemm_kernel=gluon_ws)
        with G.GROUPED_TUNING.override(**tuning), gemm_kernels("gluon_ws" if "gluon_ws" in name else "auto"):
            results.append(layer_variant(name, cfg, tokens, experts, state, graphed=name.endswith("CUDA graph")))
        state = results[-1].pop("state")
        torch.cuda.empty_cache()
    return results


def layer_variant(name: str, cfg: ModelConfig, tokens: int, experts: int, state: dict | None,
                  graphed: bool = False) -> dict:
    """One row of `layer_rows`; `state` the weights of the first variant (None: this is it, initialize);
    `graphed`: forward and backward replayed from CUDA graphs."""
    moe = MoE(cfg).cuda().bfloat16()
    if state is None:
        for p in moe.parameters():
            torch.nn.init.normal_(p, std=0.02)
        with torch.no_grad():
            moe.router.expert_bias += imbalance_bias(experts)
        state = moe.state_dict()
    moe.load_state_dict(state)
    x = torch.randn(1, tokens, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    graphs = LayerGraphs([moe], [False]) if graphed else None

    def step(moe=moe, x=x, g=g):
        for p in moe.parameters():  # as each micro-batch's own gradients: no accumulation kernels
            p.grad = None
        x.grad = None
        out, _ = graphs.run(0, x) if graphs is not None and graphs.ready([(x,)]) else moe(x)
        out.backward(g)

    step()
    saved = [0]

    def pack(t, saved=saved):
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _ = moe(x)
    del out
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    ms = bench(step)
    peak = torch.cuda.max_memory_allocated() - before
    busy = gpu_busy_ms(step)
    flops = 6 * tokens * TOPK * 3 * H * INTER  # routed experts' matmul FLOPs, fwd + bwd
    return {"variant": name, "tokens": tokens, "ms": ms, "busy_ms": busy, "expert_tflops": flops / ms / 1e9,
            "saved_mib": saved[0] / 2**20, "peak_mib": peak / 2**20, "state": state}  # fmt: skip


def dispatch_rows(tokens: int, experts: int) -> dict:
    """ep_size=1: the router's expert selection (the kernel and its PyTorch reference), plan_dispatch alone and the
    bf16 permute + combine forward+backward (no experts)."""
    idx, _ = routing(tokens, experts)
    cfg = ModelConfig.preset("ling_mini_2_0", num_experts=experts)
    scores = torch.rand(tokens, experts, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    bias = imbalance_bias(experts)
    select = (cfg.num_expert_groups, cfg.topk_groups, cfg.num_experts_per_tok)
    x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    plan = plan_dispatch(idx, experts, 16)

    def move():
        x.grad = None
        unpermute(permute(x, plan), plan).backward(g)

    return {"tokens": tokens, "experts": experts, "select_ms": bench(lambda: select_experts(scores, bias, *select)),
            "select_ref_ms": bench(lambda: select_experts_ref(scores, bias, *select)),
            "plan_ms": bench(lambda: plan_dispatch(idx, experts, 16)), "move_ms": bench(move),
            "syncs": host_syncs(lambda: plan_dispatch(idx, experts, 16))}  # fmt: skip


def ep_rows(tokens: int, experts: int) -> list[dict]:
    """moe.ep_size = world against the whole layer, `tokens` per GPU (run under torchrun)."""
    base = ModelConfig.preset("ling_mini_2_0", num_experts=experts)
    variants = {"bf16": base, "fp8": base.replace(precision="fp8")}
    results = [ep_variant(name, cfg, tokens) for name, cfg in variants.items()]
    torch.cuda.empty_cache()
    return results


def ep_variant(name: str, cfg: ModelConfig, tokens: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    whole = MoE(cfg).cuda().bfloat16()
    for p in whole.parameters():
        torch.nn.init.normal_(p, std=0.02)
    split = MoE(cfg.replace(ep_size=world), dist.group.WORLD).cuda().bfloat16()
    shard = split.experts.local_experts
    split.load_state_dict({k: v[shard] if ".experts." in f".{k}" else v for k, v in whole.state_dict().items()})
    torch.manual_seed(1 + rank)
    x = torch.randn(1, tokens, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)

    def step(moe):
        for p in moe.parameters():
            p.grad = None
        x.grad = None
        moe(x)[0].backward(g)

    rows = torch.randn(tokens * TOPK, H, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(rows)
    times = torch.tensor([fixed_ms(lambda: step(whole)), fixed_ms(lambda: step(split)),
                          fixed_ms(lambda: dist.all_to_all_single(out, rows))], device="cuda")
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    with torch.no_grad():
        syncs = host_syncs(lambda: split(x))
    return {"variant": name, "tokens": tokens, "ep": world, "whole_ms": float(times[0]), "ep_ms": float(times[1]),
            "a2a_ms": float(times[2]), "syncs": syncs}


def padded_fraction(tokens: int, experts: int) -> dict:
    idx, _ = routing(tokens, experts)
    plan = plan_dispatch(idx, experts, 16)
    real = tokens * TOPK
    padded = int(plan.rows.offsets[-1])
    counts = plan.tokens_per_expert.float()
    return {"tokens": tokens, "experts": experts, "pad_fraction": (padded - real) / real,
            "load_max_over_mean": float(counts.max() / counts.mean())}  # fmt: skip


def sweep(tokens: int, experts: int) -> list[dict]:
    """Tile configurations of the forward/dgrad kernel on the three fprop shapes and of the wgrad kernel on both
    wgrad shapes, the row blocks of the SwiGLU kernels, the token-dim quantizers' chunks, warps and grid orders and
    the gathered row quantizer's grid order; returns timings (TFLOPS or ms)."""
    idx, gates = routing(tokens, experts)
    plan = plan_dispatch(idx, experts, 16)
    rows = plan.rows
    m = tokens * TOPK
    rand = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    out = []

    def timed(kind, cfg, fn, flops):
        try:
            ms = bench(fn, warmup=5, rep=20)
            out.append({"kind": kind, "cfg": cfg, "tflops": flops / ms / 1e9 if flops else None, "ms": ms})
        except Exception as err:
            out.append({"kind": kind, "cfg": cfg, "error": str(err)[:200]})

    fprop_cases = []
    for n, k in ((2 * INTER, H), (H, INTER), (H, 2 * INTER)):  # gate_up fwd, down fwd, gate_up dgrad
        xq, xs = quantize_1x128(rand(rows.num_rows, k))
        wq, ws = G.quantize_expert_weights(rand(experts, n, k))
        fprop_cases.append((n, k, xq, xs, wq, ws))
    fwd_tiles = [(64, 128, 4, 4, 3), (64, 128, 4, 3, 3), (64, 128, 8, 4, 2), (128, 128, 8, 3, 1), (128, 128, 8, 4, 1),
                 (64, 256, 8, 3, 1), (128, 256, 8, 3, 1)]  # (block_m, block_n, warps, stages, programs per SM)
    fwd_configs = [G.GroupedGemmConfig(bm, bn, warps, stages, tma, ws_, ppsm)
                   for (bm, bn, warps, stages, ppsm), (tma, ws_) in itertools.product(
                       fwd_tiles, [(True, False), (True, True), (False, False)])]  # fmt: skip
    # the tiles loading the next K block's scales ahead (the default: GroupedConfig.fprop), also with fewer programs
    # per SM, whose overlap the prefetch may make unnecessary; and with the tile and K loops flattened into one
    # (off by default: slower as measured, docs/kernel_tuning.md)
    fwd_configs += [G.GroupedGemmConfig(64, 128, 4, stages, True, False, ppsm, prefetch_scales=True)
                    for stages, ppsm in ((3, 3), (3, 2), (4, 1))]  # fmt: skip
    fwd_configs += [G.GroupedGemmConfig(64, 128, 4, 3, True, False, 3, prefetch_scales=prefetch, flatten=True)
                    for prefetch in (False, True)]  # fmt: skip
    for cfg in fwd_configs:
        with G.GROUPED_TUNING.override(fprop=cfg):
            for n, k, xq, xs, wq, ws in fprop_cases:
                timed(f"fprop N={n} K={k}", str(cfg), lambda: G.grouped_gemm(xq, xs, wq, ws, rows), 2 * m * n * k)  # noqa: B023
    for cfg in SM90_SWEEP:  # the Hopper Gluon kernel's tiles, the forward/dgrad GEMMs
        with G.GROUPED_TUNING.override(sm90=cfg):
            for n, k, xq, xs, wq, ws in fprop_cases:
                timed(f"fprop N={n} K={k}", str(cfg), lambda: G.grouped_gemm(xq, xs, wq, ws, rows), 2 * m * n * k)  # noqa: B023
    wgrad_cases = []
    for n, k in ((2 * INTER, H), (H, INTER)):
        wgrad_cases.append((n, k, G.quantize_tokens_grouped(rand(rows.num_rows, n), rows),
                            G.quantize_tokens_grouped(rand(rows.num_rows, k), rows)))  # fmt: skip
    wgrad_tiles = [(128, 64, 4, 3, 2), (128, 64, 4, 3, 1), (128, 64, 4, 4, 1), (128, 64, 8, 3, 2), (128, 32, 4, 4, 2),
                   (256, 64, 8, 3, 1), (128, 128, 8, 3, 1), (64, 128, 4, 3, 2)]  # the k-grouped kernel's
    wgrad_configs = [G.GroupedGemmConfig(bm, bn, warps, stages, tma, False, ppsm)
                     for (bm, bn, warps, stages, ppsm), tma in itertools.product(wgrad_tiles, (True, False))]
    wgrad_configs += [G.GroupedGemmConfig(128, 64, 4, 3, True, False, ppsm, prefetch_scales=True)
                      for ppsm in (2, 1)]  # with the scales loaded ahead
    for cfg in wgrad_configs:
        # sm90_wgrad=None: the Triton tiles themselves, also where the experts' segments are short enough for the
        # default to hand the wgrad to the Gluon kernel (256 experts: 5 token blocks each at 16,384 tokens)
        with G.GROUPED_TUNING.override(wgrad=cfg, sm90_wgrad=None):
            for n, k, dyt, xt in wgrad_cases:
                timed(f"wgrad N={n} K={k}", str(cfg),
                      lambda: G.grouped_gemm_wgrad(*dyt, *xt, rows, out_dtype=torch.bfloat16), 2 * m * n * k)  # noqa: B023
    for cfg in [c for c in SM90_SWEEP if not c.warp_specialized]:  # that one runs forward/dgrad only
        with G.GROUPED_TUNING.override(sm90=cfg):
            for n, k, dyt, xt in wgrad_cases:
                timed(f"wgrad N={n} K={k}", str(cfg),
                      lambda: G.grouped_gemm_wgrad(*dyt, *xt, rows, out_dtype=torch.bfloat16), 2 * m * n * k)  # noqa: B023
    h = rand(rows.num_rows, 2 * INTER)
    row_gate = torch.rand(rows.num_rows, device="cuda")
    a_q, a_s, h_q, h_s = G.swiglu_quantize(h, row_gate, rows)
    da = rand(rows.num_rows, INTER)
    for bm in (8, 16, 32, 64):
        with G.GROUPED_TUNING.override(swiglu_block_m=bm, swiglu_bwd_block_m=bm):
            timed("swiglu fwd", f"block_m={bm}", lambda: G.swiglu_quantize(h, row_gate, rows), None)
            timed("swiglu bwd", f"block_m={bm}", lambda: G.swiglu_backward(h_q, h_s, da, row_gate, rows), None)
    x = rand(tokens, H)
    dh = h  # any bf16 [R, 2I] stands for dh here: the quantizer's time does not depend on the values
    for f, warps in ((16, 1), (16, 2), (32, 2)):  # the token-dim quantizers: chunk, warps and both grid orders
        for ff in (True, False):
            cfg = dict(tokens_block_f=f, tokens_warps=warps, tokens_features_first=ff, gathered_features_first=ff)
            with G.GROUPED_TUNING.override(**cfg):
                timed("tokens quant (gathered x)", str(cfg), lambda: G.quantize_tokens_grouped(x, rows, plan.row_src),
                      None)  # fmt: skip
                timed("tokens quant (dh)", str(cfg), lambda: G.quantize_tokens_grouped(dh, rows), None)
                timed("tokens quant (SwiGLU output)", str(cfg),
                      lambda: G.swiglu_quantize_tokens(h_q, h_s, row_gate, rows), None)  # fmt: skip
    for ff in (False, True):  # the row kernel's grid order (fp8/quant.py's QuantConfig)
        with QUANT_TUNING.override(gathered_row_features_first=ff):
            timed("rows quant (gathered x)", f"gathered_row_features_first={ff}",
                  lambda: G.quantize_rows_gathered(x, plan.row_src, rows), None)  # fmt: skip
    return out


def profile(tokens: int, experts: int) -> str:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    cfg = ModelConfig.preset("ling_mini_2_0", num_experts=experts, precision="fp8")
    moe = MoE(cfg).cuda().bfloat16()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(1, tokens, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    for _ in range(3):
        moe(x)[0].backward(g)
    torch.cuda.synchronize()
    with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            moe(x)[0].backward(g)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--skip-gemm", action="store_true")
    ap.add_argument("--skip-layer", action="store_true")
    ap.add_argument("--dispatch", action="store_true", help="only the ep_size=1 dispatch table")
    ap.add_argument("--ep", action="store_true", help="only the expert-parallel table (under torchrun)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    token_counts = [int(t) for t in args.tokens.split(",")]
    if args.ep:  # under torchrun: one GPU per rank, before anything touches CUDA
        import os

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    report: dict = {"device": torch.cuda.get_device_name()}
    if args.dispatch or args.ep:
        return dispatch_or_ep(args, token_counts, report)
    if args.sweep:
        report["sweep"] = sweep(token_counts[-1], args.experts)
        for kind in dict.fromkeys(r["kind"] for r in report["sweep"]):
            ranked = sorted((r for r in report["sweep"] if r["kind"] == kind and "ms" in r), key=lambda r: r["ms"])
            best = [f"  {r['ms']:.3f} ms {r['tflops'] or 0:.0f} TFLOPS {r['cfg']}" for r in ranked[:4]]
            print(f"sweep {kind}:", *best,
                  sep="\n", flush=True)
    report["correctness"] = correctness(token_counts[0], args.experts)
    print("correctness:", report["correctness"], flush=True)
    report["padding"] = [padded_fraction(t, e) for t in token_counts for e in (args.experts, 64)]
    if not args.skip_gemm:
        report["gemm"] = [r for t in token_counts for r in gemm_rows(t, args.experts)]
    report["quant"] = [r for t in token_counts for r in quant_rows(t, args.experts)]
    if not args.skip_layer:
        report["layer"] = [r for t in token_counts for r in layer_rows(t, args.experts)]
    if args.profile:
        report["profile"] = profile(token_counts[-1], args.experts)
        print(report["profile"])
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench_moe.json").write_text(json.dumps(report, indent=1))

    print(f"\n### Padded rows (pad to 16), {report['device']}\n")
    print("| tokens | experts | padded rows / routed rows | busiest expert / mean |")
    print("|---|---|---|---|")
    for r in report["padding"]:
        print(f"| {r['tokens']} | {r['experts']} | {r['pad_fraction']:.2%} | {r['load_max_over_mean']:.2f} |")
    if "gemm" in report:
        print(f"\n### Grouped GEMMs, {args.experts} experts, top-8, TFLOPS (routed rows only)\n")
        print("ours FP8: the default (the Triton kernels; on sm_90 the Gluon wgrad of fp8/gemm_sm90.py where the "
              "experts average at most GroupedConfig.sm90_wgrad_max_blocks token blocks); Triton FP8: the Triton "
              "kernels everywhere\n")
        print("GPU time: the same call replayed from a CUDA graph (do_bench_cudagraph), without the host's launch "
              "time, which the other columns include wherever it is longer than the kernel\n")
        print("_scaled_grouped_mm: n/a where it did not run (not timed for the weight gradients, whose K is the "
              "grouped token dim)\n")
        print("| tokens | GEMM | N×K | ours FP8 | Triton FP8 | torch._grouped_mm bf16 | _scaled_grouped_mm rowwise FP8 "
              "| ours/bf16 | ours/Triton | ours FP8, GPU time | bf16, GPU time | ours/bf16, GPU time |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in report["gemm"]:
            print(f"| {r['tokens']} | {r['gemm']} | {r['n']}×{r['k']} | {r['ours']:.0f} | {r['triton']:.0f} | "
                  f"{r['bf16']:.0f} | {cell(r['scaled'])} | {r['ours'] / r['bf16']:.2f} | "
                  f"{r['ours'] / r['triton']:.2f} | {cell(r['ours_gpu'])} | {cell(r['bf16_gpu'])} | "
                  f"{cell(r['ours_gpu'] / r['bf16_gpu'], '.2f')} |")
    print(f"\n### The experts' quantizers, {args.experts} experts, x [tokens, {H}] bf16 gathered\n")
    print("| tokens | kernel | ms | GB/s (one read, both writes) |")
    print("|---|---|---|---|")
    for r in report["quant"]:
        gbs = f"{r['gbs']:.0f}" if "gbs" in r else ""
        print(f"| {r['tokens']} | {r['kernel']} | {r['ms']:.3f} | {gbs} |")
    if "layer" not in report:
        return
    print(f"\n### MoE layer forward+backward, {args.experts} experts (router, dispatch, experts, combine, shared)\n")
    print("| tokens | variant | ms | vs bf16 | GPU busy ms | vs bf16 | wall / busy | expert TFLOPS "
          "| saved activations MiB | peak MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in report["layer"]:
        base = next(b for b in report["layer"] if b["tokens"] == r["tokens"] and b["variant"] == "bf16")
        print(f"| {r['tokens']} | {r['variant']} | {r['ms']:.2f} | {base['ms'] / r['ms']:.2f}x | {r['busy_ms']:.2f} | "
              f"{base['busy_ms'] / r['busy_ms']:.2f}x | {r['ms'] / r['busy_ms']:.2f} | {r['expert_tflops']:.0f} | "
              f"{r['saved_mib']:.0f} | "
              f"{r['peak_mib']:.0f} |")


def dispatch_or_ep(args, token_counts: list[int], report: dict) -> None:
    if args.dispatch:
        report["dispatch"] = [dispatch_rows(t, args.experts) for t in token_counts]
        print(f"\n### Dispatch without expert parallelism (ep_size=1), {args.experts} experts, {report['device']}\n")
        print("| tokens | expert selection ms (kernel) | its PyTorch reference ms | plan_dispatch ms "
              "| permute + combine fwd+bwd ms | host syncs |")
        print("|---|---|---|---|---|---|")
        for r in report["dispatch"]:
            print(f"| {r['tokens']} | {r['select_ms']:.3f} | {r['select_ref_ms']:.3f} | {r['plan_ms']:.3f} | "
                  f"{r['move_ms']:.3f} | {r['syncs']} |")
    if args.ep:
        dist.init_process_group("nccl")
        report["ep"] = [r for t in token_counts for r in ep_rows(t, args.experts)]
        if dist.get_rank() == 0:
            print(f"\n### Expert parallelism, {args.experts} experts, {dist.get_world_size()} × {report['device']}\n")
            print("| tokens per GPU | variant | all experts per GPU ms | ep_size=N ms | all-to-all of the rows ms "
                  "| host syncs per forward |")
            print("|---|---|---|---|---|---|")
            for r in report["ep"]:
                print(f"| {r['tokens']} | {r['variant']} | {r['whole_ms']:.2f} | {r['ep_ms']:.2f} | "
                      f"{r['a2a_ms']:.2f} | {r['syncs']} |")
        dist.destroy_process_group()
    if args.out and (not dist.is_initialized() or dist.get_rank() == 0):
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench_moe_dispatch.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
