#!/usr/bin/env bash
# why test_fp8_quant's f128 cases run long: first-call (compile) time of the token-dim kernel's wide configs, both trees; the rest of the file
set -uo pipefail
[ -d /tmp/site/deepspeed ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v -e bitsandbytes -e torchao) 2>&1 | tail -1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=/tmp/site:. LING_TEST_GPU=1
nvidia-smi --query-gpu=name --format=csv,noheader
(cd scratch/base && TRITON_CACHE_DIR=/tmp/tc_base timeout 200 python3 ../compile_f128.py base > $OUT/compile_base.log 2>&1; echo "base rc $?" >> $OUT/compile_base.log) &
TRITON_CACHE_DIR=/tmp/tc_new timeout 200 python3 scratch/compile_f128.py new > $OUT/compile_new.log 2>&1; echo "new rc $?" >> $OUT/compile_new.log &
timeout 150 python3 -m pytest -v -m gpu -n 4 -p no:cacheprovider -k "not f128" tests/fp8/test_fp8_quant.py > $OUT/gpu_tests_quant.log 2>&1; echo "quant tests rc $?"; grep -E "passed|failed" $OUT/gpu_tests_quant.log | tail -2
wait
cat $OUT/compile_base.log $OUT/compile_new.log
