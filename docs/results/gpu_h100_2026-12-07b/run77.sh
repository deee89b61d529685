#!/usr/bin/env bash
# sixteenth session, call 3: the parts' tables of issue #29 (bench_moe at 256 experts with the gluon_ws rows,
# bench_fp8_linear's GEMMs against cuBLAS and its layer table) on whichever GPU came
set -uo pipefail
source "$(dirname "$0")/common.sh"
date +%T; timeout 260 python3 bench/bench_moe.py --out $OUT > $OUT/bench_moe.log 2>&1; echo "moe rc $?"
left=$(( 590 - SECONDS )); date +%T; timeout $left python3 bench/bench_fp8_linear.py --out $OUT > $OUT/bench_fp8_linear.log 2>&1; echo "linear rc $?"
kill $CLK
grep "^|" $OUT/bench_moe.log | tail -50; grep "^|" $OUT/bench_fp8_linear.log | tail -60; date +%T
