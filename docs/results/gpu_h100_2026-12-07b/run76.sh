#!/usr/bin/env bash
# sixteenth session, call 2 (an H200): the step rows without MTP at micro-batch 4, and the fastest rows (the largest
# micro-batches that fit in the earlier @max searches, with expandable segments), one invocation each
set -uo pipefail
source "$(dirname "$0")/common.sh"
for v in ${ROWS:-fp8_nomtp@4 bf16_nomtp@4 fp8@12 bf16@5}; do
  left=$(( 585 - SECONDS )); [ $left -lt 60 ] && { echo "$v skipped: $left s left"; continue; }
  env=(); case $v in *@12|bf16@5) env=(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True);; esac
  f=step_${v%@*}_mb${v#*@}.log
  date +%T; env "${env[@]}" timeout $left python3 bench/bench_train.py --model ling_mini_2_0_e64 --recompute none --steps 4 --warmup 1 \
    --variants $v > $OUT/$f 2>&1; echo "$v rc $?"; grep -E "^\| (variant|fp8|bf16)" $OUT/$f
done
kill $CLK; date +%T
