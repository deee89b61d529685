#!/usr/bin/env bash
# scratch: Gluon tiles on every shape, then the step with the 64x128 two-per-SM Gluon tiles against the Triton kernels
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl) 2>&1 | tail -1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout ${T1:-230} python3 scratch/sm90_tiles2.py > $OUT/tiles.log 2>&1; echo "tiles rc $?"
grep "^|" $OUT/tiles.log; grep -v "^|" $OUT/tiles.log | tail -5
[ "${STEP:-1}" = 1 ] && SCRATCH_SM90=${SM90:-64,4,2,4} SCRATCH_ROOT=$PWD SCRATCH_MARK=$OUT/sm90_marker PYTHONPATH=/tmp/site:$PWD/scratch/sm90site timeout ${T2:-150} \
  python3 bench/bench_train.py --model ling_mini_2_0_e64 --recompute none --steps 4 --warmup 1 --variants fp8@4 > $OUT/train_gluon.log 2>&1; echo "gluon rc $?"
wc -l $OUT/sm90_marker; grep -v "\$ " $OUT/train_gluon.log | tail -6
[ "${STEP:-1}" = 1 ] && timeout ${T3:-200} python3 bench/bench_train.py --model ling_mini_2_0_e64 --recompute none --steps 4 --warmup 1 --variants fp8@4,bf16@4 > $OUT/train_base.log 2>&1; echo "base rc $?"
grep -v "\$ " $OUT/train_base.log | tail -8
