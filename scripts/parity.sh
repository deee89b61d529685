#!/usr/bin/env bash
# The FP8-vs-BF16 parity experiment (one GPU by default). For each seed: a BF16 run (+exp=parity_bf16), its FP8
# twin (+exp=parity_fp8, identical seed, data order and schedule), both in deterministic mode (DETERMINISTIC,
# default true: a difference between the two is FP8's own, not GPU kernel nondeterminism), one FP8 run per entry
# of ABLATIONS (default none) with that component in high precision, and for the seeds in NOISE_SEEDS a second
# BF16 run of the same seed without deterministic mode (the floor of kernel nondeterminism). Each run's final
# checkpoint is evaluated on the held-out split (eval.py); `eval.py compare` writes the report to
# $OUT/report/report.md (the held-out loss's, logged every train.eval_every steps, to $OUT/report_val/), one per
# ablation to $OUT/report_no-<entry>/, and scripts/ablation_table.py the table of all of them to $OUT/ablation.md.
#
#   bash scripts/parity.sh                                   # 3 seeds x 1,000 steps, noise pair on seed 1
#   SEEDS="1 2" STEPS=1000 NOISE_SEEDS=1 bash scripts/parity.sh   # a budgeted version
#   LAUNCH="torchrun --nproc_per_node 8" bash scripts/parity.sh train.micro_batch_size=1   # several GPUs
#   ABLATIONS="fwd_x adam_v fwd_x,fwd_w optim.rounding=nearest" bash scripts/parity.sh    # see scripts/ablate.sh
#   JOBS=6 SEEDS="1 2 3" bash scripts/parity.sh               # 6 runs at a time on one GPU (the parity model
#                                                             # leaves most of an H200 idle; outputs: $OUT/<run>.log)
#
# JOBS (default 1) runs that many trainings concurrently on the same device(s); deterministic runs stay
# bit-identical under concurrency (no kernel depends on timing). DET_RERUN_SEEDS (default none) adds, per seed, a
# second deterministic BF16 run that must equal the first bit for bit: the check is printed and fails the script.
# ARCHIVE=FILE.tgz (default none) packs every run's logs, config, evaluations and the reports (no checkpoints: a
# few MB) so that runs made in separate sessions or machines can be compared together with `eval.py compare`.
#
# STEP_ERROR=1 (default 0) also evaluates each seed's final BF16 and FP8 checkpoints with `eval.py mode=step_error`
# (FP8's error on one step against fp32 on the same weights, and the STEP_ERROR_ABLATE entries' effects; about a
# minute per checkpoint on an H200) into <run>/eval/step_error.json, and scripts/step_error_table.py writes the
# table over them to $OUT/step_error.md.
#
# An ABLATIONS entry is a comma-separated list of fp8.ablate components (README "FP8 ablation") or, when it holds
# '=', one Hydra override. Extra arguments are Hydra overrides given to every training run. Rerunning resumes or
# skips finished runs (each run dir resumes from its latest checkpoint; a finished one trains no further step).
set -euo pipefail
cd "$(dirname "$0")/.."
SEEDS=${SEEDS:-"1 2 3"}
STEPS=${STEPS:-1000}
NOISE_SEEDS=${NOISE_SEEDS-"1"}
DETERMINISTIC=${DETERMINISTIC:-true}
ABLATIONS=${ABLATIONS-""}
OUT=${OUT:-runs/parity}
PY=${PYTHON:-python}
LAUNCH=${LAUNCH:-$PY}
EVAL_BATCHES=${EVAL_BATCHES:-null}   # null = the whole held-out split once
JOBS=${JOBS:-1}
ARCHIVE=${ARCHIVE:-}
DET_RERUN_SEEDS=${DET_RERUN_SEEDS-""}
STEP_ERROR=${STEP_ERROR:-0}
STEP_ERROR_ABLATE=${STEP_ERROR_ABLATE-'[fwd_x,fwd_w,"dgrad_dy,dgrad_w","wgrad_dy,wgrad_x",experts]'}
mkdir -p "$OUT"

