#!/bin/bash
# usage: hol.sh BIN TAG [extra sluice args]
BIN=$1; TAG=$2; shift 2
cd /work/main
$BIN serve --model models/SmolLM2-135M-Instruct.Q4_1.gguf --port 18300 --threads 2 --ctx 32768 --calibration-cache /tmp/s35/cal-$TAG.json "$@" 2> /tmp/s35/hol-$TAG.log &
P=$!
for _ in $(seq 600); do curl -sf http://127.0.0.1:18300/health >/dev/null && break; sleep 0.2; done
curl -s http://127.0.0.1:18300/metrics > /tmp/s35/m0-$TAG.txt
target/release/sluice-bench hol --url http://127.0.0.1:18300 --quiet --timeout-s 600 --slo-ttft-ms 5000 --slo-itl-ms 250 --pid $P --temperature 0 --hol-stream-tokens 3000 --out /tmp/s35/hol-$TAG.json > /tmp/s35/hol-$TAG.txt
curl -s http://127.0.0.1:18300/metrics > /tmp/s35/m1-$TAG.txt
kill $P; wait $P
