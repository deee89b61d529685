"""The token-dim quantizers: the previous launch defaults against the new ones (grid order), alternating three times;
bit-exact against each other. Medians of do_bench, µs. Run from the repo root on the GPU."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import torch  # noqa: E402
import triton.testing  # noqa: E402

import fp8.grouped as G  # noqa: E402
from bench_moe import H, INTER, routing  # noqa: E402
from fp8.quant import QUANT_TUNING, quantize_1x128, quantize_1x128_dual, quantize_1x128_transposed  # noqa: E402
from model.dispatch import plan_dispatch  # noqa: E402

OLD_GROUPED = dict(tokens_features_first=False, gathered_features_first=False)
OLD_DENSE = dict(col_block_f=32, col_warps=4, col_features_first=False)


def ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def same(a, b) -> bool:
    def u8(t):
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t

    return all(torch.equal(u8(x), u8(y)) for x, y in zip(a, b))


def grouped(tokens: int, experts: int) -> None:
    idx, _ = routing(tokens, experts)
    plan = plan_dispatch(idx, experts, 16)
    rows, src = plan.rows, plan.row_src
    torch.manual_seed(0)
    x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
    dh = torch.randn(rows.num_rows, 2 * INTER, device="cuda", dtype=torch.bfloat16)
    h_q, h_s = quantize_1x128(torch.randn(rows.num_rows, 2 * INTER, device="cuda", dtype=torch.bfloat16))
    gate = torch.rand(rows.num_rows, device="cuda")
    nb = int(rows.block_offsets()[-1])
    ops = {"gathered x": lambda: G.quantize_tokens_grouped(x, rows, src),
           "dh": lambda: G.quantize_tokens_grouped(dh, rows),
           "SwiGLU a": lambda: G.swiglu_quantize_tokens(h_q, h_s, gate, rows)}
    for name, f in ops.items():
        new = [t[:, :nb * 128] if i == 0 else t[:, :nb] for i, t in enumerate(f())]
        with G.GROUPED_TUNING.override(**OLD_GROUPED):
            old = [t[:, :nb * 128] if i == 0 else t[:, :nb] for i, t in enumerate(f())]
        times = {"old": [], "new": []}
        for _ in range(3):
            with G.GROUPED_TUNING.override(**OLD_GROUPED):
                times["old"].append(ms(f))
            times["new"].append(ms(f))
        o, n = (sorted(v)[1] * 1e3 for v in times.values())
        print(f"| {tokens}/{experts}e | {name} | {o:.1f} | {n:.1f} | {o / n:.2f}x | {same(old, new)} |", flush=True)


def dense(tokens: int) -> None:
    torch.manual_seed(1)
    xs = {k: torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16) for k in (1024, 2048, 3072, 5120)}
    xq = quantize_1x128(xs[2048])
    ops = {f"tokens [{tokens}, {k}]": (lambda v=v: quantize_1x128_transposed(v, None, False)) for k, v in xs.items()}
    ops["tokens from FP8 [.., 2048]"] = lambda: quantize_1x128_transposed(xq[0], xq[1], False)
    ops["dual (rows + tokens) [.., 3072]"] = lambda: quantize_1x128_dual(xs[3072], False)
    for name, f in ops.items():
        new = f()
        with QUANT_TUNING.override(**OLD_DENSE):
            old = f()
        times = {"old": [], "new": []}
        for _ in range(3):
            with QUANT_TUNING.override(**OLD_DENSE):
                times["old"].append(ms(f))
            times["new"].append(ms(f))
        o, n = (sorted(v)[1] * 1e3 for v in times.values())
        print(f"| dense | {name} | {o:.1f} | {n:.1f} | {o / n:.2f}x | {same(old, new)} |", flush=True)


def rows_order(tokens: int, experts: int) -> None:
    """The row kernel (1x128 along K): rows first (the default until 2026-12-06's second session) against K blocks
    first, dense and gathered (rows past rows.total are unwritten: the comparison slices them off)."""
    from fp8.grouped import quantize_rows_gathered

    idx, _ = routing(tokens, experts)
    plan = plan_dispatch(idx, experts, 16)
    torch.manual_seed(2)
    xs = {k: torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16) for k in (1024, 2048, 3072, 5120)}
    ops = {f"rows [{tokens}, {k}]": (lambda v=v: quantize_1x128(v), "row_features_first") for k, v in xs.items()}
    used = int(plan.rows.total)  # rows from rows.total on are left unwritten: compare the written ones

    def gathered():
        q, s = quantize_rows_gathered(xs[2048], plan.row_src, plan.rows)
        return q[:used], s[:used]

    ops[f"rows gathered [{tokens}x8, 2048], {experts}e"] = (gathered, "gathered_row_features_first")
    for name, (f, knob) in ops.items():
        with QUANT_TUNING.override(**{knob: False}):
            base = f()
        with QUANT_TUNING.override(**{knob: True}):
            other = f()
        times = {"rows first": [], "K first": []}
        for _ in range(3):
            with QUANT_TUNING.override(**{knob: False}):
                times["rows first"].append(ms(f))
            with QUANT_TUNING.override(**{knob: True}):
                times["K first"].append(ms(f))
        o, n = (sorted(v)[1] * 1e3 for v in times.values())
        print(f"| row kernel | {name} | {o:.1f} | {n:.1f} | {o / n:.2f}x | {same(base, other)} |", flush=True)


def main() -> None:
    print(torch.cuda.get_device_name(), "— µs (median of 3 alternating do_bench medians)")
    print("| shape | operand | previous launch | new launch | speed-up | same bits |\n|---|---|---|---|---|---|")
    for tokens, experts in ((16384, 64), (4096, 256)):
        grouped(tokens, experts)
    dense(16384)
    print("\nThe row kernel: rows first in the 'previous' column, K blocks first in the 'new' one")
    rows_order(16384, 64)


if __name__ == "__main__":
    main()
