#!/usr/bin/env bash
# session 2026-12-06d: dense fprop/dgrad tiles on the H100, A/B in one call: base = HEAD (64x128, 2 programs per SM),
# alt = scratch/alt (HEAD with FPROP_CONFIG 128x128 / 8 warps / 4 stages / 1 per SM; the bf16 wgrad keeps 64x128 p2)
set -uo pipefail
[ -d /tmp/site/deepspeed ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v -e bitsandbytes -e torchao) 2>&1 | tail -1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 LING_TEST_GPU=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=/tmp/site:. timeout 120 python3 scratch/tile_bits.py > $OUT/tile_bits.log 2>&1; echo "tile bits rc $?"; tail -1 $OUT/tile_bits.log
for round in 1 2; do
  for l in base:. alt:scratch/alt; do
    n=${l%%:*}; d=${l#*:}
    (cd $d && PYTHONPATH=/tmp/site:. timeout 90 python3 bench/bench_fp8_linear.py --layers-only --tokens 16384 --out /tmp/o_$n) > $OUT/layers_${n}_$round.log 2>&1; echo "$n layers $round rc $?"
  done
done
for l in base:. alt:scratch/alt; do
  n=${l%%:*}; d=${l#*:}
  (cd $d && PYTHONPATH=/tmp/site:. timeout 150 python3 bench/bench_train.py --model ling_mini_2_0_e64 --recompute none --steps 4 --warmup 1 --variants fp8@2) > $OUT/step_${n}.log 2>&1; echo "$n step rc $?"
done
for f in $OUT/layers_*.log; do echo "== $f"; grep -E "^\| (qkv|o_proj|gate_up|down|shared_gate_up|shared_down) +\| ours FP8Linear" $f; done
for f in $OUT/step_*.log; do echo "== $f"; grep -E "^\| fp8@2" $f; done
