"""FP8's error on one step across the parity runs (ling.analysis.tables.step_error_table): one row per run whose
final checkpoint `eval.py mode=step_error` evaluated (scripts/parity.sh with STEP_ERROR=1 writes
`<run>/eval/step_error.json`), then the mean over those runs with a 95 % t-interval, and the ablation entries'
effects averaged the same way.

    python scripts/step_error_table.py runs/parity          # reads */eval/step_error.json, prints Markdown
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ling.analysis.tables import step_error_table  # noqa: E402

if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    print(step_error_table(Path(sys.argv[1])))
