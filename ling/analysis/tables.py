"""Markdown tables over scripts/parity.sh's outputs (printed by scripts/ablation_table.py and
scripts/step_error_table.py).

- `ablation_table`: one row per variant (the full FP8 run, then each component kept in high precision), its
  relative loss difference against BF16 over the seeds with a 95 % t-interval of the mean, and the change against
  its baseline: the full FP8 run, or for FP8Linear components the `emulated` run when it ran (scripts/ablate.sh
  runs it by default). Reads `report/` and `report_no-*/summary.json` of compare mode.
- `step_error_table`: FP8's error on one step across the parity runs: one row per run whose final checkpoint
  `eval.py mode=step_error` evaluated (`<run>/eval/step_error.json`), then the mean over those runs with a 95 %
  t-interval, and the ablation entries' effects averaged the same way.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from scipy import stats

from fp8.linear import ABLATION_COMPONENTS, EMULATED
from ling.analysis.compare import spread

# FP8Linear components: a run that keeps one in high precision takes the ablation path's fp32 GEMMs, so its
# baseline is the `emulated` run (same path, nothing in high precision) when there is one
LINEAR_COMPONENTS = set(ABLATION_COMPONENTS) - {EMULATED}
STEP_ERROR_RECORD = Path("eval") / "step_error.json"


# ------------------------------------------------------------------------------------------------ ablation
def baseline_of(name: str, names: set[str]) -> str | None:
    """The variant a variant's Δ is measured against: "no-emulated" for FP8Linear components (if it ran), else fp8."""
    if name == "fp8":
        return None
    parts = set(name.removeprefix("no-").split("+"))
    emulated = f"no-{EMULATED}"
    return emulated if parts & LINEAR_COMPONENTS and emulated in names else "fp8"


def ablation_row(name: str, summary: dict, base: str | None, base_mean: float | None) -> str:
    m = summary["mean_rel"]
    n, mean, std = m["n"], m["mean"], m["std"]
    half = stats.t.ppf(0.975, n - 1) * std / math.sqrt(n) if n > 1 else math.nan
    ci = f"[{100 * (mean - half):+.3f}, {100 * (mean + half):+.3f}] %" if n > 1 else "n/a (1 seed)"
    delta = f"{100 * (mean - base_mean):+.3f} % (vs {base})" if base is not None and base_mean is not None else "—"
    up = sum(1 for p in summary["pairs"] if p["slope"]["ci_low"] > 0)
    floor = summary.get("noise_floor")
    floor_s = f"{100 * floor:.3f} %" if floor is not None else "—"
    pairs = len(summary["pairs"])
    return f"| {name} | {n} | {100 * mean:+.3f} % ± {100 * std:.3f} | {ci} | {delta} | {up} of {pairs} | {floor_s} |"


def ablation_table(out: Path) -> str:
    """The ablation table of the reports under `out` (SystemExit naming the folder when there is none)."""
    reports = [("fp8", out / "report")] + [(p.name.removeprefix("report_"), p)
                                            for p in sorted(out.glob("report_no-*"))]
    found = [(name, json.loads((p / "summary.json").read_text())) for name, p in reports
             if (p / "summary.json").exists()]
    if not found:
        raise SystemExit(f"no report*/summary.json under {out}: run scripts/parity.sh (or ablate.sh) first")
    means = {name: summary["mean_rel"]["mean"] for name, summary in found}
    lines = [f"# FP8 ablation ({out})", "",
             "Relative loss difference (candidate − BF16) / BF16, mean over the last 20 % of steps, per seed; "
             "mean ± std over seeds, 95 % t-interval of the mean; Δ: how much keeping the component in high "
             "precision moves the difference, against the full FP8 run or, for FP8Linear components, the emulated "
             "run (same fp32 GEMM path, nothing in high precision) when it ran; upward: pairs whose slope CI lies "
             "above 0; noise floor: mean |difference| of the non-deterministic BF16 reruns.", "",
             "| variant | seeds | mean rel. diff | 95 % CI | Δ | upward | noise floor |",
             "|---|---|---|---|---|---|---|"]
    for name, summary in found:
        base = baseline_of(name, set(means))
        lines.append(ablation_row(name, summary, base, means.get(base)))
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ step error
def _pct(x: float) -> str:
    return f"{100 * x:+.4f} %"


def _interval(s: dict, fmt=_pct) -> str:
    return f"{fmt(s['mean'])} [{fmt(s['ci_low'])}, {fmt(s['ci_high'])}]" if s["n"] > 1 else f"{fmt(s['mean'])} (n=1)"


def step_error_table(root: Path) -> str:
    """The step-error table of the runs under `root` (SystemExit naming the folder when none has a record)."""
    records = {p.parent.parent.name: json.loads(p.read_text())
               for p in sorted(Path(root).glob(f"*/{STEP_ERROR_RECORD}"))}
    if not records:
        raise SystemExit(f"no {STEP_ERROR_RECORD} under {root}/*/ (run scripts/parity.sh with STEP_ERROR=1)")
    lines = ["| run | step | batches | loss, FP8 vs fp32 [95 % over batches] | loss, bf16 vs fp32 | loss, FP8 vs bf16 "
             "| gradient rel. error, bf16 / FP8 | assignments changed, bf16 / FP8 |", "|---" * 8 + "|"]
    for run, r in records.items():
        rel, err, moved = r["loss_rel"], r["grad_rel_err"], r["routing_changed"]
        flips = "–" if moved.get("fp8") is None else f"{100 * moved['bf16']:.2f} % / {100 * moved['fp8']:.2f} %"
        lines.append(f"| {run} | {r['step']} | {r['batches']} | {_interval(rel['fp8'])} | {_pct(rel['bf16']['mean'])} "
                     f"| {_pct(rel['fp8_vs_bf16']['mean'])} | {err['bf16']['all']:.3e} / {err['fp8']['all']:.3e} "
                     f"| {flips} |")
    means = {key: spread([r["loss_rel"][key]["mean"] for r in records.values()])
             for key in ("fp8", "bf16", "fp8_vs_bf16")}
    ratio = spread([r["grad_rel_err"]["fp8"]["all"] / r["grad_rel_err"]["bf16"]["all"] for r in records.values()])
    lines += ["", f"Over {len(records)} runs (mean of each run's mean, 95 % t-interval over runs): loss FP8 vs fp32 "
              f"{_interval(means['fp8'])}, bf16 vs fp32 {_interval(means['bf16'])}, FP8 vs bf16 "
              f"{_interval(means['fp8_vs_bf16'])}; FP8's gradient error / bf16's "
              f"{_interval(ratio, lambda x: f'{x:.2f}×')}."]
    effects: dict[str, list[dict]] = {}
    for r in records.values():
        for copy, e in (r.get("ablation_effect") or {}).items():
            effects.setdefault(copy, []).append(e)
    if effects:
        lines += ["", "| in high precision | baseline | runs | Δ gradient rel. error | Δ loss (rel. to fp32) |",
                  "|---|---|---|---|---|"]
        for copy, es in effects.items():
            d_err = spread([e["grad_rel_err"]["mean"] for e in es])
            d_loss = spread([e["loss_rel"]["mean"] for e in es])
            lines.append(f"| {copy.removeprefix('fp8-no-')} | {es[0]['baseline']} | {len(es)} | "
                         f"{_interval(d_err, lambda x: f'{x:+.2e}')} | {_interval(d_loss)} |")
    return "\n".join(lines)
