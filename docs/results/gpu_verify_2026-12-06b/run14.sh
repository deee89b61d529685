#!/usr/bin/env bash
# scratch: the committed grid-order defaults on the GPU: every fp8 GPU test, the confirm script (previous vs new launch,
# the row kernel's order), then the step (fp8 and, on the H200, bf16 at micro-batch 4)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v -e bitsandbytes -e torchao) 2>&1 | tail -1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 LING_TEST_GPU=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
V="bf16@4,fp8@4"; [ "$mem" -lt 100000 ] && V="fp8@2"   # bf16@4 needs the H200's memory
date +%T; timeout ${T_TESTS:-170} python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/fp8 > $OUT/gpu_tests.log 2>&1; echo "tests rc $?"
date +%T; timeout ${T_CONFIRM:-90} python3 scratch/tokquant_confirm.py > $OUT/tokquant_confirm.log 2>&1; echo "confirm rc $?"
date +%T; timeout ${T_STEP:-150} python3 bench/bench_train.py --model ling_mini_2_0_e64 --recompute none --steps 4 --warmup 1 \
  --variants $V > $OUT/bench_train.log 2>&1; echo "train rc $?"
date +%T; grep -E "passed|failed|FAILED|Error" $OUT/gpu_tests.log | tail -12; grep -v Warning $OUT/tokquant_confirm.log | grep -v "warnings.warn"
grep -A4 "^| variant" $OUT/bench_train.log | head -5
