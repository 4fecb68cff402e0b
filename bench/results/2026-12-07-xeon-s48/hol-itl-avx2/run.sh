#!/usr/bin/env bash
# As run, session 48, from the repository root, nothing else running: the
# side-by-side's head-of-line workload (2 chat streams of up to 3,000
# tokens, then a ~6,300-token prompt) on the AVX2 leg, one run each:
# llama-server (/work/peer/build-avx2), then f93c26f's AVX2 build at
# --itl-target-ms 150 (the default), 190, 220 and 250, each with a copy of
# the cache its own --calibrate-only wrote. What a longer step buys the
# long prompt, and what it costs the chats' largest gap.
set -euo pipefail
out=bench/results/2026-12-07-xeon-s48/hol-itl-avx2
sluice=/tmp/s48/sluice-avx2-f93c26f
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
url=http://127.0.0.1:18150
"$sluice" serve --model "$model" --threads 2 --ctx 32768 --calibration-cache "$out/cal.json" \
    --calibrate-only > "$out/calibrate.log" 2>&1
run() { # name pid
    until curl -sf $url/health > /dev/null 2>&1; do sleep 0.5; done
    ./target/release/sluice-bench hol --url $url --quiet --timeout-s 600 \
        --slo-ttft-ms 5000 --slo-itl-ms 250 --pid "$2" --temperature 0 --hol-stream-tokens 3000 \
        --out "$out/$1.json" > "$out/$1.txt"
    kill "$2"; wait "$2" || true
}
/work/peer/build-avx2/bin/llama-server -m "$model" --host 127.0.0.1 --port 18150 \
    -t 2 -tb 2 -c 32768 -np 4 > "$out/llama.log" 2>&1 &
run llama $!
for t in 150 190 220 250; do
    cp "$out/cal.json" "$out/itl-$t.cal.json"
    "$sluice" serve --model "$model" --threads 2 --ctx 32768 --port 18150 --itl-target-ms $t \
        --calibration-cache "$out/itl-$t.cal.json" > "$out/itl-$t.log" 2>&1 &
    run "itl-$t" $!
done
head -3 "$out"/*.txt
