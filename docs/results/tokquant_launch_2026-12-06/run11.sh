#!/usr/bin/env bash
# scratch: token-dim quantizer sweep; the step with the old defaults (fp8 and bf16), then with the sweep's best
# launch as the default (fp8); then the quantizers' GPU tests under the new defaults
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v -e bitsandbytes -e torchao) 2>&1 | tail -1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 LING_TEST_GPU=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
M=4; OLD="fp8@4,bf16@4"; [ "$mem" -lt 100000 ] && M=2 && OLD="fp8@2"   # bf16 needs the H200's memory
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,utilization.gpu,clocks_event_reasons.active --format=csv -lms 1000 > $OUT/clocks.csv &
smi=$!
date +%T; timeout ${T_SWEEP:-240} python3 scratch/tokquant_sweep.py $OUT/best.json > $OUT/tokquant_sweep.log 2>&1; echo "sweep rc $?"
date +%T; timeout ${T_OLD:-150} python3 bench/bench_train.py --model ling_mini_2_0_e64 --recompute none --steps 4 --warmup 1 \
  --variants $OLD > $OUT/bench_train_old.log 2>&1; echo "train old rc $?"
python3 scratch/apply_best.py $OUT/best.json | tee $OUT/applied.txt
date +%T; timeout ${T_NEW:-80} python3 bench/bench_train.py --model ling_mini_2_0_e64 --recompute none --steps 4 --warmup 1 \
  --variants fp8@$M > $OUT/bench_train_new.log 2>&1; echo "train new rc $?"
date +%T; kill $smi
timeout ${T_TESTS:-90} python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/fp8/test_fp8_grouped.py tests/fp8/test_fp8_quant.py 2>&1 | tail -3
grep -v "^\$ " $OUT/tokquant_sweep.log | tail -60
grep -A8 "^| variant" $OUT/bench_train_old.log | head -8; grep -A4 "^| variant" $OUT/bench_train_new.log | head -4
