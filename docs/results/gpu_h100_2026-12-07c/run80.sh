#!/usr/bin/env bash
# seventeenth session, call 2 on an H100: bench_fp8_linear with the WS column's bit check against the unsplit Triton
# GEMM, then bench_moe again (is the eager gluon_ws row's 1.2 ms host wait at 16,384 tokens repeatable?)
set -uo pipefail
source "$(dirname "$0")/common.sh"
date +%T; timeout 200 python3 bench/bench_fp8_linear.py --out $OUT > $OUT/bench_fp8_linear.log 2>&1; echo "linear rc $?"
grep -E "^\| (shape|shared_down|qkv) +\| (gemm|wgrad)" $OUT/bench_fp8_linear.log | head; grep -c "bits differ" $OUT/bench_fp8_linear.log
left=$(( ${LIMIT:-400} - SECONDS )); date +%T; timeout $left python3 bench/bench_moe.py --skip-gemm --out $OUT > $OUT/bench_moe.log 2>&1; echo "moe rc $?"
kill $CLK; grep "^|" $OUT/bench_moe.log | tail -12; date +%T
