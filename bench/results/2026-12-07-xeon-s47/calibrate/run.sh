#!/usr/bin/env bash
# As run, session 47: `--calibrate-only` three times on the AVX2 build and
# once on the native one, each with a fresh cache, from the repository root.
set -euo pipefail
out=bench/results/2026-12-07-xeon-s47/calibrate
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
for i in 1 2 3; do
    rm -f "$out/avx2-$i.json"
    target/avx2/release/sluice serve --model "$model" --threads 2 --ctx 32768 \
        --calibration-cache "$out/avx2-$i.json" --calibrate-only > "$out/avx2-$i.log" 2>&1
done
rm -f "$out/native.json"
target/release/sluice serve --model "$model" --threads 2 --ctx 32768 \
    --calibration-cache "$out/native.json" --calibrate-only > "$out/native.log" 2>&1
grep -h 'attention: flash' "$out"/*.log
