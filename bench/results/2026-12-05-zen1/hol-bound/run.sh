#!/bin/bash
# usage: hol.sh OUT "sluice args"   (or "llama")
cd /work/main
out=$1; args=$2; mkdir -p $out
M=models/SmolLM2-135M-Instruct.Q4_1.gguf
if [ "$args" = llama ]; then
  /work/peer/build-native/bin/llama-server -m $M --host 127.0.0.1 --port 18151 -t 2 -tb 2 -c 32768 -np 4 2>$out/server.log >/dev/null & p=$!
else
  cp /tmp/s37/cal.json $out/cal.json
  ./target/release/sluice serve --model $M --port 18151 --threads 2 --ctx 32768 --calibration-cache $out/cal.json $args 2>$out/server.log & p=$!
fi
for _ in $(seq 300); do curl -sf http://127.0.0.1:18151/health >/dev/null && break; sleep 0.2; done
( while kill -0 $p 2>/dev/null; do echo "t=$(date +%s)"; curl -s http://127.0.0.1:18151/metrics | grep -E '^sluice_(steps_total|passes_total|step_seconds_sum|prefill_tokens_total|tokens_generated_total|steps_mixed_total|step_budget_tokens) '; sleep 10; done ) > $out/metrics.log 2>&1 &
./target/release/sluice-bench hol --url http://127.0.0.1:18151 --quiet --timeout-s ${TO:-600} --slo-ttft-ms 5000 --slo-itl-ms 250 --pid $p --temperature 0 --hol-stream-tokens 3000 --out $out/hol.json > $out/hol.txt 2>&1
kill $p; wait $p 2>/dev/null
