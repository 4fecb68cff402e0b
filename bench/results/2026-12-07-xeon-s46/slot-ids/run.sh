#!/usr/bin/env bash
# As run, session 46: the 2-client closed loop of fresh greedy chats (the
# side-by-side's closed-fresh-greedy-c2, and the same at 3 clients), on the
# AVX2 build at 0368536 (a request takes the lowest free slot, the parked one
# last) and with the slot choice that keeps the running ids consecutive;
# 3 alternating rounds of 30 s, each on a fresh start with its own
# calibration cache. From the repository root.
set -euo pipefail
out=bench/results/2026-12-07-xeon-s46/slot-ids
declare -A bin=([old]=/tmp/sluice-avx2-old [new]=/tmp/sluice-avx2-new)
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
for b in old new; do
    "${bin[$b]}" serve --model "$model" --threads 2 --ctx 32768 \
        --calibration-cache "$out/cal-$b.json" --calibrate-only > "$out/cal-$b.log" 2>&1
done
for r in 1 2 3; do
    order=(old new); [ $((r % 2)) = 0 ] && order=(new old)
    for b in "${order[@]}"; do
        "${bin[$b]}" serve --model "$model" --threads 2 --ctx 32768 --port 18150 \
            --calibration-cache "$out/cal-$b.json" > "$out/$b-r$r.log" 2>&1 &
        pid=$!
        until curl -sf http://127.0.0.1:18150/readyz > /dev/null; do sleep 0.2; done
        for c in 2 3; do
            ./target/release/sluice-bench closed --url http://127.0.0.1:18150 --quiet --timeout-s 120 \
                --slo-ttft-ms 5000 --slo-itl-ms 250 --pid "$pid" --temperature 0 --concurrency "$c" \
                --duration-s 30 --seed "$((r * 1000 + 10 + c))" \
                --out "$out/$b-r$r-c$c.json" > "$out/$b-r$r-c$c.txt"
            curl -s http://127.0.0.1:18150/metrics | grep -E '^sluice_(passes|steps)_' > "$out/$b-r$r-c$c.metrics" || true
        done
        kill "$pid"; wait "$pid" || true
    done
done
for c in 2 3; do
    for b in old new; do
        echo "c$c $b tok/s: $(for r in 1 2 3; do awk '/^ +closed /{print $NF}' "$out/$b-r$r-c$c.txt"; done | tr '\n' ' ')"
    done
done | tee "$out/summary.txt"
