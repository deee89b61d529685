"""What FP8 health monitoring costs: a model's forward + backward with every FP8 module collecting its
statistics (`fp8.monitor`, a sampled step) against the same step without, and with the fp32 dW recompute check.

    PYTHONUNBUFFERED=1 python3 bench/bench_fp8_health.py --model parity --seq-len 1024 --micro 8   # one GPU
    python3 bench/bench_fp8_health.py --device cpu --model tiny --seq-len 256 --micro 4          # CPU

The model comes from conf/model/<name>.yaml with precision fp8 (vocab 8192, the bundled tokenizer's), random
tokens; a step is forward + backward with gradients set to None before it (no optimizer). Modes: `off` (plain
step), `health` (every FP8Linear and the FP8 experts collect underflow/distortion; the monitor then reads them
with one host sync), `health+dw` (also keeps each linear's x and recomputes dW in fp32). Prints median step
times, the extra time of a sampled step and that extra spread over `--every` steps (fp8.health_every).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from omegaconf import OmegaConf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fp8.monitor import FP8Monitor, MonitorConfig  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from model.ling import LingForCausalLM  # noqa: E402

CONF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf", "model")


def build(name: str, device: str) -> LingForCausalLM:
    d = OmegaConf.to_container(OmegaConf.load(os.path.join(CONF, f"{name}.yaml")))
    d.update(vocab_size=8192, precision="fp8")
    torch.manual_seed(0)
    model = LingForCausalLM(ModelConfig.from_dict(d)).to(device)
    return model.to(torch.bfloat16) if device == "cuda" else model


def step_ms(model, monitor: FP8Monitor | None, ids, labels, device: str) -> float:
    for p in model.parameters():
        p.grad = None
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    if monitor is not None:
        monitor.begin_step(1)
    model(ids, labels=labels).loss.backward()
    if monitor is not None:
        monitor.end_step(1)  # reads every statistic (the one host sync)
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def time_modes(model, modes: dict, ids, labels, steps: int, warmup: int, device: str) -> dict[str, float]:
    """Median ms per mode; the modes take turns step by step, so that a change in machine load hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in modes}
    for i in range(warmup + steps):
        for name, monitor in modes.items():
            ms = step_ms(model, monitor, ids, labels, device)
            if i >= warmup:
                times[name].append(ms)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="parity")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--every", type=int, default=50)
    args = ap.parse_args()
    model = build(args.model, args.device)
    modules = [(n, m) for n, m in model.named_modules() if hasattr(m, "collect_health")]
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 8192, (args.micro, args.seq_len + 1), generator=gen).to(args.device)
    ids, labels = ids[:, :-1], ids[:, 1:]
    modes = {"off": None, "health": FP8Monitor(modules, MonitorConfig(every=1)),
             "health+dw": FP8Monitor(modules, MonitorConfig(every=1, recompute_dw=True))}
    results = time_modes(model, modes, ids, labels, args.steps, args.warmup, args.device)
    dev = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    print(f"\n{args.model} (FP8, {len(modules)} FP8 modules), {args.micro} x {args.seq_len} tokens, {dev}, "
          f"torch {torch.__version__}; median of {args.steps} forward+backward steps per mode, interleaved")
    print(f"| mode | step ms | extra ms per sampled step | extra per step at health_every={args.every} |")
    print("|---|---|---|---|")
    base = results["off"]
    for name, ms in results.items():
        extra = ms - base
        print(f"| {name} | {ms:.1f} | {extra:+.1f} ({extra / base:+.1%}) | {extra / args.every / base:+.2%} |")


if __name__ == "__main__":
    main()
