#!/usr/bin/env bash
# thirteenth session: the whole GPU suite, then the kernel-level tables of issue #29 (bench_moe's 256 experts,
# bench_fp8_linear's GEMMs against cuBLAS and its layer table), on whichever GPU came
set -uo pipefail
[ -d /tmp/site/deepspeed ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v -e bitsandbytes -e torchao) 2>&1 | tail -1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=/tmp/site:. LING_TEST_GPU=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
git log --oneline -1 | tee $OUT/commit.txt
(while sleep 1; do nvidia-smi --query-gpu=timestamp,clocks.current.sm,power.draw,utilization.gpu,clocks_event_reasons.active --format=csv,noheader; done) > $OUT/clocks.csv 2>/dev/null &
CLK=$!
date +%T; timeout 230 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/ > $OUT/gpu_tests_all.log 2>&1; echo "tests rc $?"; tail -3 $OUT/gpu_tests_all.log
date +%T; timeout 200 python3 bench/bench_moe.py --out $OUT > $OUT/bench_moe.log 2>&1; echo "moe rc $?"
if [ $(( ${LIMIT:-590} - SECONDS )) -gt 150 ]; then date +%T; timeout $(( ${LIMIT:-590} - 5 - SECONDS )) python3 bench/bench_fp8_linear.py --out $OUT > $OUT/bench_fp8_linear.log 2>&1; echo "linear rc $?"; else echo "linear skipped: no time"; touch $OUT/bench_fp8_linear.log; fi
kill $CLK
grep -E "passed|failed|FAILED|ERROR" $OUT/gpu_tests_all.log | tail -12
grep "^|" $OUT/bench_moe.log | tail -45; grep "^|" $OUT/bench_fp8_linear.log | tail -45; date +%T
