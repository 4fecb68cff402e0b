#!/usr/bin/env bash
# Session 49, as run from the repository root after vs-avx2.sh and the CI
# (11:12-11:16 UTC, nothing else running): one AVX2 head-of-line run of
# sluice (f93c26f AVX2 build, a copy of vs-avx2's calibration cache) with a
# sampler of its threads (sample.py: context switches, faults, CPU), every
# SAMPLE_S seconds: r20ms/ at 0.02 (its samples left out, 8 MB), r1s/ at 1.
# Outputs were written to /tmp/s49/diag and copied here.
set -euo pipefail
cd /work/main
out=/tmp/s49/diag
sluice=/tmp/s49/sluice-avx2-f93c26f
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
url=http://127.0.0.1:18150
cp bench/results/2026-12-07-xeon-s49/vs-avx2/calibration.json $out/cal.json
"$sluice" serve --model "$model" --threads 2 --ctx 32768 --port 18150 \
    --calibration-cache "$out/cal.json" > "$out/sluice.log" 2>&1 &
pid=$!
until curl -sf $url/health > /dev/null 2>&1; do sleep 0.5; done
t0=$(python3 -c 'import time; print(time.time())')
python3 $out/sample.py $pid $out/samples.jsonl $t0 ${SAMPLE_S:-0.02} &
spid=$!
./target/release/sluice-bench hol --url $url --quiet --timeout-s 600 \
    --slo-ttft-ms 5000 --slo-itl-ms 250 --pid $pid --temperature 0 --hol-stream-tokens 3000 \
    --out "$out/hol.json" > "$out/hol.txt"
echo $t0 > $out/t0
curl -s $url/metrics > $out/metrics-after
kill $spid || true
kill $pid; wait $pid || true
