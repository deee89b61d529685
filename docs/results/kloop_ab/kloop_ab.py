"""The TMA K loop's variants A/B, ready for a GPU (written in the ninth and tenth sessions, 2026-12-06, not yet run
there): `prefetch_scales` (the next K block's scales loaded during this block's product) and `flatten` (the
persistent tile loop and the K loop flattened into one, so the pipeliner loads the next tile's first K blocks
during this tile's store; forward and dgrad only, the wgrad's token loop varies by expert).

Every FP8 GEMM of the e64 step at 16,384 tokens, the default tiles against the same tiles with each variant (and
the prefetch with fewer programs per SM), bits compared, `triton.testing.do_bench` medians, alternating three
rounds; a table last. Run from the repo root: `python docs/results/kloop_ab/kloop_ab.py`. `--cpu-smoke` runs
every call once on tiny shapes in Triton's interpreter (no timing; the interpreter ignores `flatten`) to check the
script."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import torch  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--cpu-smoke", action="store_true")
p.add_argument("--rounds", type=int, default=3)
p.add_argument("--json", default=None, help="also write {gemm: {variant: {ms, same_bits}}} here (median ms)")
args = p.parse_args()
if args.cpu_smoke:
    os.environ["TRITON_INTERPRET"] = "1"

import triton.testing  # noqa: E402

import fp8.grouped as G  # noqa: E402
from fp8.gemm import FPROP_CONFIG, GemmConfig, fp8_gemm, fp8_gemm_wgrad  # noqa: E402
from fp8.quant import quantize_1x128, quantize_128x128  # noqa: E402
from model.dispatch import plan_dispatch  # noqa: E402

DEV = "cpu" if args.cpu_smoke else "cuda"
T, E, TOPK = (256, 8, 2) if args.cpu_smoke else (16384, 64, 8)
H, INTER = (384, 128) if args.cpu_smoke else (2048, 512)
DENSE = {"qkv": (3 * H // 2, H), "o_proj": (H, H), "shared_gate_up": (INTER * 2, H), "shared_down": (H, INTER)}
if not args.cpu_smoke:
    DENSE.update({"gate_up": (10240, 2048), "down": (2048, 5120)})


def ms(fn) -> float:
    if args.cpu_smoke:
        fn()
        return float("nan")
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def bits(out: torch.Tensor) -> torch.Tensor:
    return out.view(torch.int16) if out.dtype == torch.bfloat16 else out.view(torch.int32)


def dense_cases():
    """(name, flops, fn(config) -> output) for each dense shape's fprop, dgrad and wgrad (bf16 dW)."""
    cases = []
    for name, (n, k) in DENSE.items():
        x = torch.randn(T, k, device=DEV)
        w = torch.randn(n, k, device=DEV) * 0.02
        dy = torch.randn(T, n, device=DEV) * 1e-3
        xq, xs = quantize_1x128(x)
        wq, ws = quantize_128x128(w)
        wtq, wts = quantize_128x128(w.t().contiguous())
        dyq, dys = quantize_1x128(dy)
        dytq, dyts = quantize_1x128(dy.t().contiguous())
        xtq, xts = quantize_1x128(x.t().contiguous())
        cases += [
            (f"{name} fprop", 2 * T * n * k, lambda c, a=(xq, xs, wq, ws): fp8_gemm(*a, config=c)),
            (f"{name} dgrad", 2 * T * n * k, lambda c, a=(dyq, dys, wtq, wts): fp8_gemm(*a, config=c)),
            (f"{name} wgrad", 2 * T * n * k, lambda c, a=(dytq, dyts, xtq, xts): fp8_gemm_wgrad(
                *a, out_dtype=torch.bfloat16, config=c)),
        ]  # fmt: skip
    return cases


def grouped_cases():
    gen = torch.Generator(device=DEV).manual_seed(0)
    idx = torch.rand(T, E, generator=gen, device=DEV).topk(TOPK, dim=1).indices
    plan = plan_dispatch(idx, E, 16)
    rows = plan.rows
    m = T * TOPK
    cases = []
    for n, k in ((2 * INTER, H), (H, INTER), (H, 2 * INTER)):  # gate_up fwd, down fwd, gate_up dgrad
        xq, xs = quantize_1x128(torch.randn(rows.num_rows, k, device=DEV))
        wq, ws = G.quantize_expert_weights(torch.randn(E, n, k, device=DEV) * 0.02)
        used = int(rows.offsets[-1])  # rows past the segments are left unwritten
        cases.append((f"grouped fprop N={n} K={k}", 2 * m * n * k, "fprop",
                      lambda a=(xq, xs, wq, ws), u=used: G.grouped_gemm(*a, rows)[:u]))
    for n, k in ((2 * INTER, H), (H, INTER)):
        dyt = G.quantize_tokens_grouped(torch.randn(rows.num_rows, n, device=DEV), rows)
        xt = G.quantize_tokens_grouped(torch.randn(rows.num_rows, k, device=DEV), rows)
        cases.append((f"grouped wgrad N={n} K={k}", 2 * m * n * k, "wgrad",
                      lambda a=(*dyt, *xt): G.grouped_gemm_wgrad(*a, rows, out_dtype=torch.bfloat16)))
    return cases


