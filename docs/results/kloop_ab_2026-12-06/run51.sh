#!/usr/bin/env bash
# tenth session, call 1 (any GPU): the K-loop variants' A/B on every FP8 GEMM of the e64 step (bits compared), then
# every gpu test (among them the flatten/prefetch bit-identity cases)
set -uo pipefail
[ -d /tmp/site/deepspeed ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v -e bitsandbytes -e torchao) 2>&1 | tail -1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=/tmp/site:. LING_TEST_GPU=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
date +%T; timeout 250 python3 docs/results/kloop_ab/kloop_ab.py --json /tmp/kloop.json > $OUT/kloop_ab.log 2>&1; echo "ab rc $?"
cp /tmp/kloop.json $OUT/ 2>/dev/null
date +%T; timeout 300 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/ > $OUT/gpu_tests.log 2>&1; echo "tests rc $?"
date +%T
tail -22 $OUT/kloop_ab.log
grep -E "passed|failed|FAILED|ERROR" $OUT/gpu_tests.log | tail -15
