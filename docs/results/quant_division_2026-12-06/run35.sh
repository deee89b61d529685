#!/usr/bin/env bash
# GPU tests of the changed kernels; swiglu_backward's bits per tensor; the step A/B (HEAD~ tree vs working tree, alternating); loss chunks
set -uo pipefail
[ -d /tmp/site/deepspeed ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v -e bitsandbytes -e torchao) 2>&1 | tail -1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=/tmp/site:. LING_TEST_GPU=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1); M=4; [ "$mem" -lt 100000 ] && M=2
date +%T; timeout 230 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider --durations=8 tests/fp8/test_division.py tests/fp8/test_fp8_quant.py tests/fp8/test_fp8_grouped.py tests/fp8/test_expert_wgrad.py tests/fp8/test_fp8_linear.py > $OUT/gpu_tests.log 2>&1; echo "tests rc $?"; grep -E "passed|failed|FAILED" $OUT/gpu_tests.log | tail -8
date +%T; (cd scratch/base && timeout 60 python3 ../quant_ab.py base /tmp/ab/base > /dev/null 2>&1); timeout 60 python3 scratch/quant_ab.py new /tmp/ab/new > /dev/null 2>&1
python3 scratch/quant_ab.py --compare /tmp/ab/base /tmp/ab/new | grep -i swiglu | tee $OUT/swiglu_bits.log
for i in 1 2; do
  date +%T; (cd scratch/base && timeout 90 python3 bench/bench_train.py --model ling_mini_2_0_e64 --recompute none --steps 4 --warmup 1 --variants fp8@$M > $OUT/step_base_$i.log 2>&1); echo "base rc $?"
  date +%T; timeout 90 python3 bench/bench_train.py --model ling_mini_2_0_e64 --recompute none --steps 4 --warmup 1 --variants fp8@$M > $OUT/step_new_$i.log 2>&1; echo "new rc $?"
done
for f in $OUT/step_*.log; do echo "$(basename $f): $(grep -E '^\| fp8@' $f)"; done
date +%T; timeout 100 python3 bench/bench_model.py --models ling_mini_2_0_e64 --micro $M --loss-only --loss-chunks 2048,4096 > $OUT/loss_chunks.log 2>&1; echo "loss rc $?"; tail -12 $OUT/loss_chunks.log; date +%T
