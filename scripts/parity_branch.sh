#!/usr/bin/env bash
# The branch protocol: FP8 against BF16 on short branches of one BF16 trajectory, where training has not yet had
# the time to amplify a perturbation into a different trajectory (README "The branch protocol").
#
# For each seed of SEEDS: a deterministic BF16 run (+exp=parity_bf16, the trunk: TRUNK_STEPS steps, a checkpoint
# every EVERY steps), then from each of its checkpoints c (EVERY, 2·EVERY, … up to TRUNK_STEPS − LENGTH) an FP8 branch
# (+exp=parity_fp8, deterministic) of LENGTH steps: `train.resume=<trunk>/checkpoints/step<c>` in a fresh run dir
# (the trunk's weights, fp32 master weights, data position and RNG; AdamW's moments converted into FP8AdamW's) and
# `train.stop_at=c+LENGTH` (the lr schedule still spans TRUNK_STEPS). In deterministic mode a BF16 branch would be
# the trunk bit for bit, so each FP8 branch is compared with the trunk's own steps c+1 … c+LENGTH: FP8's effect
# accumulated over LENGTH steps from identical states. For the seeds of NOISE_SEEDS (default: the first seed), a
# nondeterministic BF16 branch beside each FP8 one gives the same comparison for kernel nondeterminism alone.
# ABLATIONS (default none) adds, per entry, an FP8 branch with that component in high precision beside each FP8 one
# (entries as in scripts/ablate.sh: fp8.ablate components, comma-joined, or one Hydra override with '='); each gets
# its report in $OUT/report_no-<entry>/.
# The held-out loss is measured every gcd(EVERY, LENGTH) steps in the trunk and the branches, so at every branch's
# last step in both.
#
#   bash scripts/parity_branch.sh                                # seed 1, branches from 250, 500, 750 of 100 steps
#   SEEDS="1 2 3" EVERY=100 LENGTH=50 JOBS=8 bash scripts/parity_branch.sh logging.wandb.mode=disabled
#   ABLATIONS="emulated fwd_x experts adam_v" bash scripts/parity_branch.sh     # which component moves the loss
#
# Reports (eval.py compare, one pair per branch against its trunk): $OUT/report/ (training loss, the mean over each
# branch's last WINDOW fraction of steps, default 0.5) and $OUT/report_val/ (the held-out loss at each branch's end:
# the window is its last logged step).
# Disk: the trunk keeps all its checkpoints until its branches have run (parity model: about 6.4 GB each), then
# deletes them unless KEEP_TRUNK_CHECKPOINTS=1. Rerunning skips finished runs. Extra arguments are Hydra overrides
# given to every run.
set -euo pipefail
cd "$(dirname "$0")/.."
SEEDS=${SEEDS:-"1"}
TRUNK_STEPS=${TRUNK_STEPS:-1000}
EVERY=${EVERY:-250}
LENGTH=${LENGTH:-100}
NOISE_SEEDS=${NOISE_SEEDS-"${SEEDS%% *}"}
WINDOW=${WINDOW:-0.5}
OUT=${OUT:-runs/parity_branch}
PY=${PYTHON:-python}
LAUNCH=${LAUNCH:-$PY}
JOBS=${JOBS:-4}
KEEP_TRUNK_CHECKPOINTS=${KEEP_TRUNK_CHECKPOINTS:-0}
ABLATIONS=${ABLATIONS-""}
if [ $((LENGTH)) -le 0 ] || [ $((EVERY)) -le 0 ] || [ $((EVERY + LENGTH)) -gt $((TRUNK_STEPS)) ]; then
  echo "parity_branch.sh: need 0 < LENGTH, 0 < EVERY and EVERY + LENGTH <= TRUNK_STEPS (got EVERY=$EVERY" \
       "LENGTH=$LENGTH TRUNK_STEPS=$TRUNK_STEPS)" >&2
  exit 2
fi
mkdir -p "$OUT"
gcd() { local a=$1 b=$2; while [ "$b" -gt 0 ]; do set -- "$b" $((a % b)); a=$1 b=$2; done; echo "$a"; }
EVAL_EVERY=$(gcd "$EVERY" "$LENGTH")

finished() {  # finished RUN_DIR LAST_STEP: its metrics.jsonl reached LAST_STEP (a rerun skips it)
  [ -f "$1/metrics.jsonl" ] && [ "$(tail -n 1 "$1/metrics.jsonl" | sed -n 's/^{"step": \([0-9]*\).*/\1/p')" = "$2" ]
}

