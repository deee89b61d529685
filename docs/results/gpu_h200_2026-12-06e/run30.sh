#!/usr/bin/env bash
# session 2026-12-06e, on an H200: the FP8 step's profile at micro-batch 4, beside the opt-in bf16 expert wgrad
set -uo pipefail
[ -d /tmp/site/deepspeed ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v -e bitsandbytes -e torchao) 2>&1 | tail -1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout 400 python3 bench/bench_train.py --model ling_mini_2_0_e64 --recompute none --steps 4 --warmup 1 --variants fp8@4,fp8_bf16wgrad@4 --profile fp8@4 > $OUT/step_profile_fp8at4.log 2>&1; echo "rc $?"
grep -E "^\| (variant|fp8|bf16)" $OUT/step_profile_fp8at4.log
grep -n -A40 -i "profile" $OUT/step_profile_fp8at4.log | head -80
