#!/usr/bin/env bash
# The next GPU call for the warp-specialised step's host stall (written in the fifteenth session, not yet run):
# the launch micro-benchmark, then both steps profiled side by side on one machine (with the allocator-retry column),
# at micro-batch 2 on an H100 (BF16 does not fit e64 there) or 4 on an H200.
set -uo pipefail
[ -d /tmp/site/deepspeed ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v -e bitsandbytes -e torchao) 2>&1 | tail -1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
MB=4; grep -q H100 $OUT/gpu.txt && MB=2
timeout 120 python3 docs/results/gpu_h100_2026-12-07/launch_cost.py > $OUT/launch_cost.log 2>&1; echo "launch rc $?"
grep -v -i warn $OUT/launch_cost.log | head -30
timeout 420 python3 bench/bench_train.py --model ling_mini_2_0_e64 --recompute none --steps 6 --warmup 1 \
  --variants fp8@$MB,fp8_ws@$MB --profile fp8@$MB,fp8_ws@$MB > $OUT/step_pair_profiles.log 2>&1; echo "pair rc $?"
grep -E "^\| fp8" $OUT/step_pair_profiles.log | head -4; grep -E "^\| (dense linears|experts|router|other) |GPU busy" $OUT/step_pair_profiles.log
