"""DeepSpeed's gradient path alone: what ZeRO's gradient hooks and its optimizer step cost per option, without the
model's compute, beside the floor of an fp32 accumulation done by hand.

    PYTHONUNBUFFERED=1 python3 bench/bench_grad_path.py [--model ling_mini_2_0_e64] [--grad-accum 8] [--steps 3]
        [--variants autograd,fp32_by_hand,fp32_kernel,zero2,zero2_bf16_accum,zero2_no_contiguous,zero2_overlap,
         zero2_bucket_2e8,zero2_fp32_comm,zero1,zero1_stock_hook]
    python3 bench/bench_grad_path.py --model tiny --device cpu --steps 1    # smoke test

Every variant gets a fresh copy of the preset's parameters (LingForCausalLM, bf16 on CUDA and also on CPU, as
under DeepSpeed bf16) and a stand-in loss, Σ_p sum(p) · 1e-6, whose backward costs one bf16 fill per parameter:
the gradients arrive as in a real backward, one AccumulateGrad per parameter, but all at the end of the backward
instead of between its kernels (so nothing here overlaps with compute). An optimizer step is `--grad-accum`
micro-batch backwards then the step; the optimizer itself does nothing (`NoOpOptimizer`), so the step column is
DeepSpeed's own work (gradient norm, clipping, the fp32 → bf16 weight copy). Variants:
  autograd           the stand-in backward alone, gradients dropped (the floor every variant pays)
  fp32_by_hand       autograd + a post-accumulate hook adding each bf16 gradient into an fp32 buffer, in place
                     (10 bytes per parameter: what a fused fp32 accumulation must move at least), with PyTorch's
                     mixed-dtype add
  fp32_kernel        fp32_by_hand with `kernels.grad_accum.accumulate_` (the lean hook's add)
  zero2              DeepSpeed ZeRO-2 with grad_accum_dtype fp32 (`deepspeed=zero2`, the CPU default)
  zero2_bf16_accum   grad_accum_dtype = the model's dtype (DeepSpeed's own default; rounds the sum to bf16)
  zero2_no_contiguous, zero2_overlap, zero2_bucket_2e8
                     zero2 with contiguous_gradients=false / overlap_comm=true / reduce_bucket_size=2e8
  zero2_fp32_comm    zero2 with communication_data_type=fp32 (exact data-parallel means; tests/runtime/
                     test_grad_accum.py)
  zero1              `deepspeed=zero1`, the GPU experiments' (fp32 accumulation: DeepSpeed's BF16_Optimizer, fp32
                     sums in its hooks and one fp32 all-reduce at the boundary, with ling/train/engine.py's lean hook)
  zero1_stock_hook   zero1 with DeepSpeed's own hook (an fp32 copy of each bf16 gradient before the add)
The DeepSpeed config comes from the trainer's own `ling.train.engine.deepspeed_config`.
Each variant runs in a fresh process (`--json` prints its row), so one variant's memory cannot leak into the next.
Columns: ms per micro-batch backward (median), the same minus autograd's (the gradient path's own cost), ms per
optimizer step (the boundary micro-batch's `engine.step()`, median of the steps after the first), peak memory.
Figures go to the README, not here.
Not imported by the library.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels.grad_accum import accumulate_  # noqa: E402
from ling.analysis.profiling import markdown  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from model.ling import LingForCausalLM  # noqa: E402

# variant → the `deepspeed` config node (None: no DeepSpeed), turned into DeepSpeed's config by the trainer's own
# ling.train.engine.deepspeed_config
VARIANTS: dict[str, dict | None] = {
    "autograd": None,
    "fp32_by_hand": None,
    "fp32_kernel": None,
    "zero2": {"zero_stage": 2, "grad_accum_dtype": "fp32"},
    "zero2_bf16_accum": {"zero_stage": 2, "grad_accum_dtype": None},
    "zero2_no_contiguous": {"zero_stage": 2, "grad_accum_dtype": "fp32", "zero_extra": {"contiguous_gradients": False}},
    "zero2_overlap": {"zero_stage": 2, "grad_accum_dtype": "fp32", "zero_extra": {"overlap_comm": True}},
    "zero2_bucket_2e8": {"zero_stage": 2, "grad_accum_dtype": "fp32", "zero_extra": {"reduce_bucket_size": int(2e8)}},
    "zero2_fp32_comm": {"zero_stage": 2, "grad_accum_dtype": "fp32", "extra": {"communication_data_type": "fp32"}},
    "zero1": {"zero_stage": 1, "grad_accum_dtype": "fp32"},
    "zero1_stock_hook": {"zero_stage": 1, "grad_accum_dtype": "fp32"},  # built by plain deepspeed.initialize
}
STOCK = {"zero1_stock_hook"}  # variants without ling.engine's substitutions (DeepSpeed's own BF16_Optimizer hook)


class NoOpOptimizer(torch.optim.Optimizer):
    """An optimizer whose step changes nothing: DeepSpeed's step then costs only its own work."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.0})

    def step(self, closure=None):
        return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _init_single_process(device: torch.device) -> None:
    """One-rank process group for DeepSpeed (gloo on CPU, nccl on CUDA)."""
    import deepspeed

    if torch.distributed.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", str(port))):
        os.environ.setdefault(key, value)
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")


