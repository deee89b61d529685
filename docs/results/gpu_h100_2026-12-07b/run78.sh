#!/usr/bin/env bash
# sixteenth session, last call: every GPU test at HEAD on whichever GPU came
set -uo pipefail
[ -d /tmp/site/deepspeed ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v -e bitsandbytes -e torchao) 2>&1 | tail -1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=/tmp/site:. LING_TEST_GPU=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
git log --oneline -1 | tee $OUT/commit.txt
date +%T; timeout $(( ${LIMIT:-240} - 15 - SECONDS )) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -rf tests/ > $OUT/gpu_tests_all.log 2>&1; echo "tests rc $?"
grep -E "passed|failed|FAILED|ERROR" $OUT/gpu_tests_all.log | tail -15; date +%T
