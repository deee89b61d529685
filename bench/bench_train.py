"""Side-by-side training throughput and memory: BF16 vs FP8 runs of the same model through train.py.

    python bench/bench_train.py [--model ling_mini_2_0_l6] [--steps 12] [--seq-len 4096] [--micro 1]
        [--grad-accum 8] [--variants bf16,fp8] [--extra 'key=value ...']

Each variant is a fresh `python train.py` process (so peak memory is per variant) on synthetic data; the
table reports medians over the steps after the first `--warmup` ones. Prints a Markdown table last.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "bf16": ["precision=bf16", "optim=adamw"],
    "fp8": ["precision=fp8", "optim=fp8_adamw"],
    "fp8_linear_only": ["precision=fp8", "optim=adamw"],
    "bf16_fp8_adam": ["precision=bf16", "optim=fp8_adamw"],
}


def run_variant(name: str, args) -> dict:
    out_dir = Path(tempfile.mkdtemp(prefix=f"bench_{name}_"))
    cmd = [sys.executable, "train.py", f"model={args.model}", "data=synthetic", f"data.vocab_size={args.vocab}",
           f"train.steps={args.steps}", f"train.seq_len={args.seq_len}", f"train.micro_batch_size={args.micro}",
           f"train.grad_accum={args.grad_accum}",
           "train.device=cuda", "train.save_final=false", "logging.wandb.mode=disabled", "logging.progress_bar=false",
           f"hydra.run.dir={out_dir}", "optim.warmup_steps=2", *VARIANTS[name], *shlex.split(args.extra)]
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout[-2000:], proc.stderr[-6000:], flush=True)
        return {"variant": name, "error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"}
    return {"variant": name, **summarize_run(out_dir, args.warmup)}


def summarize_run(run_dir: Path, warmup: int) -> dict:
    """A train.py run's metrics.jsonl → medians over the steps after `warmup` (tokens/s global, TFLOPS and MFU
    per GPU), the peak memory over all steps, the first and last loss."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = rows[warmup:] or rows
    med = lambda key: statistics.median(r[key] for r in timed if r.get(key) is not None)  # noqa: E731
    return {"tokens_per_s": med("tokens_per_s"), "tflops": med("tflops_per_gpu"),
            "mfu": med("mfu") if timed[0].get("mfu") is not None else float("nan"),
            "peak_mem_gib": max(r["peak_mem_gib"] for r in rows),
            "loss_first": rows[0]["loss"], "loss_last": rows[-1]["loss"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="ling_mini_2_0_l6")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--micro", type=int, default=1)
    ap.add_argument("--grad-accum", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=157184)
    ap.add_argument("--variants", default="bf16,fp8")
    ap.add_argument("--extra", default="model.activation_checkpointing=true")
    args = ap.parse_args()
    results = [run_variant(v, args) for v in args.variants.split(",")]
    base = next((r for r in results if r["variant"] == "bf16" and "error" not in r), None)
    print(f"\n### {args.model}, seq {args.seq_len} x micro-batch {args.micro} x grad_accum {args.grad_accum}, "
          f"{args.steps} steps "
          f"(medians after {args.warmup})\n")
    print("| variant | tokens/s | vs bf16 | TFLOPS/GPU | MFU | peak mem GiB | vs bf16 | loss first→last |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['variant']} | failed: {r['error'][:80]} | | | | | | |")
            continue
        sp = r["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
        mem = r["peak_mem_gib"] / base["peak_mem_gib"] if base else float("nan")
        print(f"| {r['variant']} | {r['tokens_per_s']:.0f} | {sp:.2f}x | {r['tflops']:.0f} | {r['mfu']:.1%} | "
              f"{r['peak_mem_gib']:.1f} | {mem:.2f}x | {r['loss_first']:.3f}→{r['loss_last']:.3f} |")


if __name__ == "__main__":
    main()