def stand_in_loss(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """Σ_p sum(p) · 1e-6 in fp32: each gradient is a constant bf16 fill, the cheapest real AccumulateGrad."""
    return torch.stack([p.sum(dtype=torch.float32) for p in params]).sum() * 1e-6


def run_variant(name: str, config: ModelConfig, args, device: torch.device) -> dict:
    torch.manual_seed(0)
    with torch.device(device):
        model = LingForCausalLM(config).to(torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]
    ds = VARIANTS[name]
    engine = None
    main_grads: dict[torch.nn.Parameter, torch.Tensor] = {}
    if ds is not None:
        from omegaconf import OmegaConf

        from ling.train.engine import deepspeed_config, initialize_engine

        cfg = OmegaConf.create({"train": {"micro_batch_size": 1, "grad_accum": args.grad_accum},
                                "optim": {"grad_clip": 1.0}, "deepspeed": ds})
        conf = deepspeed_config(cfg, use_bf16=True)
        if name in STOCK:
            import deepspeed

            engine, *_ = deepspeed.initialize(model=model, optimizer=NoOpOptimizer(params), config=conf)
        else:
            engine, *_ = initialize_engine(model, NoOpOptimizer(params), conf)  # the trainer's engine and hooks
    elif name in ("fp32_by_hand", "fp32_kernel"):
        add = accumulate_ if name == "fp32_kernel" else torch.Tensor.add_
        for p in params:
            main_grads[p] = torch.zeros(p.shape, dtype=torch.float32, device=device)

            def accumulate(p: torch.Tensor) -> None:
                add(main_grads[p], p.grad)
                p.grad = None

            p.register_post_accumulate_grad_hook(accumulate)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    backward_ms, step_ms = [], []
    for step in range(args.steps + 1):  # the first optimizer step warms up
        for micro in range(args.grad_accum):
            _sync(device)
            t0 = time.perf_counter()
            loss = stand_in_loss(params)
            if engine is not None:
                engine.backward(loss)
            else:
                loss.backward()
                for p in params:
                    p.grad = None  # autograd: dropped; fp32_by_hand / fp32_kernel: already None
            _sync(device)
            t1 = time.perf_counter()
            if engine is not None:
                engine.step()  # as the trainer does after every micro-batch: DeepSpeed steps at the boundary only
            _sync(device)
            if step:
                backward_ms.append(1e3 * (t1 - t0))
                if micro == args.grad_accum - 1:
                    step_ms.append(1e3 * (time.perf_counter() - t1))
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    row = {"variant": name, "backward_ms": statistics.median(backward_ms), "step_ms": statistics.median(step_ms),
           "peak_gib": peak, "params": sum(p.numel() for p in params)}
    return row  # the process ends with this one variant (run_in_subprocess): nothing to free


def run_in_subprocess(name: str, args) -> dict:
    """One variant in a fresh Python process (its own CUDA context and process group) → its row."""
    cmd = [sys.executable, os.path.abspath(__file__), "--json", "--variants", name, "--model", args.model,
           "--grad-accum", str(args.grad_accum), "--steps", str(args.steps), "--device", args.device]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-8000:])
        raise SystemExit(f"variant {name} failed (exit {done.returncode}); its output is above")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="ling_mini_2_0_e64")
    ap.add_argument("--grad-accum", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3, help="timed optimizer steps after one warm-up step")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", action="store_true", help="run the one variant here and print its row as JSON")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")
    if args.json:  # one variant in this process, its row as the last line
        if len(names) != 1:
            raise SystemExit("--json takes exactly one variant")
        config = ModelConfig.preset(args.model, **({"vocab_size": 8192} if args.model == "tiny" else {}))
        if VARIANTS[names[0]] is not None:
            _init_single_process(device)
        print(json.dumps(run_variant(names[0], config, args, device)))
        return
    rows = [run_in_subprocess(v, args) for v in names]
    floor = next((r["backward_ms"] for r in rows if r["variant"] == "autograd"), None)
    print(f"{args.model}: {rows[0]['params'] / 1e6:,.1f}M parameters, grad_accum {args.grad_accum}, {device}, "
          f"medians over {args.steps} optimizer steps after one warm-up")
    table = [[r["variant"], f"{r['backward_ms']:.1f}",
              "–" if floor is None else f"{r['backward_ms'] - floor:.1f}", f"{r['step_ms']:.1f}",
              f"{r['peak_gib']:.1f}"] for r in rows]
    print(markdown(["variant", "ms per micro-batch backward", "minus autograd's", "ms per optimizer step",
                    "peak GiB"], table))


if __name__ == "__main__":
    main()
