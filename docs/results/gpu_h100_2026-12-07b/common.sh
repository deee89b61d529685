# Sourced by this folder's unrun calls (run76.sh, run77.sh, run78.sh): install the carried wheels into /tmp/site,
# set the environment, record the GPU and the commit, and start the one-second clock sampler (its pid in $CLK).
[ -d /tmp/site/deepspeed ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v -e bitsandbytes -e torchao) 2>&1 | tail -1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=/tmp/site:. LING_TEST_GPU=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
git log --oneline -1 | tee $OUT/commit.txt
(while sleep 1; do nvidia-smi --query-gpu=timestamp,clocks.current.sm,power.draw,utilization.gpu,clocks_event_reasons.active --format=csv,noheader; done) > $OUT/clocks.csv 2>/dev/null &
CLK=$!
