#!/usr/bin/env bash
# quantizer division: GPU tests of the changed kernels, then the quantizers A/B (HEAD tree vs working tree), alternating
set -uo pipefail
[ -d /tmp/site/deepspeed ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v -e bitsandbytes -e torchao) 2>&1 | tail -1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=/tmp/site:. LING_TEST_GPU=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout 200 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/fp8/test_division.py tests/fp8/test_fp8_quant.py tests/fp8/test_fp8_grouped.py tests/fp8/test_expert_wgrad.py > $OUT/gpu_tests.log 2>&1; echo "tests rc $?"; tail -3 $OUT/gpu_tests.log
for i in 1 2; do
  (cd scratch/base && timeout 100 python3 ../quant_ab.py base$i /tmp/ab/base)
  timeout 100 python3 scratch/quant_ab.py new$i /tmp/ab/new
done > $OUT/quant_ab.log 2>&1
python3 scratch/quant_ab.py --compare /tmp/ab/base /tmp/ab/new | tee $OUT/quant_bits.log
python3 - <<'PY' $OUT/quant_ab.log
import sys, collections, statistics
t = collections.defaultdict(lambda: collections.defaultdict(list))
for line in open(sys.argv[1]):
    if line.startswith("ROW"):
        _, rest = line.split(" ", 1); label, name, us = [p.strip() for p in rest.split("|")]
        t[name][label.rstrip("0123456789")].append(float(us))
print("| quantizer | base µs | new µs | speed-up |"); print("|---|---|---|---|")
for name, d in t.items():
    b, n = statistics.median(d["base"]), statistics.median(d["new"])
    print(f"| {name} | {b:.1f} ({'/'.join(f'{v:.1f}' for v in d['base'])}) | {n:.1f} ({'/'.join(f'{v:.1f}' for v in d['new'])}) | {b / n:.2f}x |")
PY
grep -v "^ROW" $OUT/quant_ab.log | tail -5
