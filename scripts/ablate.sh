#!/usr/bin/env bash
# FP8 ablation on the parity experiment: which FP8 component moves the loss away from BF16. scripts/parity.sh with
# one FP8 run per component kept in high precision (fp8.ablate=[X]) beside the BF16 and full FP8 runs of each seed,
# all in deterministic mode; reports per component in $OUT/report_no-<X>/ and the table in $OUT/ablation.md. The
# `emulated` run (FP8Linears on the ablation path's fp32 GEMMs, nothing in high precision) is the FP8Linear
# components' baseline.
# (wgrad_bf16 is left out: with bf16 weights it is bit-identical to the recipe, tests/fp8/test_fp8_ablation.py.)
#
#   bash scripts/ablate.sh                                        # 3 seeds x (bf16, fp8, 11 variants), 1,000 steps
#   ABLATIONS="fwd_x adam_v" SEEDS="1 2" STEPS=600 bash scripts/ablate.sh
#
# Environment and extra arguments as scripts/parity.sh (OUT defaults to runs/ablation).
set -euo pipefail
export ABLATIONS=${ABLATIONS:-"emulated fwd_x fwd_w dgrad_dy dgrad_w wgrad_dy wgrad_x experts adam_m adam_v optim.rounding=nearest"}
export OUT=${OUT:-runs/ablation}
exec bash "$(dirname "$0")/parity.sh" "$@"
