#!/usr/bin/env bash
# The side-by-side's closed loop of long prompts (500-2,000 tokens, uniform;
# 64-token answers; greedy) against sluice at its defaults (`short`: a prompt
# up to 960 tokens + 64 fits the second context's 1,024 cells, flash attention
# on, f16 cache; longer ones run in the main context, off/q8_0/f16 here), with
# the second context wide enough for every request of the loop (`wide`:
# --short-cells 2064, so all of them run with flash attention on and an f16
# cache, as llama-server's do), and llama-server, in turn; a fresh start each,
# 5 s of warm-up, DUR (40) s measured. (Session 41's long-loop/run.sh with
# `wide` in place of `noshort`.)
# Usage: run.sh OUT LLAMA_SERVER CALIBRATION_JSON CONCURRENCY [ROUNDS]
set -euo pipefail
out=$1 llama=$2 cal=$3 conc=$4 rounds=${5:-3}
mkdir -p "$out"
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
bench=./target/release/sluice-bench
for r in $(seq "$rounds"); do
    for cfg in short wide llama; do
        cp "$cal" "$out/cal-$cfg.json"
        case $cfg in
            short) args=() ;;
            wide) args=(--short-cells 2064) ;;
        esac
        if [ $cfg = llama ]; then
            "$llama" -m "$model" --host 127.0.0.1 --port 18150 -t 2 -tb 2 -c 32768 -np 4 2> "$out/$cfg-c$conc-r$r.log" > /dev/null &
        else
            ./target/release/sluice serve --model "$model" --port 18150 --threads 2 --ctx 32768 \
                --calibration-cache "$out/cal-$cfg.json" "${args[@]}" 2> "$out/$cfg-c$conc-r$r.log" &
        fi
        pid=$!
        for _ in $(seq 600); do curl -sf http://127.0.0.1:18150/health >/dev/null && break; sleep 0.2; done
        $bench closed --url http://127.0.0.1:18150 --quiet --concurrency "$conc" --temperature 0 \
            --prompt-tokens uniform:500:2000 --max-tokens 64 --duration-s 5 --seed 99 --out "$out/warm.json" > /dev/null 2>&1
        echo "round $r: $cfg c$conc" >&2
        $bench closed --url http://127.0.0.1:18150 --quiet --concurrency "$conc" --temperature 0 \
            --prompt-tokens uniform:500:2000 --max-tokens 64 --duration-s "${DUR:-40}" \
            --seed $((r * 1000 + 500 + conc)) --pid $pid --out "$out/$cfg-c$conc-r$r.json" > "$out/$cfg-c$conc-r$r.txt" 2>&1
        kill $pid; wait $pid 2>/dev/null || true
    done
done
