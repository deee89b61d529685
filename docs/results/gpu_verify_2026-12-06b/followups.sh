#!/usr/bin/env bash
# The two follow-up calls after run15.sh on the same warm H100 (as run, one line each in the `run` tool; wheels
# already installed in /tmp/site): old2, new3; then new4, old3, new5, old4. scratch/old = `git archive 86bc762`.
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,utilization.gpu,temperature.gpu,clocks_event_reasons.active --format=csv -lms 1000 > $OUT/clocks2.csv & smi=$!
B="--model ling_mini_2_0_e64 --recompute none --steps 4 --warmup 1 --variants fp8@2"
for l in old2:scratch/old new3:.; do  # second call: new4:. old3:scratch/old new5:. old4:scratch/old (clocks3.csv)
  n=${l%%:*}; d=${l#*:}; date +%T
  (cd $d && PYTHONPATH=/tmp/site:. timeout 120 python3 bench/bench_train.py $B) > $OUT/bench_$n.log 2>&1
  echo "$n: $(grep '^| fp8@2' $OUT/bench_$n.log)"
done
kill $smi
