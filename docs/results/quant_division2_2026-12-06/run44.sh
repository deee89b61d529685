#!/usr/bin/env bash
# ninth session, call B: the quantizers' leaner division (fp8/triton_blocks.py) against the tree before it
# (scratch/base = 90d9e36): bench_quant alternating, outputs compared bit for bit; the GPU tests of fp8, kernels,
# the loss and the runtime guard; Nsight Compute on the gathered token-dim kernel; then on an H200 the step
# pair with the FP8 profile, on an H100 an fp8@2 step A/B
set -uo pipefail
[ -d /tmp/site/deepspeed ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v -e bitsandbytes -e torchao) 2>&1 | tail -1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=/tmp/site:. LING_TEST_GPU=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
left() { echo $(( ${BUDGET:-585} - SECONDS )); }
B="python3 bench/bench_train.py --model ling_mini_2_0_e64 --recompute none --steps 4 --warmup 1"
if [ "$mem" -gt 100000 ]; then
  date +%T; timeout 380 $B --variants fp8@4,bf16@4 --profile fp8@4 > $OUT/step_pair_profile.log 2>&1; echo "pair rc $?"
  grep -E "^\| (variant|fp8|bf16)" $OUT/step_pair_profile.log; grep -iE "out of memory|error" $OUT/step_pair_profile.log | tail -3
fi
for i in 1 2; do
  date +%T; (cd scratch/base && PYTHONPATH=/tmp/site:. timeout 120 python3 bench/bench_quant.py --save /tmp/q_base) > $OUT/bench_quant_base_$i.log 2>&1; echo "base rc $?"
  timeout 120 python3 bench/bench_quant.py --save /tmp/q_new > $OUT/bench_quant_new_$i.log 2>&1; echo "new rc $?"
done
python3 bench/bench_quant.py --compare /tmp/q_base /tmp/q_new > $OUT/bench_quant_compare.log 2>&1; echo "compare rc $?"; tail -5 $OUT/bench_quant_compare.log
for f in base_2 new_2; do echo "== $f"; tail -3 $OUT/bench_quant_$f.log; done
T=$(( $(left) - 60 )); [ $T -gt 150 ] && T=150
date +%T; timeout $T python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/fp8 tests/kernels tests/model/test_loss.py tests/runtime/test_runtime_guard.py > $OUT/gpu_tests.log 2>&1; echo "tests rc $?"
grep -E "passed|failed|FAILED|rror" $OUT/gpu_tests.log | tail -6
[ "$(left)" -gt 60 ] && date +%T && timeout 50 ncu --clock-control none -k regex:_quant_tokens_grouped_kernel --launch-skip 2 --launch-count 1 --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats python3 scratch/tokq_one.py > $OUT/ncu_quant_tokens_grouped_new.log 2>&1; echo "ncu rc $?"
grep -E "Duration|Compute \(SM\)|L2 Cache Throughput|DRAM Throughput|Registers Per|Achieved Occupancy|Warp Cycles Per Issued" $OUT/ncu_quant_tokens_grouped_new.log | head -8
if [ "$mem" -lt 100000 ]; then
  for i in 1 2; do
    [ "$(left)" -gt 220 ] || break
    date +%T; (cd scratch/base && PYTHONPATH=/tmp/site:. timeout 110 $B --variants fp8@2) > $OUT/step_base_$i.log 2>&1; echo "step base rc $?"
    timeout 110 $B --variants fp8@2 > $OUT/step_new_$i.log 2>&1; echo "step new rc $?"
  done
  for f in $OUT/step_*.log; do echo "$(basename $f): $(grep -E '^\| fp8' $f | cut -d'|' -f2,5,12,13)"; done
fi
date +%T
