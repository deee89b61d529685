"""The train loop: data → model → DeepSpeed step (skipped when not finite) → expert-bias update → metrics,
validation, checkpoints; plus resume, preemption and the closing summary.

`train(cfg)` holds the run dir's lock, routes the logs and catches SIGTERM/SIGINT/SIGHUP for the whole run;
the `Trainer` does the work. Runs end normally (returning the last step's metrics; a run that is already
complete returns its summary and trains nothing) or with a `StopRun` carrying a message and an exit code:
NonFiniteStop (3), Preempted (128 + signal), RunDirBusy / RunDirNotEmpty / CheckpointError /
MemoryPlanRefusal (2). Any other error is logged, with its traceback, to train.log before it propagates.
Checkpoints are written in the background (`train.async_save`): a save costs the step a host copy of the state;
its files are committed once every rank has written them, noticed through the step's all-reduce.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import random
import re
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from data import batch_to_device, build_loaders
from fp8.kernel_choice import gemm_kernels
from fp8.monitor import FP8Monitor, MonitorConfig
from ling.analysis.evaluate import evaluate
from ling.analysis.profiling import GRAD_REDUCE_SCOPE, OPTIMIZER_SCOPE, StepProfiler
from ling.checkpoint import store as checkpoint
from ling.checkpoint.layout import MANIFEST, METRICS, PARTIAL, RESOLVED_CONFIG, SUMMARY, step_of
from ling.checkpoint.snapshot import SaveFaults
from ling.checkpoint.store import CheckpointWriteError
from ling.checkpoint.weights import save_run_tokenizer
from ling.config import FRESH, model_config_from, resolve_device
from ling.files import atomic_write
from ling.ranks import barrier, broadcast, env_rank, init_distributed, rank_world
from ling.train.determinism import deterministic_mode
from ling.train.engine import build_engine
from ling.train.gpu_clocks import ClockSampler
from ling.train.guard import NonFiniteGuard, NonFiniteStop, check_engine_can_skip
from ling.train.launch import StopRun
from ling.train.logger import MetricsLogger, setup_logging, truncate_metrics
from ling.train.memory_plan import MemoryPlanRefusal, plan_memory
from ling.train.metrics import (
    allocator_retries,
    flops_per_token,
    optimizer_state_bytes,
    peak_memory_gib,
    peak_tflops,
)
from ling.train.preemption import STOP_SIGNALS, Preempted, StopSignals
from ling.train.rundir import RunDirNotEmpty, clear_previous_run, locked_run_dir, previous_run, write_hydra_files
from model.config import ModelConfig
from model.layers import scope
from model.ling import count_parameters
from model.moe import update_expert_biases

log = logging.getLogger(__name__)
# (run config, model config, device) → (DeepSpeed engine, lr scheduler): how the trainer gets its engine
EngineFactory = Callable[[DictConfig, ModelConfig, torch.device], tuple[Any, Any]]


class CheckpointError(StopRun):
    exit_code = 2


class RunComplete(StopRun):
    """The run dir's newest checkpoint is at the run's last step: nothing to train (`train` returns `summary`)."""

    exit_code = 0

    def __init__(self, message: str, summary: dict[str, Any]) -> None:
        super().__init__(message)
        self.summary = summary


def run_dir_from_hydra() -> Path:
    return Path(HydraConfig.get().runtime.output_dir)


def fp8_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules that collect FP8 health (FP8Linear, FP8 grouped experts)."""
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "collect_health")]


