#!/usr/bin/env bash
# session 2026-12-06e: the LM-head loss's compiled epilogue without the fp32 copy (new = the working tree, base =
# scratch/base = c0754e2's... HEAD before the change): GPU tests, kernels, the loss bench and the step, alternated
set -uo pipefail
[ -d /tmp/site/deepspeed ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v -e bitsandbytes -e torchao) 2>&1 | tail -1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
LING_TEST_GPU=1 PYTHONPATH=/tmp/site:. timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/model/test_loss.py > $OUT/loss_gpu_tests.log 2>&1; echo "tests rc $?"; tail -2 $OUT/loss_gpu_tests.log
for l in base:scratch/base new:.; do
  n=${l%%:*}; d=${l#*:}
  (cd $d && PYTHONPATH=/tmp/site:. timeout 90 python3 $OLDPWD/scratch/loss_kernels.py) > $OUT/loss_kernels_$n.log 2>&1; echo "== $n kernels rc $?"; cat $OUT/loss_kernels_$n.log | grep -v Warn
done
for round in 1 2; do
  for l in base:scratch/base new:.; do
    n=${l%%:*}; d=${l#*:}
    (cd $d && PYTHONPATH=/tmp/site:. timeout 90 python3 bench/bench_model.py --models ling_mini_2_0_e64 --micro 4 --loss-only --steps 10 --warmup 3) > $OUT/loss_bench_${n}_$round.log 2>&1; echo "$n loss $round rc $?"
    grep -E "compiled epilogue|materialised" $OUT/loss_bench_${n}_$round.log
  done
done
for l in new:. base:scratch/base; do
  n=${l%%:*}; d=${l#*:}
  (cd $d && PYTHONPATH=/tmp/site:. timeout 130 python3 bench/bench_train.py --model ling_mini_2_0_e64 --recompute none --steps 4 --warmup 1 --variants fp8@4) > $OUT/step_${n}.log 2>&1; echo "$n step rc $?"
  grep -E "^\| fp8@4" $OUT/step_${n}.log
done
