#!/usr/bin/env bash
# The side-by-side's mix below capacity on this box (0.07 req/s for 180 s;
# prompts lognormal 150 tokens x e^1.3, 5-3,000; answers lognormal 64 x
# e^0.9, 8-400; temperature 0.7; SLOs 5 s to the first token, 200 ms a
# token), seeds SEEDS (default 34-36, which the side-by-side has not run:
# its rounds use 31-33), against sluice at
# its defaults and llama-server (session 41's run.sh without its
# --short-cells 0 leg); a fresh start each, taking turns.
# Usage: run.sh OUT LLAMA_SERVER CALIBRATION_JSON
set -euo pipefail
out=$1 llama=$2 cal=$3
mkdir -p "$out"
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
for seed in ${SEEDS:-34 35 36}; do
    for cfg in short llama; do
        cp "$cal" "$out/cal-$cfg.json"
        case $cfg in
            short) args=() ;;
        esac
        if [ $cfg = llama ]; then
            "$llama" -m "$model" --host 127.0.0.1 --port 18154 -t 2 -tb 2 -c 32768 -np 4 2> "$out/$cfg-s$seed.log" > /dev/null &
        else
            ./target/release/sluice serve --model "$model" --port 18154 --threads 2 --ctx 32768 \
                --calibration-cache "$out/cal-$cfg.json" "${args[@]}" 2> "$out/$cfg-s$seed.log" &
        fi
        pid=$!
        for _ in $(seq 600); do curl -sf http://127.0.0.1:18154/health >/dev/null && break; sleep 0.2; done
        echo "seed $seed: $cfg" >&2
        ./target/release/sluice-bench run --url http://127.0.0.1:18154 --quiet --timeout-s 120 --pid $pid \
            --prompt-tokens lognormal:150:1.3:5:3000 --max-tokens lognormal:64:0.9:8:400 --temperature 0.7 \
            --slo-ttft-ms 5000 --slo-itl-ms 200 --duration-s 180 --rate 0.07 --seed $seed \
            --out "$out/$cfg-s$seed.json" > "$out/$cfg-s$seed.txt" 2>&1
        kill $pid; wait $pid 2>/dev/null || true
    done
done
