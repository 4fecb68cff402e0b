#!/bin/bash
cd /work/main
M=models/SmolLM2-135M-Instruct.Q4_1.gguf
CAL=bench/results/2026-12-04-epyc/vs/calibration.json
P=18150
wait_up() { for _ in $(seq 300); do curl -sf http://127.0.0.1:$P/health >/dev/null && return 0; sleep 0.2; done; echo "not up"; }
run_sluice() { # label args...
  local label=$1; shift
  ./target/release/sluice serve --model $M --port $P --threads 2 --ctx 32768 --calibration-cache $CAL "$@" 2>/tmp/ttft/$label.log & local pid=$!
  wait_up; python3 /tmp/ttft/ttft.py $P "$label" 15; kill $pid; wait $pid 2>/dev/null
}
run_llama() {
  /work/peer/build-native/bin/llama-server -m $M --host 127.0.0.1 --port $P -t 2 -tb 2 -c 32768 -np 4 2>/tmp/ttft/llama.log >/dev/null & local pid=$!
  wait_up; python3 /tmp/ttft/ttft.py $P llama 15; kill $pid; wait $pid 2>/dev/null
}
for round in 1 2; do
  run_sluice "sluice-default-r$round"
  run_llama
  run_sluice "sluice-on-f16-r$round" --flash-attn on --kv-type f16
  run_sluice "sluice-off-q8f16-r$round" --flash-attn off --kv-type q8_0/f16
done
