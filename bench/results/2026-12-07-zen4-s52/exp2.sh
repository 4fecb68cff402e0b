#!/usr/bin/env bash
# After exp.done: a fresh --calibrate-only cache, the head-of-line workload
# alone with it (a second start, as round 1 of vs-avx2 was), then llama-server
# alone, then again sluice with the fresh cache as its first run left it.
cd /work/main
while [ ! -f /tmp/s52/exp.done ]; do sleep 2; done
mkdir -p /tmp/s52/hol/fresh-cal
/tmp/s52/sluice-avx2 serve --model models/SmolLM2-135M-Instruct.Q4_1.gguf --threads 2 --ctx 32768 \
  --calibrate-only --calibration-cache /tmp/s52/hol/fresh-cal/calibration.json > /tmp/s52/hol/fresh-cal/calibrate.log 2>&1
cp /tmp/s52/hol/fresh-cal/calibration.json /tmp/s52/hol/fresh-cal/calibration-initial.json
/tmp/s52/hol-state.sh fresh-cal-1 none /tmp/s52/hol/fresh-cal/calibration-initial.json > /tmp/s52/hol-fresh1.log 2>&1
cp /tmp/s52/hol/fresh-cal-1/calibration.json /tmp/s52/hol/fresh-cal/calibration-after-1.json
/tmp/s52/hol-state.sh fresh-cal-2 none /tmp/s52/hol/fresh-cal/calibration-after-1.json > /tmp/s52/hol-fresh2.log 2>&1
echo done > /tmp/s52/exp2.done
