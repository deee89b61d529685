#!/usr/bin/env bash
# scratch: the GPU tests of the FP8 kernels under the new launch defaults, then previous vs new launch timings
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v -e bitsandbytes -e torchao) 2>&1 | tail -1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 LING_TEST_GPU=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
date +%T; timeout ${T_TESTS:-100} python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/fp8/test_fp8_quant.py tests/fp8/test_fp8_grouped.py tests/fp8/test_fp8_linear.py > $OUT/gpu_tests.log 2>&1; echo "tests rc $?"
date +%T; timeout ${T_CONFIRM:-70} python3 scratch/tokquant_confirm.py > $OUT/tokquant_confirm.log 2>&1; echo "confirm rc $?"
date +%T; grep -E "passed|failed|FAILED" $OUT/gpu_tests.log | tail -8; grep -v Warning $OUT/tokquant_confirm.log | grep -v "warnings.warn"
