#!/usr/bin/env bash
# As run, session 47: the side-by-side's head-of-line workload (2 chat
# streams of up to 3,000 tokens, then a ~6,300-token prompt), three
# alternating rounds, AVX2 builds: sluice (SLUICE, default the AVX2 build)
# with a copy of the calibration cache CAL, llama-server from
# /work/peer/build-avx2 (crate's ggml). Polls sluice's pass counters. From
# the repository root: run.sh OUT CAL
set -euo pipefail
out=$1; cal=$2; sluice=${SLUICE:-target/avx2/release/sluice}
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p "$out"
run() { # name pid
    ./target/release/sluice-bench hol --url http://127.0.0.1:18150 --quiet --timeout-s 600 \
        --slo-ttft-ms 5000 --slo-itl-ms 250 --pid "$2" --temperature 0 --hol-stream-tokens 3000 \
        --out "$out/$1.json" > "$out/$1.txt"
}
counters() { curl -s http://127.0.0.1:18150/metrics | grep -E '^sluice_(passes_total|passes_split_total|steps_total|short_context_requests_total) ' || true; }
for r in 1 2 3; do
    order="sluice llama"; [ "$r" = 2 ] && order="llama sluice"
    for s in $order; do
        name="$s-r$r"
        if [ "$s" = sluice ]; then
            cp "$cal" "$out/$name.cal.json"
            "$sluice" serve --model "$model" --threads 2 --ctx 32768 --port 18150 \
                --calibration-cache "$out/$name.cal.json" > "$out/$name.log" 2>&1 &
        else
            /work/peer/build-avx2/bin/llama-server -m "$model" --host 127.0.0.1 --port 18150 \
                -t 2 -tb 2 -c 32768 -np 4 > "$out/$name.log" 2>&1 &
        fi
        pid=$!
        until curl -sf http://127.0.0.1:18150/health > /dev/null 2>&1; do sleep 0.5; done
        [ "$s" = sluice ] && counters > "$out/$name.metrics-before"
        run "$name" "$pid"
        [ "$s" = sluice ] && counters > "$out/$name.metrics-after"
        kill "$pid"; wait "$pid" || true
    done
done
head -3 "$out"/*.txt
