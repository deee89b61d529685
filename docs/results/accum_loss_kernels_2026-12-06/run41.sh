#!/usr/bin/env bash
# eighth session, call D (run inline on the warm H100): three more A/B alternations, this tree first, then
# scratch/base (7b7fafc), against the order effect of calls B and C
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=/tmp/site:.
B="python3 bench/bench_train.py --model ling_mini_2_0_e64 --recompute none --steps 4 --warmup 1 --variants fp8@2"
for i in 6 7 8; do [ $SECONDS -gt 230 ] && break; timeout 70 $B > $OUT/step_new_$i.log 2>&1; (cd scratch/base && timeout 70 $B > $OUT/step_base_$i.log 2>&1); done
for f in $OUT/step_*.log; do echo "$(basename $f): $(grep -E '^\| (fp8|bf16)' $f)"; done; date +%T
