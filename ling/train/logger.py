"""What a run tells its user: log lines (console + `train.log`), per-step metrics (jsonl, wandb, progress bar).

Only rank 0 speaks. Its root logger gets two handlers: `train.log` in the run dir (everything at INFO and
above: ours, the data package's, DeepSpeed's warnings, Python warnings, and a failed run's error with its
traceback; attached once the run dir's lock is held) and the console (the same lines, printed above the progress
bar, minus library deprecation warnings and exact repeats). Other ranks print errors only. The compiler command
lines of DeepSpeed's library probes (`gcc ... -laio`) go nowhere. `quiet_library_noise()` runs before DeepSpeed
is imported, so that its import-time banner comes from rank 0 alone.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from ling.checkpoint.layout import METRICS
from ling.files import atomic_write

log = logging.getLogger("ling")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATEFMT = "%Y-%m-%d %H:%M:%S"
NOISY_WARNINGS = ("DeprecationWarning", "FutureWarning")


def _env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


class _BelowErrorOnOtherRanks(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _env_rank() == 0 or record.levelno >= logging.ERROR


def quiet_library_noise() -> None:
    """Call before importing DeepSpeed or datasets: DeepSpeed's logger keeps this filter, so ranks > 0 drop its
    banners, and ranks > 0 draw no `datasets` progress bars (rank 0's show the data preparation)."""
    logging.getLogger("DeepSpeed").addFilter(_BelowErrorOnOtherRanks())
    if _env_rank() != 0:
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")


class _ConsoleFilter(logging.Filter):
    """Console only: drop records marked console=False (step lines while a bar shows them), library
    deprecation warnings (they stay in train.log) and exact repeats of an earlier warning."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[str, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "console", True):
            return False
        msg = record.getMessage()
        if record.name == "py.warnings" and any(w in msg for w in NOISY_WARNINGS):
            return False
        if record.levelno < logging.WARNING:
            return True
        key = (record.name, msg)
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


class _TqdmHandler(logging.StreamHandler):
    """Writes through tqdm so that a log line never tears the progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 (logging must not raise)
            self.handleError(record)


class _NoCompilerProbes(logging.Filter):
    """Drop the compiler command lines setuptools' distutils logs at INFO (DeepSpeed's op builders probe for
    libraries such as libaio by compiling a test program: `gcc ... -laio`, on every start)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not any(part in record.pathname for part in DISTUTILS_PATHS)


DISTUTILS_PATHS = (f"{os.sep}_distutils{os.sep}", f"{os.sep}distutils{os.sep}")


class LogRouting:
    """Where rank 0's records go: the console from the start, `train.log` once `attach_file` is called (after
    the run dir's lock is held: a run refused on a busy directory writes nothing into it)."""

    def __init__(self, root: logging.Logger, formatter: logging.Formatter, rank: int) -> None:
        self.root, self.formatter, self.rank = root, formatter, rank
        self.file: logging.FileHandler | None = None

    def attach_file(self, path: Path) -> None:
        """Append rank 0's records to `path` from now on (a no-op on other ranks, or when attached already)."""
        if self.rank != 0 or self.file is not None:
            return
        self.file = logging.FileHandler(path, mode="a", encoding="utf-8")
        self.file.setFormatter(self.formatter)
        self.file.addFilter(_NoCompilerProbes())
        self.root.addHandler(self.file)


@contextmanager
def setup_logging(run_dir: Path | None, rank: int, level: str = "info",
                  deepspeed_level: str = "warning") -> Iterator[LogRouting]:
    """Route log records for the duration of a run (restores the previous handlers afterwards).

    rank 0: root → console, and `run_dir/train.log` (append) when `run_dir` is given (else later, through the
    yielded LogRouting's `attach_file`); ranks > 0: errors only, prefixed with the rank. DeepSpeed's logger
    (which prints on its own) is routed through the same handlers at `deepspeed_level`; the compiler probes of
    its op builders are dropped.
    """
    root, ds = logging.getLogger(), logging.getLogger("DeepSpeed")
    saved = (root.handlers[:], root.level, ds.handlers[:], ds.level, ds.propagate)
    formatter = logging.Formatter(FORMAT, DATEFMT)
    console = _TqdmHandler(sys.stderr)
    console.setFormatter(formatter if rank == 0 else logging.Formatter(f"[rank {rank}] {FORMAT}", DATEFMT))
    console.addFilter(_NoCompilerProbes())
    if rank == 0:
        console.addFilter(_ConsoleFilter())
    else:
        console.setLevel(logging.ERROR)
    root.handlers[:] = [console]
    root.setLevel(logging.getLevelName(level.upper()))
    ds.handlers[:] = []
    ds.propagate = True
    ds.setLevel(logging.getLevelName(deepspeed_level.upper()))
    logging.captureWarnings(True)
    routing = LogRouting(root, formatter, rank)
    try:
        if run_dir is not None:
            routing.attach_file(Path(run_dir) / "train.log")
        yield routing
    finally:
        logging.captureWarnings(False)
        for h in (console, routing.file):
            if h is not None:
                h.close()
        root.handlers[:], root.level = saved[0], saved[1]
        ds.handlers[:], ds.level, ds.propagate = saved[2], saved[3], saved[4]


def _finite_or_none(value: Any) -> Any:
    """jsonl holds strict JSON: a non-finite float becomes null (the line's `skipped` says why)."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def truncate_metrics(path: Path, last_step: int) -> int:
    """Keep the lines of `path` with step <= last_step (a resumed run rewrites what follows); returns how
    many lines were dropped. Torn lines (a crash mid-write) are dropped too. Atomic."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            keep = int(json.loads(line)["step"]) <= last_step
        except (ValueError, KeyError, TypeError):
            keep = False
        if keep:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        atomic_write(path, lambda tmp: tmp.write_text("".join(f"{line}\n" for line in kept)))
    return dropped


STEP_LINE_KEYS = (("loss", "loss", ".4f"), ("lm_loss", "lm", ".4f"), ("mtp_loss", "mtp", ".4f"),
                  ("val_loss", "val", ".4f"), ("lr", "lr", ".3g"), ("grad_norm", "gnorm", ".3g"),
                  ("tokens_per_s", "tok/s", ".0f"), ("peak_mem_gib", "mem_GiB", ".2f"))


def step_line(step: int, total: int, metrics: dict[str, Any]) -> str:
    parts = [f"step {step}/{total}"]
    for key, label, fmt in STEP_LINE_KEYS:
        value = metrics.get(key)
        if isinstance(value, (int, float)):
            parts.append(f"{label} {value:{fmt}}")
    if metrics.get("skipped"):
        parts.append(f"SKIPPED (non-finite; {metrics.get('nonfinite_steps')} so far)")
    return " | ".join(parts)


class MetricsLogger:
    """`log(step, metrics)` writes one jsonl line, updates the bar and wandb and puts a step line in train.log
    (and on the console when no bar shows); a no-op on ranks > 0."""

    def __init__(self, cfg: DictConfig, run_dir: Path, total_steps: int, start_step: int, enabled: bool) -> None:
        self.enabled = enabled
        self.total = total_steps
        self.bar = None
        self.jsonl = None
        self.wandb_run = None
        if not enabled:
            return
        log_cfg = cfg.logging
        if log_cfg.jsonl:
            self.jsonl = open(run_dir / METRICS, "a", buffering=1)  # noqa: SIM115 (closed in close())
        if log_cfg.progress_bar:
            # disable=None: no bar when stderr is not a terminal (batch jobs get the step lines instead)
            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True, disable=None)
        wb = log_cfg.wandb
        if wb.mode != "disabled":
            try:
                import wandb
            except ImportError as e:
                raise RuntimeError(f"logging.wandb.mode={wb.mode} needs the wandb package, which is not installed "
                                   "here: pip install wandb, or set logging.wandb.mode=disabled") from e

            os.environ.setdefault("WANDB_SILENT", "true")
            self.wandb_run = wandb.init(
                project=wb.project, entity=wb.get("entity"), name=cfg.run_name, dir=str(run_dir),
                mode=wb.mode, config=OmegaConf.to_container(cfg, resolve=True), tags=list(wb.get("tags", [])),
                resume="allow", id=str(cfg.run_name).replace("/", "-"),
            )

    @property
    def bar_visible(self) -> bool:
        return self.bar is not None and not self.bar.disable

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"step": step, **{k: _finite_or_none(v) for k, v in metrics.items()}})
                             + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=step)
        log.info(step_line(step, self.total, metrics), extra={"console": not self.bar_visible})
        if self.bar_visible:
            self.bar.update(step - self.bar.n)
            shown = {k: metrics[k] for k in ("loss", "mtp_loss", "lr", "grad_norm", "tokens_per_s") if k in metrics}
            self.bar.set_postfix({k: f"{v:.4g}" for k, v in shown.items() if v is not None}, refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
