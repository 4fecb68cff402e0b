#!/usr/bin/env bash
# What sampling costs each server: the side-by-side's repeated-prompt 4-client
# loop (one prompt, 32-128-token answers, ignore_eos) with the SAME seed, so
# the same prompt and answer lengths, at temperature 0 and at 0.7; sluice at
# its defaults and llama-server, a fresh start each run, in turn; 5 s of
# warm-up, DUR (20) s measured. With PERF set, sluice's runs are also
# recorded by `perf record` (call graphs) for the measured part.
# Usage: run.sh OUT LLAMA_SERVER CALIBRATION_JSON [ROUNDS]
set -euo pipefail
out=$1 llama=$2 cal=$3 rounds=${4:-2}
mkdir -p "$out"
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
bench=./target/release/sluice-bench
for r in $(seq "$rounds"); do
    for srv in sluice llama; do
        for temp in 0 0.7; do
            name=$srv-t$temp-r$r
            if [ $srv = llama ]; then
                "$llama" -m "$model" --host 127.0.0.1 --port 18150 -t 2 -tb 2 -c 32768 -np 4 2> "$out/$name.log" > /dev/null &
            else
                cp "$cal" "$out/cal-$name.json"
                ./target/release/sluice serve --model "$model" --port 18150 --threads 2 --ctx 32768 \
                    --calibration-cache "$out/cal-$name.json" 2> "$out/$name.log" &
            fi
            pid=$!
            for _ in $(seq 600); do curl -sf http://127.0.0.1:18150/health >/dev/null && break; sleep 0.2; done
            $bench closed --url http://127.0.0.1:18150 --quiet --concurrency 4 --temperature "$temp" --repeat-prompt \
                --duration-s 5 --seed 99 --out "$out/warm.json" > /dev/null 2>&1
            echo "round $r: $name" >&2
            perf_pid=""
            if [ -n "${PERF:-}" ] && [ $srv = sluice ]; then
                perf record -g -o "$out/$name.perf" -p $pid -- sleep "${DUR:-20}" 2> /dev/null &
                perf_pid=$!
            fi
            $bench closed --url http://127.0.0.1:18150 --quiet --concurrency 4 --temperature "$temp" --repeat-prompt \
                --duration-s "${DUR:-20}" --seed $((r * 1000 + 44)) --pid $pid --out "$out/$name.json" > "$out/$name.txt" 2>&1
            [ -n "$perf_pid" ] && wait $perf_pid || true
            kill $pid; wait $pid 2>/dev/null || true
        done
    done
done
