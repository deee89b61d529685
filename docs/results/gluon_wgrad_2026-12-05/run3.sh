#!/usr/bin/env bash
# scratch: the Gluon wgrad for short expert segments (GroupedConfig.sm90_wgrad): GPU tests, then bench_moe's tables
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl) 2>&1 | tail -1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
LING_TEST_GPU=1 timeout ${T1:-190} python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/fp8/test_fp8_gemm_sm90.py \
  tests/fp8/test_fp8_grouped.py tests/fp8/test_expert_wgrad.py tests/fp8/test_tma_k_loop.py tests/kernels/test_gradient_outputs.py \
  tests/model/test_graphs_gpu.py tests/model/test_dispatch.py > $OUT/gpu_tests.log 2>&1; echo "tests rc $?"
grep -E "passed|failed|FAILED|Error" $OUT/gpu_tests.log | tail -12
timeout ${T2:-210} python3 bench/bench_moe.py --experts 256 --out $OUT > $OUT/bench_moe_e256.log 2>&1; echo "moe256 rc $?"
grep "^|" $OUT/bench_moe_e256.log | tail -32
timeout ${T3:-80} python3 bench/bench_moe.py --experts 64 --tokens 4096,16384 --skip-layer > $OUT/bench_moe_e64.log 2>&1; echo "moe64 rc $?"
grep "^|" $OUT/bench_moe_e64.log | grep -i "wgrad\|tokens | GEMM"
