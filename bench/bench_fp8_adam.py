"""FP8AdamW on one GPU: correctness first, then step time and state bytes against other optimizers.

    PYTHONUNBUFFERED=1 python3 bench/bench_fp8_adam.py [--params 1e9] [--out DIR]

1. Correctness: the fused kernel against its torch reference (same maths) on Ling-mini-2.0 shapes, and
   FP8AdamW against AdamW computed in float64 for 3 steps (step 1 must agree to fp32 rounding; later
   steps carry the E4M3 rounding of the stored moments).
2. Launch-shape sweep of the kernel (blocks per program × warps) on the 477 × [1024, 2048] layout.
3. Step time (median of CUDA-event timed steps, host overhead included) and state bytes per parameter for
   FP8AdamW, torch.optim.AdamW(fused=True), bitsandbytes AdamW8bit and torchao AdamWFp8, on three
   layouts of ~1B fp32 parameters: 477 × [1024, 2048]; the tensors of Ling-mini-2.0 (one MoE layer with
   its grouped experts, plus the word embedding); one flat ZeRO-style 1-D partition (length not a
   multiple of 128). A table is printed last.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fp8.adam import (  # noqa: E402
    AdamScalars,
    FP8AdamW,
    KernelConfig,
    fp8_adamw_update_reference,
    fp8_adamw_update_triton,
    quantize_blockwise_reference,
)
from fp8.quant import e4m3_code_distance  # noqa: E402
from kernels.interpreter import fixed_fp8_cast  # noqa: E402

H = 2048  # Ling-mini-2.0 hidden size
DEV = "cuda"  # --device cpu: a dry run of this script (kernel in the Triton interpreter, tiny sizes)


def ling_shapes() -> list[tuple[int, ...]]:
    """One Ling-mini-2.0 MoE layer (as stored in model/: grouped experts) plus the word embedding."""
    layer = [
        (3072, H), (H, H), (128,), (128,), (H,), (H,),  # attention: fused QKV, dense, QK-norms, 2 norms
        (256, H),  # router
        (256, 2 * 512, H), (256, H, 512),  # 256 routed experts, grouped: gate_up and down
        (2 * 512, H), (H, 512),  # shared expert
    ]  # fmt: skip
    return layer + [(157184, H)]


LAYOUTS: dict[str, Callable[[int], list[tuple[int, ...]]]] = {
    "477x1024x2048": lambda n: [(1024, 2048)] * max(1, round(n / (1024 * 2048))),
    "flat-partition": lambda n: [(int(n) + 37,)],  # ZeRO-style: one 1-D tensor, not a multiple of 128
    "ling-mini-2.0": lambda n: ling_shapes(),
}


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor, looking through tensor subclasses (torchao keeps codes + scales inside one)."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def state_bytes(opt: torch.optim.Optimizer) -> int:
    total = 0
    for st in opt.state.values():
        for k, v in st.items():
            if torch.is_tensor(v) and k != "step" and v.numel() > 1:
                total += tensor_bytes(v)
    return total


def make_params(shapes, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    ps = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, device=DEV, generator=gen) * 0.02)
        p.grad = torch.randn(s, device=DEV, generator=gen) * 1e-3
        ps.append(p)
    return ps


# ---------------------------------------------------------------------------------------------------
# Correctness
# ---------------------------------------------------------------------------------------------------


def check_kernel_vs_reference() -> dict:
    bs = 128
    gen = torch.Generator(device=DEV).manual_seed(1)
    shapes = [(3072, H), (256, H), (H, 512), (12345,)]
    tensors, refs = [], []
    for s in shapes:
        n = math.prod(s)
        g = torch.randn(n, device=DEV, generator=gen) * 1e-3
        m = 0.3 * g + 1e-5 * torch.randn(n, device=DEV, generator=gen)
        r = g.abs() * torch.exp(0.5 * torch.randn(n, device=DEV, generator=gen)) + 1e-7
        mq, ms = quantize_blockwise_reference(m, bs)
        rq, rs = quantize_blockwise_reference(r, bs, floor_nonzero=True)
        p = torch.randn(n, device=DEV, generator=gen)
        tup = [p, g, mq, ms, rq, rs]
        tensors.append(tuple(tup))
        refs.append([t.clone() for t in tup])
    s = AdamScalars.from_hparams(1e-3, 0.9, 0.95, 1e-8, 0.1, step=5)
    fp8_adamw_update_triton(tensors, s, bs)
    for r in refs:
        fp8_adamw_update_reference(*r, s=s, block_size=bs)
    sync()
    out = {"max_param_err_over_lr": 0.0, "moment_code_mismatch": 0.0, "moment_max_code_dist": 0}
    total = 0
    for a, b in zip(tensors, refs):
        dp = (a[0] - b[0]).abs().max().item() / 1e-3  # in units of lr (the size of one update)
        out["max_param_err_over_lr"] = max(out["max_param_err_over_lr"], dp)
        for i in (2, 4):
            da = e4m3_code_distance(a[i], b[i])  # in E4M3 steps (the raw code difference is 128 across ±0)
            out["moment_code_mismatch"] += (da > 0).sum().item()
            out["moment_max_code_dist"] = max(out["moment_max_code_dist"], int(da.max().item()))
            total += da.numel()
    out["moment_code_mismatch"] /= total
    return out


def check_vs_float64_adamw(steps: int = 3) -> list[float]:
    """‖Δp_fp8 − Δp_f64‖ / ‖Δp_f64‖ per step for 3 Ling-shaped tensors (same grads)."""
    torch.manual_seed(2)
    shapes = [(3072, H), (H, 512), (256, H)]
    ours = [torch.nn.Parameter(torch.randn(s, device=DEV) * 0.02) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().double().clone()) for p in ours]
    kw = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    o, r = FP8AdamW(ours, **kw), torch.optim.AdamW(ref, **kw, foreach=False)
    errs = []
    for _ in range(steps):
        before = [p.detach().double().clone() for p in ours]
        for a, b in zip(ours, ref):
            g = torch.randn_like(a) * torch.exp(torch.randn_like(a)) * 1e-3
            a.grad, b.grad = g, g.double()
            b.data.copy_(a.detach().double())  # same starting point each step: compare one update
        o.step()
        r.step()
        num = sum(((a.detach().double() - b0) - (b.detach() - b0)).norm() ** 2 for a, b, b0 in zip(ours, ref, before))
        den = sum((b.detach() - b0).norm() ** 2 for b, b0 in zip(ref, before))
        errs.append(math.sqrt(num / den))
    return errs


def underflow_rates() -> dict[str, float]:
    """Fraction of non-zero v that becomes 0 when stored directly vs as sqrt(v) (+ floor), lognormal |g|."""
    from fp8.adam import dequantize_blockwise_reference as deq

    gen = torch.Generator(device=DEV).manual_seed(3)
    n = 1 << 24 if DEV == "cuda" else 1 << 16
    out = {}
    for sigma in (1.0, 2.5):
        g = torch.randn(n, device=DEV, generator=gen)
        g = g * torch.exp(sigma * torch.randn(n, device=DEV, generator=gen))
        v = g * g
        nz = (v > 0).sum().item()
        for name, x, fl in (("v", v, False), ("sqrt_v", v.sqrt(), False), ("sqrt_v_floor", v.sqrt(), True)):
            q, s = quantize_blockwise_reference(x, 128, floor_nonzero=fl)
            out[f"sigma{sigma}_{name}"] = ((deq(q, s, 128) == 0) & (v > 0)).sum().item() / nz
    return out


# ---------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------


def time_steps(step: Callable[[], None], warmup: int, iters: int) -> tuple[float, float]:
    """(median ms per step on the GPU timeline incl. launch gaps, mean host ms per step call)."""
    for _ in range(warmup):
        step()
    if DEV == "cpu":
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times), statistics.mean(times)
    sync()
    times, host = [], []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        step()
        host.append((time.perf_counter() - t0) * 1e3)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), statistics.mean(host)


def copy_bandwidth(nbytes: int = 2 * 10**9) -> float:
    nbytes = nbytes if DEV == "cuda" else 4 * 10**6
    """Device-to-device copy, TB/s counting bytes read plus written."""
    x = torch.randn(nbytes // 4, device=DEV)
    y = torch.empty_like(x)
    ms, _ = time_steps(lambda: y.copy_(x), 3, 10)
    return 2 * nbytes / ms / 1e9


def make_optimizer(name: str, params, cfg: KernelConfig | None = None):
    kw = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    if name == "fp8_adamw (ours)":
        return FP8AdamW(params, **kw, kernel=cfg, backend="triton")
    if name == "torch AdamW fused":
        return torch.optim.AdamW(params, **kw, fused=DEV == "cuda")
    if name == "bnb AdamW8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, **kw)
    if name == "torchao AdamWFp8":
        from torchao.optim import AdamWFp8

        return AdamWFp8(params, **kw)
    raise ValueError(name)


def bench_one(name: str, shapes, cfg: KernelConfig | None = None) -> dict:
    params = make_params(shapes)
    n = sum(p.numel() for p in params)
    res: dict = {"optimizer": name, "params": n, "tensors": len(params)}
    try:
        opt = make_optimizer(name, params, cfg)
        t0 = time.perf_counter()
        opt.step()  # first step: state init (+ compile for torchao / Triton)
        sync()
        res["first_step_s"] = time.perf_counter() - t0
        opt.step()
        sync()
        t0 = time.perf_counter()
        opt.step()
        sync()
        one = time.perf_counter() - t0
        iters = 20 if one < 0.05 else 5
        ms, host = time_steps(opt.step, warmup=2, iters=iters)
        res.update(ms=ms, host_ms=host, state_bytes_per_param=state_bytes(opt) / n)
        res["finite"] = all(bool(torch.isfinite(p).all()) for p in params[:4])
    except Exception as e:  # report and carry on: one failing baseline must not hide the others
        res["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    finally:
        params = opt = None  # noqa: F841
        gc.collect()
        if DEV == "cuda":
            torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=1e9)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--skip", default="", help="comma-separated optimizer names to skip")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip remaining timings after this long")
    args = ap.parse_args()
    global DEV
    DEV = args.device
    name = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (dry run)"
    print(f"device {name}, torch {torch.__version__}", flush=True)
    # on CPU the kernel runs in Triton's interpreter, whose e4m3 cast needs kernels/interpreter.py's fix
    with fixed_fp8_cast() if DEV == "cpu" else contextlib.nullcontext():
        run(args)


def run(args: argparse.Namespace) -> None:
    """The checks, the launch sweep and the tables of `main`."""
    results: dict = {}
    t_start = time.perf_counter()

    # Copy bandwidth ceiling (read + write bytes).
    results["copy_TBps"] = copy_bandwidth()
    print(f"copy bandwidth {results['copy_TBps']:.2f} TB/s", flush=True)

    results["kernel_vs_reference"] = check_kernel_vs_reference()
    print("kernel vs torch reference:", results["kernel_vs_reference"], flush=True)
    results["vs_float64_adamw"] = check_vs_float64_adamw()
    print("update error vs float64 AdamW per step:", results["vs_float64_adamw"], flush=True)
    results["underflow"] = underflow_rates()
    print("underflow of non-zero v:", results["underflow"], flush=True)

    shapes_a = LAYOUTS["477x1024x2048"](args.params)
    sweep, cfgs = [], {}
    for nb, nw, it in ((16, 16, 1), (8, 8, 1), (8, 8, 4), (16, 16, 2), (16, 8, 1), (32, 8, 1)):
        cfg = KernelConfig(blocks_per_program=nb, num_warps=nw, iters_per_program=it)
        r = bench_one("fp8_adamw (ours)", shapes_a, cfg)
        r["config"] = f"NB={nb} warps={nw} iters={it}"
        cfgs[r["config"]] = cfg
        sweep.append(r)
        print("sweep", r, flush=True)
    results["sweep"] = sweep
    best = min((r for r in sweep if "ms" in r), key=lambda r: r["ms"])
    best_cfg = cfgs[best["config"]]
    results["best_config"] = best["config"]

    names = ["fp8_adamw (ours)", "torch AdamW fused", "bnb AdamW8bit", "torchao AdamWFp8"]
    names = [n for n in names if n not in args.skip.split(",")]
    rows = []
    for layout, fn in LAYOUTS.items():
        if layout not in args.layouts.split(","):
            continue
        shapes = fn(args.params)
        for name in names:
            if name.startswith("torchao") and layout == "ling-mini-2.0":
                continue  # torch.compile per distinct shape (12 here) would take minutes of device time
            if time.perf_counter() - t_start > args.budget_s:
                r = {"optimizer": name, "params": sum(math.prod(s) for s in shapes), "error": "skipped (budget)"}
            else:
                r = bench_one(name, shapes, best_cfg if name.startswith("fp8") else None)
            r["layout"] = layout
            rows.append(r)
            print(r, flush=True)
            with open(os.path.join(args.out, "bench_fp8_adam.json"), "w") as f:
                json.dump({**results, "rows": rows}, f, indent=1)
    results["rows"] = rows
    with open(os.path.join(args.out, "bench_fp8_adam.json"), "w") as f:
        json.dump(results, f, indent=1)

    floor_ms = lambda n: n * (16 + 16 / 128) / (results["copy_TBps"] * 1e12) * 1e3  # ours: bytes/param
    swept = ", ".join(f"{r['config']}: {r.get('ms', float('nan')):.2f} ms" for r in sweep)
    print(f"\nkernel sweep (477x1024x2048): {swept}; tables below use {best['config']}")
    print("\n| layout | optimizer | params | step ms | host ms | state B/param | vs fused AdamW |")
    print("|---|---|---|---|---|---|---|")
    for layout in LAYOUTS:
        if layout not in args.layouts.split(","):
            continue
        lr = [r for r in rows if r["layout"] == layout]
        ref = next((r["ms"] for r in lr if r["optimizer"] == "torch AdamW fused" and "ms" in r), float("nan"))
        for r in lr:
            if "ms" in r:
                print(
                    f"| {layout} | {r['optimizer']} | {r['params'] / 1e9:.3f}B | {r['ms']:.2f} | {r['host_ms']:.2f} "
                    f"| {r['state_bytes_per_param']:.3f} | {r['ms'] / ref:.2f}x |"
                )
            else:
                print(f"| {layout} | {r['optimizer']} | {r['params'] / 1e9:.3f}B | n/a | | | {r['error']} |")
        ours = next((r for r in lr if r["optimizer"].startswith("fp8") and "ms" in r), None)
        if ours:
            floor = floor_ms(ours["params"])
            print(f"| {layout} | (ours: bandwidth floor at {results['copy_TBps']:.2f} TB/s) | | {floor:.2f} | | | |")


if __name__ == "__main__":
    main()
