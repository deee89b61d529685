#!/usr/bin/env bash
# sixteenth session, last call: every GPU test at HEAD on whichever GPU came
set -uo pipefail
source "$(dirname "$0")/common.sh"
date +%T; timeout $(( ${LIMIT:-240} - 15 - SECONDS )) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -rf tests/ > $OUT/gpu_tests_all.log 2>&1; echo "tests rc $?"
kill $CLK
grep -E "passed|failed|FAILED|ERROR" $OUT/gpu_tests_all.log | tail -15; date +%T
