"""The train loop: data → model → DeepSpeed step → expert-bias update → metrics, checkpoints."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from data import build_loader
from fp8.linear import FP8Linear, invalidate_fp8_weight_caches
from ling import checkpoint
from ling.engine import build_engine, model_config_from, resolve_device
from ling.launch import init_distributed
from ling.logger import MetricsLogger
from ling.metrics import flops_per_token, peak_memory_gib, peak_tflops
from model.ling import count_parameters


def _dist_info() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _mean_across_ranks(values: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        values = values.clone()
        dist.all_reduce(values)
        values /= dist.get_world_size()
    return values


def run_dir_from_hydra() -> Path:
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def fp8_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, FP8Linear)]


def train(cfg: DictConfig, run_dir: Path | None = None) -> dict[str, Any]:
    """Run `cfg.train.steps` optimizer steps; returns the last step's metrics (rank-averaged)."""
    init_distributed()
    rank, world = _dist_info()
    run_dir = Path(run_dir) if run_dir is not None else run_dir_from_hydra()
    run_dir.mkdir(parents=True, exist_ok=True)
    tc = cfg.train
    seed = int(tc.seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    device = resolve_device(cfg)

    loader = build_loader(cfg.data, seq_len=int(tc.seq_len), micro_batch_size=int(tc.micro_batch_size),
                          rank=rank, world_size=world, seed=seed)
    model_config = model_config_from(cfg, getattr(loader, "vocab_size", None))
    counts = count_parameters(model_config)
    engine, scheduler = build_engine(cfg, model_config, device)
    model = engine.module

    total_steps = int(tc.steps)
    ckpt_dir = Path(tc.checkpoint_dir) if tc.get("checkpoint_dir") else run_dir / "checkpoints"
    start_step = 0
    resume_from = str(tc.resume)
    tag = None
    if resume_from == "auto":
        tag = checkpoint.latest_tag(ckpt_dir)
    elif resume_from not in ("none", "null", "None", ""):
        ckpt_dir = Path(resume_from)
        tag = checkpoint.latest_tag(ckpt_dir)
        if tag is None:
            raise FileNotFoundError(f"train.resume={resume_from}: no 'latest' file in that folder")
    if tag is not None:
        state = checkpoint.load(engine, ckpt_dir, tag, rank)
        start_step = int(state["step"])
        loader.load_state_dict(state["loader"])

    logger = MetricsLogger(cfg, run_dir, total_steps, start_step, enabled=rank == 0)
    if rank == 0:
        (run_dir / "resolved_config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    logger.print(f"model: {counts}; linears={model_config.precision}; ranks={world}; device={device}")
    if tag is not None:
        logger.print(f"resumed from {ckpt_dir / tag} at step {start_step}")

    accum = int(tc.grad_accum)
    tokens_per_step = int(tc.micro_batch_size) * int(tc.seq_len) * accum * world
    fpt = flops_per_token(model_config, counts, int(tc.seq_len))
    peak = peak_tflops(device, tc.get("peak_tflops"))
    health_every = int(cfg.fp8.get("health_every", 0) or 0)
    fp8_layers = fp8_modules(model)
    routers = model.routers()
    bias_rate = model_config.bias_update_rate if tc.get("bias_update", True) else 0.0
    save_every = int(tc.save_every or 0)
    metrics: dict[str, Any] = {}

    engine.train()
    for step in range(start_step, total_steps):
        collect = health_every > 0 and step % health_every == 0 and bool(fp8_layers)
        for _, m in fp8_layers:
            m.collect_health = collect
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss, lm_loss, mtp_loss, z_loss (NCCL: on GPU)
        for _ in range(accum):
            batch = {k: v.to(device, non_blocking=True) for k, v in loader.next_batch().items()}
            out = engine(batch["input_ids"], labels=batch["labels"], doc_ids=batch.get("doc_ids"))
            engine.backward(out.loss)
            engine.step()
            parts = [out.loss, out.lm_loss, out.mtp_loss if out.mtp_loss is not None else out.loss * 0, out.z_loss]
            sums += torch.stack([p.detach().double() for p in parts])
        if fp8_layers:
            # DeepSpeed ZeRO writes the updated weights through `.data`, which autograd's version counter does
            # not see: drop the FP8 weight caches so each FP8Linear re-quantizes once for the next step.
            invalidate_fp8_weight_caches()
        loads = [r.update_expert_bias(bias_rate) for r in routers]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        avg = _mean_across_ranks(sums / accum)
        grad_norm = engine.get_global_grad_norm()
        tokens_per_s = tokens_per_step / dt
        metrics = {
            "loss": float(avg[0]), "lm_loss": float(avg[1]),
            "mtp_loss": float(avg[2]) if model_config.num_mtp_layers > 0 else None,
            "z_loss": float(avg[3]),
            "lr": float(scheduler.get_last_lr()[0]),
            "grad_norm": float(grad_norm) if grad_norm is not None else None,
            "step_time_s": dt, "tokens_per_s": tokens_per_s,
            "tflops_per_gpu": fpt * tokens_per_s / world / 1e12,
            "peak_mem_gib": peak_memory_gib(device),
        }
        if peak:
            metrics["mfu"] = metrics["tflops_per_gpu"] / peak
        if loads:
            max_over_mean = [s["max_over_mean"] for s in loads]
            metrics["expert_load_max_over_mean"] = float(np.mean(max_over_mean))
            metrics["expert_load_max_over_mean_worst"] = float(np.max(max_over_mean))
        if collect:
            metrics.update(_health_metrics(fp8_layers))
        done = step + 1
        if done % int(tc.log_every) == 0 or done == total_steps:
            logger.log(done, metrics)
        if (save_every and done % save_every == 0) or (done == total_steps and tc.get("save_final", True)):
            checkpoint.save(engine, ckpt_dir, done, {"loader": loader.state_dict()}, rank,
                            int(tc.get("keep_last", 2)))
    logger.close()
    return metrics


def _health_metrics(fp8_layers) -> dict[str, float]:
    """Per-layer FP8 health (underflow, distortion) plus the mean over layers of each statistic."""
    out: dict[str, float] = {}
    per_key: dict[str, list[float]] = {}
    for name, m in fp8_layers:
        stats = getattr(m, "health", None) or {}
        for key, value in stats.items():
            out[f"fp8/{name}/{key}"] = float(value)
            per_key.setdefault(key, []).append(float(value))
    for key, values in per_key.items():
        out[f"fp8/mean/{key}"] = float(np.mean(values))
    return out
