"""Learning-rate schedules as multipliers of the peak lr: warmup + cosine, warmup-stable-decay, constant."""

from __future__ import annotations

import math
from collections.abc import Callable


def lr_multiplier(schedule: str, total_steps: int, warmup_steps: int, min_lr_ratio: float = 0.1,
                  decay_fraction: float = 0.2) -> Callable[[int], float]:
    """Return f(step) → multiplier in [0, 1] of the peak lr for optimizer step `step` (0-based).

    - warmup: linear from 1/warmup to 1 over `warmup_steps`;
    - cosine: cosine from 1 down to `min_lr_ratio` over the remaining steps;
    - wsd: constant 1, then a linear decay to `min_lr_ratio` over the last `decay_fraction` of the steps;
    - constant: 1 after warmup.
    """
    if schedule not in ("cosine", "wsd", "constant"):
        raise ValueError(f"optim.schedule={schedule!r} is unknown (known: cosine, wsd, constant)")
    if total_steps <= 0:
        raise ValueError(f"train.steps must be positive, got {total_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    if not 0.0 <= decay_fraction <= 1.0:
        raise ValueError(f"optim.decay_fraction must be in [0, 1], got {decay_fraction}")
    warmup = max(0, min(warmup_steps, total_steps))

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        if schedule == "cosine":
            span = max(1, total_steps - warmup)
            progress = min(1.0, (step - warmup) / span)
            return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        decay_steps = max(1, int(round(total_steps * decay_fraction)))
        decay_start = max(warmup, total_steps - decay_steps)
        if step < decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start) / max(1, total_steps - decay_start))
        return 1.0 - (1.0 - min_lr_ratio) * progress

    return f
