#!/usr/bin/env bash
# The fresh greedy closed loop (the side-by-side's, same seeds) against
# sluice with its second context for short requests (the default, 1024
# cells), without it (--short-cells 0: every request in the calibration
# cache's off/q8_0/f16 context), and llama-server; rounds of the three in
# turn. Each run: a fresh start, 5 s of warm-up, then 20 s measured.
# Usage: run.sh OUT LLAMA_SERVER CALIBRATION_JSON [CONCURRENCY] [ROUNDS]
set -euo pipefail
out=$1 llama=$2 cal=$3 conc=${4:-4} rounds=${5:-3}
mkdir -p "$out"
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
bench=./target/release/sluice-bench
for r in $(seq "$rounds"); do
    for cfg in short noshort llama; do
        cp "$cal" "$out/cal-$cfg.json" 2>/dev/null || true
        case $cfg in
            short) args=() ;;
            noshort) args=(--short-cells 0) ;;
        esac
        if [ $cfg = llama ]; then
            "$llama" -m "$model" --host 127.0.0.1 --port 18150 -t 2 -tb 2 -c 32768 -np 4 2> "$out/$cfg-c$conc-r$r.log" > /dev/null &
        else
            ./target/release/sluice serve --model "$model" --port 18150 --threads 2 --ctx 32768 \
                --calibration-cache "$out/cal-$cfg.json" "${args[@]}" 2> "$out/$cfg-c$conc-r$r.log" &
        fi
        pid=$!
        for _ in $(seq 600); do curl -sf http://127.0.0.1:18150/health >/dev/null && break; sleep 0.2; done
        $bench closed --url http://127.0.0.1:18150 --quiet --concurrency "$conc" --temperature 0 --duration-s 5 --seed 99 --out "$out/warm.json" > /dev/null 2>&1
        echo "round $r: $cfg c$conc" >&2
        $bench closed --url http://127.0.0.1:18150 --quiet --concurrency "$conc" --temperature 0 --duration-s 20 \
            --seed $((r * 1000 + 10 + conc)) --pid $pid --out "$out/$cfg-c$conc-r$r.json" > "$out/$cfg-c$conc-r$r.txt" 2>&1
        kill $pid; wait $pid 2>/dev/null || true
    done
done
