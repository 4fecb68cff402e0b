#!/usr/bin/env bash
# As run, session 46: the side-by-side's head-of-line workload (2 chat
# streams of up to 3,000 tokens, then a ~6,300-token prompt), once each, on
# the AVX2 builds: sluice at dcff482 (a request alone goes to the short
# context only where its prompt pays for its answer), sluice at c22bf76
# (session 45's rule: any request alone that fits), llama-server. From the
# repository root.
set -euo pipefail
out=bench/results/2026-12-07-xeon-s46/hol-lone
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
new=/tmp/sluice-avx2-dcff482; old=/tmp/sluice-avx2-new   # c22bf76's code
"$new" serve --model "$model" --threads 2 --ctx 32768 --calibration-cache "$out/cal-new.json" \
    --calibrate-only > "$out/cal-new.log" 2>&1
run() { # name pid
    ./target/release/sluice-bench hol --url http://127.0.0.1:18150 --quiet --timeout-s 600 \
        --slo-ttft-ms 5000 --slo-itl-ms 250 --pid "$2" --temperature 0 --hol-stream-tokens 3000 \
        --out "$out/$1.json" > "$out/$1.txt"
}
for s in new llama old; do
    case $s in
        new) "$new" serve --model "$model" --threads 2 --ctx 32768 --port 18150 \
                 --calibration-cache "$out/cal-new.json" > "$out/$s.log" 2>&1 & ;;
        old) "$old" serve --model "$model" --threads 2 --ctx 32768 --port 18150 \
                 --calibration-cache bench/results/2026-12-07-xeon-s46/slot-ids/cal-new.json > "$out/$s.log" 2>&1 & ;;
        llama) /work/peer/build-avx2/bin/llama-server -m "$model" --host 127.0.0.1 --port 18150 \
                 -t 2 -tb 2 -c 32768 -np 4 > "$out/$s.log" 2>&1 & ;;
    esac
    pid=$!
    until curl -sf http://127.0.0.1:18150/health > /dev/null 2>&1 || curl -sf http://127.0.0.1:18150/readyz > /dev/null 2>&1; do sleep 0.5; done
    [ "$s" = llama ] || curl -s http://127.0.0.1:18150/metrics | grep -E '^sluice_(passes_total|steps_total|short_context_requests_total) ' > "$out/$s.metrics-before"
    run "$s" "$pid"
    [ "$s" = llama ] || curl -s http://127.0.0.1:18150/metrics | grep -E '^sluice_(passes_total|steps_total|short_context_requests_total) ' > "$out/$s.metrics-after"
    kill "$pid"; wait "$pid" || true
done
head -4 "$out"/{new,llama,old}.txt

# Then (the first run's calibration had chosen on/q8_0 for the main context,
# c22bf76's off/q8_0/f16): dcff482 again with its cache's kept pairing set to
# off/q8_0/f16 (cal-new-offq8.json, edited from cal-new.json), as the
# integration tests edit a cache.
"$new" serve --model "$model" --threads 2 --ctx 32768 --port 18150 \
    --calibration-cache "$out/cal-new-offq8.json" > "$out/new-offq8.log" 2>&1 &
pid=$!
until curl -sf http://127.0.0.1:18150/health > /dev/null 2>&1; do sleep 0.5; done
run new-offq8 "$pid"
curl -s http://127.0.0.1:18150/metrics | grep -E '^sluice_(passes_total|steps_total|short_context_requests_total) ' > "$out/new-offq8.metrics-after"
kill "$pid"; wait "$pid" || true
