"""Token-dim quantizer launch sweep (grouped and dense): grid order, chunks per program, features per chunk, warps.
Every variant is checked bit for bit against the default launch on the same inputs; medians of do_bench (ms).
Run from the repo root on the GPU: python scratch/tokquant_sweep.py"""

from __future__ import annotations

import json
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


def ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def same(a, b) -> bool:
    return all(torch.equal(x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x,
                           y.view(torch.uint8) if y.dtype == torch.float8_e4m3fn else y) for x, y in zip(a, b))


# (features per chunk, chunks, features first, warps)
GROUPED = [(16, 1, False, 1), (16, 1, True, 1), (16, 1, True, 2), (16, 2, False, 1), (16, 2, True, 1),
           (16, 4, True, 1), (16, 8, True, 1), (16, 8, False, 1), (16, 8, True, 2), (32, 1, True, 1),
           (32, 1, True, 2), (32, 4, True, 2), (32, 4, False, 2), (64, 1, True, 2), (64, 2, True, 4)]
DENSE = [(32, 1, False, 4), (32, 1, True, 4), (16, 1, False, 1), (16, 1, True, 1), (16, 1, True, 2),
         (32, 1, True, 2), (32, 4, True, 2), (16, 8, True, 1), (16, 8, False, 1), (64, 1, True, 4), (64, 2, True, 4)]


def grouped_rows(tokens: int, experts: int) -> list[tuple]:
    idx, _ = routing(tokens, experts)
    plan = plan_dispatch(idx, experts, 16)
    rows, src = plan.rows, plan.row_src
    torch.manual_seed(0)
    x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
    dh = torch.randn(rows.num_rows, 2 * INTER, device="cuda", dtype=torch.bfloat16)
    h_q, h_s = quantize_1x128(torch.randn(rows.num_rows, 2 * INTER, device="cuda", dtype=torch.bfloat16))
    gate = torch.rand(rows.num_rows, device="cuda")
    ops = {"gathered x": lambda: G.quantize_tokens_grouped(x, rows, src),
           "dh": lambda: G.quantize_tokens_grouped(dh, rows),
           "swiglu a": lambda: G.swiglu_quantize_tokens(h_q, h_s, gate, rows)}
    nb = int(rows.block_offsets()[-1])
    base = {k: [t[:, :nb * 128] if i == 0 else t[:, :nb] for i, t in enumerate(f())] for k, f in ops.items()}
    out = []
    for bf, chunks, ff, warps in GROUPED:
        cfg = dict(tokens_block_f=bf, tokens_chunks=chunks, tokens_features_first=ff, tokens_warps=warps)
        row = [f"{tokens}/{experts}e", f"{bf}x{chunks} {'F' if ff else 'B'} w{warps}"]
        total = 0.0
        with G.GROUPED_TUNING.override(**cfg):
            for k, f in ops.items():
                got = [t[:, :nb * 128] if i == 0 else t[:, :nb] for i, t in enumerate(f())]
                ok = same(got, base[k])
                t = ms(f)
                total += t
                row.append(f"{t * 1e3:7.1f}{'' if ok else ' BITS!'}")
        row.append(f"{total * 1e3:7.1f}")
        out.append(tuple(row))
        if tokens == 16384 and experts == 64 and "BITS" not in " ".join(row):
            SCORES["grouped"].append((total, cfg))
    return out


def dense_rows(tokens: int) -> list[tuple]:
    torch.manual_seed(1)
    xs = {k: torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16) for k in (2048, 3072, 5120)}
    xq = quantize_1x128(xs[2048])
    ops = {f"x [{tokens}, {k}]": (lambda v=v: quantize_1x128_transposed(v, None, False)) for k, v in xs.items()}
    ops["from FP8 [.., 2048]"] = lambda: quantize_1x128_transposed(xq[0], xq[1], False)
    ops["dual [.., 3072]"] = lambda: quantize_1x128_dual(xs[3072], False)
    base = {k: f() for k, f in ops.items()}
    out = []
    for bf, chunks, ff, warps in DENSE:
        cfg = dict(col_block_f=bf, col_chunks=chunks, col_features_first=ff, col_warps=warps)
        row = [f"{tokens}", f"{bf}x{chunks} {'F' if ff else 'B'} w{warps}"]
        total = 0.0
        with QUANT_TUNING.override(**cfg):
            for k, f in ops.items():
                ok = same(f(), base[k])
                t = ms(f)
                if not k.startswith("dual"):
                    total += t
                row.append(f"{t * 1e3:7.1f}{'' if ok else ' BITS!'}")
        row.append(f"{total * 1e3:7.1f}")
        out.append(tuple(row))
        if "BITS" not in " ".join(row):
            SCORES["dense"].append((total, cfg))
    return out


SCORES: dict[str, list] = {"grouped": [], "dense": []}


def main() -> None:
    print(torch.cuda.get_device_name(), "— µs, medians; F: features first, B: blocks first; BITS!: differs from default")
    print("\nGrouped token-dim quantizers (top-8, padding to 16): gathered x [T, 2048], dh [R, 1024], SwiGLU a [R, 512]")
    print("| tokens/experts | launch | gathered x | dh | SwiGLU a | sum |\n|---|---|---|---|---|---|")
    for tokens, experts in ((16384, 64), (16384, 256), (4096, 256)):
        for r in grouped_rows(tokens, experts):
            print("| " + " | ".join(r) + " |", flush=True)
    print("\nDense token-dim quantizer (quantize_1x128_transposed; sum excludes the dual row+token call)")
    print("| tokens | launch | x 2048 | x 3072 | x 5120 | from FP8 2048 | dual 3072 | sum |\n|---|---|---|---|---|---|---|---|")
    for r in dense_rows(16384):
        print("| " + " | ".join(r) + " |", flush=True)
    best = {k: min(v, key=lambda t: t[0])[1] for k, v in SCORES.items() if v}
    print("\nbest (grouped: by the 16384-token 64-expert sum; dense: by the sum):", best)
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(best))


if __name__ == "__main__":
    main()
