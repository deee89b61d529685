"""FP8 health monitor: sampled underflow / distortion per layer and tensor kind, alarms on thresholds, the fp32
recompute check of dW, and the per-layer fallback to high precision that a checkpoint keeps.

Every `every` steps (`fp8.health_every`) the monitor switches `collect_health` on for the step in every FP8
module it watches (anything with `collect_health` and a `health` dict: `FP8Linear`, FP8 grouped experts); the
modules fill `health` with 0-dim device tensors during the step (fp8/health.py: no host sync per layer). At the
end of the step `end_step` stacks every layer's statistics into one tensor, optionally reduces it across ranks
(so that every rank sees the same values and takes the same decisions), reads it back once, and:
- returns the metrics `fp8/<layer>/<kind>_<stat>` and their means over layers `fp8/mean/<kind>_<stat>`, plus
  `fp8/alarms` (alarms this step) and `fp8/bf16_layers` (layers switched to high precision so far);
- for each statistic above its threshold (`thresholds[kind][stat]`, None = never) logs a warning naming the
  layer, the statistic, its value and the threshold's config key;
- with `recompute_dw`, the sampled step also recomputes each layer's dW = dyᵀ·x in fp32 from the
  high-precision dy and x of the same micro-batch (the last one of the step) and compares it with the FP8 dW
  (`dw_rel_err`, a statistic like the others: logged, averaged, `thresholds.dw.rel_err` alarms on it, and an
  alarm on another kind quotes it);
- with `fallback`, an alarmed layer is switched to high precision for the rest of the run (`use_fp8 = False`:
  BF16 under DeepSpeed bf16). `state_dict()` names those layers; the trainer stores it in its checkpoint state
  and `load_state_dict` switches them again on resume.

Tensor kinds: act (forward input x, 1x128 along K), grad (dy for dgrad, along N), gradT (dyᵀ for wgrad, along
tokens), weight (W, read along K), dw (the recompute check).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["KINDS", "MonitorConfig", "FP8Monitor", "Alarm"]

log = logging.getLogger(__name__)

KINDS: dict[str, tuple[str, ...]] = {
    "act": ("underflow", "distortion"),
    "grad": ("underflow", "distortion"),
    "gradT": ("underflow", "distortion"),
    "weight": ("underflow", "distortion"),
    "dw": ("rel_err",),
}


def _key(kind: str, stat: str) -> str:
    return f"{kind}_{stat}"


@dataclass
class MonitorConfig:
    """`fp8.health_every` and the `fp8.monitor` node (conf/precision/fp8.yaml)."""

    every: int = 0  # sample every N steps (0 = off)
    thresholds: dict[str, dict[str, float | None]] = field(default_factory=dict)  # kind -> stat -> threshold
    recompute_dw: bool = False  # sampled steps also recompute dW in fp32 (keeps x for that step)
    fallback: bool = False  # an alarmed layer runs in high precision for the rest of the run

    def __post_init__(self) -> None:
        if int(self.every) < 0:
            raise ValueError(f"fp8.health_every must be >= 0, got {self.every}")
        for kind, stats in self.thresholds.items():
            if kind not in KINDS:
                raise ValueError(f"fp8.monitor.thresholds.{kind}: unknown tensor kind (known: {list(KINDS)})")
            for stat, value in (stats or {}).items():
                if stat not in KINDS[kind]:
                    raise ValueError(f"fp8.monitor.thresholds.{kind}.{stat}: unknown statistic (known: "
                                     f"{list(KINDS[kind])})")
                if value is not None and not (isinstance(value, int | float) and value >= 0):
                    raise ValueError(f"fp8.monitor.thresholds.{kind}.{stat} must be a number >= 0 or null, "
                                     f"got {value!r}")

    @classmethod
    def from_dict(cls, every: int, monitor: Mapping[str, Any] | None) -> MonitorConfig:
        monitor = dict(monitor or {})
        unknown = sorted(set(monitor) - {"thresholds", "recompute_dw", "fallback"})
        if unknown:
            raise ValueError(f"fp8.monitor.{unknown[0]}: unknown key (known: thresholds, recompute_dw, fallback)")
        thresholds = {k: dict(v or {}) for k, v in dict(monitor.get("thresholds") or {}).items()}
        return cls(int(every or 0), thresholds, bool(monitor.get("recompute_dw", False)),
                   bool(monitor.get("fallback", False)))

    def threshold(self, key: str) -> tuple[float | None, str]:
        """(threshold, its config key) of a statistic key such as "grad_underflow"."""
        kind, _, stat = key.partition("_")
        return (self.thresholds.get(kind) or {}).get(stat), f"fp8.monitor.thresholds.{kind}.{stat}"


@dataclass(frozen=True)
class Alarm:
    step: int
    layer: str
    key: str  # e.g. "grad_underflow"
    value: float
    threshold: float


class FP8Monitor:
    """Samples, checks and acts on the health of `modules` = [(name, module)]; see the module doc."""

    def __init__(self, modules: Iterable[tuple[str, nn.Module]], config: MonitorConfig) -> None:
        self.config = config
        self.modules = [(n, m) for n, m in modules if hasattr(m, "collect_health") and hasattr(m, "health")]
        self.bf16_layers: set[str] = set()
        self.alarms: list[Alarm] = []  # every alarm of this session
        self._sampling = False

    def active(self) -> list[tuple[str, nn.Module]]:
        """The watched modules still running in FP8."""
        return [(n, m) for n, m in self.modules if getattr(m, "use_fp8", True)]

    def sampled(self, step: int) -> bool:
        """Whether 1-based `step` is sampled: steps 1, 1 + every, 1 + 2·every, ..."""
        every = self.config.every
        return every > 0 and (step - 1) % every == 0 and bool(self.active())

    def begin_step(self, step: int) -> bool:
        """Switch collection on for a sampled step (off otherwise); returns whether it is sampled."""
        self._sampling = self.sampled(step)
        for _, m in self.modules:
            m.collect_health = self._sampling
            m.health = {}
            if hasattr(m, "check_dw"):
                m.check_dw = self._sampling and self.config.recompute_dw
        return self._sampling

    def end_step(self, step: int, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, float]:
        """After a sampled step: read every statistic at once (`reduce` e.g. averages across ranks), check the
        thresholds, act; returns the metrics. Switches collection off. Returns {} for a step not sampled."""
        if not self._sampling:
            return {}
        self._sampling = False
        entries = [(name, key, value) for name, m in self.active() for key, value in m.health.items()]
        for _, m in self.modules:
            m.collect_health = False
            if hasattr(m, "check_dw"):
                m.check_dw = False
        if not entries:
            return {}
        stacked = torch.stack([v.detach().float().reshape(()) for _, _, v in entries])
        if reduce is not None:
            stacked = reduce(stacked)
        values = stacked.tolist()  # the monitor's one host sync per sampled step
        metrics: dict[str, float] = {}
        per_layer: dict[str, dict[str, float]] = {}
        per_key: dict[str, list[float]] = {}
        for (name, key, _), v in zip(entries, values):
            metrics[f"fp8/{name}/{key}"] = v
            per_layer.setdefault(name, {})[key] = v
            per_key.setdefault(key, []).append(v)
        for key, vs in per_key.items():
            metrics[f"fp8/mean/{key}"] = sum(vs) / len(vs)
        alarms = self._check(step, per_layer)
        metrics["fp8/alarms"] = float(len(alarms))
        metrics["fp8/bf16_layers"] = float(len(self.bf16_layers))
        return metrics

    def _check(self, step: int, per_layer: dict[str, dict[str, float]]) -> list[Alarm]:
        alarms = []
        modules = dict(self.modules)
        for name, stats in per_layer.items():
            hits = []
            for key, value in stats.items():
                threshold, config_key = self.config.threshold(key)
                if threshold is not None and value > threshold:
                    hits.append(Alarm(step, name, key, value, float(threshold)))
                    dw = "" if key == "dw_rel_err" or "dw_rel_err" not in stats else \
                        f"; dW vs its fp32 recompute: relative error {stats['dw_rel_err']:.4g}"
                    log.warning("FP8 health alarm at step %d: %s %s = %.4g > %.4g (%s)%s", step, name, key, value,
                                threshold, config_key, dw)
            if hits and self.config.fallback:
                if self._switch_to_high_precision(name, modules[name]):
                    log.warning("FP8 health: %s runs in high precision (BF16) from step %d on (fp8.monitor.fallback;"
                                " kept in checkpoints)", name, step + 1)
            alarms += hits
        self.alarms += alarms
        return alarms

    def _switch_to_high_precision(self, name: str, module: nn.Module) -> bool:
        if not hasattr(module, "use_fp8"):
            log.warning("FP8 health: %s (%s) has no high-precision fallback; it stays in FP8", name,
                        type(module).__name__)
            return False
        module.use_fp8 = False
        module.collect_health = False
        if hasattr(module, "invalidate_weight_cache"):
            module.invalidate_weight_cache()  # its FP8 weight is not needed any more
        self.bf16_layers.add(name)
        return True

    # -- checkpoint state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"bf16_layers": sorted(self.bf16_layers)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Switch the layers a checkpoint names back to high precision (before the first resumed step)."""
        modules = dict(self.modules)
        for name in state.get("bf16_layers", []):
            if name not in modules:
                raise ValueError(f"checkpoint state fp8_monitor.bf16_layers names {name!r}, which is not an FP8 "
                                 f"layer of this model (known: {sorted(modules)[:5]}...)")
            self._switch_to_high_precision(name, modules[name])
