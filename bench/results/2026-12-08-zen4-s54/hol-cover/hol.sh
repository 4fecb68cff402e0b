#!/usr/bin/env bash
# usage: hol.sh OUT RUNS   the head-of-line workload alone on the traced build, one fresh start a run
set -uo pipefail
cd /work/main
out=$1; runs=$2; mkdir -p $out
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
cp /tmp/s53/cal-native.json $out/calibration.json
for r in $(seq $runs); do
  SLUICE_TRACE=1 ${SL:-/tmp/s54/sluice-trace} serve --model $model --port 18161 --threads 2 --ctx 32768 --calibration-cache $out/calibration.json ${SLUICE_ARGS:-} > $out/sluice-$r.log 2>&1 & pid=$!
  until curl -sf http://127.0.0.1:18161/health > /dev/null 2>&1; do sleep 0.3; done
  ./target/release/sluice-bench hol --url http://127.0.0.1:18161 --quiet --timeout-s 600 --slo-ttft-ms 5000 \
     --slo-itl-ms 250 --pid $pid --temperature 0 --hol-stream-tokens 3000 --out $out/hol-$r.json > $out/hol-$r.txt
  kill $pid; wait $pid 2>/dev/null
  echo "run $r: $(sed -n 2p $out/hol-$r.txt) | $(grep during $out/hol-$r.txt)"
done
