"""The non-finite guard: a step whose loss or global gradient norm is not finite changes no state.

How a step is skipped. DeepSpeed's optimizer wrappers (ZeRO-1/2/3, and the bf16 wrappers of stage 0) compute
the global gradient norm before they touch anything and, when it is not finite, clear the gradients and
return: no parameter, optimizer moment (FP8AdamW's E4M3 moments and their scales included) or lr-scheduler
step changes, and `engine.was_step_applied()` says False. The guard makes a non-finite *loss* take the same
path: `loss_for_backward` multiplies the loss by NaN when it is not finite, so every gradient it reaches is
NaN. The trainer then leaves the routers' expert bias alone and drops their token counts. The check costs no
host sync of its own: DeepSpeed's overflow test is already one, and the loss is read once per step for the
metrics anyway.

Plain fp32 without ZeRO (`deepspeed=zero0` on CPU) has no such wrapper (DeepSpeed calls the optimizer
directly), so the guard refuses that combination up front.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ling.train.launch import StopRun


class NonFiniteStop(StopRun):
    """`train.max_bad_steps` non-finite steps in a row."""

    exit_code = 3


def check_engine_can_skip(engine) -> None:
    """DeepSpeed without ZeRO in fp32 applies whatever the gradients hold; refuse it before training."""
    check_can_skip(engine.zero_optimization_stage(), engine.bfloat16_enabled() or engine.fp16_enabled())


def check_can_skip(zero_stage: int, half_precision: bool) -> None:
    """The same refusal from the config (ling/config_check.py), before the engine is built."""
    if zero_stage == 0 and not half_precision:
        raise ValueError("deepspeed.zero_stage=0 with fp32 weights (a CPU run unless deepspeed.bf16=true, or "
                         "deepspeed.bf16=false) calls the optimizer without DeepSpeed's overflow check, so a "
                         "non-finite step could not be skipped: use deepspeed=zero1 (the same memory on one process)")


@dataclass
class NonFiniteGuard:
    """Counts non-finite steps; `max_bad_steps` in a row raise NonFiniteStop.

    `inject_nan_steps`: 1-based steps whose loss is replaced by NaN (`train.inject_nan_steps`, for tests).
    """

    max_bad_steps: int
    inject_nan_steps: frozenset[int] = frozenset()
    total: int = 0  # non-finite steps so far (restored on resume)
    streak: int = 0  # non-finite steps in a row, up to the last one
    streak_start: int = 0
    last: dict[str, float | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_bad_steps < 1:
            raise ValueError(f"train.max_bad_steps must be >= 1, got {self.max_bad_steps}")

    def loss_for_backward(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        """loss (scalar) for `engine.backward` at 1-based `step`: unchanged when finite (times exactly 1.0),
        NaN everywhere downstream when not."""
        if step in self.inject_nan_steps:
            loss = loss * float("nan")
        poison = torch.where(torch.isfinite(loss.detach()), 1.0, float("nan"))
        return loss * poison

    def record(self, step: int, applied: bool, loss: float, grad_norm: float | None) -> bool:
        """Account for optimizer step `step` (1-based); True when it was skipped as non-finite.

        `applied`: engine.was_step_applied(); `loss`: the rank-averaged loss; `grad_norm`: DeepSpeed's.
        """
        finite = math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm))
        if applied and not finite:
            raise RuntimeError(f"step {step}: DeepSpeed applied an update although loss={loss} and "
                               f"grad_norm={grad_norm}; the parameters can no longer be trusted (the non-finite "
                               "guard relies on DeepSpeed skipping such steps, see ling/train/guard.py)")
        skipped = not applied
        if skipped:
            self.total += 1
            self.streak += 1
            self.streak_start = self.streak_start if self.streak > 1 else step
            self.last = {"loss": loss, "grad_norm": grad_norm}
        else:
            self.streak = 0
        return skipped

    @property
    def exhausted(self) -> bool:
        return self.streak >= self.max_bad_steps

    def state_dict(self) -> dict[str, int]:
        return {"total": self.total, "streak": self.streak}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.total, self.streak = int(state.get("total", 0)), int(state.get("streak", 0))