train_and_eval() {  # NAME EXP SEED [overrides]: train, then evaluate the final checkpoint
  local name=$1 exp=$2 seed=$3
  shift 3
  $LAUNCH train.py "+exp=$exp" "train.seed=$seed" "train.steps=$STEPS" "run_name=parity-$name" \
    "hydra.run.dir=$OUT/$name" "$@"
  $PY eval.py "checkpoint=$OUT/$name" "batches=$EVAL_BATCHES" progress_bar=false
}

failed=0
run() {  # run NAME EXP SEED [overrides]: in the foreground (JOBS=1) or as one of JOBS background jobs
  echo "=== $1: +exp=$2 train.seed=$3 train.steps=$STEPS ${*:4}"
  if [ "$JOBS" -le 1 ]; then train_and_eval "$@"; return; fi
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n || failed=1; done
  train_and_eval "$@" > "$OUT/$1.log" 2>&1 &
}

source scripts/ablation_entry.sh  # variant ENTRY → the run-name suffix and the override of an ABLATIONS entry

pairs=()
noise=()
for seed in $SEEDS; do
  run "s${seed}_bf16" parity_bf16 "$seed" "train.deterministic=$DETERMINISTIC" "$@"
  run "s${seed}_fp8" parity_fp8 "$seed" "train.deterministic=$DETERMINISTIC" "$@"
  pairs+=("$OUT/s${seed}_fp8:$OUT/s${seed}_bf16")
  for entry in $ABLATIONS; do
    read -r suffix override <<< "$(variant "$entry")"
    run "s${seed}_fp8-no-${suffix}" parity_fp8 "$seed" "train.deterministic=$DETERMINISTIC" "$override" "$@"
  done
done
for seed in $NOISE_SEEDS; do
  run "s${seed}_bf16_rerun" parity_bf16 "$seed" "train.deterministic=false" "$@"
  noise+=("$OUT/s${seed}_bf16_rerun:$OUT/s${seed}_bf16")
done
for seed in $DET_RERUN_SEEDS; do
  run "s${seed}_bf16_detrerun" parity_bf16 "$seed" "train.deterministic=true" "$@"
done
while [ "$(jobs -rp | wc -l)" -gt 0 ]; do wait -n || failed=1; done
if [ "$failed" != 0 ]; then echo "a run failed: see $OUT/*.log" >&2; exit 1; fi
for seed in $DET_RERUN_SEEDS; do
  $PY eval.py compare --identical "$OUT/s${seed}_bf16" "$OUT/s${seed}_bf16_detrerun"
done
$PY eval.py compare --pairs "${pairs[@]}" ${noise[@]+--noise "${noise[@]}"} --out "$OUT/report"
# the held-out loss (val_loss, every train.eval_every steps on the same batches) over the last 30 % of steps
$PY eval.py compare --key val_loss --window 0.3 --pairs "${pairs[@]}" ${noise[@]+--noise "${noise[@]}"} \
  --out "$OUT/report_val"
for entry in $ABLATIONS; do
  read -r suffix _ <<< "$(variant "$entry")"
  ablated=()
  for seed in $SEEDS; do ablated+=("$OUT/s${seed}_fp8-no-${suffix}:$OUT/s${seed}_bf16"); done
  $PY eval.py compare --pairs "${ablated[@]}" ${noise[@]+--noise "${noise[@]}"} --out "$OUT/report_no-${suffix}"
done
if [ -n "$ABLATIONS" ]; then $PY scripts/ablation_table.py "$OUT" | tee "$OUT/ablation.md"; fi
if [ "$STEP_ERROR" = 1 ]; then
  for seed in $SEEDS; do
    for p in bf16 fp8; do
      $PY eval.py "checkpoint=$OUT/s${seed}_$p" mode=step_error "batches=$EVAL_BATCHES" progress_bar=false \
        "step_error_ablate=$STEP_ERROR_ABLATE" "output=$OUT/s${seed}_$p/eval/step_error.json"
    done
  done
  $PY scripts/step_error_table.py "$OUT" | tee "$OUT/step_error.md"
fi
if [ -n "$ARCHIVE" ]; then
  tar czf "$ARCHIVE" --ignore-failed-read $(cd "$OUT" >/dev/null && ls -d */metrics.jsonl */resolved_config.yaml */eval \
    */summary.json report* ablation.md step_error.md *.log 2>/dev/null | sed "s#^#$OUT/#")
  echo "archive: $ARCHIVE"
fi
