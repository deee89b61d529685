#!/usr/bin/env bash
# session 2026-12-06d: the step A/B again, order alternated (alt first): fp8@2, base = HEAD, alt = scratch/alt (128x128 fprop)
set -uo pipefail
[ -d /tmp/site/deepspeed ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v -e bitsandbytes -e torchao) 2>&1 | tail -1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
for round in 1 2; do
  for l in alt:scratch/alt base:.; do
    n=${l%%:*}; d=${l#*:}
    (cd $d && PYTHONPATH=/tmp/site:. timeout 130 python3 bench/bench_train.py --model ling_mini_2_0_e64 --recompute none --steps 5 --warmup 1 --variants fp8@2) > $OUT/step_${n}_$round.log 2>&1; echo "$n step $round rc $?"
  done
done
for f in $OUT/step_*.log; do echo "== $f"; grep -E "^\| fp8@2" $f; done
