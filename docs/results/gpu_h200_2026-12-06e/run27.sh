#!/usr/bin/env bash
# session 2026-12-06e, on an H200: the dense GEMM tile sweep, then every GPU test
set -uo pipefail
[ -d /tmp/site/deepspeed ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v -e bitsandbytes -e torchao) 2>&1 | tail -1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=/tmp/site:. LING_TEST_GPU=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout 250 python3 bench/bench_fp8_linear.py --sweep --out $OUT > $OUT/bench_fp8_linear_sweep.log 2>&1; echo "sweep rc $?"
timeout 280 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/ > $OUT/gpu_tests_all.log 2>&1; echo "tests rc $?"; tail -5 $OUT/gpu_tests_all.log
grep -A30 "^## Blockwise FP8 GEMM" $OUT/bench_fp8_linear_sweep.log | head -40
python3 - <<'PY'
import json, os
d = json.load(open(os.path.join(os.environ["OUT"], "bench_fp8.json")))
for e in d["gemm"]:
    if e["kind"] in ("fprop", "dgrad"):
        t = {c[:110]: ms for ms, err, c in e["all"]}
        a = [ms for c, ms in t.items() if c.startswith("GemmConfig(block_m=64, block_n=128, group_m=8, num_warps=4, num_stages=4, tma=True, persistent=True, warp_specialize=False, programs_per_sm=2")]
        b = [ms for c, ms in t.items() if c.startswith("GemmConfig(block_m=128, block_n=128, group_m=8, num_warps=8, num_stages=4, tma=True, persistent=True, warp_specialize=False, programs_per_sm=1")]
        print(e["shape"], e["kind"], "64x128 p2", a, "128x128 p1", b, "best", min(t.values()))
PY
