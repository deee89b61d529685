#!/usr/bin/env bash
# scratch: split-K rule v2 (one wave, >= 32 K blocks per split): its GPU tests, the split/unsplit timing with forced splits
set -uo pipefail
[ -d /tmp/site/deepspeed ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v -e bitsandbytes -e torchao) 2>&1 | tail -1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 LING_TEST_GPU=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
date +%T; timeout 150 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/fp8/test_fp8_gemm.py tests/kernels/test_gradient_outputs.py > $OUT/gpu_tests.log 2>&1; echo "tests rc $?"
date +%T; timeout 200 python3 scratch/splitk_check.py > $OUT/splitk_check.log 2>&1; echo "splitk rc $?"
date +%T
grep -E "passed|failed|FAILED|Error" $OUT/gpu_tests.log | tail -12
grep -A40 "^| tokens" $OUT/splitk_check.log
