"""Blockwise FP8 GEMM / FP8Linear benchmark on one H200 (Ling-mini-2.0 shapes at 16384 tokens).

    PYTHONUNBUFFERED=1 python3 bench/bench_fp8_linear.py [--tokens 16384] [--sweep] [--out DIR]
        [--layers-only] [--host] [--skip-layers]

Prints (last) a GEMM table: ours vs cuBLAS blockwise `scaled_mm` vs bf16 matmul, TFLOPS (medians, same run),
for fprop / dgrad / wgrad of each shape; a layer table: forward+backward of our FP8Linear, bf16 nn.Linear
and torchao's Float8BlockwiseLinear (use_triton False/True) with saved-activation bytes; and quantizer
bandwidths. Every timed product is first checked against a float64 product of the dequantized operands.
The layer table also reports the rate over summed CUDA kernel time ("GPU busy") and of the step replayed as
a CUDA graph, which separate host overhead from GPU work; `--host` profiles that host overhead (cProfile).
Not imported by the library.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fp8 import gemm as G  # noqa: E402
from fp8.gemm import GEMM_TUNING, GemmConfig, fp8_gemm, fp8_gemm_wgrad  # noqa: E402
from fp8.gemm_sm90 import SM90_CONFIG, SM90_SMALL_TILES, SM90_WARP_SPECIALIZED, sm90_available  # noqa: E402
from fp8.health import relative_error  # noqa: E402
from fp8.kernel_choice import gemm_kernels  # noqa: E402
from fp8.linear import FP8Linear, invalidate_fp8_weight_caches  # noqa: E402
from fp8.quant import (  # noqa: E402
    QUANT_TUNING,
    dequantize_1x128,
    dequantize_128x128,
    fp8_transpose_128x128,
    quantize_1x128,
    quantize_1x128_dual,
    quantize_1x128_transposed,
    quantize_128x128,
)

SHAPES = {"qkv": (3072, 2048), "o_proj": (2048, 2048), "gate_up": (10240, 2048), "down": (2048, 5120),
          "shared_gate_up": (1024, 2048), "shared_down": (2048, 512)}  # (N, K) of every Ling-mini FP8Linear
# the Hopper Gluon kernel's tiles swept (fp8/gemm_sm90.py; sm_90 only): its default, and two resident 64x128
# programs per SM with 4 and 3 stages (also swept by bench_moe.py on the grouped GEMMs); the warp-specialised kernel
# with 4 and 5 stages, with and without the carried product
SM90_SWEEP = [SM90_CONFIG, SM90_SMALL_TILES, dataclasses.replace(SM90_SMALL_TILES, stages=3), SM90_WARP_SPECIALIZED,
              dataclasses.replace(SM90_WARP_SPECIALIZED, stages=5),
              dataclasses.replace(SM90_WARP_SPECIALIZED, carry=True)]  # fmt: skip
SWEEP = [  # H200 runs 1-3 also tried 128x256 / 256x128 tiles (spills or shared-memory overflow: 100-550 TFLOPS)
    GemmConfig(64, 128, 8, 4, 4, tma=True, persistent=True, programs_per_sm=2),  # FPROP_CONFIG
    # loading the next K block's scales ahead (fp8/triton_blocks.py): WGRAD_CONFIG, the 16-bit wgrad's default
    GemmConfig(64, 128, 8, 4, 4, tma=True, persistent=True, programs_per_sm=2, prefetch_scales=True),
    GemmConfig(64, 128, 8, 4, 4, tma=True, persistent=True, programs_per_sm=1, prefetch_scales=True),
    # the tile loop and the K loop flattened into one (off by default: slower as measured, docs/kernel_tuning.md)
    GemmConfig(64, 128, 8, 4, 4, tma=True, persistent=True, programs_per_sm=2, flatten=True),
    GemmConfig(64, 128, 8, 4, 4, tma=True, persistent=True, programs_per_sm=3),
    GemmConfig(64, 128, 8, 4, 4, tma=True, persistent=False),
    GemmConfig(128, 128, 8, 8, 4, tma=True, persistent=True, warp_specialize=True),  # fprop's until 2026-12-02
    GemmConfig(128, 128, 8, 8, 3, tma=True, persistent=True, warp_specialize=True),  # fp32-out wgrad's
    # the two wgrad defaults without split-K (the default splits the shared expert's down wgrad: fp8/gemm.py)
    GemmConfig(64, 128, 8, 4, 4, tma=True, persistent=True, programs_per_sm=2, split_k=1),
    GemmConfig(128, 128, 8, 8, 3, tma=True, persistent=True, warp_specialize=True, split_k=1),
    GemmConfig(128, 128, 16, 8, 4, tma=True, persistent=True, warp_specialize=True),
    GemmConfig(128, 128, 8, 8, 4, tma=True, persistent=True),
    GemmConfig(128, 128, 8, 8, 3, tma=True, persistent=True),
    GemmConfig(128, 128, 8, 8, 5),
    GemmConfig(128, 128, 8, 8, 4),
    *SM90_SWEEP,
]


def bench_ms(fn, rep: int = 200) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def tflops(flops: float, ms: float) -> float:
    return flops / ms / 1e9


# ------------------------------------------------------------------------------------------------ cuBLAS
_CUBLAS_LAYOUT: dict[tuple, int] = {}


def _cublas_candidates(b_s: torch.Tensor, b_blockwise: bool):
    if b_blockwise:  # ours: [NB, KB], row-major once made contiguous (dgrad's Wᵀ scales are a transposed view)
        b_s = b_s.contiguous()
        kb = b_s.shape[1]
        pad = (-kb) % 4
        padded = F.pad(b_s, (0, pad)) if pad else b_s
        return [padded.t(), b_s.t().contiguous(), b_s]
    return [b_s.t(), b_s.t().contiguous(), b_s]  # ours: [N, KB] stride (1, N)


def cublas_blockwise(a, a_s, b, b_s, b_blockwise: bool, out_dtype):
    """F.scaled_mm with BlockWise1x128 x (BlockWise128x128 | BlockWise1x128); the scale layout that cuBLAS
    accepts is found once per recipe and scale shape (fprop's and dgrad's weight scales differ) and then reused,
    the others tried after it (checked for numerics by the caller)."""
    st = F.ScalingType
    rb = st.BlockWise128x128 if b_blockwise else st.BlockWise1x128
    key = ("bw" if b_blockwise else "rw", tuple(b_s.shape), tuple(b_s.stride()))
    cands = _cublas_candidates(b_s, b_blockwise)
    order = sorted(range(len(cands)), key=lambda i: i != _CUBLAS_LAYOUT.get(key))
    err = None
    for i in order:
        try:
            out = F.scaled_mm(a, b.t(), a_s, st.BlockWise1x128, cands[i], rb, output_dtype=out_dtype)
            _CUBLAS_LAYOUT.setdefault(key, i)
            return out
        except Exception as e:  # noqa: BLE001 - report the last refusal
            err = e
    raise RuntimeError(f"cuBLAS blockwise scaled_mm refused every scale layout: {err}")


# ------------------------------------------------------------------------------------------------ GEMMs
def gemm_operands(kind: str, m: int, n: int, k: int):
    """(a, a_s, b, b_s, b_blockwise, out_dtype, a_bf16, b_bf16) for the GEMM `kind` of a linear [n, k]: "fprop",
    "dgrad", "wgrad" (fp32 out) or "wgrad_bf16" (the bf16 weight's gradient, as FP8Linear writes it in training)."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 1e-3
    if kind == "fprop":
        a, a_s = quantize_1x128(x)
        b, b_s = quantize_128x128(w)
        return a, a_s, b, b_s, True, torch.bfloat16, x, w
    if kind == "dgrad":
        a, a_s = quantize_1x128(dy)
        wq, ws = quantize_128x128(w)
        b, b_s = fp8_transpose_128x128(wq, ws)
        return a, a_s, b, b_s, True, torch.bfloat16, dy, w.t().contiguous()
    a, a_s = quantize_1x128_transposed(dy)
    b, b_s = quantize_1x128_transposed(x)
    out_dtype = torch.bfloat16 if kind == "wgrad_bf16" else torch.float32
    return a, a_s, b, b_s, False, out_dtype, dy.t().contiguous(), x.t().contiguous()


def run_gemms(m: int, sweep: bool, log: dict) -> tuple[list[list[str]], dict[str, GemmConfig]]:
    """The GEMM table's rows, and (with `sweep`) the config per kind with the best total time over all shapes."""
    rows = []
    chosen: dict[str, GemmConfig] = {}
    best_cfg: dict[str, dict] = {"fprop": {}, "wgrad": {}}
    for name, (n, k) in SHAPES.items():
        for kind in ("fprop", "dgrad", "wgrad", "wgrad_bf16"):
            a, a_s, b, b_s, bw, odt, a16, b16 = gemm_operands(kind, m, n, k)
            mm, nn_ = a.shape[0], b.shape[0]
            flops = 2.0 * mm * nn_ * a.shape[1]
            deq_a = dequantize_1x128(a, a_s, torch.float64)
            deq_b = dequantize_128x128(b, b_s, torch.float64) if bw else dequantize_1x128(b, b_s, torch.float64)
            ref = deq_a @ deq_b.t()
            del deq_a, deq_b
            gk = "fprop" if bw else "wgrad"
            fn = functools.partial(fp8_gemm if bw else fp8_gemm_wgrad, a, a_s, b, b_s, out_dtype=odt)
            results = []
            for cfg in SWEEP if sweep else [None]:
                if bw and isinstance(cfg, GemmConfig) and cfg.split_k is not None:  # fprop and dgrad never split
                    continue
                try:
                    out = fn(config=cfg)
                    err = float(relative_error(out, ref))
                    ms = bench_ms(functools.partial(fn, config=cfg))
                    results.append((ms, err, cfg))
                    print(f"  {name:8s} {kind:5s} {cfg} {tflops(flops, ms):7.1f} TFLOPS err {err:.2e}", flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"  {name:8s} {kind:5s} {cfg} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            ok = [r for r in results if r[1] < 2e-2]
            best = min(ok, key=lambda r: r[0]) if ok else (float("nan"), float("nan"), None)
            best_cfg[gk][f"{name}.{kind}"] = str(best[2])
            # cuBLAS
            try:
                cfn = functools.partial(cublas_blockwise, a, a_s, b, b_s, bw, odt)
                cerr = float(relative_error(cfn(), ref))
                cms = bench_ms(cfn)
                cub = f"{tflops(flops, cms):.0f}" + ("" if cerr < 2e-2 else f" (err {cerr:.1e}!)")
            except Exception as e:  # noqa: BLE001
                cms, cerr, cub = float("nan"), float("nan"), f"n/a ({type(e).__name__})"
                print(f"  cuBLAS blockwise failed: {e}", flush=True)
            bms = bench_ms(functools.partial(torch.matmul, a16, b16.t()))
            # the Hopper Gluon kernel (fp8/gemm_sm90.py; off by default), on the same operands
            gms = bench_ms(functools.partial(fn, config=SM90_CONFIG)) if sm90_available(a) else float("nan")
            # its warp-specialised dense kernel (off by default), checked bit for bit against ours' default tiles
            # unsplit: the Gluon kernels never split K, and a split wgrad (the shared expert's down projection)
            # sums its K blocks in another order
            wms, wbits = float("nan"), ""
            if sm90_available(a):
                wfn = functools.partial(fn, config=SM90_WARP_SPECIALIZED)
                unsplit = dataclasses.replace(G.default_gemm_config(mm, gk, odt), split_k=1)
                wbits = "" if torch.equal(wfn(), fn(config=unsplit)) else " (bits differ!)"
                wms = bench_ms(wfn)
            rows.append(
                [
                    name,
                    kind,
                    f"{mm}x{nn_}x{a.shape[1]}",
                    f"{tflops(flops, best[0]):.0f}",
                    f"{tflops(flops, gms):.0f}",
                    f"{tflops(flops, wms):.0f}{wbits}",
                    cub,
                    f"{tflops(flops, bms):.0f}",
                    f"{tflops(flops, best[0]) / tflops(flops, cms):.2f}",
                    f"{tflops(flops, best[0]) / tflops(flops, bms):.2f}",
                    f"{best[1]:.1e}",
                    f"{cerr:.1e}",
                ]
            )
            log.setdefault("gemm", []).append(
                {
                    "shape": name,
                    "kind": kind,
                    "ours_ms": best[0],
                    "gluon_ms": gms,
                    "gluon_ws_ms": wms,
                    "cublas_ms": cms,
                    "bf16_ms": bms,
                    "err": best[1],
                    "cfg": str(best[2]),
                    "all": [(r[0], r[1], str(r[2])) for r in results],
                }
            )
            del a, b, a16, b16, ref
            torch.cuda.empty_cache()
    log["best_cfg"] = best_cfg
    if sweep:  # the config with the best total time over all shapes, per kind, drives the layer table
        for gk in ("fprop", "wgrad"):
            tot: dict[str, float] = {}
            for e in log["gemm"]:
                if e["kind"].startswith("wgrad") == (gk == "wgrad"):
                    for ms, err, c in e["all"]:
                        if err < 2e-2:
                            tot[c] = tot.get(c, 0.0) + ms
            if tot:
                best = min(tot, key=tot.get)
                chosen[gk] = next(c for c in SWEEP if str(c) == best)
                log.setdefault("chosen", {})[gk] = best
                print(f"chosen {gk}: {best} total {tot[best]:.3f} ms", flush=True)
    return rows, chosen


# ------------------------------------------------------------------------------------------------ layers
def saved_bytes(layer: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd saves for backward in one forward, not counting the (cached) weight tensors."""
    total = [0]
    skip = {layer.weight.data_ptr()}
    if isinstance(layer, FP8Linear):  # W, Wᵀ and their scales live in the weight cache, not per step
        skip |= {t.data_ptr() for t in layer.fp8_weights()}

    def pack(t):
        if t.data_ptr() not in skip:
            total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    del y
    return total[0]


def gpu_busy_ms(step, iters: int = 5) -> float:
    """Summed CUDA kernel time of one step (torch profiler): the step's cost with host overhead hidden."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    us = 0.0
    for e in prof.key_averages():
        us += getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
    return us / 1e3 / iters


def cuda_graph_step(step):
    """Capture one forward+backward `step` into a CUDA graph; returns its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


WS_LAYER = "ours FP8Linear, Gluon warp-specialised"


def time_layer(label: str, layer: torch.nn.Module, x: torch.Tensor, g: torch.Tensor, ref_y: torch.Tensor,
               flops: float) -> dict[str, tuple[float, float, int, float]]:
    """{row suffix: (wall ms, forward relative error, saved bytes, GPU busy ms)} of one layer's forward + backward
    on x [M, K] with output gradient g [M, N]: "" for the eager step and, for an FP8Linear, ", CUDA graph" for the
    same step replayed from one graph (no host overhead). `label` names the row in the progress lines."""
    step = layer_step(layer, x, g)  # FP8: the weight quantization counts in every step
    err = float(relative_error(layer(x), ref_y))
    ms = bench_ms(step)
    busy = gpu_busy_ms(step)
    sb = saved_bytes(layer, x)
    out = {"": (ms, err, sb, busy)}
    print(f"  {label:35s} {tflops(flops, ms):7.1f} TFLOPS (GPU busy {tflops(flops, busy):.0f}) fwd err {err:.2e} "
          f"saved {sb / 2**20:.1f} MiB", flush=True)  # fmt: skip
    if isinstance(layer, FP8Linear):
        gms = bench_ms(cuda_graph_step(step))
        out[", CUDA graph"] = (gms, err, sb, gms)
        print(f"  {label}, CUDA graph {tflops(flops, gms):7.1f} TFLOPS", flush=True)
    return out


def run_layers(m: int, log: dict) -> list[list[str]]:
    rows = []
    try:
        from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear
    except Exception as e:  # noqa: BLE001
        Float8BlockwiseLinear = None  # noqa: N806
        print(f"torchao Float8BlockwiseLinear unavailable: {e}", flush=True)
    for name, (n, k) in SHAPES.items():
        flops = 6.0 * m * n * k
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        base = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        ref_y = x.detach().double() @ base.weight.detach().double().t()
        layers: dict[str, torch.nn.Module] = {"bf16 nn.Linear": base}
        ours = FP8Linear(k, n, device="cuda", dtype=torch.bfloat16)
        ours.load_state_dict(base.state_dict())
        layers["ours FP8Linear"] = ours
        layers[WS_LAYER] = ours  # the same layer, its GEMMs on the warp-specialised Gluon kernel (fp8.gemm_kernel)
        if Float8BlockwiseLinear is not None:
            for ut in (False, True):
                try:
                    t = Float8BlockwiseLinear(k, n, bias=False, use_triton=ut).to("cuda", torch.bfloat16)
                    t.load_state_dict(base.state_dict())
                    layers[f"torchao use_triton={ut}"] = t
                except Exception as e:  # noqa: BLE001
                    print(f"torchao use_triton={ut} construct failed: {e}", flush=True)
        res = {}
        for lname, layer in layers.items():
            try:
                # the row's GEMM kernels, chosen once around all its timing (the choice holds in every thread)
                with gemm_kernels("gluon_ws" if lname == WS_LAYER else "auto"):
                    rows_of_layer = time_layer(f"{name:8s} {lname}", layer, x, g, ref_y, flops)
                res.update({lname + suffix: row for suffix, row in rows_of_layer.items()})
            except Exception as e:  # noqa: BLE001
                print(f"  {name:8s} {lname} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        bf = res.get("bf16 nn.Linear", (float("nan"),) * 4)
        for lname, (ms, err, sb, busy) in res.items():
            rows.append(
                [
                    name,
                    lname,
                    f"{tflops(flops, ms):.0f}",
                    f"{bf[0] / ms:.2f}",
                    f"{tflops(flops, busy):.0f}",
                    f"{err:.1e}",
                    f"{sb / 2**20:.0f}",
                    f"{sb / bf[2]:.2f}",
                ]
            )
        log.setdefault("layer", []).append({"shape": name, **{k2: list(v) for k2, v in res.items()}})
        del x, g, layers, ours, base
        torch.cuda.empty_cache()
    return rows


def run_quant(m: int, log: dict, sweep: bool) -> tuple[list[list[str]], dict]:
    """The quantizer table's rows, and the QuantConfig fields of the best total time (with `sweep`)."""
    rows = []
    x = torch.randn(m, 5120, device="cuda", dtype=torch.bfloat16)
    xq, xs = quantize_1x128(x)
    w = torch.randn(10240, 2048, device="cuda", dtype=torch.bfloat16)
    wq, ws = quantize_128x128(w)
    nx = x.numel()
    cases = [
        ("quantize_1x128 [M,5120] bf16", lambda: quantize_1x128(x), nx * 2 + nx + nx // 32),
        ("quantize_1x128_dual (row + token-dim)", lambda: quantize_1x128_dual(x), nx * 2 + 2 * nx + nx // 16),
        ("quantize_1x128_transposed (bf16 x)", lambda: quantize_1x128_transposed(x), 3 * nx + nx // 32),
        ("quantize_1x128_transposed (from fp8 x)", lambda: quantize_1x128_transposed(xq, xs), 2 * nx + nx // 16),
        ("quantize_128x128 [10240,2048]", lambda: quantize_128x128(w), w.numel() * 3),
        ("fp8_transpose_128x128 [10240,2048]", lambda: fp8_transpose_128x128(wq, ws), wq.numel() * 2),
    ]
    best = None
    sweeps = (  # token-dim chunk width, warps and grid order, the row kernel's grid order (docs/kernel_tuning.md)
        {"col_block_f": 16, "col_warps": 1, "col_features_first": True},
        {"col_block_f": 16, "col_warps": 1, "col_features_first": False},
        {"col_block_f": 32, "col_warps": 4, "col_features_first": False},
        {"col_block_f": 32, "col_warps": 4, "col_features_first": True},
        {"col_block_f": 64, "col_warps": 4},
        {"row_features_first": False},
    )
    for opts in sweeps if sweep else (dataclasses.asdict(QUANT_TUNING.current()),):
        tot = 0.0
        with QUANT_TUNING.override(**opts):
            for name, fn, nbytes in cases:
                try:
                    ms = bench_ms(fn, rep=100)
                except Exception as e:  # noqa: BLE001
                    print(f"  quant {name} {opts} FAILED {e}", flush=True)
                    ms = float("inf")
                tot += ms
                rows.append([name, str(opts), f"{ms * 1e3:.0f}", f"{nbytes / ms / 1e6:.0f}"])
        if best is None or tot < best[0]:
            best = (tot, dict(opts))
    log["quant_options"] = best[1]
    print(f"chosen quant options: {best[1]}", flush=True)
    print(table(["kernel", "options", "us", "GB/s"], rows), flush=True)
    return rows, best[1]


def layer_step(layer: torch.nn.Module, x: torch.Tensor, g: torch.Tensor):
    """One forward+backward of `layer` on x (requires grad) with output gradient g; FP8 layers re-quantize
    their weight every step (as after each optimizer step in training)."""

    def step():
        x.grad = None
        layer.weight.grad = None
        if isinstance(layer, FP8Linear):
            invalidate_fp8_weight_caches(layer)
        layer(x).backward(g)

    return step


def fp8_layer_step(m: int, n: int, k: int):
    """`layer_step` of a fresh bf16 FP8Linear [n, k] on random x [m, k]."""
    layer = FP8Linear(k, n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    return layer_step(layer, x, g)


def profile_layer(m: int, n: int, k: int, out_dir: str) -> str:
    """Per-kernel CUDA time of one FP8Linear forward+backward (weight quantization included)."""
    from torch.profiler import ProfilerActivity, profile

    step = fp8_layer_step(m, n, k)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            step()
        torch.cuda.synchronize()
    txt = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60)
    with open(os.path.join(out_dir, "profile_gate_up.txt"), "w") as f:
        f.write(txt)
    return txt


def host_profile(m: int, n: int, k: int, out_dir: str) -> str:
    """Where the host time of one FP8Linear forward+backward goes: enqueue time per step (no sync: the CPU
    cost of the Python wrappers and kernel launches), wall time per synchronised step, and a cProfile."""
    import cProfile
    import io
    import pstats
    import time

    step = fp8_layer_step(m, n, k)

    for _ in range(10):
        step()
    torch.cuda.synchronize()
    reps = 50
    t0 = time.perf_counter()
    for _ in range(reps):
        step()
    t_enqueue = (time.perf_counter() - t0) / reps
    torch.cuda.synchronize()
    t_total = (time.perf_counter() - t0) / reps
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(25)
    txt = (
        f"FP8Linear [{m}, {k}] -> {n}: host enqueue {t_enqueue * 1e3:.3f} ms/step, "
        f"wall {t_total * 1e3:.3f} ms/step (50 steps)\n" + buf.getvalue()
    )
    with open(os.path.join(out_dir, f"host_profile_{n}x{k}.txt"), "w") as f:
        f.write(txt)
    return txt


def table(header: list[str], rows: list[list[str]]) -> str:
    w = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(str(c).ljust(w[i]) for i, c in enumerate(r)) + " |"
    return "\n".join([line(header), "|" + "|".join("-" * (x + 2) for x in w) + "|"] + [line(r) for r in rows])


GEMM_HEADER = [
    "shape",
    "gemm",
    "MxNxK",
    "ours",
    "ours, Gluon kernel",
    "ours, Gluon warp-specialised",
    "cuBLAS bw",
    "bf16",
    "ours/cuBLAS",
    "ours/bf16",
    "err ours",
    "err cuBLAS",
]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--sweep", action="store_true", help="time every GemmConfig in SWEEP, report the best")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--skip-layers", action="store_true")
    p.add_argument("--host", action="store_true", help="only profile the host time of the o_proj/QKV layers")
    p.add_argument("--layers-only", action="store_true", help="only the FP8Linear layer table")
    args = p.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__} triton {triton.__version__} {torch.cuda.get_device_name()}", flush=True)
    log: dict = {}
    if args.host:
        for n, k in (SHAPES["o_proj"], SHAPES["qkv"]):
            for m in (args.tokens, 4096):
                print(host_profile(m, n, k, args.out)[:6000], flush=True)
        return
    if args.layers_only:
        layer_rows = run_layers(args.tokens, log)
        print(f"\n## FP8Linear forward+backward, {args.tokens} tokens (TFLOPS = 6MNK/time, median)")
        print(table(["shape", "layer", "TFLOPS", "x bf16", "TFLOPS of GPU busy time", "fwd rel err", "saved MiB",
                     "saved / bf16"], layer_rows))  # fmt: skip
        return
    gemm_rows, chosen = run_gemms(args.tokens, args.sweep, log)
    print(table(GEMM_HEADER, gemm_rows), flush=True)
    # the sweep's choices (none without --sweep: the defaults) drive the profile and the layer table
    with GEMM_TUNING.override(**chosen):
        quant_rows, quant_options = run_quant(args.tokens, log, args.sweep)
        with QUANT_TUNING.override(**quant_options):
            try:
                print("\n## Profile: FP8Linear gate_up (N=10240, K=2048) fwd+bwd x10", flush=True)
                print(profile_layer(args.tokens, 10240, 2048, args.out), flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"profile failed: {e}", flush=True)
            layer_rows = [] if args.skip_layers else run_layers(args.tokens, log)
    with open(os.path.join(args.out, "bench_fp8.json"), "w") as f:
        json.dump(log, f, indent=1, default=str)
    print("\nbest configs:", json.dumps(log.get("best_cfg", {}), indent=1))
    print(f"cuBLAS scale layouts used: {_CUBLAS_LAYOUT}  (gemm module {G.__name__})")
    print("\n## Quantizers (H200, median)")
    print(table(["kernel", "options", "us", "GB/s"], quant_rows))
    if layer_rows:
        print(f"\n## FP8Linear forward+backward, {args.tokens} tokens (TFLOPS = 6MNK/time, median)")
        print(
            table(
                ["shape", "layer", "TFLOPS", "x bf16", "TFLOPS of GPU busy time", "fwd rel err", "saved MiB",
                 "saved / bf16"],
                layer_rows,
            )
        )  # fmt: skip
    print(f"\n## Blockwise FP8 GEMM, {args.tokens} tokens (TFLOPS, median; err = rel. to float64 of dequantized)")
    print(table(GEMM_HEADER, gemm_rows))


if __name__ == "__main__":
    main()
