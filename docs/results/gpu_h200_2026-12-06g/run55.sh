#!/usr/bin/env bash
# eleventh session: on an H200 the step rows fp8@4, bf16@4, fp8_graphs@4 with fp8@4's profile (clocks logged), then
# the GPU tests of tests/fp8 and tests/kernels; on an H100 the whole GPU suite, then bench_moe's 64-expert table
set -uo pipefail
[ -d /tmp/site/deepspeed ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v -e bitsandbytes -e torchao) 2>&1 | tail -1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=/tmp/site:. LING_TEST_GPU=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
git log --oneline -1 | tee $OUT/commit.txt
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "$mem" -gt 100000 ]; then
  (while sleep 1; do nvidia-smi --query-gpu=timestamp,clocks.current.sm,power.draw,utilization.gpu,clocks_event_reasons.active --format=csv,noheader; done) > $OUT/clocks.csv 2>/dev/null &
  CLK=$!
  B="python3 bench/bench_train.py --model ling_mini_2_0_e64 --recompute none --steps 4 --warmup 1"
  date +%T; timeout 330 $B --variants fp8@4,bf16@4 --profile fp8@4,bf16@4 > $OUT/step_pair.log 2>&1; echo "pair rc $?"
  date +%T; timeout $(( ${LIMIT:-590} - 90 - SECONDS )) $B --variants fp8_graphs@4 > $OUT/step_graphs.log 2>&1; echo "graphs rc $?"
  kill $CLK; date +%T
  timeout $(( ${LIMIT:-590} - 5 - SECONDS )) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/fp8 tests/kernels > $OUT/gpu_tests.log 2>&1; echo "tests rc $?"
  grep -E "^\| (variant|fp8|bf16)|GPU busy|fastest" $OUT/step_pair.log $OUT/step_graphs.log; grep -iE "out of memory|Error" $OUT/step_pair.log $OUT/step_graphs.log | tail -3
else
  timeout $(( ${LIMIT:-590} / 2 )) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/ > $OUT/gpu_tests.log 2>&1; echo "tests rc $?"
  timeout $(( ${LIMIT:-590} - 10 - SECONDS )) python3 bench/bench_moe.py --experts 64 --out $OUT > $OUT/bench_moe.log 2>&1; echo "moe rc $?"
  tail -40 $OUT/bench_moe.log
fi
grep -E "passed|failed|FAILED|ERROR" $OUT/gpu_tests.log | tail -15; date +%T
