#!/usr/bin/env bash
# fourteenth session, last device minutes: the warp-specialised GEMM's table (two variants) and its GPU bit tests
set -uo pipefail
[ -d /tmp/site/deepspeed ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v -e bitsandbytes -e torchao) 2>&1 | tail -1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=/tmp/site:. LING_TEST_GPU=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
git log --oneline -1 | tee $OUT/commit.txt
date +%T; VARIANTS="ws s4,ws carry s4" TOKENS=16384 timeout 125 python3 scratch/ws_gemm.py > $OUT/ws_gemm.log 2>&1; echo "ws rc $?"; grep "bit mismatches" $OUT/ws_gemm.log
date +%T; timeout 85 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider -k 'warp or clock' tests/fp8/test_fp8_gemm_sm90.py tests/runtime/test_gpu_clocks.py > $OUT/gpu_tests.log 2>&1; echo "tests rc $?"; tail -3 $OUT/gpu_tests.log
grep -E "FAILED|Error" $OUT/gpu_tests.log | head -6
cat $OUT/ws_gemm.log | tail -24; date +%T
