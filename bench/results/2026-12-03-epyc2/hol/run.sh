#!/bin/bash
# usage: run.sh NAME [sluice args...]
cd /work/main
name=$1; shift
./target/release/sluice serve --model models/SmolLM2-135M-Instruct.Q4_1.gguf --port 18150 --threads 2 --ctx 32768 \
  --calibration-cache /tmp/hol/cal-$name.json --request-timeout-ms 900000 "$@" 2> /tmp/hol/$name.log &
pid=$!
for _ in $(seq 600); do curl -sf http://127.0.0.1:18150/readyz >/dev/null && break; sleep 0.2; done
./target/release/sluice-bench hol --url http://127.0.0.1:18150 --quiet --timeout-s 600 --slo-ttft-ms 5000 --slo-itl-ms 250 --pid $pid --temperature 0 --hol-stream-tokens 3000 ${HOLARGS:-} --out /tmp/hol/$name.json > /tmp/hol/$name.txt 2>&1
curl -s http://127.0.0.1:18150/metrics | grep -E "^sluice_(steps|engine_steps|step_|mixed|prefill_tokens|decode_tokens)" > /tmp/hol/$name.metrics
kill $pid; wait $pid
