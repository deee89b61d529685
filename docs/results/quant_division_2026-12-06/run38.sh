#!/usr/bin/env bash
# the f128 cases with 4 warps, then every GPU test of the repository
set -uo pipefail
[ -d /tmp/site/deepspeed ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v -e bitsandbytes -e torchao) 2>&1 | tail -1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=/tmp/site:. LING_TEST_GPU=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout 60 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -k f128 tests/fp8/test_fp8_quant.py 2>&1 | tail -1
date +%T; timeout 330 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/ > $OUT/gpu_tests_all.log 2>&1; echo "all rc $?"; grep -E "passed|failed|FAILED" $OUT/gpu_tests_all.log | tail -8; date +%T
