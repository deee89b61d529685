#!/usr/bin/env bash
# fourteenth session: the warp-specialised Gluon dense GEMM (bits + TFLOPS against ours and cuBLAS), its GPU tests,
# the clock sampler's GPU test, then (time and memory allowing) the step pair with MTP, logging clocks
set -uo pipefail
[ -d /tmp/site/deepspeed ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v -e bitsandbytes -e torchao) 2>&1 | tail -1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=/tmp/site:. LING_TEST_GPU=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
git log --oneline -1 | tee $OUT/commit.txt
python3 -c "import pynvml; print('pynvml from', pynvml.__file__)" 2>&1 | tail -1
(while sleep 1; do nvidia-smi --query-gpu=timestamp,clocks.current.sm,power.draw,utilization.gpu,clocks_event_reasons.active --format=csv,noheader; done) > $OUT/clocks.csv 2>/dev/null &
CLK=$!
left() { echo $(( ${LIMIT:-585} - SECONDS )); }
date +%T; TOKENS=16384 timeout 190 python3 scratch/ws_gemm.py > $OUT/ws_gemm.log 2>&1; echo "ws rc $?"; grep "bit mismatches" $OUT/ws_gemm.log
date +%T; timeout 120 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider -k 'warp or clock or bench_train' tests/fp8/test_fp8_gemm_sm90.py tests/runtime/test_gpu_clocks.py tests/bench/test_bench_train.py > $OUT/gpu_tests.log 2>&1; echo "tests rc $?"; tail -3 $OUT/gpu_tests.log
if [ $(left) -gt 150 ]; then date +%T; TOKENS=4096 timeout $(( $(left) - 10 )) python3 scratch/ws_gemm.py > $OUT/ws_gemm_4096.log 2>&1; echo "ws4096 rc $?"; fi
kill $CLK
grep -E "FAILED|Error" $OUT/gpu_tests.log | head -8
tail -22 $OUT/ws_gemm.log; tail -20 $OUT/ws_gemm_4096.log 2>/dev/null; date +%T
