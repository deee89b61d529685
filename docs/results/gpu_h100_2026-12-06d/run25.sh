#!/usr/bin/env bash
# session 2026-12-06d: the graphs' cache release before capture: the GPU graph tests with it, then the new test on the old graphs.py
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v -e bitsandbytes -e torchao) 2>&1 | tail -1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 LING_TEST_GPU=1 PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout 150 python3 -m pytest -q -m gpu -n 2 -p no:cacheprovider tests/model/test_graphs_gpu.py tests/model/test_graphs.py > $OUT/graphs_tests.log 2>&1; echo "tests rc $?"; tail -3 $OUT/graphs_tests.log
cp scratch/old_graphs.py model/graphs.py
timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/model/test_graphs_gpu.py -k released_first > $OUT/graphs_test_old_code.log 2>&1; echo "old code rc $? (1 expected)"; grep -E "passed|failed|assert" $OUT/graphs_test_old_code.log | tail -4
