#!/usr/bin/env bash
# session 2026-12-06e, on an H200: the MoE layer and grouped GEMM table, then the no-MTP step pair
set -uo pipefail
[ -d /tmp/site/deepspeed ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v -e bitsandbytes -e torchao) 2>&1 | tail -1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout 290 python3 bench/bench_moe.py --out $OUT > $OUT/bench_moe.log 2>&1; echo "moe rc $?"
timeout 230 python3 bench/bench_train.py --model ling_mini_2_0_e64 --recompute none --steps 4 --warmup 1 --variants fp8_nomtp@4,bf16_nomtp@4 > $OUT/step_pair_nomtp.log 2>&1; echo "nomtp rc $?"
grep -E "^\| (variant|fp8|bf16)" $OUT/step_pair_nomtp.log
tail -60 $OUT/bench_moe.log
