#!/usr/bin/env bash
# scratch: the 7 GPU tests that failed on the H100 (graphs vs eager, corpus wheel, flagship message) and the memory
# plan's, with the probes of the graphs' difference and of the dense layer's saved tensors
set -uo pipefail
export OUT=${OUT:-gpu_out}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v -e bitsandbytes -e torchao) 2>&1 | tail -1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 LING_TEST_GPU=1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout ${T0:-120} python3 scratch/probe_graphs.py > $OUT/probe_graphs.log 2>&1; echo "probe_graphs rc $?"
grep -v -i "warn\|DEBUG" $OUT/probe_graphs.log | tail -30
timeout ${T1:-240} python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/model/test_graphs_gpu.py \
  tests/runtime/test_memory_plan.py "tests/runtime/test_determinism.py" "tests/runtime/test_run_faults.py::test_gpu_the_flagship_on_one_gpu_is_refused_before_the_build" \
  > $OUT/gpu_tests.log 2>&1; echo "tests rc $?"
grep -a -E "passed|failed" $OUT/gpu_tests.log | tail -3
sed -n '/= FAILURES =/,/= warnings summary/p' $OUT/gpu_tests.log | grep -a -E "^_.* _$|^E  " | head -30
timeout ${T2:-120} python3 scratch/probe_saved.py > $OUT/probe_saved.log 2>&1; echo "probe_saved rc $?"
grep -v -i "warn" $OUT/probe_saved.log | tail -40
