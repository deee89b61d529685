#!/usr/bin/env bash
# scratch: the whole GPU suite (scripts/gpu_check.sh tests), then what a dense e64 layer keeps (probe_saved.py)
set -uo pipefail
export OUT=${OUT:-gpu_out}
T_TESTS=${T_TESTS:-330} bash scripts/gpu_check.sh tests > $OUT/gpu_check.txt 2>&1; echo "gpu_check rc $?"
tail -30 $OUT/gpu_check.txt
grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.log | head -20
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
timeout ${T2:-150} python3 scratch/probe_saved.py > $OUT/probe_saved.log 2>&1; echo "probe rc $?"
grep -v Warning $OUT/probe_saved.log | tail -60
