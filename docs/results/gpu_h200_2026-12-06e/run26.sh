#!/usr/bin/env bash
# session 2026-12-06e, on an H200: the step pair with HEAD, fp8_graphs@12 with expandable segments, fp8@4 with the
# 128x128 forward tiles (scratch/alt = HEAD with FPROP_CONFIG 128x128 / 8 warps / 4 stages / 1 per SM)
set -uo pipefail
[ -d /tmp/site/deepspeed ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v -e bitsandbytes -e torchao) 2>&1 | tail -1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
B="python3 bench/bench_train.py --model ling_mini_2_0_e64 --recompute none --steps 4 --warmup 1"
timeout 230 $B --variants fp8@4,bf16@4 > $OUT/step_pair.log 2>&1; echo "pair rc $?"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 170 $B --variants fp8_graphs@12 > $OUT/graphs12_expandable.log 2>&1; echo "graphs12 rc $?"
(cd scratch/alt && PYTHONPATH=/tmp/site:. timeout 120 $B --variants fp8@4) > $OUT/step_alt_fp8at4.log 2>&1; echo "alt rc $?"
for f in $OUT/step_pair.log $OUT/graphs12_expandable.log $OUT/step_alt_fp8at4.log; do echo "== $f"; grep -E "^\| (variant|fp8|bf16)" $f; grep -iE "out of memory|error" $f | tail -3; done
