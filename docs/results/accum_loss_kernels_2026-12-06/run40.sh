#!/usr/bin/env bash
# eighth session, call C: the ZeRO-3 guard test after the bias fix, the new kernels' GPU tests, then three more
# alternations of the step A/B (scratch/base = 7b7fafc against this tree), fp8@2 on an H100
set -uo pipefail
[ -d /tmp/site/deepspeed ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v -e bitsandbytes -e torchao) 2>&1 | tail -1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=/tmp/site:. LING_TEST_GPU=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1); M=4; [ "$mem" -lt 100000 ] && M=2
date +%T; timeout 120 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/runtime/test_runtime_guard.py tests/kernels tests/model/test_loss.py > $OUT/gpu_tests_c.log 2>&1; echo "tests rc $?"; grep -E "passed|failed|FAILED" $OUT/gpu_tests_c.log | tail -4
B="python3 bench/bench_train.py --model ling_mini_2_0_e64 --recompute none --steps 4 --warmup 1 --variants fp8@$M"
for i in 3 4 5; do
  [ $SECONDS -gt ${BUDGET:-330} ] && break
  date +%T; (cd scratch/base && timeout 70 $B > $OUT/step_base_$i.log 2>&1); echo "base rc $?"
  date +%T; timeout 70 $B > $OUT/step_new_$i.log 2>&1; echo "new rc $?"
done
for f in $OUT/step_*.log; do echo "$(basename $f): $(grep -E '^\| (fp8|bf16)' $f)"; done; date +%T