def main() -> None:
    torch.manual_seed(0)
    print(torch.cuda.get_device_name() if DEV == "cuda" else "CPU interpreter (smoke run, no timing)")
    base = FPROP_CONFIG if DEV == "cuda" else GemmConfig(64, 64, 4, num_warps=4, num_stages=2, tma=True,
                                                         persistent=True)  # fmt: skip
    # variant: (prefetch_scales, flatten, programs per SM: dense, grouped forward, grouped wgrad; None = the tiles')
    changes = {"default": (False, False, None), "prefetch": (True, False, None), "flatten": (False, True, None),
               "flatten + prefetch": (True, True, None), "prefetch, fewer per SM": (True, False, (1, 2, 1))}
    tuned = G.GROUPED_TUNING.current()
    grouped_base = {"fprop": tuned.fprop, "wgrad": tuned.wgrad}
    if DEV == "cpu":  # the interpreter's small tiles
        grouped_base = {"fprop": G.GroupedGemmConfig(32, 128, 4, 2, True),
                        "wgrad": G.GroupedGemmConfig(32, 32, 4, 2, True)}
    dense_variants, grouped_variants = {}, {}
    for name, (prefetch, flatten, per_sm) in changes.items():
        dense_variants[name] = dataclasses.replace(base, prefetch_scales=prefetch, flatten=flatten,
                                                   programs_per_sm=per_sm[0] if per_sm else base.programs_per_sm)
        grouped_variants[name] = {
            kind: dataclasses.replace(cfg, prefetch_scales=prefetch, tma=True, flatten=flatten and kind == "fprop",
                                      programs_per_sm=per_sm[1 + (kind == "wgrad")] if per_sm else cfg.programs_per_sm)
            for kind, cfg in grouped_base.items()}
    rows, times = [], {}
    dense, grouped = dense_cases(), grouped_cases()
    ref = {name: bits(fn(dense_variants["default"])) for name, _, fn in dense}
    for name, _, _, fn in grouped:
        with G.GROUPED_TUNING.override(**grouped_variants["default"], sm90_wgrad=None):
            ref[name] = bits(fn())
    for _ in range(args.rounds if DEV == "cuda" else 1):
        for variant, cfg in dense_variants.items():
            for name, flops, fn in dense:
                same = torch.equal(bits(fn(cfg)), ref[name])
                times.setdefault((name, variant), []).append((ms(lambda f=fn, c=cfg: f(c)), same, flops))
        for variant, over in grouped_variants.items():
            with G.GROUPED_TUNING.override(**over, sm90_wgrad=None):
                for name, flops, _, fn in grouped:
                    same = torch.equal(bits(fn()), ref[name])
                    times.setdefault((name, variant), []).append((ms(fn), same, flops))
    names = [c[0] for c in dense] + [c[0] for c in grouped]
    variants = list(dense_variants)
    print("\n| GEMM | " + " | ".join(f"{v} TFLOPS" for v in variants) + " | "
          + " | ".join(f"default / {v}" for v in variants[1:]) + " |")
    print("|---|" + "---|" * (2 * len(variants) - 1))
    for name in names:
        cells, med = [], {}
        for v in variants:
            got = sorted(times[(name, v)], key=lambda r: r[0])
            t, same, flops = got[len(got) // 2]
            med[v] = t
            ok = all(r[1] for r in got)
            cells.append(f"{flops / t / 1e9:.0f}{'' if ok else ' BITS!'}" if t == t else ("ran" if ok else "BITS!"))
        ratios = [med["default"] / med[v] for v in variants[1:]]
        rows.append(f"| {name} | " + " | ".join(cells) + " | " + " | ".join(f"{r:.3f}" for r in ratios) + " |")
    print("\n".join(rows))
    if args.json:
        medians = {name: {v: {"ms": sorted(r[0] for r in times[(name, v)])[len(times[(name, v)]) // 2],
                              "same_bits": all(r[1] for r in times[(name, v)])} for v in variants}
                   for name in names}
        with open(args.json, "w") as f:
            json.dump(medians, f, indent=1)


if __name__ == "__main__":
    main()
