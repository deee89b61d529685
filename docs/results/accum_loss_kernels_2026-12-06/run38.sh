#!/usr/bin/env bash
# eighth session, call A: every GPU test (the simplified routing kernel's first compiled run, the accumulation and
# cross-entropy kernels), the gradient path (PyTorch's mixed-dtype add against the kernel), the LM-head loss's
# epilogues side by side, then the step pair (bf16 and fp8 at micro-batch 4 on an H200, 2 on an H100)
set -uo pipefail
[ -d /tmp/site/deepspeed ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v -e bitsandbytes -e torchao) 2>&1 | tail -1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=/tmp/site:. LING_TEST_GPU=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1); M=4; PAIR=fp8@4,bf16@4
[ "$mem" -lt 100000 ] && { M=2; PAIR=fp8@2; }  # bf16@2 does not fit an H100's 80 GB
left() { echo $(( ${BUDGET:-585} - SECONDS )); }
date +%T; timeout 200 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider --durations=5 tests/ > $OUT/gpu_tests.log 2>&1; echo "tests rc $?"; grep -E "passed|failed|FAILED|rror" $OUT/gpu_tests.log | tail -8
date +%T; timeout 70 python3 bench/bench_model.py --models ling_mini_2_0_e64 --micro $M --loss-only --steps 10 --warmup 3 > $OUT/loss_epilogues.log 2>&1; echo "loss rc $?"; grep -E "LM head" $OUT/loss_epilogues.log
date +%T; timeout 60 python3 scratch/ce_sweep.py > $OUT/ce_sweep.log 2>&1; echo "ce rc $?"; tail -11 $OUT/ce_sweep.log
date +%T; timeout 90 python3 bench/bench_grad_path.py --steps 2 --variants autograd,fp32_by_hand,fp32_kernel,zero1 > $OUT/grad_path.log 2>&1; echo "grad rc $?"; tail -7 $OUT/grad_path.log
date +%T; [ "$(left)" -gt 150 ] && { timeout $(( $(left) - 5 )) python3 bench/bench_train.py --model ling_mini_2_0_e64 --recompute none --steps 4 --warmup 1 \
    --variants $PAIR > $OUT/step_pair.log 2>&1; echo "pair rc $?"; }
grep -E "^\| (variant|fp8|bf16)" $OUT/step_pair.log; grep -iE "out of memory|error" $OUT/step_pair.log | tail -3; date +%T
