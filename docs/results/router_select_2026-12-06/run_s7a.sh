#!/usr/bin/env bash
# seventh session, one call: the GPU tests of fp8/, kernels/ and model/ (the integer amax and the router's selection
# kernel compiled), the selection kernel's bits and times, one fp8@4 step row, then bench_quant with what time is left
set -uo pipefail
[ -d /tmp/site/deepspeed ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v -e bitsandbytes -e torchao) 2>&1 | tail -1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=/tmp/site:. LING_TEST_GPU=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
left() { echo $(( ${BUDGET:-575} - SECONDS )); }
date +%T; timeout 200 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/fp8 tests/kernels tests/model > $OUT/gpu_tests.log 2>&1; echo "tests rc $?"; grep -E "passed|failed|FAILED|rror" $OUT/gpu_tests.log | tail -8; date +%T
timeout 60 python3 scratch/router_sel.py > $OUT/router_sel.log 2>&1; echo "router_sel rc $?"; tail -6 $OUT/router_sel.log
if [ "$(left)" -gt 200 ]; then
  timeout $(( $(left) - 40 )) python3 bench/bench_train.py --model ling_mini_2_0_e64 --recompute none --steps 4 --warmup 1 \
    --variants ${VARIANTS:-fp8@4} > $OUT/bench_train.log 2>&1; echo "train rc $?"
  grep -v "\$ " $OUT/bench_train.log | tail -6
fi
if [ "$(left)" -gt 45 ]; then
  timeout $(( $(left) - 5 )) python3 bench/bench_quant.py --out $OUT > $OUT/bench_quant.log 2>&1; echo "quant rc $?"; tail -40 $OUT/bench_quant.log
fi
date +%T
