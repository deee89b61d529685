#!/usr/bin/env bash
# scratch: the step fp8@2 on one machine, alternating the code before the grid-order change (86bc762, scratch/old)
# and HEAD (new defaults incl. the row kernel's K-blocks-first order): new, old, new; clocks sampled; then the
# quantizer/linear GPU tests under the new defaults
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v -e bitsandbytes -e torchao) 2>&1 | tail -1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 LING_TEST_GPU=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
nproc; lscpu | grep -m1 "Model name"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,utilization.gpu,temperature.gpu,clocks_event_reasons.active --format=csv -lms 1000 > $OUT/clocks.csv &
smi=$!
B="--model ling_mini_2_0_e64 --recompute none --steps 4 --warmup 1 --variants fp8@2"
step() {  # $1 label, $2 dir
  date +%T; (cd $2 && PYTHONPATH=/tmp/site:. timeout ${T_STEP:-130} python3 bench/bench_train.py $B) > $OUT/bench_$1.log 2>&1; echo "$1 rc $?"
}
step new1 .
step old scratch/old
step new2 .
kill $smi
date +%T; PYTHONPATH=/tmp/site:. timeout ${T_TESTS:-90} python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/fp8/test_fp8_quant.py tests/fp8/test_fp8_linear.py > $OUT/gpu_tests.log 2>&1; echo "tests rc $?"
grep -E "passed|failed" $OUT/gpu_tests.log | tail -3
for l in new1 old new2; do echo "$l: $(grep '^| fp8@2' $OUT/bench_$l.log)"; done
