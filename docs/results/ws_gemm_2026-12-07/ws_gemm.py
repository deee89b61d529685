"""Experiment (fourteenth session): the warp-specialised Gluon dense GEMM (fp8/gemm_sm90.py,
Sm90GemmConfig.warp_specialized) against our Triton kernel (the default) and cuBLAS's blockwise scaled_mm, on the
Ling shapes' forward, dgrad and bf16 wgrad, every output compared bit for bit with the Triton kernel's; and the
experts' grouped forward/dgrad (GROUPED=0 skips them).

Run on the GPU: python scratch/ws_gemm.py
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys

import torch
import triton

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "bench"))

from bench_fp8_linear import SHAPES, cublas_blockwise, gemm_operands  # noqa: E402
from bench_moe import INTER, TOPK, H, routing  # noqa: E402

from fp8 import grouped as G  # noqa: E402
from fp8.gemm import GEMM_TUNING, default_gemm_config, fp8_gemm, fp8_gemm_wgrad  # noqa: E402
from fp8.gemm_sm90 import Sm90GemmConfig, fp8_gemm_sm90  # noqa: E402
from fp8.quant import quantize_1x128  # noqa: E402
from model.dispatch import plan_dispatch  # noqa: E402

VARIANTS_ALL = {
    "ws s4": Sm90GemmConfig(warp_specialized=True),
    "ws s5": Sm90GemmConfig(warp_specialized=True, stages=5),
    "ws carry s4": Sm90GemmConfig(warp_specialized=True, carry=True),
    "ws carry s5": Sm90GemmConfig(warp_specialized=True, carry=True, stages=5),
}


VARIANTS = {name: VARIANTS_ALL[name] for name in os.environ.get("VARIANTS", ",".join(VARIANTS_ALL)).split(",")}


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def cell(fn, same_bits, flops: float) -> tuple[str, bool]:
    """The variant's TFLOPS (flagged where its bits differ from the Triton kernel's), or its error."""
    try:
        same = same_bits(fn())
        return f"{flops / bench(fn) / 1e9:.0f}{'' if same else ' BITS!'}", not same
    except Exception as e:  # noqa: BLE001
        return f"err {type(e).__name__}: {str(e)[:80]}", False


def print_table(head: list[str], rows: list[list[str]]) -> None:
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(r) + " |")


def grouped_rows() -> tuple[list[list[str]], int]:
    """The experts' forward/dgrad GEMMs (gate_up fwd, down fwd, gate_up dgrad) at 16,384 tokens, top-8 of 64 and of
    256 experts: the default (Triton) against the warp-specialised variants, the bits of every segment compared."""
    out, bad = [], 0
    for experts in (64, 256):
        idx, _ = routing(16384, experts)
        rows = plan_dispatch(idx, experts, 16).rows
        segs = rows.offsets.tolist()
        for n, k in ((2 * INTER, H), (H, INTER), (H, 2 * INTER)):
            xq, xs = quantize_1x128(torch.randn(rows.num_rows, k, device="cuda", dtype=torch.bfloat16))
            wq, ws = G.quantize_expert_weights(torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16))
            flops = 2.0 * 16384 * TOPK * n * k
            fn = functools.partial(G.grouped_gemm, xq, xs, wq, ws, rows)
            ref = fn()
            row = [f"16384/{experts}", f"N={n} K={k}", f"{flops / bench(fn) / 1e9:.0f}"]
            same_bits = lambda got: all(torch.equal(got[lo:hi], ref[lo:hi])  # noqa: E731,B023
                                        for lo, hi in zip(segs[:-1], segs[1:]))  # noqa: B023
            for cfg in VARIANTS.values():
                with G.GROUPED_TUNING.override(sm90=cfg):
                    text, differs = cell(fn, same_bits, flops)
                row.append(text)
                bad += differs
            out.append(row)
            print(" | ".join(row), flush=True)
    return out, bad


def main() -> None:
    grows, gbad = grouped_rows() if os.environ.get("GROUPED", "1") == "1" else ([], 0)
    rows, bad = [], 0
    tokens = [int(t) for t in os.environ.get("TOKENS", "16384,4096").split(",")]
    for m in tokens:
        for name, (n, k) in SHAPES.items():
            for kind in ("fprop", "dgrad", "wgrad_bf16"):
                a, a_s, b, b_s, bw, od, _, _ = gemm_operands(kind, m, n, k)
                with GEMM_TUNING.override(sm90=None):
                    ours = (functools.partial(fp8_gemm, a, a_s, b, b_s, od) if bw
                            else functools.partial(fp8_gemm_wgrad, a, a_s, b, b_s, od))  # fmt: skip
                    t_ours = bench(ours)
                    # the bit reference sums each output's K blocks in one pass, as the Gluon kernel does (ours may
                    # split a wgrad's token reduction, which sums in another order)
                    ref = ours() if bw else fp8_gemm_wgrad(
                        a, a_s, b, b_s, od,
                        config=dataclasses.replace(default_gemm_config(a.shape[0], "wgrad", od), split_k=1))
                flops = 2.0 * a.shape[0] * b.shape[0] * a.shape[1]
                try:
                    t_cub = bench(lambda: cublas_blockwise(a, a_s, b, b_s, bw, od))  # noqa: B023
                except Exception:  # noqa: BLE001
                    t_cub = float("nan")
                row = [str(m), name, kind, f"{flops / t_ours / 1e9:.0f}", f"{flops / t_cub / 1e9:.0f}"]
                for cfg in VARIANTS.values():
                    fn = functools.partial(fp8_gemm_sm90, a, a_s, b, b_s, od, b_blockwise=bw, config=cfg)
                    text, differs = cell(fn, lambda got: torch.equal(got, ref), flops)  # noqa: B023
                    row.append(text)
                    bad += differs
                rows.append(row)
                print(" | ".join(row), flush=True)
    print(f"\nbit mismatches: {bad} dense, {gbad} grouped")
    print_table(["tokens/experts", "GEMM", "ours (Triton)", *VARIANTS], grows)
    print_table(["tokens", "shape", "GEMM", "ours (Triton)", "cuBLAS blockwise", *VARIANTS], rows)


if __name__ == "__main__":
    main()
