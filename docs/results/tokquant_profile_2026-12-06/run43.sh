#!/usr/bin/env bash
# ninth session: the token-dim quantizer, the committed kernel against the pipelined prototype (bits + do_bench)
set -uo pipefail
[ -d /tmp/site/deepspeed ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v -e bitsandbytes -e torchao) 2>&1 | tail -1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
date +%T; timeout 300 python3 scratch/tokq_sweep2.py > $OUT/tokq_sweep2.log 2>&1; echo "sweep rc $?"; tail -9 $OUT/tokq_sweep2.log
date +%T
ncu --version | tail -1
for k in _quant_tokens_grouped_kernel quant_tokens_pipe_kernel; do
  timeout 120 ncu --clock-control none -k regex:$k --launch-skip 2 --launch-count 1 --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats python3 scratch/tokq_one.py > $OUT/ncu_$k.log 2>&1; echo "ncu $k rc $?"
  grep -E "Duration|Memory Throughput|DRAM Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|Stall|Warp Cycles Per Issued" $OUT/ncu_$k.log | head -20
done
date +%T
