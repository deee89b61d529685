#!/usr/bin/env bash
# The FP8-vs-BF16 parity experiment (one GPU by default). For each seed: a BF16 run (+exp=parity_bf16), its FP8
# twin (+exp=parity_fp8, identical seed, data order and schedule), and for the seeds in NOISE_SEEDS a second BF16
# run of the same seed (GPU kernel nondeterminism alone: the noise floor). Each run's final checkpoint is then
# evaluated on the held-out split (eval.py), and `eval.py compare` writes the report to $OUT/report/report.md.
#
#   bash scripts/parity.sh                                   # 3 seeds x 1,000 steps, noise pair on seed 1
#   SEEDS="1 2" STEPS=1000 NOISE_SEEDS=1 bash scripts/parity.sh   # a budgeted version
#   LAUNCH="torchrun --nproc_per_node 8" bash scripts/parity.sh train.micro_batch_size=1   # several GPUs
#
# Extra arguments are Hydra overrides given to every training run. Rerunning resumes or skips finished runs
# (each run dir resumes from its latest checkpoint; a finished one trains no further step).
set -euo pipefail
cd "$(dirname "$0")/.."
SEEDS=${SEEDS:-"1 2 3"}
STEPS=${STEPS:-1000}
NOISE_SEEDS=${NOISE_SEEDS-"1"}
OUT=${OUT:-runs/parity}
PY=${PYTHON:-python}
LAUNCH=${LAUNCH:-$PY}
EVAL_BATCHES=${EVAL_BATCHES:-null}   # null = the whole held-out split once

run() {  # run NAME EXP SEED: train, then evaluate the final checkpoint
  local name=$1 exp=$2 seed=$3
  shift 3
  echo "=== $name: +exp=$exp train.seed=$seed train.steps=$STEPS"
  $LAUNCH train.py "+exp=$exp" "train.seed=$seed" "train.steps=$STEPS" "run_name=parity-$name" \
    "hydra.run.dir=$OUT/$name" "$@"
  $PY eval.py "checkpoint=$OUT/$name" "batches=$EVAL_BATCHES" progress_bar=false
}

pairs=()
noise=()
for seed in $SEEDS; do
  run "s${seed}_bf16" parity_bf16 "$seed" "$@"
  run "s${seed}_fp8" parity_fp8 "$seed" "$@"
  pairs+=("$OUT/s${seed}_fp8:$OUT/s${seed}_bf16")
done
for seed in $NOISE_SEEDS; do
  run "s${seed}_bf16_rerun" parity_bf16 "$seed" "$@"
  noise+=("$OUT/s${seed}_bf16_rerun:$OUT/s${seed}_bf16")
done
$PY eval.py compare --pairs "${pairs[@]}" ${noise[@]+--noise "${noise[@]}"} --out "$OUT/report"
