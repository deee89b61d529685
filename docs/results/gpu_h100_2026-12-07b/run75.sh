#!/usr/bin/env bash
# sixteenth session, call 1 (ran on an H100 as its first form; this form adds LIMIT and the H200 order): on an H200
# every GPU test, then fp8@4 (profiled), bf16@4 and fp8_ws@4; on an H100 the warp-specialised / kernel-choice /
# clock / allocator-retry GPU tests, fp8@2 and fp8_ws@2 (both profiled), then the launch micro-benchmark.
# LIMIT: the seconds the call may take (default 590). Run from the repository root.
set -uo pipefail
source "$(dirname "$0")/common.sh"
MB=4; SEL=(); grep -q H100 $OUT/gpu.txt && { MB=2; SEL=(-k "warp or clock or kernel_choice or retries"); }
date +%T; timeout 240 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/ "${SEL[@]}" > $OUT/gpu_tests.log 2>&1; echo "tests rc $?"
grep -E "passed|failed|FAILED|ERROR" $OUT/gpu_tests.log | tail -12
V="fp8@$MB bf16@$MB fp8_ws@$MB"; grep -q H100 $OUT/gpu.txt && V="fp8@$MB fp8_ws@$MB"
for v in $V; do
  left=$(( ${LIMIT:-590} - 30 - SECONDS )); [ $left -lt 60 ] && { echo "$v skipped: $left s left"; continue; }
  prof=(--profile $v); [ ${v%@*} = bf16 ] && prof=(); [ ${v%@*} = fp8_ws ] && [ $MB = 4 ] && prof=()
  f=step_${v%@*}_mb${v#*@}.log
  date +%T; timeout $left python3 bench/bench_train.py --model ling_mini_2_0_e64 --recompute none --steps 4 --warmup 1 \
    --variants $v "${prof[@]}" > $OUT/$f 2>&1; echo "$v rc $?"; grep -E "^\| (variant|fp8|bf16)" $OUT/$f
done
left=$(( ${LIMIT:-590} - SECONDS )); [ $MB = 2 ] && [ $left -gt 30 ] && { date +%T; timeout $left python3 docs/results/gpu_h100_2026-12-07/launch_cost.py > $OUT/launch_cost.log 2>&1; echo "launch rc $?"; grep -v -i warn $OUT/launch_cost.log | head -24; }
kill $CLK
for f in $OUT/step_*.log; do echo "== $f"; grep -E "^\| (part|dense linears|experts|router|other|attention|total|LM head|dispatch|optimizer) |GPU busy|wait" $f | head -24; done; date +%T
