"""Multi-GPU scaling: ZeRO and expert parallelism on N GPUs, BF16 + AdamW vs FP8 + FP8 Adam, through train.py.

    python bench/bench_scaling.py [--gpus 1,2,4,8] [--models ling_mini_2_0_e64,ling_mini_2_0] [--ep 1,N]
        [--variants bf16,fp8] [--steps 10] [--warmup 4] [--deepspeed zero1] [--dry-run]
    python bench/bench_scaling.py --device cpu --gpus 1,2 --models tiny --steps 3 --warmup 1   # smoke test (gloo)

For each model, GPU count N (default: 1 and every power of two up to the GPUs present), expert-parallel size
(`--ep`: 1 and N, the latter written `N`) and variant, one `torchrun --nproc_per_node N train.py` on synthetic
data at seq 4096 and grad_accum 8 (micro-batch 1). Weak scaling: the per-GPU batch is fixed, so the global batch
grows with N; efficiency = (tokens/s per GPU at N) / (tokens/s per GPU at N=1) of the same model, variant and
ep=1 (`ling_mini_2_0` does not fit one H200 and is compared with its smallest N). Every launch sets
NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1: NVLink multicast stays off on
the lent machines. Prints a Markdown table last.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_train import summarize_run  # noqa: E402

VARIANTS = {"bf16": ["precision=bf16", "optim=adamw"], "fp8": ["precision=fp8", "optim=fp8_adamw"]}
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def command(model: str, gpus: int, ep: int, variant: str, args, run_dir: Path) -> list[str]:
    return ["torchrun", "--standalone", f"--nproc_per_node={gpus}", "train.py", f"model={model}", "data=synthetic",
            f"data.vocab_size={args.vocab}", f"train.steps={args.steps}", f"train.seq_len={args.seq_len}",
            f"train.micro_batch_size={args.micro}", f"train.grad_accum={args.grad_accum}",
            f"train.device={args.device}", "train.save_final=false", "train.save_every=0", "train.eval_every=0",
            "logging.wandb.mode=disabled", "logging.progress_bar=false", f"hydra.run.dir={run_dir}",
            "optim.warmup_steps=2", f"moe.ep_size={ep}", f"deepspeed={args.deepspeed}",
            *VARIANTS[variant], *shlex.split(args.extra)]  # fmt: skip


def run(model: str, gpus: int, ep: int, variant: str, args) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix=f"scaling_{model}_{gpus}_{ep}_{variant}_"))
    cmd = command(model, gpus, ep, variant, args, run_dir)
    row = {"model": model, "gpus": gpus, "ep": ep, "variant": variant}
    print("$", " ".join(cmd), flush=True)
    if args.dry_run:
        return {**row, "error": "dry run"}
    env = {**os.environ, **NO_MULTICAST, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout[-2000:], proc.stderr[-4000:], flush=True)
        return {**row, "error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    summary = summarize_run(run_dir, args.warmup)
    return {**row, **summary, "tokens_per_s_gpu": summary["tokens_per_s"] / gpus}


def gpu_counts(spec: str | None, device: str) -> list[int]:
    if spec:
        return [int(n) for n in spec.split(",")]
    import torch

    have = torch.cuda.device_count() if device == "cuda" else 2
    return [n for n in (1, 2, 4, 8) if n <= have]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", default=None, help="comma-separated process counts (default: 1, 2, 4, 8 up to the GPUs)")
    ap.add_argument("--models", default="ling_mini_2_0_e64,ling_mini_2_0")
    ap.add_argument("--ep", default="1,N", help="expert-parallel sizes; N = the process count")
    ap.add_argument("--variants", default="bf16,fp8")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--micro", type=int, default=1)
    ap.add_argument("--grad-accum", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=157184)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--extra", default="model.recompute=full")
    ap.add_argument("--deepspeed", default="zero1", help="the deepspeed config group (default zero1, the GPU "
                    "experiments')")
    ap.add_argument("--dry-run", action="store_true", help="print the launch commands only")
    args = ap.parse_args()
    if args.device == "cpu":  # the smoke test: small shapes
        args.seq_len, args.grad_accum, args.vocab = min(args.seq_len, 64), min(args.grad_accum, 2), 512
        args.extra = args.extra.replace("model.recompute=full", "")
    rows = []
    for model in args.models.split(","):
        for gpus in gpu_counts(args.gpus, args.device):
            eps = sorted({gpus if e == "N" else int(e) for e in args.ep.split(",")})
            for ep in eps:
                if gpus % ep:
                    continue
                for variant in args.variants.split(","):
                    rows.append(run(model, gpus, ep, variant, args))
    print("\n### Weak scaling (per-GPU batch fixed: seq "
          f"{args.seq_len} x micro-batch {args.micro} x grad_accum {args.grad_accum})\n")
    print("| model | GPUs | ep_size | variant | tokens/s per GPU | TFLOPS/GPU | MFU | peak GiB/GPU | efficiency |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | {r['gpus']} | {r['ep']} | {r['variant']} | {r['error'][:60]} | | | | |")
            continue
        base = min((b for b in rows if "error" not in b and b["model"] == r["model"] and b["variant"] == r["variant"]
                    and b["ep"] == 1), key=lambda b: b["gpus"], default=None)  # fmt: skip
        eff = r["tokens_per_s_gpu"] / base["tokens_per_s_gpu"] if base else float("nan")
        print(f"| {r['model']} | {r['gpus']} | {r['ep']} | {r['variant']} | {r['tokens_per_s_gpu']:,.0f} | "
              f"{r['tflops']:.0f} | {r['mfu']:.1%} | {r['peak_mem_gib']:.1f} | {eff:.0%} |")


if __name__ == "__main__":
    sys.exit(main())
