"""Metrics sinks: console progress bar, jsonl in the run dir, wandb (offline by default). Rank 0 only."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm


class MetricsLogger:
    """`log(step, metrics)` writes one jsonl line, updates the bar and wandb; a no-op on ranks > 0."""

    def __init__(self, cfg: DictConfig, run_dir: Path, total_steps: int, start_step: int, enabled: bool) -> None:
        self.enabled = enabled
        self.bar = None
        self.jsonl = None
        self.wandb_run = None
        if not enabled:
            return
        log_cfg = cfg.logging
        if log_cfg.jsonl:
            self.jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115 (closed in close())
        if log_cfg.progress_bar:
            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True)
        wb = log_cfg.wandb
        if wb.mode != "disabled":
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self.wandb_run = wandb.init(
                project=wb.project, entity=wb.get("entity"), name=cfg.run_name, dir=str(run_dir),
                mode=wb.mode, config=OmegaConf.to_container(cfg, resolve=True), tags=list(wb.get("tags", [])),
                resume="allow", id=str(cfg.run_name).replace("/", "-"),
            )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=step)
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            shown = {k: metrics[k] for k in ("loss", "mtp_loss", "lr", "grad_norm", "tokens_per_s") if k in metrics}
            self.bar.set_postfix({k: f"{v:.4g}" for k, v in shown.items() if v is not None}, refresh=False)

    def print(self, msg: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(msg)
        else:
            print(msg, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
