#!/usr/bin/env bash
# scratch: split-K of the dense wgrad: its GPU tests and the kernels' GPU tests, the split/unsplit timing, then the
# FP8Linear layer table (bench_fp8_linear, defaults)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v -e bitsandbytes -e torchao) 2>&1 | tail -1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 LING_TEST_GPU=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
date +%T; timeout 200 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/fp8/test_fp8_gemm.py tests/fp8/test_tma_k_loop.py \
  tests/fp8/test_fp8_gemm_sm90.py tests/kernels tests/fp8/test_fp8_linear.py > $OUT/gpu_tests.log 2>&1; echo "tests rc $?"
date +%T; timeout 200 python3 scratch/splitk_check.py > $OUT/splitk_check.log 2>&1; echo "splitk rc $?"
date +%T; timeout 150 python3 bench/bench_fp8_linear.py --out $OUT > $OUT/bench_fp8_linear.log 2>&1; echo "linear rc $?"
date +%T
grep -E "passed|failed|FAILED|Error" $OUT/gpu_tests.log | tail -12
tail -26 $OUT/splitk_check.log
grep -A30 "^## Blockwise FP8 GEMM" $OUT/bench_fp8_linear.log | grep -E "shared|^\| shape|wgrad" | head -30
