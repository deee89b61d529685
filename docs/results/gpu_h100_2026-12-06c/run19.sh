#!/usr/bin/env bash
# scratch: split-K (rule v3, >= 16 K blocks per split): GPU tests, then the FP8Linear layer table at HEAD~ (scratch/base =
# git archive 69d7a9d) and with split-K, alternating, at 16,384 and 4,096 tokens
set -uo pipefail
[ -d /tmp/site/deepspeed ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v -e bitsandbytes -e torchao) 2>&1 | tail -1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 LING_TEST_GPU=1
PYTHONPATH=/tmp/site:. timeout 120 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/fp8/test_fp8_gemm.py tests/kernels/test_gradient_outputs.py tests/fp8/test_fp8_linear.py > $OUT/gpu_tests.log 2>&1; echo "tests rc $?"
for t in 16384 4096; do
  for l in new:. base:scratch/base; do
    n=${l%%:*}; d=${l#*:}
    (cd $d && PYTHONPATH=/tmp/site:. timeout 100 python3 bench/bench_fp8_linear.py --layers-only --tokens $t) > $OUT/layers_${n}_$t.log 2>&1; echo "$n $t rc $?"
  done
done
grep -E "passed|failed" $OUT/gpu_tests.log | tail -3
for f in $OUT/layers_*.log; do echo "== $f"; grep -E "^\| (shape|shared_down|shared_gate_up|qkv) " $f; done
