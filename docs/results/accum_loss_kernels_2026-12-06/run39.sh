#!/usr/bin/env bash
# eighth session, call B (right after A, on the warm machine): the step A/B, the seventh session's HEAD (scratch/base,
# 7b7fafc) against this tree, fp8 at micro-batch 4 (H200) or 2 (H100), alternating; then the dispatch table
set -uo pipefail
[ -d /tmp/site/deepspeed ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v -e bitsandbytes -e torchao) 2>&1 | tail -1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1); M=4; [ "$mem" -lt 100000 ] && M=2
B="python3 bench/bench_train.py --model ling_mini_2_0_e64 --recompute none --steps 4 --warmup 1 --variants ${V:-fp8}@$M"
for i in 1 2; do
  date +%T; (cd scratch/base && timeout 120 $B > $OUT/step_base_$i.log 2>&1); echo "base rc $?"
  date +%T; timeout 120 $B > $OUT/step_new_$i.log 2>&1; echo "new rc $?"
done
for f in $OUT/step_*.log; do echo "$(basename $f): $(grep -E '^\| (fp8|bf16)' $f)"; done
date +%T; timeout 80 python3 bench/bench_moe.py --dispatch --out $OUT > $OUT/bench_moe_dispatch.log 2>&1; echo "dispatch rc $?"; tail -14 $OUT/bench_moe_dispatch.log; date +%T
