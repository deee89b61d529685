#!/usr/bin/env bash
# fifteenth session: smoke the warp-specialised kernel (a hang shows as a timeout), its table, the step with it
# against the Triton kernels (fp8.gemm_kernel), then its GPU tests
set -uo pipefail
[ -d /tmp/site/deepspeed ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v -e bitsandbytes -e torchao) 2>&1 | tail -1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=/tmp/site:. LING_TEST_GPU=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
git log --oneline -1 | tee $OUT/commit.txt
MB=4; grep -q H100 $OUT/gpu.txt && MB=2
(while sleep 1; do nvidia-smi --query-gpu=timestamp,clocks.current.sm,power.draw,utilization.gpu,clocks_event_reasons.active --format=csv,noheader; done) > $OUT/clocks.csv 2>/dev/null &
CLK=$!
left() { echo $(( ${LIMIT:-585} - SECONDS )); }
date +%T; timeout 90 python3 scratch/ws_smoke.py > $OUT/ws_smoke.log 2>&1; SMOKE=$?; echo "smoke rc $SMOKE"; tail -8 $OUT/ws_smoke.log
if [ $SMOKE -eq 0 ]; then
  date +%T; VARIANTS="ws s4,ws carry s4" TOKENS=16384 timeout 150 python3 scratch/ws_gemm.py > $OUT/ws_gemm.log 2>&1; echo "ws rc $?"; grep "bit mismatches" $OUT/ws_gemm.log
  STEPS="fp8_ws fp8"; grep -q DIFFER $OUT/ws_smoke.log && STEPS=""  # wrong bits: no step, straight to the tests
  for v in $STEPS; do
    if [ $(left) -gt 130 ]; then date +%T; timeout $(( $(left) - 40 )) python3 bench/bench_train.py --model ling_mini_2_0_e64 --recompute none --steps 4 --warmup 1 --variants ${v}@$MB > $OUT/step_${v}.log 2>&1; echo "step $v rc $?"; grep -E "^\| ${v}" $OUT/step_${v}.log | tail -1; fi
  done
  if [ $(left) -gt 60 ]; then date +%T; timeout $(( $(left) - 8 )) python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider -k 'warp or clock' tests/fp8/test_fp8_gemm_sm90.py tests/runtime/test_gpu_clocks.py > $OUT/gpu_tests.log 2>&1; echo "tests rc $?"; tail -3 $OUT/gpu_tests.log; grep -E "FAILED|Error" $OUT/gpu_tests.log | head -8; fi
else
  date +%T; timeout 150 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider -k 'clock' tests/runtime/test_gpu_clocks.py > $OUT/gpu_tests.log 2>&1; echo "tests rc $?"; tail -3 $OUT/gpu_tests.log
fi
kill $CLK
tail -24 $OUT/ws_gemm.log 2>/dev/null; date +%T
