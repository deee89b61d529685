#!/usr/bin/env bash
# scratch: the whole GPU test suite (verifies the conftest dynamo reset on a GPU)
set -uo pipefail
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader
OUT=$OUT T_TESTS=${T_TESTS:-450} bash scripts/gpu_check.sh tests
grep -E "passed|failed" $OUT/gpu_tests.log | tail -3
