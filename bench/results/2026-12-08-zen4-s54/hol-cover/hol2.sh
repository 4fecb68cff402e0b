#!/usr/bin/env bash
# conversation, a pause as long as the other server's turn, then hol: in one process, as in a round
set -uo pipefail
cd /work/main
out=$1; runs=$2; mkdir -p $out
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
cp /tmp/s53/cal-native.json $out/calibration.json
for r in $(seq $runs); do
  SLUICE_TRACE=1 ${SL:-/tmp/s54/sluice-trace} serve --model $model --port 18161 --threads 2 --ctx 32768 --calibration-cache $out/calibration.json ${SLUICE_ARGS:-} > $out/sluice-$r.log 2>&1 & pid=$!
  until curl -sf http://127.0.0.1:18161/health > /dev/null 2>&1; do sleep 0.3; done
  ./target/release/sluice-bench conversation --url http://127.0.0.1:18161 --quiet --timeout-s 120 --slo-ttft-ms 5000 --slo-itl-ms 250 --pid $pid --temperature 0 --seed $((r+10)) --out $out/conv-$r.json > $out/conv-$r.txt 2>/dev/null
  sleep ${PAUSE:-75}
  echo "TRACE-MARK hol starts $(date +%s%6N)" >> $out/sluice-$r.log
  ./target/release/sluice-bench hol --url http://127.0.0.1:18161 --quiet --timeout-s 600 --slo-ttft-ms 5000 \
     --slo-itl-ms 250 --pid $pid --temperature 0 --hol-stream-tokens 3000 --out $out/hol-$r.json > $out/hol-$r.txt 2>/dev/null
  kill $pid; wait $pid 2>/dev/null
  echo "run $r: $(sed -n 2p $out/hol-$r.txt) | $(grep during $out/hol-$r.txt)"
done