failed=0
branch() {  # branch NAME EXP SEED FROM [overrides]: LENGTH steps from the trunk's checkpoint at step FROM
  local name=$1 exp=$2 seed=$3 from=$4
  shift 4
  local dir="$OUT/$name" stop=$((from + LENGTH))
  if finished "$dir" "$stop"; then return; fi
  rm -rf "$dir"  # an interrupted branch starts over: it resumes from the trunk, not from itself
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n || failed=1; done
  echo "=== $name: +exp=$exp from step $from to $stop"
  $LAUNCH train.py "+exp=$exp" "train.seed=$seed" "train.steps=$TRUNK_STEPS" "train.stop_at=$stop" \
    "train.resume=$OUT/s${seed}_trunk/checkpoints/$(printf 'step%08d' "$from")" "train.eval_every=$EVAL_EVERY" \
    "train.save_final=false" "run_name=parity-$name" "hydra.run.dir=$dir" "$@" > "$OUT/$name.log" 2>&1 &
}

source scripts/ablation_entry.sh  # variant ENTRY → the run-name suffix and the override of an ABLATIONS entry

pairs=()
noise=()
declare -A ablated=()
for seed in $SEEDS; do
  trunk="$OUT/s${seed}_trunk"
  if ! finished "$trunk" "$TRUNK_STEPS"; then
    echo "=== s${seed}_trunk: +exp=parity_bf16 train.seed=$seed train.steps=$TRUNK_STEPS, checkpoints every $EVERY"
    $LAUNCH train.py +exp=parity_bf16 "train.seed=$seed" "train.steps=$TRUNK_STEPS" train.deterministic=true \
      "train.save_every=$EVERY" train.keep_last=0 "train.eval_every=$EVAL_EVERY" "run_name=parity-s${seed}_trunk" \
      "hydra.run.dir=$trunk" "$@" > "$OUT/s${seed}_trunk.log" 2>&1
  fi
  for ((from = EVERY; from + LENGTH <= TRUNK_STEPS; from += EVERY)); do
    branch "s${seed}_fp8_from${from}" parity_fp8 "$seed" "$from" train.deterministic=true "$@"
    pairs+=("$OUT/s${seed}_fp8_from${from}:$trunk")
    for entry in $ABLATIONS; do
      read -r suffix override <<< "$(variant "$entry")"
      branch "s${seed}_fp8-no-${suffix}_from${from}" parity_fp8 "$seed" "$from" train.deterministic=true "$override" "$@"
      ablated[$suffix]+=" $OUT/s${seed}_fp8-no-${suffix}_from${from}:$trunk"
    done
    if [[ " $NOISE_SEEDS " == *" $seed "* ]]; then
      branch "s${seed}_bf16nd_from${from}" parity_bf16 "$seed" "$from" train.deterministic=false "$@"
      noise+=("$OUT/s${seed}_bf16nd_from${from}:$trunk")
    fi
  done
  while [ "$(jobs -rp | wc -l)" -gt 0 ]; do wait -n || failed=1; done
  if [ "$failed" != 0 ]; then echo "a run failed: see $OUT/*.log" >&2; exit 1; fi
  if [ "$KEEP_TRUNK_CHECKPOINTS" != 1 ]; then rm -rf "$trunk/checkpoints"; fi
done
$PY eval.py compare --window "$WINDOW" --pairs "${pairs[@]}" ${noise[@]+--noise "${noise[@]}"} --out "$OUT/report"
for entry in $ABLATIONS; do
  read -r suffix _ <<< "$(variant "$entry")"
  # shellcheck disable=SC2086  # the pairs are space-separated words
  $PY eval.py compare --window "$WINDOW" --pairs ${ablated[$suffix]} ${noise[@]+--noise "${noise[@]}"} \
    --out "$OUT/report_no-${suffix}"
done
if grep -q '"val_loss"' "$OUT/s${SEEDS%% *}_trunk/metrics.jsonl" 2>/dev/null; then  # data=synthetic has none
  $PY eval.py compare --key val_loss --window 0.01 --pairs "${pairs[@]}" ${noise[@]+--noise "${noise[@]}"} \
    --out "$OUT/report_val"
fi
