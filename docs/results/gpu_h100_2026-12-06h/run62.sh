#!/usr/bin/env bash
# twelfth session, H200: the new GPU tests (batch_to_device, the idle column's pairing), the profiled step pair at
# micro-batch 2 (H100: BF16 e64 does not fit) with the pinned batch copy, then the FP8 row of the previous HEAD (f5ee797, pageable copy) unprofiled
# on the same machine, then the new FP8 row unprofiled again (the before/after side by side)
set -uo pipefail
[ -d /tmp/site/deepspeed ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v -e bitsandbytes -e torchao) 2>&1 | tail -1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
git log --oneline -1 | tee $OUT/commit.txt
date +%T; timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider -n 3 tests/data/test_batch_to_device.py tests/analysis/test_profiling.py 2>&1 | tail -4 | tee $OUT/tests.log
B="python3 bench/bench_train.py --model ling_mini_2_0_e64 --recompute none --steps 4 --warmup 1"
date +%T; timeout 330 $B --variants fp8@2 --profile fp8@2 > $OUT/step_pair.log 2>&1; echo "pair rc $?"
date +%T; (cd scratch/trees/base && PYTHONPATH=/tmp/site:. timeout 150 $B --variants fp8@2 > $OUT/step_fp8_base.log 2>&1); echo "base rc $?"
date +%T; timeout $(( ${LIMIT:-590} - 5 - SECONDS )) $B --variants fp8@2 > $OUT/step_fp8_new.log 2>&1; echo "new rc $?"
grep -hE "^\| (variant|fp8|bf16)|GPU busy|the GPU works" $OUT/step_*.log; date +%T
