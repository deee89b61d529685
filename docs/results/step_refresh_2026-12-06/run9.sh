#!/usr/bin/env bash
# scratch: the step bench, $VARIANTS side by side (the kept runs: fp8@4,bf16@4 and fp8_nomtp@4,bf16_nomtp@4;
# $PROFILE empty, so no row was profiled), clocks sampled
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v -e bitsandbytes -e torchao) 2>&1 | tail -1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,utilization.gpu,clocks_event_reasons.active --format=csv -lms 1000 > $OUT/clocks.csv &
smi=$!
timeout ${T3:-560} python3 bench/bench_train.py --model ling_mini_2_0_e64 --recompute none --steps 4 --warmup 1 \
  --variants ${VARIANTS:-fp8@4,bf16@4} ${PROFILE:-} > $OUT/bench_train.log 2>&1; echo "train rc $?"
kill $smi
grep -v "\$ " $OUT/bench_train.log | tail -24
