#!/usr/bin/env bash
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=/tmp/site:. LING_TEST_GPU=1
[ -d /tmp/site/deepspeed ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v -e bitsandbytes -e torchao) 2>&1 | tail -1
nvidia-smi --query-gpu=name --format=csv,noheader
for v in fp8_ws fp8 fp8_ws; do date +%T; timeout 150 python3 bench/bench_train.py --model ling_mini_2_0_e64 --recompute none --steps 4 --warmup 1 --variants ${v}@2 > $OUT/step_${v}_$SECONDS.log 2>&1; echo "step $v rc $?"; grep -E "^\| ${v}@" $OUT/step_${v}_*.log | tail -1; done
date +%T; timeout 120 python3 bench/bench_fp8_linear.py --layers-only --out $OUT > $OUT/bench_fp8_linear.log 2>&1; echo "linear rc $?"; grep -E "FP8Linear|nn.Linear" $OUT/bench_fp8_linear.log | tail -40
