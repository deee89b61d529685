#!/usr/bin/env bash
# seventeenth session, call 1: every GPU test at HEAD on whichever GPU came; then on an H200 fp8@4 (profiled),
# bf16@4 and fp8_ws@4, on an H100 bench_moe (its gluon_ws rows never ran) and bench_fp8_linear as time allows.
# LIMIT: the seconds the call may take (default 585). Run from the repository root.
set -uo pipefail
source "$(dirname "$0")/common.sh"
date +%T; timeout 290 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -rf tests/ > $OUT/gpu_tests_all.log 2>&1; echo "tests rc $?"
grep -E "passed|failed|FAILED|ERROR" $OUT/gpu_tests_all.log | tail -15
if grep -q H200 $OUT/gpu.txt; then
  for v in fp8@4 bf16@4 fp8_ws@4; do
    left=$(( ${LIMIT:-585} - 25 - SECONDS )); [ $left -lt 60 ] && { echo "$v skipped: $left s left"; continue; }
    prof=(); [ $v = fp8@4 ] && prof=(--profile $v)
    f=step_${v%@*}_mb${v#*@}.log
    date +%T; timeout $left python3 bench/bench_train.py --model ling_mini_2_0_e64 --recompute none --steps 4 --warmup 1 \
      --variants $v "${prof[@]}" > $OUT/$f 2>&1; echo "$v rc $?"; grep -E "^\| (variant|fp8|bf16)" $OUT/$f
  done
else
  left=$(( ${LIMIT:-585} - 20 - SECONDS )); date +%T; timeout $left python3 bench/bench_moe.py --out $OUT > $OUT/bench_moe.log 2>&1; echo "moe rc $?"
  grep "^|" $OUT/bench_moe.log | tail -40
fi
kill $CLK
for f in $OUT/step_*.log; do [ -f $f ] || continue; echo "== $f"; grep -E "^\| (part|dense linears|experts|router|other|attention|total|LM head|dispatch|optimizer) |GPU busy|wait" $f | head -24; done; date +%T
