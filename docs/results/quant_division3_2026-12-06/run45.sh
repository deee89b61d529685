#!/usr/bin/env bash
# ninth session, call C (H100 or H200): after the signed-zero fix, the quantizer GPU tests, then bench_quant against
# scratch/base (90d9e36), outputs compared bit for bit
set -uo pipefail
[ -d /tmp/site/deepspeed ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v -e bitsandbytes -e torchao) 2>&1 | tail -1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=/tmp/site:. LING_TEST_GPU=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
date +%T; timeout 130 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/fp8 tests/kernels > $OUT/gpu_tests.log 2>&1; echo "tests rc $?"
grep -E "passed|failed|FAILED" $OUT/gpu_tests.log | tail -6
date +%T; (cd scratch/base && PYTHONPATH=/tmp/site:. timeout 70 python3 bench/bench_quant.py --save /tmp/q_base) > $OUT/bench_quant_base.log 2>&1; echo "base rc $?"
timeout 70 python3 bench/bench_quant.py --save /tmp/q_new > $OUT/bench_quant_new.log 2>&1; echo "new rc $?"
python3 bench/bench_quant.py --compare /tmp/q_base /tmp/q_new > $OUT/bench_quant_compare.log 2>&1; echo "compare rc $?"; grep -c "same bits" $OUT/bench_quant_compare.log; grep -v "same bits" $OUT/bench_quant_compare.log | head -5
for f in base new; do echo "== $f"; tail -1 $OUT/bench_quant_$f.log; done; date +%T
