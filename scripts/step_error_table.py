"""FP8's error on one step across the parity runs: one row per run whose final checkpoint `eval.py mode=step_error`
evaluated (scripts/parity.sh with STEP_ERROR=1 writes `<run>/eval/step_error.json`), then the mean over those runs
with a 95 % t-interval, and the ablation entries' effects averaged the same way.

    python scripts/step_error_table.py runs/parity          # reads */eval/step_error.json, prints Markdown
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ling.analysis.compare import spread  # noqa: E402

RECORD = Path("eval") / "step_error.json"


def _pct(x: float) -> str:
    return f"{100 * x:+.4f} %"


def _interval(s: dict, fmt=_pct) -> str:
    return f"{fmt(s['mean'])} [{fmt(s['ci_low'])}, {fmt(s['ci_high'])}]" if s["n"] > 1 else f"{fmt(s['mean'])} (n=1)"


def table(root: Path) -> str:
    records = {p.parent.parent.name: json.loads(p.read_text()) for p in sorted(Path(root).glob(f"*/{RECORD}"))}
    if not records:
        raise SystemExit(f"no {RECORD} under {root}/*/ (run scripts/parity.sh with STEP_ERROR=1)")
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


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    print(table(Path(sys.argv[1])))
