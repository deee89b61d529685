"""Compare training runs: an FP8 run against its BF16 twin (and several seeds, and a BF16-vs-BF16 noise floor).

From each run dir: `metrics.jsonl` (per-step loss, FP8 health), `resolved_config.yaml` and the newest
held-out result of eval.py (`eval/*.json`). For each pair (candidate A, baseline B) on the steps both logged:
rel_s = (loss_A − loss_B) / loss_B; over the last `window` fraction of those steps its mean, mean |rel| and
the slope of rel against the step with a 95 % confidence interval (OLS, the standard error widened for the
lag-1 autocorrelation of the residuals, which neighbouring steps of two training runs have). Output: PNG
plots, `report.md` and `summary.json` in one folder.

    python eval.py compare RUN_FP8 RUN_BF16 [--out DIR]
    python eval.py compare --pairs 'runs/parity/s*_fp8:runs/parity/s*_bf16' \
        --noise runs/parity/s1_bf16:runs/parity/s1_bf16_rerun
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import re
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import OmegaConf

from ling.checkpoint.layout import METRICS, RESOLVED_CONFIG

# Config keys two runs of a comparison may differ in without a warning: what makes the FP8 / BF16 twin (the
# precision recipe, the optimizer's moment format), the seed of a seed sweep, bookkeeping, and what makes a branch
# of a trunk (scripts/parity_branch.sh: where it starts and stops, its checkpoints and validation cadence).
EXPECTED_DIFFERENCES = ("run_name", "precision.", "fp8.", "optim.name", "optim.block_size", "optim.min_fp8_numel",
                        "optim.rounding", "train.seed", "data.seed", "logging.", "train.checkpoint_dir", "train.resume",
                        "train.deterministic", "train.stop_at", "train.save_every", "train.save_final",
                        "train.keep_last", "train.eval_every")
HEALTH_KINDS = ("act", "grad", "gradT", "weight")
HEALTH_STATS = ("underflow", "distortion")
TARGET_REL_DIFF = 1e-3  # Ling 2.0 reports about 0.1 % between FP8 and BF16 loss
# The fewest logged steps a summary window needs for its slope to be reported: with fewer, the slope per 1k steps
# extrapolates a few noisy points by 100x and its interval (t quantile on a handful of effective samples) spans
# both signs by far (a 12-step window: +49 [-88, +187] %/1k steps).
MIN_SLOPE_STEPS = 30


class ConfigMismatchWarning(UserWarning):
    """Two compared runs differ in more than precision / optimizer / seed / run name."""


@dataclass
class Run:
    """One run dir's logs: metrics by step (the last record of a step wins, as after a resume)."""

    path: Path
    name: str
    config: dict[str, Any]  # flattened resolved config: {"train.steps": 1000, ...}
    steps: np.ndarray  # int64 [S], increasing
    metrics: dict[str, np.ndarray]  # key → float64 [S] (NaN where the step did not log it)
    held_out: dict[str, Any] | None  # the newest eval.py record of this run's precision, if any

    def series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) where `key` was logged."""
        if key not in self.metrics:
            known = ", ".join(sorted(self.metrics)[:12])
            raise KeyError(f"run {self.path}: metrics.jsonl has no {key!r} (keys: {known})")
        v = self.metrics[key]
        ok = np.isfinite(v)
        return self.steps[ok], v[ok]

    @property
    def precision(self) -> str | None:
        return self.config.get("precision.name")


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def load_run(path: str | Path) -> Run:
    """Read a run dir; raises naming the missing file or an empty log."""
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"run {p}: no such folder")
    log = p / METRICS
    if not log.is_file():
        raise FileNotFoundError(f"run {p}: no metrics.jsonl (not a run dir, or trained with logging.jsonl=false)")
    by_step: dict[int, dict[str, Any]] = {}
    bad = 0
    for line in log.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            by_step[int(rec["step"])] = rec
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            bad += 1  # a line cut short by a crash mid-write
    if bad:
        warnings.warn(f"run {p}: skipped {bad} unreadable line(s) of metrics.jsonl", stacklevel=2)
    if not by_step:
        raise ValueError(f"run {p}: metrics.jsonl holds no step record")
    steps = np.array(sorted(by_step), dtype=np.int64)
    keys = sorted({k for rec in by_step.values() for k, v in rec.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)})
    metrics = {k: np.array([_num(by_step[s].get(k)) for s in steps], dtype=np.float64) for k in keys}
    conf_path = p / RESOLVED_CONFIG
    config = _flatten(OmegaConf.to_container(OmegaConf.load(conf_path))) if conf_path.is_file() else {}
    if not config:
        warnings.warn(f"run {p}: no resolved_config.yaml; its config cannot be compared", stacklevel=2)
    return Run(p, p.name, config, steps, metrics, _held_out(p, config.get("precision.name")))


def _num(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan


def _held_out(run_dir: Path, precision: str | None) -> dict[str, Any] | None:
    """The eval.py record (eval/*.json) of the newest checkpoint evaluated in the run's own precision."""
    best = None
    for f in sorted((run_dir / "eval").glob("*.json")):
        try:
            rec = json.loads(f.read_text())
        except json.JSONDecodeError:
            continue
        if precision and rec.get("precision") != precision or rec.get("split") != "val":
            continue
        key = (rec.get("step") or -1, f.stat().st_mtime)
        if best is None or key > best[0]:
            best = (key, rec)
    return best[1] if best else None


def config_differences(a: Run, b: Run) -> list[tuple[str, Any, Any, bool]]:
    """[(key, value in a, value in b, expected)] for every flattened config key whose values differ."""
    absent = "<absent>"
    out = []
    for k in sorted(set(a.config) | set(b.config)):
        va, vb = a.config.get(k, absent), b.config.get(k, absent)
        if va != vb:
            out.append((k, va, vb, any(k == e or (e.endswith(".") and k.startswith(e)) for e in EXPECTED_DIFFERENCES)))
    return out


# ------------------------------------------------------------------------------------------------ statistics
@dataclass
class Slope:
    per_step: float  # d rel / d step
    ci_low: float  # 95 % confidence interval of per_step
    ci_high: float
    autocorr: float  # lag-1 autocorrelation of the residuals used to widen the interval


def slope_with_ci(x: np.ndarray, y: np.ndarray) -> Slope:
    """OLS slope of y on x with a 95 % CI; the standard error is scaled by sqrt((1+ρ)/(1−ρ)) for the lag-1
    autocorrelation ρ ≥ 0 of the residuals, and the t quantile uses the matching effective sample size."""
    from scipy import stats

    n = len(x)
    if n < 3:
        return Slope(math.nan, math.nan, math.nan, math.nan)
    xc = x - x.mean()
    sxx = float((xc * xc).sum())
    b = float((xc * (y - y.mean())).sum() / sxx)
    resid = y - y.mean() - b * xc
    ss = float((resid * resid).sum())
    rho = 0.0
    if ss > 0:
        rho = float(np.clip((resid[1:] * resid[:-1]).sum() / ss, 0.0, 0.99))
    se = math.sqrt(ss / (n - 2) / sxx) * math.sqrt((1 + rho) / (1 - rho))
    n_eff = max(3.0, n * (1 - rho) / (1 + rho))
    half = float(stats.t.ppf(0.975, n_eff - 2)) * se
    return Slope(b, b - half, b + half, rho)


@dataclass
class PairSummary:
    """Relative loss difference of a candidate run (A) against a baseline (B)."""

    candidate: str
    baseline: str
    key: str
    steps: int  # steps both runs logged
    window: tuple[int, int]  # first and last step of the summary window
    window_steps: int
    mean_rel: float  # mean of (A − B) / B over the window
    mean_abs_rel: float  # mean of |A − B| / B over the window
    slope: Slope  # of the relative difference per step, over the window
    final_rel: float  # at the last common step
    held_out_a: float | None = None  # final held-out loss (eval.py) of A and B, when evaluated
    held_out_b: float | None = None
    config_differences: list[tuple[str, Any, Any, bool]] = field(default_factory=list)

    @property
    def held_out_rel(self) -> float | None:
        if self.held_out_a is None or self.held_out_b is None:
            return None
        return (self.held_out_a - self.held_out_b) / self.held_out_b


def aligned_relative_difference(a: Run, b: Run, key: str = "loss",
                                first_steps: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(steps both logged, (A − B) / B at those steps); with `first_steps` only the first that many of them (to
    compare branches cut short at one common length)."""
    sa, va = a.series(key)
    sb, vb = b.series(key)
    common, ia, ib = np.intersect1d(sa, sb, return_indices=True)
    if len(common) == 0:
        raise ValueError(f"runs {a.path} and {b.path} share no logged step of {key!r}")
    if first_steps is not None:
        if first_steps < 1:
            raise ValueError(f"steps={first_steps}: must be at least 1")
        if len(common) < first_steps:
            raise ValueError(f"runs {a.path} and {b.path} share {len(common)} logged steps of {key!r}, fewer "
                             f"than the {first_steps} asked for")
        common, ia, ib = common[:first_steps], ia[:first_steps], ib[:first_steps]
    return common, (va[ia] - vb[ib]) / vb[ib]


def summarize_pair(a: Run, b: Run, *, key: str = "loss", window: float = 0.2,
                   first_steps: int | None = None) -> PairSummary:
    if not 0 < window <= 1:
        raise ValueError(f"window={window}: must be in (0, 1]")
    steps, rel = aligned_relative_difference(a, b, key, first_steps)
    n_win = max(1, int(round(len(steps) * window)))
    ws, wr = steps[-n_win:], rel[-n_win:]
    diffs = config_differences(a, b)
    unexpected = [d for d in diffs if not d[3]]
    if unexpected:
        listed = "; ".join(f"{k}: {va!r} vs {vb!r}" for k, va, vb, _ in unexpected)
        warnings.warn(f"{a.name} vs {b.name} differ beyond precision/optimizer/seed/run name: {listed}",
                      ConfigMismatchWarning, stacklevel=2)
    held_key = "loss"
    # a held-out result is of the run's end: with the comparison cut short of either run's end it is left out
    cut = int(steps[-1]) < max(int(a.steps[-1]), int(b.steps[-1])) if first_steps is not None else False
    a_held, b_held = (None, None) if cut else (a.held_out, b.held_out)
    return PairSummary(
        candidate=a.name, baseline=b.name, key=key, steps=len(steps), window=(int(ws[0]), int(ws[-1])),
        window_steps=n_win, mean_rel=float(wr.mean()), mean_abs_rel=float(np.abs(wr).mean()),
        slope=slope_with_ci(ws.astype(np.float64), wr), final_rel=float(rel[-1]),
        held_out_a=(a_held or {}).get("metrics", {}).get(held_key),
        held_out_b=(b_held or {}).get("metrics", {}).get(held_key),
        config_differences=diffs,
    )


def over_the_run(steps: np.ndarray, rel: np.ndarray, edges: np.ndarray) -> list[float | None]:
    """Mean of one pair's relative difference `rel` (at `steps`, aligned_relative_difference) in each step range
    (edges[i], edges[i + 1]]: where along the run a gap opens (None for a range without a logged step)."""
    return [float(rel[m].mean()) if (m := (steps > lo) & (steps <= hi)).any() else None
            for lo, hi in zip(edges[:-1], edges[1:])]


def step_edges(logged_steps: Sequence[np.ndarray], bins: int = 10) -> np.ndarray:
    """`bins` + 1 step boundaries splitting the pairs' logged steps into equal ranges: (0, last]; for a sparsely
    logged key (val_loss every N steps) at most one range per logged step."""
    logged = np.unique(np.concatenate(list(logged_steps)))
    if len(logged) <= bins:
        return np.concatenate([[0], logged]).astype(np.int64)
    return np.unique(np.round(np.linspace(0, logged[-1], bins + 1)).astype(np.int64))


def spread(values: Sequence[float]) -> dict[str, float]:
    """mean, std (ddof 1), min, max, n and the mean's 95 % t-interval (ci_low, ci_high; NaN for n < 2)."""
    from scipy import stats

    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], dtype=np.float64)
    if len(v) == 0:
        return {"mean": math.nan, "std": math.nan, "min": math.nan, "max": math.nan, "n": 0,
                "ci_low": math.nan, "ci_high": math.nan}
    std = float(v.std(ddof=1)) if len(v) > 1 else 0.0
    half = float(stats.t.ppf(0.975, len(v) - 1)) * std / math.sqrt(len(v)) if len(v) > 1 else math.nan
    return {"mean": float(v.mean()), "std": std, "min": float(v.min()), "max": float(v.max()), "n": len(v),
            "ci_low": float(v.mean()) - half, "ci_high": float(v.mean()) + half}


@dataclass
class Comparison:
    pairs: list[PairSummary]
    noise: list[PairSummary]
    mean_rel: dict[str, float]  # spread over pairs of mean_rel
    mean_abs_rel: dict[str, float]
    noise_floor: float | None  # mean over noise pairs of mean_abs_rel
    noise_rel: dict[str, float] | None  # spread over noise pairs of mean_rel
    within_noise: bool | None  # |mean over pairs of mean_rel| <= noise_floor
    within_target: bool  # |mean over pairs of mean_rel| <= 0.1 %
    upward_trend: list[str]  # candidates whose slope CI lies above 0 (windows of MIN_SLOPE_STEPS or more)
    edges: list[int] = field(default_factory=list)  # step ranges (edges[i], edges[i + 1]] of the tables below
    over_the_run: dict[str, list[float | None]] = field(default_factory=dict)  # "A vs B" → mean rel. diff per range


def summarize(pairs: list[PairSummary], noise: list[PairSummary]) -> Comparison:
    mean_rel = spread([p.mean_rel for p in pairs])
    floor = spread([p.mean_abs_rel for p in noise])["mean"] if noise else None
    level = abs(mean_rel["mean"])
    return Comparison(pairs, noise, mean_rel, spread([p.mean_abs_rel for p in pairs]), floor,
                      spread([p.mean_rel for p in noise]) if noise else None,
                      None if floor is None else bool(level <= floor), bool(level <= TARGET_REL_DIFF),
                      [p.candidate for p in pairs if p.window_steps >= MIN_SLOPE_STEPS and p.slope.ci_low > 0])


# ------------------------------------------------------------------------------------------------ plots
def smoothing_width(n: int) -> int:
    """Points in the moving average of an n-point curve: an odd number near n / 20 (11 for 200 steps, 51 for
    1,000), 1 (no smoothing) below 30 points."""
    return 1 if n < 30 else (n // 20) | 1


def smooth(y: np.ndarray, width: int) -> np.ndarray:
    """Centered moving average over `width` points (fewer at the ends)."""
    if width <= 1 or len(y) < 3:
        return y.copy()
    kernel = np.ones(width)
    return np.convolve(y, kernel, mode="same") / np.convolve(np.ones_like(y), kernel, mode="same")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label(ax, ylabel: str, title: str, legend_size: int = 8) -> None:
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend_size)


def _save(plt, fig, out: Path) -> Path:
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_losses(pairs: list[tuple[Run, Run]], noise: list[tuple[Run, Run]], key: str, out: Path) -> Path:
    plt = _plt()
    return _save(plt, loss_figure(plt, pairs, noise, key), out)


def loss_figure(plt, pairs: list[tuple[Run, Run]], noise: list[tuple[Run, Run]], key: str):
    """Each run's per-step `key` (faint) and its centered moving average over smoothing_width points."""
    fig, ax = plt.subplots(figsize=(9, 5))
    seen: set[Path] = set()
    widths = set()
    for i, (a, b) in enumerate(pairs + noise):
        for run, style in ((a, "-"), (b, "--")):
            if run.path in seen:
                continue
            seen.add(run.path)
            s, v = run.series(key)
            color = "0.5" if i >= len(pairs) else f"C{i % 10}"
            width = smoothing_width(len(v))
            widths.add(width)
            if width > 1:
                ax.plot(s, v, style, color=color, lw=0.5, alpha=0.25)
            ax.plot(s, smooth(v, width), style, color=color, lw=1.4, label=f"{run.name} ({run.precision or '?'})")
    shown = sorted(widths)
    if shown == [1]:
        ylabel = f"{key} (per step)"
    else:
        ylabel = f"{key} (moving average over {'/'.join(map(str, shown))} steps; faint: per step)"
    _label(ax, ylabel, f"training {key}")
    return fig


def plot_relative_difference(pairs: list[tuple[Run, Run]], noise: list[tuple[Run, Run]],
                             diffs: list[tuple[np.ndarray, np.ndarray]], summaries: list[PairSummary], key: str,
                             out: Path) -> Path:
    """`diffs`: each pair's (steps, relative difference), pairs then noise pairs (`aligned_relative_difference`)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 5))
    for i, ((a, b), (steps, rel)) in enumerate(zip(pairs + noise, diffs, strict=True)):
        is_noise = i >= len(pairs)
        color = "0.45" if is_noise else f"C{i % 10}"
        ax.plot(steps, 100 * rel, color=color, alpha=0.18, lw=0.6)
        ax.plot(steps, 100 * smooth(rel, max(3, len(rel) // 25)), color=color, lw=1.8,
                ls="--" if is_noise else "-", label=f"{a.name} vs {b.name}" + (" (noise floor)" if is_noise else ""))
    if summaries:
        lo = min(s.window[0] for s in summaries)
        ax.axvspan(lo, max(s.window[1] for s in summaries), color="0.9", zorder=0, label="summary window")
    ax.axhline(0, color="k", lw=0.8)
    for y in (100 * TARGET_REL_DIFF, -100 * TARGET_REL_DIFF):
        ax.axhline(y, color="r", lw=0.6, ls=":")
    _label(ax, f"relative {key} difference (%)", "(A − B) / B per step (faint) and its moving average; dotted: ±0.1 %")
    return _save(plt, fig, out)


def health_series(run: Run, kind: str, stat: str) -> tuple[np.ndarray, np.ndarray] | None:
    """FP8 `stat` of tensor `kind` averaged over layers: `fp8/mean/<kind>_<stat>`, else the mean of the
    per-layer keys `fp8/<layer>/<kind>_<stat>`."""
    suffix = f"/{kind}_{stat}"
    mean_key = f"fp8/mean{suffix}"
    if mean_key in run.metrics:
        return run.series(mean_key)
    layer_keys = [k for k in run.metrics if k.startswith("fp8/") and k.endswith(suffix)]
    if not layer_keys:
        return None
    stacked = np.stack([run.metrics[k] for k in layer_keys])
    ok = np.isfinite(stacked).any(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return run.steps[ok], np.nanmean(stacked[:, ok], axis=0)


def plot_fp8_health(runs: list[Run], out: Path) -> Path | None:
    """Underflow and distortion over time per tensor kind (act, grad, gradT, weight), one line per FP8 run."""
    plt = _plt()
    fig = fp8_health_figure(plt, runs)
    return None if fig is None else _save(plt, fig, out)


def fp8_health_figure(plt, runs: list[Run]):
    """The health plot (None without health statistics): a marker on every sampled step (fp8.health_every apart),
    the lines between them only joining the samples."""
    found = [(r, k, s, health_series(r, k, s)) for r in runs for k in HEALTH_KINDS for s in HEALTH_STATS]
    found = [f for f in found if f[3] is not None]
    if not found:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = ["-", "--", ":", "-."]
    run_names = list(dict.fromkeys(r.name for r, *_ in found))
    for run, kind, stat, (s, v) in found:
        ax = axes[HEALTH_STATS.index(stat)]
        ax.plot(s, 100 * v, color=f"C{HEALTH_KINDS.index(kind)}", ls=styles[run_names.index(run.name) % 4],
                lw=1.0, marker="o", ms=3.5, label=f"{kind}" + (f" ({run.name})" if len(run_names) > 1 else ""))
    samples = max(len(s) for *_, (s, _) in found)
    for ax, stat in zip(axes, HEALTH_STATS):
        _label(ax, f"{stat} (%)", f"FP8 {stat}, mean over layers ({samples} sampled steps)", legend_size=7)
    return fig


# ------------------------------------------------------------------------------------------------ report
def _pct(x: float | None, digits: int = 3) -> str:
    return "–" if x is None or not math.isfinite(x) else f"{100 * x:+.{digits}f} %"


def _loss(x: float | None) -> str:
    return "–" if x is None else f"{x:.4f}"


def round_to_interval(value: float, low: float, high: float) -> tuple[str, str, str]:
    """value and its interval [low, high], signed, to two significant digits of the interval's half-width (the
    digits beyond are noise): (+49.487, -88.128, +187.102) → ("+50", "-90", "+190")."""
    half = (high - low) / 2
    if not (math.isfinite(half) and half > 0):
        return tuple(f"{x:+.4g}" for x in (value, low, high))  # an exact fit: every digit holds
    place = math.floor(math.log10(half)) - 1  # the decimal place of the half-width's second digit
    decimals = max(0, -place)
    return tuple(f"{round(x, -place):+.{decimals}f}" for x in (value, low, high))


def slope_text(p: PairSummary) -> str:
    """The slope in %/1k steps with its 95 % interval, or why there is none."""
    if p.window_steps < MIN_SLOPE_STEPS or not math.isfinite(p.slope.per_step):
        return f"window too short ({p.window_steps} steps; a slope needs {MIN_SLOPE_STEPS})"
    k = 1000 * 100
    value, low, high = round_to_interval(p.slope.per_step * k, p.slope.ci_low * k, p.slope.ci_high * k)
    return f"{value} [{low}, {high}]"


def _row(p: PairSummary) -> str:
    slope = slope_text(p)
    return (f"| {p.candidate} vs {p.baseline} | {p.steps} | {p.window[0]}–{p.window[1]} | {_pct(p.mean_rel)} | "
            f"{_pct(p.mean_abs_rel).lstrip('+')} | {slope} | {_pct(p.final_rel)} | "
            f"{_loss(p.held_out_a)} / {_loss(p.held_out_b)} ({_pct(p.held_out_rel)}) |")


def _mean_row(label: str, m: dict[str, float], a: dict[str, float]) -> str:
    ci = f"; 95 % CI [{_pct(m['ci_low'])}, {_pct(m['ci_high'])}]" if math.isfinite(m["ci_low"]) else ""
    return (f"| {label} (± std; min … max{'; t-interval of the mean' if ci else ''}) | | | {_pct(m['mean'])} ± "
            f"{_pct(m['std']).lstrip('+')} ({_pct(m['min'])} … {_pct(m['max'])}{ci}) | "
            f"{_pct(a['mean']).lstrip('+')} ± {_pct(a['std']).lstrip('+')} | | | |")


def render_report(comp: Comparison, plots: dict[str, Path | None], command: str, window: float) -> str:
    key = comp.pairs[0].key
    lines = [f"# FP8 vs BF16 comparison ({key})", "",
             f"Written by `{command}` on {time.strftime('%Y-%m-%d %H:%M')}. Relative difference (A − B) / B of "
             f"the training `{key}` per step, on the steps both runs logged; summary over the last "
             f"{100 * window:.0f} % of them. The slope's 95 % interval is OLS, widened for the residuals' lag-1 "
             "autocorrelation.", "", "## Summary", "",
             "| A vs B | steps | window | mean rel. diff | mean abs. rel. diff | slope (%/1k steps) [95 % CI] "
             "| final rel. diff | held-out loss A / B (rel.) |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [_row(p) for p in comp.pairs]
    if len(comp.pairs) > 1:
        m, a = comp.mean_rel, comp.mean_abs_rel
        lines.append(_mean_row(f"**mean over {m['n']} pairs**", m, a))
    lines += [_row(p).replace("| ", "| noise: ", 1) for p in comp.noise]
    if len(comp.noise) > 1:
        lines.append(_mean_row(f"**noise: mean over {len(comp.noise)} pairs**", comp.noise_rel,
                               spread([p.mean_abs_rel for p in comp.noise])))
    lines += ["", "**Verdict.** " + verdict(comp), ""]
    for q in comp.pairs + comp.noise:
        if n := sum(not ok for *_, ok in q.config_differences):
            lines += [f"⚠ **{q.candidate} vs {q.baseline}: {n} unexpected config difference{'s' if n > 1 else ''}** "
                      "(listed first under [Config differences](#config-differences)).", ""]
    if comp.edges:
        lines += ["## Over the run", "", f"Mean relative `{key}` difference in each range of steps (ending at the "
                  "step in the header): where along the run the gap opens.", "",
                  "| A vs B | " + " | ".join(f"≤ {e}" for e in comp.edges[1:]) + " |",
                  "|---|" + "---|" * (len(comp.edges) - 1)]
        lines += [f"| {name} | " + " | ".join("–" if v is None else _pct(v, 2) for v in row) + " |"
                  for name, row in comp.over_the_run.items()]
        lines.append("")
    lines += ["## Plots", ""]
    for title, name in (("Loss curves", "loss"), ("Relative difference", "rel_diff"), ("FP8 health", "fp8_health")):
        if plots.get(name) is not None:
            lines += [f"### {title}", "", f"![{title}]({plots[name].name})", ""]
    if plots.get("fp8_health") is None:
        lines += ["No FP8 health statistics in the candidate runs' logs (fp8.health_every=0?).", ""]
    lines += ["## Config differences", ""]
    for p in comp.pairs + comp.noise:
        lines += config_difference_lines(p)
    return "\n".join(lines) + "\n"


def config_difference_lines(p: PairSummary) -> list[str]:
    """A pair's config differences for the report: the unexpected ones first, as a table of their own; the
    expected ones (EXPECTED_DIFFERENCES: what makes the twin, the seed, bookkeeping) after them, folded."""
    head = f"**{p.candidate} vs {p.baseline}**"
    if not p.config_differences:
        return [f"{head}: identical configs", ""]
    unexpected = [d for d in p.config_differences if not d[3]]
    expected = [d for d in p.config_differences if d[3]]

    def table(rows: list[tuple[str, Any, Any, bool]], mark: str) -> list[str]:
        return ["| key | A | B | |", "|---|---|---|---|"] + [f"| `{k}` | `{va}` | `{vb}` | {mark} |"
                                                             for k, va, vb, _ in rows]

    lines = [head, ""]
    if unexpected:
        lines += [f"⚠ {len(unexpected)} unexpected difference{'s' if len(unexpected) > 1 else ''} (beyond "
                  "precision, optimizer, seed and bookkeeping):", "", *table(unexpected, "⚠ unexpected"), ""]
    if expected:
        lines += [f"<details><summary>{len(expected)} expected difference{'s' if len(expected) > 1 else ''} "
                  "(precision, optimizer, seed, bookkeeping)</summary>", "", *table(expected, ""), "", "</details>",
                  ""]
    return lines


def verdict(comp: Comparison) -> str:
    level = comp.mean_rel["mean"]
    parts = [f"mean relative {comp.pairs[0].key} difference over the window: {_pct(level)}"
             + (f" (mean of {comp.mean_rel['n']} pairs)" if comp.mean_rel["n"] > 1 else "")]
    parts.append(f"{'within' if comp.within_target else 'NOT within'} the 0.1 % target")
    m = comp.mean_rel
    if math.isfinite(m["ci_low"]):
        contains = m["ci_low"] <= 0 <= m["ci_high"]
        parts.append(f"95 % interval of the mean [{_pct(m['ci_low'])}, {_pct(m['ci_high'])}] "
                     f"{'contains' if contains else 'excludes'} 0")
    if comp.noise_rel is not None and comp.noise_rel["n"] > 1 and m["n"] > 1:
        wider = m["std"] > comp.noise_rel["std"]
        parts.append(f"spread across pairs (std) {_pct(m['std']).lstrip('+')} "
                     f"{'wider than' if wider else 'no wider than'} the noise pairs' "
                     f"{_pct(comp.noise_rel['std']).lstrip('+')}")
    noise = comp.noise_rel
    if noise is not None and math.isfinite(noise["ci_low"]) and not noise["ci_low"] <= 0 <= noise["ci_high"]:
        # kernel nondeterminism moves a run either way: noise pairs whose mean is off 0 differ in something else
        parts.append(f"the noise pairs' mean {_pct(noise['mean'])} is not 0 (95 % interval [{_pct(noise['ci_low'])}, "
                     f"{_pct(noise['ci_high'])}]): their runs differ from their twins systematically, not only by "
                     "kernel nondeterminism")
    if comp.noise_floor is None:
        parts.append("no noise-floor pair given (--noise), so the noise floor is unknown")
    else:
        parts.append(f"{'within' if comp.within_noise else 'NOT within'} the BF16-vs-BF16 noise floor "
                     f"(mean abs. rel. diff {_pct(comp.noise_floor).lstrip('+')})")
    if comp.upward_trend:
        parts.append("upward trend (slope CI above 0) in: " + ", ".join(comp.upward_trend))
    elif any(p.window_steps < MIN_SLOPE_STEPS or not math.isfinite(p.slope.per_step) for p in comp.pairs):
        parts.append(f"no trend stated: a summary window is too short for a slope (fewer than {MIN_SLOPE_STEPS} "
                     "logged steps; --window widens it)")
    else:
        parts.append("no upward trend (every slope CI reaches 0 or below)")
    return "; ".join(parts) + "."


def compare(pairs: list[tuple[str | Path, str | Path]], noise: list[tuple[str | Path, str | Path]] = (),
            out_dir: str | Path = "runs/compare", *, key: str = "loss", window: float = 0.2,
            first_steps: int | None = None, command: str = "ling.analysis.compare.compare(...)") -> Comparison:
    """Summarize, plot and report; writes loss_curves.png, rel_diff.png, fp8_health.png (when the logs hold
    FP8 health), report.md and summary.json into `out_dir`. `first_steps`: every pair on only the first that
    many steps both runs logged (the window is a fraction of those)."""
    if not pairs:
        raise ValueError("compare: no pair of runs given")
    runs: dict[str, Run] = {}

    def run(p: str | Path) -> Run:
        k = str(Path(p).resolve())
        if k not in runs:
            runs[k] = load_run(p)
        return runs[k]

    run_pairs = [(run(a), run(b)) for a, b in pairs]
    noise_pairs = [(run(a), run(b)) for a, b in noise]
    summaries = [summarize_pair(a, b, key=key, window=window, first_steps=first_steps) for a, b in run_pairs]
    noise_summaries = [summarize_pair(a, b, key=key, window=window, first_steps=first_steps)
                       for a, b in noise_pairs]
    comp = summarize(summaries, noise_summaries)
    diffs = [aligned_relative_difference(a, b, key, first_steps) for a, b in run_pairs + noise_pairs]
    edges = step_edges([steps for steps, _ in diffs])
    comp.edges = [int(e) for e in edges]
    comp.over_the_run = {
        f"{'noise: ' if i >= len(run_pairs) else ''}{a.name} vs {b.name}": over_the_run(*diff, edges)
        for i, ((a, b), diff) in enumerate(zip(run_pairs + noise_pairs, diffs))}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots = {"loss": plot_losses(run_pairs, noise_pairs, key, out / "loss_curves.png"),
             "rel_diff": plot_relative_difference(run_pairs, noise_pairs, diffs, summaries, key, out / "rel_diff.png"),
             "fp8_health": plot_fp8_health([a for a, _ in run_pairs], out / "fp8_health.png")}
    _write(out / "report.md", render_report(comp, plots, command, window))
    _write(out / "summary.json", json.dumps(asdict(comp), indent=2, default=str) + "\n")
    return comp


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _expand_pairs(specs: Sequence[str]) -> list[tuple[str, str]]:
    """'A:B' → (A, B); either side may be a glob: both sides are expanded, sorted and zipped."""
    out = []
    for spec in specs:
        if spec.count(":") != 1:
            raise SystemExit(f"pair {spec!r}: expected RUN_A:RUN_B")
        a, b = spec.split(":")
        ga, gb = (sorted(glob.glob(a)) or [a]), (sorted(glob.glob(b)) or [b])
        if len(ga) != len(gb):
            raise SystemExit(f"pair {spec!r}: the globs match {len(ga)} and {len(gb)} runs; they must match "
                             "as many")
        out += list(zip(ga, gb))
    return out


TIMING_KEYS = re.compile(r"time|per_s|tflops|mfu|mem")  # metrics that differ between identical runs


def identical_runs(a: Run, b: Run) -> list[str]:
    """The differences between two runs that should be bit-identical (a deterministic rerun): every logged
    metric except timing and memory, step by step, compared exactly, and the held-out loss. [] = identical."""
    problems = []
    if not np.array_equal(a.steps, b.steps):
        problems.append(f"logged steps differ: {len(a.steps)} vs {len(b.steps)}")
        return problems
    for key in sorted(set(a.metrics) | set(b.metrics)):
        if TIMING_KEYS.search(key):
            continue
        va, vb = a.metrics.get(key), b.metrics.get(key)
        if va is None or vb is None:
            problems.append(f"{key}: logged by only one run")
            continue
        differ = ~((va == vb) | (np.isnan(va) & np.isnan(vb)))
        if differ.any():
            first = int(np.argmax(differ))
            problems.append(f"{key}: {int(differ.sum())} of {len(va)} steps differ, first at step "
                            f"{int(a.steps[first])}: {va[first]!r} vs {vb[first]!r}")
    ha = (a.held_out or {}).get("metrics", {}).get("loss")
    hb = (b.held_out or {}).get("metrics", {}).get("loss")
    if ha != hb:
        problems.append(f"held-out loss: {ha!r} vs {hb!r}")
    return problems


def check_identical(path_a: str, path_b: str) -> int:
    """CLI of `eval.py compare --identical A B`: prints the verdict; 0 if bit-identical, 1 if not."""
    a, b = load_run(path_a), load_run(path_b)
    problems = identical_runs(a, b)
    if problems:
        print(f"NOT bit-identical: {path_a} vs {path_b}")
        for line in problems:
            print(f"  {line}")
        return 1
    print(f"bit-identical: {path_a} vs {path_b} ({len(a.steps)} logged steps, every non-timing metric and the "
          f"held-out loss equal)")
    return 0


def main(argv: list[str] | None = None) -> Comparison:
    parser = argparse.ArgumentParser(prog="python eval.py compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="*", help="RUN_A RUN_B: the candidate (FP8) and the baseline (BF16) run dir")
    parser.add_argument("--pairs", nargs="+", default=[], help="A:B pairs (e.g. one per seed); globs allowed")
    parser.add_argument("--noise", nargs="+", default=[], help="BF16-vs-BF16 pairs A:B: the noise floor")
    parser.add_argument("--out", default=None, help="output folder (default runs/compare/<A>_vs_<B>)")
    parser.add_argument("--key", default="loss", help="metric to compare (default loss)")
    parser.add_argument("--window", type=float, default=0.2, help="fraction of the last steps summarized")
    parser.add_argument("--steps", type=int, default=None,
                        help="compare each pair on only the first N steps both runs logged (branches cut short)")
    parser.add_argument("--identical", action="store_true",
                        help="RUN_A RUN_B must be bit-identical (a deterministic rerun); exit 1 naming what differs")
    args = parser.parse_args(argv)
    if args.identical:
        if len(args.runs) != 2:
            parser.error("--identical takes exactly two runs: RUN_A RUN_B")
        raise SystemExit(check_identical(*args.runs))
    if args.runs and len(args.runs) != 2:
        parser.error("give exactly two runs (RUN_A RUN_B), or --pairs")
    pairs = ([tuple(args.runs)] if args.runs else []) + _expand_pairs(args.pairs)
    if not pairs:
        parser.error("nothing to compare: give RUN_A RUN_B or --pairs A:B ...")
    out = args.out or f"runs/compare/{Path(pairs[0][0]).name}_vs_{Path(pairs[0][1]).name}"
    command = "python eval.py compare " + " ".join(argv if argv is not None else [])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        comp = compare(pairs, _expand_pairs(args.noise), out, key=args.key, window=args.window,
                       first_steps=args.steps, command=command)
    for w in caught:
        print(f"WARNING: {w.message}")
    print(Path(out, "report.md").read_text().split("## Plots")[0].rstrip())
    print(f"\nreport: {Path(out) / 'report.md'}")
    return comp
