"""The FP8 ablation table from scripts/parity.sh's reports (ling.analysis.tables.ablation_table): one row per
variant (the full FP8 run, then each component kept in high precision), its relative loss difference against BF16
over the seeds with a 95 % t-interval of the mean, and the change against its baseline: the full FP8 run, or for
FP8Linear components the `emulated` run when it ran (scripts/ablate.sh runs it by default).

    python scripts/ablation_table.py runs/ablation          # reads report/ and report_no-*/summary.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ling.analysis.tables import ablation_table  # noqa: E402

if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    print(ablation_table(Path(sys.argv[1])), end="")