def _sum_across_ranks(values: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        values = values.clone()
        dist.all_reduce(values)
    return values


def _mean_across_ranks(values: torch.Tensor) -> torch.Tensor:
    return _sum_across_ranks(values) / rank_world()[1]


def _due(every: int, step: int, total: int) -> bool:
    return every > 0 and (step % every == 0 or step == total)


def train(cfg: DictConfig, run_dir: Path | None = None, *,
          build_engine: EngineFactory = build_engine) -> dict[str, Any]:
    """Run `cfg.train.steps` optimizer steps; returns the last step's metrics (rank-averaged), or the summary
    of a run that was already complete. `build_engine` makes the engine (ling.train.engine.build_engine; a test
    may wrap it to see or instrument the engine)."""
    run_dir = Path(run_dir) if run_dir is not None else run_dir_from_hydra()
    rank = env_rank()  # the launcher's: logging starts before torch.distributed
    with contextlib.ExitStack() as stack:
        logs = stack.enter_context(setup_logging(None, rank, cfg.logging.level, cfg.logging.deepspeed_level))
        try:
            init_distributed()
            rank, _ = rank_world()
            if cfg.train.on_locked not in ("fail", "wait"):
                raise ValueError(f"train.on_locked={cfg.train.on_locked!r} is unknown (known: fail, wait)")
            run_dir.mkdir(parents=True, exist_ok=True)
            stack.enter_context(deterministic_mode(bool(cfg.train.get("deterministic", False))))  # before any GEMM
            stack.enter_context(gemm_kernels(str(cfg.fp8.get("gemm_kernel", "auto"))))  # every GEMM of the run
            stack.enter_context(locked_run_dir(run_dir, wait=cfg.train.on_locked == "wait"))
            logs.attach_file(run_dir / "train.log")  # only now: a refused run writes nothing into the run dir
            if rank == 0:
                write_hydra_files(run_dir, cfg)
            signals = stack.enter_context(StopSignals())
            trainer = Trainer(cfg, run_dir, signals, build_engine=build_engine)
            stack.callback(trainer.close)
            return trainer.fit()
        except RunComplete as done:
            if rank == 0:
                log.info("%s", done)
            return done.summary
        except StopRun as stop:  # a refusal, a preemption, too many non-finite steps: said once, by rank 0
            if rank == 0:
                log.log(logging.WARNING if stop.exit_code > 128 else logging.ERROR, "%s", stop)
            raise
        except KeyboardInterrupt as e:
            log.warning("interrupted (%s): stopped without a checkpoint", e or "KeyboardInterrupt")
            raise
        except Exception as e:  # every rank says it (ranks > 0 on the console); rank 0's goes into train.log
            log.error("the run failed: %s: %s", type(e).__name__, e, exc_info=True)
            raise


class Trainer:
    """Builds data, model and engine (through `build_engine`, see `train`), resumes, and runs the loop (`fit`).
    All ranks construct one."""

    def __init__(self, cfg: DictConfig, run_dir: Path, signals: StopSignals, *,
                 build_engine: EngineFactory = build_engine) -> None:
        init_distributed()
        self.cfg, self.run_dir, self.signals = cfg, run_dir, signals
        tc = self.tc = cfg.train
        self.rank, self.world = rank_world()
        self.total_steps = int(tc.steps)
        # train.stop_at: this session's last step; the lr schedule still spans train.steps (a branch of a longer run)
        self.last_step = self.total_steps if tc.get("stop_at") is None else int(tc.stop_at)
        if not 1 <= self.last_step <= self.total_steps:
            raise ValueError(f"train.stop_at={tc.stop_at}: expected a step in 1 … train.steps ({self.total_steps})")
        self.ckpt_dir = Path(tc.checkpoint_dir) if tc.get("checkpoint_dir") else run_dir / "checkpoints"
        resume_from = self._select_checkpoint()  # before the expensive builds: refusals come fast
        resumes_at = checkpoint.saved_step(resume_from) if resume_from is not None else None
        if resumes_at is not None and resumes_at == self.last_step:
            raise RunComplete(*self._complete(resume_from, resumes_at))
        if resumes_at is not None and resumes_at > self.last_step:
            raise ValueError(f"train.stop_at={self.last_step}: the run resumes at step {resumes_at} (from "
                             f"{resume_from}), past it; give a later train.stop_at or an earlier checkpoint")

        seed = int(tc.seed)
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        self.device = resolve_device(cfg)
        self.profiler = StepProfiler.from_config(tc, self.total_steps, run_dir / "profile", self.device,
                                                 write=self.rank == 0)
        batch_args = {"seq_len": int(tc.seq_len), "micro_batch_size": int(tc.micro_batch_size),
                      "rank": self.rank, "world_size": self.world, "seed": seed}
        self.loader, self.val_loader = self._build_loaders(batch_args)
        self.model_config = model_config_from(cfg, getattr(self.loader, "vocab_size", None))
        model_dict = dataclasses.asdict(self.model_config)
        if resume_from is not None and (changed := checkpoint.model_mismatch(resume_from, model_dict)):
            raise CheckpointError(f"train.resume: checkpoint {resume_from} was written for another model; a "
                                  f"checkpoint fixes these keys: {'; '.join(changed)}. Set them back, or start "
                                  "the new model under another run_name")
        self.counts = count_parameters(self.model_config)
        self._check_memory(cfg)  # before the build: a run that cannot fit says so, with what would fit
        self.engine, self.scheduler = build_engine(cfg, self.model_config, self.device)
        check_engine_can_skip(self.engine)
        self.model = self.engine.module
        self.guard = NonFiniteGuard(int(tc.max_bad_steps), frozenset(int(s) for s in tc.inject_nan_steps))
        self.monitor = FP8Monitor(fp8_modules(self.model),
                                  MonitorConfig.from_dict(cfg.fp8.get("health_every", 0), cfg.fp8.get("monitor")))

        self.checkpointer = checkpoint.Checkpointer(
            self.ckpt_dir, int(tc.keep_last), async_save=bool(tc.get("async_save", True)),
            faults=SaveFaults(float(tc.get("inject_save_delay_s") or 0), tc.get("inject_save_enospc_after_bytes")),
            manifest_extra={"model": model_dict})
        self.start_step, self.last_checkpoint, self.last_saved_step = 0, None, None
        self.save_stall_s = 0.0  # training time spent on checkpoints: snapshots, and waits for a write in flight
        if resume_from is not None:
            state = checkpoint.load(self.engine, resume_from)
            self.start_step = self.last_saved_step = int(state["step"])
            self.last_checkpoint = resume_from
            self.loader.load_state_dict(state["loader"])
            self.guard.load_state_dict(state.get("guard", {}))
            self.monitor.load_state_dict(state.get("fp8_monitor", {}))  # layers switched to BF16 stay so
        if self.rank == 0:
            dropped = truncate_metrics(run_dir / METRICS, self.start_step)
            if dropped:
                log.info("metrics.jsonl: dropped %d lines after step %d (they are trained again)", dropped,
                         self.start_step)
            resolved = OmegaConf.to_yaml(cfg, resolve=True)
            atomic_write(run_dir / RESOLVED_CONFIG, lambda tmp: tmp.write_text(resolved))
            save_run_tokenizer(getattr(self.loader, "tokenizer", None), run_dir)  # for the HF export
        self.logger = MetricsLogger(cfg, run_dir, self.total_steps, self.start_step, enabled=self.rank == 0)

        self.accum = int(tc.grad_accum)
        self.tokens_per_step = int(tc.micro_batch_size) * int(tc.seq_len) * self.accum * self.world
        self.flops_per_token = flops_per_token(self.model_config, self.counts, int(tc.seq_len))
        self.peak = peak_tflops(self.device, tc.get("peak_tflops"))
        # rank 0's GPU clock, power and power-cap share over each step (logged; rank 0 writes the metrics)
        self.clocks = (ClockSampler.for_device(self.device, float(cfg.logging.gpu_clock_interval_s))
                       if self.rank == 0 else None)
        self.routers = self.model.routers()
        self.bias_rate = self.model_config.bias_update_rate if tc.bias_update else 0.0
        self.stop_requested = False
        self.writes_done = False  # every rank's background checkpoint write is done (this step's all-reduce)
        self.recent_losses: deque[float] = deque(maxlen=10)
        self.val_metrics: dict[str, float] = {}
        self.timed = [0, 0.0]  # steps and seconds of this session after its first step (tokens/s)
        self.optim_state_gib: float | None = None  # measured after the first applied step (state is lazy)
        log.info("model: %s; linears=%s; ranks=%d (moe.ep_size=%d); device=%s; run dir %s", self.counts,
                 self.model_config.precision, self.world, self.model_config.ep_size, self.device, run_dir)
        if resume_from is not None:
            log.info("resumed from %s at step %d%s", resume_from, self.start_step,
                     f" (its {state['converted_from']} state converted for {checkpoint.optimizer_name(self.engine)})"
                     if "converted_from" in state else "")

    # ------------------------------------------------------------------------------------------ resume
    def _select_checkpoint(self) -> Path | None:
        """Apply the run-dir rules and pick the checkpoint to resume from (verified), or None."""
        resume = str(self.tc.resume)
        explicit = None if resume in FRESH or resume == "auto" else Path(resume).resolve()
        found = broadcast(previous_run(self.run_dir, self.ckpt_dir) if self.rank == 0 else None)
        foreign = explicit is not None and self.ckpt_dir.resolve() not in (explicit, *explicit.parents)
        if found and (resume in FRESH or foreign):
            if not self.tc.overwrite:
                raise RunDirNotEmpty(f"train.resume={resume} but {self.run_dir} already holds a run "
                                     f"({'; '.join(found)}): resume it with train.resume=auto, pick another "
                                     "run_name, or set train.overwrite=true to delete it")
            if self.rank == 0:
                log.warning("train.overwrite=true: deleting the earlier run in %s (%s)", self.run_dir, "; ".join(found))
                clear_previous_run(self.run_dir, self.ckpt_dir)
            barrier()
        if resume in FRESH:
            return None
        checksums = bool(self.tc.verify_checksums)
        if explicit is not None and (step_of(explicit.name) is not None
                                     or (explicit / MANIFEST).exists()):
            problems = checkpoint.verify(explicit, checksums)
            if problems:
                raise CheckpointError(f"train.resume={explicit}: the checkpoint does not verify: {'; '.join(problems)}")
            return explicit
        folder, skipped = checkpoint.newest_verified(explicit or self.ckpt_dir, checksums)
        for name, why in skipped:
            log.warning("resume: skipping checkpoint %s: %s", name, why)
        if folder is None and (explicit is not None or any(not n.endswith(PARTIAL) for n, _ in skipped)):
            raise CheckpointError(self._no_checkpoint_message(resume, explicit or self.ckpt_dir, skipped))
        return folder

    def _no_checkpoint_message(self, resume: str, where: Path, skipped: list[tuple[str, str]]) -> str:
        """Why nothing resumes, and what to do: never advice that would delete a checkpoint that may be intact."""
        worlds = sorted({m.group(1) for _, why in skipped if (m := re.match(r"written by (\d+) ranks", why))})
        message = f"train.resume={resume}: no checkpoint in {where} can be resumed here (see above). "
        if worlds:
            message += (f"Checkpoints written by {' or '.join(worlds)} ranks resume with that many ranks "
                        f"(torchrun --nproc_per_node {worlds[-1]}; this run has {self.world}). ")
        damaged = [n for n, why in skipped if not n.endswith(PARTIAL) and not why.startswith("written by")]
        if damaged:
            message += (f"Damaged: {', '.join(damaged)}: move those out of {where} to resume from an older one. ")
        return message + ("To start over and keep every checkpoint, give another run_name (or "
                          "train.checkpoint_dir); nothing was deleted.")

    def _complete(self, folder: Path, step: int) -> tuple[str, dict[str, Any]]:
        """(the message, the summary kept) for a run whose checkpoint `folder` is at its last step already."""
        summary = broadcast(self._read_summary() if self.rank == 0 else None)
        until = "train.steps" if self.last_step == self.total_steps else "train.stop_at"
        kept = (f"summary.json is kept (outcome: {summary.get('outcome')}, train loss {summary.get('train_loss')}, "
                f"val loss {summary.get('val_loss')})" if summary else "there is no summary.json")
        return (f"run {self.run_dir} is already complete: its checkpoint {folder} is at step {step} = {until}; "
                f"nothing to train, {kept}. To train on, raise {until} (with train.steps the lr schedule "
                "follows the new length), or start another run_name.", summary or {})

    def _read_summary(self) -> dict[str, Any] | None:
        try:
            return json.loads((self.run_dir / SUMMARY).read_text())
        except (OSError, ValueError):
            return None

    def _check_memory(self, cfg: DictConfig) -> None:
        """Log the memory plan (rank 0); on GPUs refuse a run whose estimate exceeds a GPU (train.memory_check)."""
        plan = plan_memory(cfg, self.model_config, self.world, on_gpu=self.device.type == "cuda")
        if self.rank == 0:
            log.info("%s", plan.describe())
        if self.device.type == "cuda" and bool(self.tc.get("memory_check", True)):  # CPU runs: the plan is told
            capacity = torch.cuda.get_device_properties(self.device).total_memory
            refusal = plan.refusal(capacity)
            if refusal:
                raise MemoryPlanRefusal(refusal)

    def _build_loaders(self, batch_args: dict[str, Any]):
        """The train loader and the validation one (None without validation), from one preparation of the data."""
        want_val = int(self.tc.eval_every) > 0
        if want_val and self.cfg.data.get("name") == "synthetic":
            log.info("validation: data=synthetic has no held-out split; train.eval_every is ignored")
            want_val = False
        loaders = build_loaders(self.cfg.data, ("train", "val") if want_val else ("train",), **batch_args)
        val = loaders.get("val")
        if want_val and val is None:
            log.info("validation off: the data has no held-out split (data.val_fraction > 0 gives one)")
        if val is not None:
            self.val_start = val.state_dict()
        return loaders["train"], val

    # ------------------------------------------------------------------------------------------- loop
    def fit(self) -> dict[str, Any]:
        tc, last = self.tc, self.last_step  # last = train.steps, or train.stop_at
        metrics: dict[str, Any] = {}
        self.engine.train()
        for step in range(self.start_step + 1, last + 1):
            with self.profiler.step(step):  # train.profile_step / profile_python_step only
                metrics = self.train_step(step)
            if step == self.start_step + 1 and self._saves_ahead(step):  # the optimizer state exists now: pin the
                self.checkpointer.prepare(self.engine)  # snapshot's host buffers in the background meanwhile
            if self.writes_done:  # every rank has written its files of the save in flight: commit it
                self._commit_save(step)
            stopping = self.stop_requested and step < last
            if _due(int(tc.eval_every), step, last) and not stopping:
                metrics.update(self.validate())
            if step % int(tc.log_every) == 0 or step == last or metrics["skipped"] or stopping:
                self.logger.log(step, metrics)
            if self.guard.exhausted:
                self._wait_for_save(step)
                self._summary(step, "non-finite steps", NonFiniteStop.exit_code)
                raise NonFiniteStop(self._nonfinite_message(step))
            save_every = int(tc.save_every or 0)
            if (save_every and step % save_every == 0) or (step == last and tc.save_final) or stopping:
                self.save(step)
            if stopping:
                self._wait_for_save(step)  # the stop's checkpoint is committed before the process exits
                self._summary(step, f"stopped by {self.signals.name}", 128 + self.signals.signum)
                raise Preempted(self._preempted_message(step), self.signals.signum)
        self._wait_for_save(last)
        self._summary(last, "completed" if last == self.total_steps else "stopped at train.stop_at", 0)
        return metrics

    def _saves_ahead(self, step: int) -> bool:
        """Whether this session will save after `step` (train.save_every, train.save_final)."""
        every = int(self.tc.save_every or 0)
        return bool(self.tc.save_final) or (every > 0 and (step // every + 1) * every <= self.last_step)

    def train_step(self, step: int) -> dict[str, Any]:
        """Optimizer step `step` (1-based; grad_accum micro-batches); returns its metrics, rank-averaged."""
        engine, device = self.engine, self.device
        self.monitor.begin_step(step)  # sampled steps collect FP8 health
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        retries = allocator_retries(device)
        if self.clocks is not None:
            self.clocks.take()  # the window starts with the step
        # loss, lm, mtp, z; one stop flag per STOP_SIGNALS; "my checkpoint write is done" (NCCL: on GPU)
        sums = torch.zeros(4 + len(STOP_SIGNALS) + 1, dtype=torch.float64, device=device)
        for _ in range(self.accum):
            batch = batch_to_device(self.loader.next_batch(), device)  # queued: no wait for the GPU
            out = engine(batch["input_ids"], labels=batch["labels"], doc_ids=batch.get("doc_ids"))
            loss = self.guard.loss_for_backward(out.loss, step)  # = out.loss when finite, else NaN
            with scope(GRAD_REDUCE_SCOPE):  # profiler ranges (no-ops unless profiling): DeepSpeed's backward hooks
                engine.backward(loss)
            with scope(OPTIMIZER_SCOPE):  # DeepSpeed steps the optimizer at the accumulation boundary
                engine.step()
            parts = [loss, out.lm_loss, out.mtp_loss if out.mtp_loss is not None else loss * 0, out.z_loss]
            sums[:4] += torch.stack([p.detach().double() for p in parts])
        applied = engine.was_step_applied()
        # a skipped step leaves the expert biases alone; rate 0 only clears the step's token counts
        loads = update_expert_biases(self.routers, self.bias_rate if applied else 0.0)  # one all-reduce for all
        if self.signals.signum in STOP_SIGNALS:
            sums[4 + STOP_SIGNALS.index(self.signals.signum)] = 1.0
        sums[-1] = 1.0 if self.checkpointer.local_done() else 0.0
        totals = _sum_across_ranks(sums).tolist()  # the step's one host sync (plus DeepSpeed's own)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        stops = [sig for i, sig in enumerate(STOP_SIGNALS) if totals[4 + i] > 0]
        if stops:  # whichever rank got it: every rank stops, under the same name
            self.signals.agree(stops[0])
        self.stop_requested = bool(stops)
        self.writes_done = self.checkpointer.pending is not None and totals[-1] == self.world
        loss, lm_loss, mtp_loss, z_loss = (v / (self.accum * self.world) for v in totals[:4])
        grad_norm = engine.get_global_grad_norm()
        grad_norm = float(grad_norm) if grad_norm is not None else None
        skipped = self.guard.record(step, applied, loss, grad_norm)
        if skipped:
            log.warning("step %d: loss %s, grad norm %s: not finite, step skipped (nothing updated; %d in a row, "
                        "%d in all, train.max_bad_steps=%d)", step, loss, grad_norm, self.guard.streak,
                        self.guard.total, self.guard.max_bad_steps)
        else:
            self.recent_losses.append(loss)
        if step > self.start_step + 1:
            self.timed[0] += 1
            self.timed[1] += dt
        tokens_per_s = self.tokens_per_step / dt
        metrics: dict[str, Any] = {
            "loss": loss, "lm_loss": lm_loss, "mtp_loss": mtp_loss if self.model_config.num_mtp_layers > 0 else None,
            "z_loss": z_loss, "lr": float(self.scheduler.get_last_lr()[0]), "grad_norm": grad_norm,
            "step_time_s": dt, "tokens_per_s": tokens_per_s,
            "tflops_per_gpu": self.flops_per_token * tokens_per_s / self.world / 1e12,
            "peak_mem_gib": peak_memory_gib(device), "skipped": skipped, "nonfinite_steps": self.guard.total,
        }
        if device.type == "cuda":  # the caching allocator's release-and-retry stalls in this step (0: none)
            metrics["alloc_retries"] = allocator_retries(device) - retries
        if self.peak:
            metrics["mfu"] = metrics["tflops_per_gpu"] / self.peak
        if self.clocks is not None:
            metrics.update(self.clocks.take())  # sm_clock_mhz, power_w, power_capped_share
        if loads:
            max_over_mean = [s["max_over_mean"] for s in loads]
            metrics["expert_load_max_over_mean"] = float(np.mean(max_over_mean))
            metrics["expert_load_max_over_mean_worst"] = float(np.max(max_over_mean))
        if self.optim_state_gib is None and applied:
            metrics["optim_state_gib"] = self._measure_optimizer_state()
        metrics.update(self.monitor.end_step(step, _mean_across_ranks))  # alarms, recompute check, fallback
        return metrics

    def _measure_optimizer_state(self) -> float:
        state, master = optimizer_state_bytes(self.engine.optimizer, self.model)
        self.optim_state_gib = (state + master) / 2**30
        cls = type(self.engine.optimizer)  # DeepSpeed's wrapper, or ling.train's subclass of it
        ds_cls = next((c for c in cls.__mro__ if c.__module__.startswith("deepspeed")), cls)
        log.info("optimizer state on rank %d: %.3f GiB (moments and their scales %.3f + fp32 master weights %.3f; "
                 "DeepSpeed's %s)", self.rank, self.optim_state_gib, state / 2**30, master / 2**30,
                 ds_cls.__name__ + ("" if ds_cls is cls else f" via {cls.__name__}"))
        return self.optim_state_gib

    def validate(self) -> dict[str, float]:
        """Validation losses (`val_` + evaluate's keys) over the same `train.eval_batches` batches each time."""
        if self.val_loader is None:
            return {}
        self.val_loader.load_state_dict(self.val_start)
        n = int(self.tc.eval_batches)
        batches = (self.val_loader.next_batch() for _ in range(n))
        self.val_metrics = {f"val_{k}": v for k, v in evaluate(self.model, batches, self.device, max_batches=n).items()}
        return self.val_metrics

    def save(self, step: int) -> None:
        """Snapshot step `step` into a checkpoint: written in the background (train.async_save) and committed
        when every rank is done, or written and committed now."""
        if self.last_saved_step == step:
            return
        if self.guard.streak > 0:
            log.warning("step %d: no checkpoint after a non-finite step; the last good one stays %s", step,
                        self.last_checkpoint or "none (none was written yet)")
            return
        self._wait_for_save(step)  # one save in flight
        state = {"loader": self.loader.state_dict(), "guard": self.guard.state_dict(),
                 "fp8_monitor": self.monitor.state_dict()}
        try:
            pending = self.checkpointer.start(self.engine, step, state)
        except CheckpointWriteError as e:
            self._checkpoint_failed(step, e)
        self.last_saved_step = step
        self.save_stall_s += pending.stall_s
        if pending.write is None:
            self._commit_save(step)
        else:
            log.info("checkpoint %s: snapshot taken in %.1f s (training waited that long); writing it in the "
                     "background", pending.tag, pending.stall_s)

    def _wait_for_save(self, step: int) -> None:
        """Wait for the save in flight, if any, and commit it (every rank)."""
        if self.checkpointer.pending is None:
            return
        t0 = time.perf_counter()
        if self.checkpointer.pending.write is not None:
            self.checkpointer.pending.write.join()
        waited = time.perf_counter() - t0
        self.save_stall_s += waited
        if waited > 0.05:
            log.info("waited %.1f s for checkpoint %s to be written", waited, self.checkpointer.pending.tag)
        self._commit_save(step)

    def _commit_save(self, step: int) -> None:
        try:
            done = self.checkpointer.finish()
        except CheckpointWriteError as e:
            self._checkpoint_failed(step, e)
        self.last_checkpoint = done.final
        if done.write is None:  # a synchronous save: training waited for the write and the hashing too
            self.save_stall_s += done.write_s
        where = "in the background" if done.write is not None else "while training waited"
        log.info("saved checkpoint %s (snapshot %.1f s; written and hashed in %.1f s %s)", done.final, done.stall_s,
                 done.write_s, where)

    def _checkpoint_failed(self, step: int, error: CheckpointWriteError):
        self._summary(step, "checkpoint failed", CheckpointError.exit_code)
        raise CheckpointError(str(error)) from error

    # ---------------------------------------------------------------------------------------- the end
    def _nonfinite_message(self, step: int) -> str:
        g = self.guard
        return (f"stopping after step {step}: {g.streak} non-finite steps in a row (steps {g.streak_start}-{step}; "
                f"last loss {g.last.get('loss')}, grad norm {g.last.get('grad_norm')}; train.max_bad_steps="
                f"{g.max_bad_steps}). They updated nothing; the last good checkpoint is "
                f"{self.last_checkpoint or 'none (none was written yet)'}. Fix the cause (e.g. a lower optim.lr) "
                "and resume with train.resume=auto.")

    def _preempted_message(self, step: int) -> str:
        saved = (f"saved {self.last_checkpoint}" if self.last_saved_step == step
                 else f"not saved (the last step was not finite); the last good checkpoint is {self.last_checkpoint}")
        return (f"received {self.signals.description}: stopped after step {step}/{self.total_steps}, {saved}. "
                f"Resume with the same command and run_name={self.cfg.run_name} (train.resume=auto).")

    def _summary(self, step: int, outcome: str, exit_code: int) -> dict[str, Any]:
        """Log the closing summary and write it to <run dir>/summary.json (rank 0), with the workers' exit code
        (torchrun's own exit code does not carry it: docs/runtime_scale.md)."""
        steps_timed, seconds = self.timed
        summary = {
            "run_dir": str(self.run_dir), "outcome": outcome, "step": step, "total_steps": self.total_steps,
            "nonfinite_steps": self.guard.total,
            "train_loss": self.recent_losses[-1] if self.recent_losses else None,
            "train_loss_mean_last_10": float(np.mean(self.recent_losses)) if self.recent_losses else None,
            "val_loss": self.val_metrics.get("val_loss"),
            "tokens_per_s": self.tokens_per_step * steps_timed / seconds if seconds else None,
            "peak_mem_gib": peak_memory_gib(self.device), "optim_state_gib": self.optim_state_gib,
            "checkpoint": str(self.last_checkpoint) if self.last_checkpoint else None,
            "checkpoint_stall_s": self.save_stall_s, "exit_code": exit_code,
        }
        if self.rank == 0:
            atomic_write(self.run_dir / SUMMARY, lambda tmp: tmp.write_text(json.dumps(summary, indent=1)))
            fmt = lambda v, f: "n/a" if v is None else format(v, f)  # noqa: E731
            log.info("run %s: %s at step %d/%d (%d non-finite steps skipped)", self.run_dir, outcome, step,
                     self.total_steps, self.guard.total)
            log.info("  train loss %s (mean of the last 10: %s) | val loss %s | %s tokens/s | peak memory %s GiB",
                     fmt(summary["train_loss"], ".4f"), fmt(summary["train_loss_mean_last_10"], ".4f"),
                     fmt(summary["val_loss"], ".4f"), fmt(summary["tokens_per_s"], ",.0f"),
                     fmt(summary["peak_mem_gib"], ".2f"))
            log.info("  checkpoint %s", summary["checkpoint"] or "none")
        return summary

    def close(self) -> None:
        if self.clocks is not None:
            self.clocks.close()
        self.checkpointer.close()
        self.logger.close()

