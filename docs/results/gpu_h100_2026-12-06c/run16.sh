#!/usr/bin/env bash
# scratch: on the H200, every GPU test at HEAD, then the step fp8@4,bf16@4 side by side (clocks sampled)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v -e bitsandbytes -e torchao) 2>&1 | tail -1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 LING_TEST_GPU=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
V=${VARIANTS:-fp8@4,bf16@4}; [ "$mem" -lt 100000 ] && V="fp8@2"
date +%T; timeout ${T_TESTS:-260} python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider ${TEST_FILES:-tests/} > $OUT/gpu_tests.log 2>&1; echo "tests rc $?"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,utilization.gpu,clocks_event_reasons.active --format=csv -lms 1000 > $OUT/clocks.csv & smi=$!
date +%T; timeout ${T_STEP:-300} python3 bench/bench_train.py --model ling_mini_2_0_e64 --recompute none --steps 4 --warmup 1 \
  --variants $V > $OUT/bench_train.log 2>&1; echo "train rc $?"
kill $smi; date +%T
grep -E "passed|failed|FAILED|Error" $OUT/gpu_tests.log | tail -15
grep -v "\$ " $OUT/bench_train.log | tail -14
