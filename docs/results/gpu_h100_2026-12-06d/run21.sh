#!/usr/bin/env bash
# session 2026-12-06d, call 1 on an H100 (the H200 did not come): the whole GPU suite, then bench_moe (the GPU-time columns' first run)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v -e bitsandbytes -e torchao) 2>&1 | tail -1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 LING_TEST_GPU=1 PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout 200 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/ > $OUT/gpu_tests.log 2>&1; echo "tests rc $?"
tail -3 $OUT/gpu_tests.log
timeout 240 python3 bench/bench_moe.py --out $OUT > $OUT/bench_moe.log 2>&1; echo "moe rc $?"
tail -40 $OUT/bench_moe.log
