"""The FP8 quantizers of one MoE decoder layer of the step's model, at the step's shapes: every quantization a
micro-batch's forward and backward makes in that layer (attention's and the shared expert's FP8Linears, the routed
experts), timed alone, with the bytes each must move at least and the rate that gives.

    python bench/bench_quant.py [--model ling_mini_2_0_e64] [--tokens 16384] [--peak-tbs 4.8] [--save DIR] [--out DIR]
    python bench/bench_quant.py --compare DIR_A DIR_B

`--tokens` is one micro-batch's tokens (seq 4096 x micro-batch 4 = 16,384 in `bench_train.py`'s fp8@4 row).
Routing: top-k of random scores, padded to `moe.pad_multiple` as in training. Times are `triton.testing.do_bench`
medians on CUDA (the Triton kernels), one timed call on CPU (the PyTorch references: a smoke run, not a figure).
"min MB" counts each input read once and each output written once (a gathered input's repeats hit L2), so
"GB/s" is a lower bound of the traffic's rate; `--peak-tbs` adds its share of that DRAM bandwidth. The step
estimate multiplies the layer's sum by the MoE layers (the MTP layer's included) and the gradient accumulation.

A/B of two trees (the outputs must not change a bit): run with `--save DIR` in each (from the tree's root), then
`--compare DIR_A DIR_B`: one line per output, the number of values whose bits differ.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fp8 import grouped as G  # noqa: E402
from fp8.quant import (  # noqa: E402
    fp8_transpose_128x128,
    quantize_1x128,
    quantize_1x128_dual,
    quantize_1x128_transposed,
    quantize_128x128_with_transpose,
)
from model.config import ModelConfig  # noqa: E402
from model.dispatch import plan_dispatch  # noqa: E402

BF16, FP8, FP32 = 2, 1, 4  # bytes per value
GRAD_ACCUM = 8  # as in exp=fp8_mtp and bench_train.py


@dataclass
class Case:
    """One quantizer call: `run()` returns its outputs; `used(out)` the parts of them that are written (a grouped
    output's rows or blocks past the used ones are left unwritten by design); `min_bytes` its least traffic."""

    part: str
    name: str
    shape: str
    run: Callable[[], tuple]
    used: Callable[[tuple], tuple]
    min_bytes: float


def _whole(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def fp8_linears(cfg: ModelConfig) -> list[tuple[str, int, int]]:
    """(part, out features, in features) of one MoE decoder layer's FP8Linears: QKV, o_proj, the shared expert's
    gate_up and down."""
    h, shared = cfg.hidden_size, cfg.num_shared_experts * cfg.expert_intermediate_size
    qkv, attn_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, cfg.num_heads * cfg.head_dim
    return [("attention", qkv, h), ("attention", h, attn_out), ("shared expert", 2 * shared, h),
            ("shared expert", h, shared)]  # fmt: skip


def layer_cases(cfg: ModelConfig, tokens: int, device: str, seed: int = 0) -> list[Case]:
    """The quantizations of one MoE decoder layer's forward + backward for `tokens` tokens, in call order."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(torch.bfloat16)

    h, e, k, inter = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.expert_intermediate_size
    idx = torch.rand(tokens, e, generator=gen, device=device).topk(k, dim=1).indices
    plan = plan_dispatch(idx, e, cfg.moe_pad_multiple)
    rows, src = plan.rows, plan.row_src
    routed = int(rows.offsets[-1])  # rows the grouped quantizers write (the padded segments)
    used_blocks = int(rows.block_offsets()[-1])

    def row_part(out: tuple) -> tuple:
        return tuple(t[:routed] for t in out)

    def block_part(out: tuple) -> tuple:
        q, s = out
        return q[:, : used_blocks * 128], s[:, :used_blocks]

    def scales(values: float) -> float:
        return values / 128 * FP32

    def quantized(m: int, n: int, copies: int = 1) -> float:
        """A bf16 [m, n] read once and `copies` E4M3 quantizations of it written with their scales."""
        return m * n * BF16 + copies * (m * n * FP8 + scales(m * n))

    x = randn(tokens, h)
    cases = []
    # FP8Linears: forward quantize_1x128_dual(x) (rows for the GEMM, token-dim for wgrad), backward dy both ways
    for part, n_out, n_in in fp8_linears(cfg):
        xi, dy = randn(tokens, n_in), randn(tokens, n_out, scale=1e-3)
        linear = f"[{n_out}, {n_in}]"
        cases += [
            Case(part, f"x dual (rows + token-dim), linear {linear}", f"[{tokens}, {n_in}]",
                 lambda xi=xi: quantize_1x128_dual(xi), _whole, quantized(tokens, n_in, copies=2)),
            Case(part, f"dy rows, linear {linear}", f"[{tokens}, {n_out}]",
                 lambda dy=dy: quantize_1x128(dy), _whole, quantized(tokens, n_out)),
            Case(part, f"dy token-dim, linear {linear}", f"[{tokens}, {n_out}]",
                 lambda dy=dy: quantize_1x128_transposed(dy), _whole, quantized(tokens, n_out)),
        ]  # fmt: skip
    # the routed experts (fp8/grouped.py's autograd function, fp8.expert_wgrad=fp8)
    # routed rows as training makes them: the padding rows (row_src < 0) and the unused ones are zero, gate 0
    data = (src >= 0)[:, None]

    def routed_rows(width: int, scale: float = 1.0) -> torch.Tensor:
        return torch.where(data, randn(rows.num_rows, width, scale=scale), 0.0).to(torch.bfloat16)

    h_up = routed_rows(2 * inter)
    h_q, h_s = quantize_1x128(h_up)
    gate = torch.where(data[:, 0], torch.rand(rows.num_rows, generator=gen, device=device), 0.0)
    da = routed_rows(inter, 1e-3)
    dout = randn(tokens, h, scale=1e-3)
    dh = routed_rows(2 * inter, 1e-3)
    w_gu_q, w_gu_s = G.quantize_expert_weights(randn(e, 2 * inter, h, scale=0.02))
    w_d_q, w_d_s = G.quantize_expert_weights(randn(e, h, inter, scale=0.02))
    gathered = tokens * h * BF16 + routed * h * FP8 + scales(routed * h)
    cases += [
        Case("experts", "x gathered rows (forward GEMM)", f"[{routed}, {h}]",
             lambda: G.quantize_rows_gathered(x, src, rows), row_part, gathered),
        Case("experts", "x gathered token-dim (wgrad, saved)", f"[{routed}, {h}]",
             lambda: G.quantize_tokens_grouped(x, rows, src), block_part, gathered),
        Case("experts", "SwiGLU a and h (forward)", f"[{routed}, {2 * inter}]",
             lambda: G.swiglu_quantize(h_up, gate, rows, save_h=True), row_part,
             routed * 2 * inter * (BF16 + FP8) + routed * inter * FP8 + scales(3 * routed * inter)),
        Case("experts", "dy gathered rows (dgrad)", f"[{routed}, {h}]",
             lambda: G.quantize_rows_gathered(dout, src, rows), row_part, gathered),
        Case("experts", "down weight transpose (dgrad)", f"[{e}, {h}, {inter}]",
             lambda: fp8_transpose_128x128(w_d_q, w_d_s), _whole, 2 * e * h * inter * FP8),
        Case("experts", "SwiGLU backward (dh and its rows)", f"[{routed}, {2 * inter}]",
             lambda: G.swiglu_backward(h_q, h_s, da, gate, rows), row_part,
             routed * 2 * inter * FP8 + routed * inter * BF16 + routed * 2 * inter * (BF16 + FP8)
             + scales(routed * 2 * inter)),
        Case("experts", "dy gathered token-dim (wgrad)", f"[{routed}, {h}]",
             lambda: G.quantize_tokens_grouped(dout, rows, src), block_part, gathered),
        Case("experts", "SwiGLU a token-dim from FP8 h (wgrad)", f"[{routed}, {inter}]",
             lambda: G.swiglu_quantize_tokens(h_q, h_s, gate, rows), block_part,
             routed * 2 * inter * FP8 + routed * inter * FP8 + scales(routed * inter)),
        Case("experts", "dh token-dim (wgrad)", f"[{routed}, {2 * inter}]",
             lambda: G.quantize_tokens_grouped(dh, rows), block_part,
             routed * 2 * inter * (BF16 + FP8) + scales(routed * 2 * inter)),
        Case("experts", "gate_up weight transpose (dgrad)", f"[{e}, {2 * inter}, {h}]",
             lambda: fp8_transpose_128x128(w_gu_q, w_gu_s), _whole, 2 * e * 2 * inter * h * FP8),
    ]  # fmt: skip
    return cases


def weight_cases(cfg: ModelConfig, device: str) -> list[Case]:
    """Once per optimizer step, not per micro-batch: one MoE layer's weights quantized, the FP8Linears' with their
    transposes (the weight caches), the experts' stacked [E, N, K]."""
    gen = torch.Generator(device=device).manual_seed(1)
    h, e, inter = cfg.hidden_size, cfg.num_experts, cfg.expert_intermediate_size
    part = "weights (per optimizer step)"
    out = []
    for _, n, k in fp8_linears(cfg):
        w = (torch.randn(n, k, generator=gen, device=device) * 0.02).to(torch.bfloat16)
        out.append(Case(part, f"128x128 + transpose, linear [{n}, {k}]", f"[{n}, {k}]",
                        lambda w=w: quantize_128x128_with_transpose(w), _whole, n * k * (BF16 + 2 * FP8)))  # fmt: skip
    for n, k in ((2 * inter, h), (h, inter)):
        w = (torch.randn(e, n, k, generator=gen, device=device) * 0.02).to(torch.bfloat16)
        out.append(Case(part, f"128x128, experts [{e}, {n}, {k}]", f"[{e}, {n}, {k}]",
                        lambda w=w: G.quantize_expert_weights(w), _whole, e * n * k * (BF16 + FP8)))  # fmt: skip
    return out


def time_us(fn: Callable[[], object]) -> float:
    """Median µs: CUDA events through `triton.testing.do_bench` on a GPU, one call's wall time on CPU."""
    if torch.cuda.is_available():
        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def save_outputs(cases: list[Case], directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for i, case in enumerate(cases):
        out = tuple(t.contiguous().cpu() for t in case.used(_whole(case.run())))
        torch.save({"part": case.part, "name": case.name, "outputs": out}, directory / f"{i:02d}.pt")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A float tensor's bit patterns as integers (others as they are)."""
    if not t.dtype.is_floating_point:
        return t
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def compare_outputs(dir_a: Path, dir_b: Path) -> list[str]:
    """One line per saved output of dir_a: how many values differ in their bits from dir_b's (NaN = NaN)."""
    lines = []
    for path in sorted(dir_a.glob("*.pt")):
        a, b = torch.load(path), torch.load(dir_b / path.name)
        if a["name"] != b["name"]:
            raise ValueError(f"{path.name}: {a['name']!r} in {dir_a} but {b['name']!r} in {dir_b}")
        counts = []
        for x, y in zip(a["outputs"], b["outputs"], strict=True):
            both_nan = torch.isnan(x.float()) & torch.isnan(y.float()) if x.dtype.is_floating_point else False
            counts.append(int(((_bits(x) != _bits(y)) & ~both_nan).sum()))
        verdict = "same bits" if not any(counts) else "DIFFER"
        lines.append(f"{a['part']} | {a['name']}: {verdict} (values differing per output: {counts})")
    return lines


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="ling_mini_2_0_e64")
    p.add_argument("--tokens", type=int, default=16384, help="one micro-batch's tokens")
    p.add_argument("--peak-tbs", type=float, default=None, help="the GPU's DRAM bandwidth, TB/s, for a share column")
    p.add_argument("--save", default=None, help="save every output's used part here (for --compare)")
    p.add_argument("--compare", nargs=2, default=None, metavar=("DIR_A", "DIR_B"))
    p.add_argument("--out", default=None, help="write bench_quant.json here")
    args = p.parse_args(argv)
    if args.compare:
        for line in compare_outputs(Path(args.compare[0]), Path(args.compare[1])):
            print(line)
        return []
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = ModelConfig.preset(args.model)
    cases = layer_cases(cfg, args.tokens, device)
    weights = weight_cases(cfg, device)
    if args.save:
        save_outputs(cases + weights, Path(args.save))
    rows = []
    for case in cases + weights:
        us = time_us(case.run)
        rows.append({"part": case.part, "quantizer": case.name, "shape": case.shape, "us": us,
                     "min_mb": case.min_bytes / 1e6, "gbs": case.min_bytes / us / 1e3})  # fmt: skip
    moe_layers = cfg.num_layers - cfg.num_dense_layers + cfg.num_mtp_layers
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU (PyTorch references, one call each)"
    print(f"# bench_quant on {where}, {args.model}, {args.tokens} tokens per micro-batch, top-{cfg.num_experts_per_tok}"
          f" of {cfg.num_experts} experts, padding {cfg.moe_pad_multiple}\n")  # fmt: skip
    share = f" | % of {args.peak_tbs} TB/s" if args.peak_tbs else ""
    print(f"| part | quantizer | shape | µs | min MB | GB/s{share} |")
    print("|---|---|---|---|---|---|" + ("---|" if args.peak_tbs else ""))
    for r in rows:
        pct = f" | {r['gbs'] / (args.peak_tbs * 1e3) * 100:.0f} %" if args.peak_tbs else ""
        figures = f"{r['us']:.1f} | {r['min_mb']:.0f} | {r['gbs']:.0f}{pct}"
        print(f"| {r['part']} | {r['quantizer']} | {r['shape']} | {figures} |")
    per_layer = sum(r["us"] for r in rows if not r["part"].startswith("weights"))
    print(f"\nOne MoE layer's forward + backward quantizations: {per_layer:.0f} µs; x {moe_layers} MoE layers x "
          f"{GRAD_ACCUM} micro-batches = {per_layer * moe_layers * GRAD_ACCUM / 1e3:.1f} ms per optimizer step "
          f"(the dense layer 0 and the LM head not counted).")  # fmt: skip
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench_quant.json").write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
