"""The FP8 ablation table from scripts/parity.sh's reports: one row per variant (the full FP8 run, then each
component kept in high precision), its relative loss difference against BF16 over the seeds with a 95 %
t-interval of the mean, and the change against its baseline: the full FP8 run, or for FP8Linear components the
`emulated` run when it ran (scripts/ablate.sh runs it by default).

    python scripts/ablation_table.py runs/ablation          # reads report/ and report_no-*/summary.json
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fp8.linear import ABLATION_COMPONENTS, EMULATED  # noqa: E402

# FP8Linear components: a run that keeps one in high precision takes the ablation path's fp32 GEMMs, so its
# baseline is the `emulated` run (same path, nothing in high precision) when there is one
LINEAR_COMPONENTS = set(ABLATION_COMPONENTS) - {EMULATED}


def baseline_of(name: str, names: set[str]) -> str | None:
    """The variant a variant's Δ is measured against: "no-emulated" for FP8Linear components (if it ran), else fp8."""
    if name == "fp8":
        return None
    parts = set(name.removeprefix("no-").split("+"))
    emulated = f"no-{EMULATED}"
    return emulated if parts & LINEAR_COMPONENTS and emulated in names else "fp8"


def row(name: str, summary: dict, base: str | None, base_mean: float | None) -> str:
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


def table(out: Path) -> str:
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
        lines.append(row(name, summary, base, means.get(base)))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    print(table(Path(sys.argv[1])), end="")
