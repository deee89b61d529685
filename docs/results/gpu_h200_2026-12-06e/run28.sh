#!/usr/bin/env bash
# session 2026-12-06e, on an H200: fastest against fastest, every row with expandable segments
set -uo pipefail
[ -d /tmp/site/deepspeed ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v -e bitsandbytes -e torchao) 2>&1 | tail -1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=/tmp/site:. PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout 520 python3 bench/bench_train.py --model ling_mini_2_0_e64 --recompute none --steps 4 --warmup 1 --variants bf16@5,bf16_graphs@6,fp8@12,fp8_graphs@12 > $OUT/step_fastest_expandable.log 2>&1; echo "rc $?"
grep -E "^\| (variant|fp8|bf16)" $OUT/step_fastest_expandable.log; grep -iE "out of memory" $OUT/step_fastest_expandable.log | tail -3
