#!/usr/bin/env bash
# scratch: the Gluon GEMMs checked and timed, the GPU tests, then the step
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl) 2>&1 | tail -1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout ${T1:-240} python3 scratch/sm90_gemm_check.py > $OUT/sm90_check.log 2>&1; echo "check rc $?"
grep -v "^(" $OUT/sm90_check.log | grep -v "^  " | tail -60
grep "^  " $OUT/sm90_check.log | grep -v "True, err" | head -5
LING_TEST_GPU=1 timeout ${T2:-150} python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/fp8/test_fp8_gemm_sm90.py \
  tests/model/test_graphs_gpu.py tests/kernels/test_gradient_outputs.py tests/fp8/test_fp8_gemm.py tests/fp8/test_fp8_grouped.py \
  tests/fp8/test_expert_wgrad.py tests/fp8/test_fp8_linear.py > $OUT/gpu_tests.log 2>&1; echo "tests rc $?"
grep -E "passed|failed|Error|error" $OUT/gpu_tests.log | tail -12
timeout ${T3:-200} python3 bench/bench_train.py --model ling_mini_2_0_e64 --recompute none --steps 4 --warmup 1 \
  --variants ${VARIANTS:-fp8@4,bf16@4} > $OUT/bench_train.log 2>&1; echo "train rc $?"
grep -v "\$ " $OUT/bench_train.log | tail -14
